"""`csmserve talk`: a spoken conversation with any OpenAI-compatible LLM, CSM speaking with the whole
conversation (both sides' audio) as context (docs/talk.md).

One exchange: the user's audio -> text (asr.py, or typed) -> the LLM's streamed reply (llm.py) -> fed as it
arrives into `CSM.speak` over an iterator, so speech starts at the first complete sentence. CSM runs
in-process or behind `csmserve serve` (speech.py; integrations' Conversation). Barge-in
(`TalkSession.interrupt()`) cuts the assistant's turn, in CSM's context and the LLM's history, at what
was played (session.py).
"""
from csmserve.apps.talk.errors import TalkError
from csmserve.apps.talk.session import Exchange, PromptRecord, TalkSession

__all__ = ["Exchange", "PromptRecord", "TalkError", "TalkSession"]
