"""`csmserve talk`: a spoken conversation with any OpenAI-compatible LLM, CSM speaking with the whole
conversation (both sides' audio) as context.

One exchange: the user's audio (a WAV file) is transcribed by an OpenAI-compatible
`/v1/audio/transcriptions` endpoint (asr.py; or the text is typed) -> the text and the history go to an
OpenAI-compatible `/v1/chat/completions` endpoint, streamed (llm.py) -> the reply's tokens are fed as they
arrive into CSM's long-form text-streaming path (`CSM.speak` over an iterator), so speech starts at
the first complete sentence, long before the LLM has finished -> CSM speaks as `speaker` after the
conversation's turns: the user's audio (Mimi-encoded once, speaker `user_speaker`) and the
assistant's generated codes (speaker `speaker`). CSM runs in-process or behind a running
`csmserve serve` (speech.py: the SpeechBackend protocol; websocket.py: the server's WebSocket).

Barge-in: when the user speaks again (`TalkSession.interrupt()`, a typed line arriving while the
assistant speaks, or the `barge_in_after_ms` test hook) the assistant's audio stops and its turn is
cut, in the CSM context and in the LLM history, at what was played (the frames delivered so far).

`TalkSession.prompts` keeps, per turn, the context CSM was given (a test hook);
`TalkSession.turns` the per-turn results (Exchange) with their latency split (session.py).
The command line: cli.py.
"""
from csmserve.apps.talk.errors import TalkError
from csmserve.apps.talk.session import Exchange, PromptRecord, TalkSession

__all__ = ["Exchange", "PromptRecord", "TalkError", "TalkSession"]
