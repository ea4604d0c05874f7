"""Where talk's CSM runs: in this process (InProcessSpeech) or behind a running `csmserve serve` (ServerSpeech,
through integrations/conversation.py's Conversation); the two have the same methods, which TalkSession calls."""
from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from csmserve.apps.common import from_pcm16, pcm16
from csmserve.apps.talk.errors import TalkError
from csmserve.config import FRAME_MS, FRAME_SAMPLES, SAMPLE_RATE, ServerConfig
from csmserve.integrations.conversation import Conversation, ConversationError, ReplyAudio

if TYPE_CHECKING:
    from csmserve.api import CSM, Segment
    from csmserve.apps.talk.llm import LLMStream


@dataclass
class SpeechChunk:
    """A piece of a spoken reply: what the session reads of an api.AudioChunk (codes None from a server)."""

    codes: np.ndarray | None
    audio: np.ndarray
    segment: int  # which sentence of the reply
    text: str | None  # that sentence
    final: bool = False
    finish_reason: str | None = None


class InProcessSpeech:
    """CSM in this process: the user's audio Mimi-encoded once, the reply from CSM.speak over the LLM's pieces.
    A TalkSession's CSM (its speaker and sampling fixed for the conversation), as ServerSpeech is."""

    def __init__(self, csm: CSM, speaker: int, user_speaker: int, sampling: dict) -> None:
        self.csm, self.speaker, self.user_speaker, self.sampling = csm, speaker, user_speaker, sampling
        self.frame_size = csm.frame_size  # audio samples per frame

    def user_turn(self, text: str, pcm: np.ndarray | None) -> Segment:
        """The user's turn (`pcm`: their audio, None: typed) as the session's context keeps it."""
        from csmserve.api import Segment

        return Segment(self.user_speaker, text, codes=None if pcm is None else self.csm.encode_audio(pcm))

    def reply(self, llm: LLMStream, context: list[Segment]) -> Iterator:
        """The reply to `context` (its last segment the user's turn) as the LLM's pieces arrive -> chunks as
        they come (a generator: closing it early stops the reply)."""
        return self.csm.speak(iter(llm), speaker=self.speaker, context=context, **self.sampling)

    def end(self, frames: int) -> None:
        """The session left the reply (at its end, a barge-in or an error) with its first `frames` played."""
        # (here the session's context holds the reply's codes as played: the next prompt is built from it)

    def close(self) -> None:
        """Let go of what the backend holds (not an in-process CSM: its owner closes it)."""


SERVER_CLIP_SECONDS = ServerConfig().max_clip_seconds  # a user turn's last 60 s: what a server takes by default


class ServerSpeech:
    """CSM behind `csmserve serve` (--url): one Conversation (one context_id; the server keeps the turns, the
    user's audio encoded there once), on an event-loop thread of its own. A barge-in cancels the reply with
    `audio_end_ms`: the server keeps exactly what was played as the assistant's turn."""

    frame_size = FRAME_SAMPLES

    def __init__(self, url: str, context_id: str, speaker: int, user_speaker: int, sampling: dict,
                 api_key: str | None = None, voice: str | None = None) -> None:
        self.conv = Conversation(url, voice=voice, api_key=api_key, context_id=context_id, speaker=speaker,
                                 user_speaker=user_speaker, max_user_seconds=SERVER_CLIP_SECONDS, **sampling)
        self.user_speaker = user_speaker
        self._reply = None  # the Conversation's Reply in progress (or the last)
        self._feeder: threading.Thread | None = None  # the last reply's text sender
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="csmserve-talk-ws")
        self._thread.start()

    def user_turn(self, text: str, pcm: np.ndarray | None) -> Segment:
        from csmserve.api import Segment

        if pcm is not None:  # sent as a 24 kHz WAV before the next reply's text
            self.conv.add_user_audio(pcm16(pcm), SAMPLE_RATE)
        self.conv.end_user_turn(text)
        return Segment(self.user_speaker, text, audio=pcm)

    def reply(self, llm: LLMStream, context: list[Segment]) -> Iterator[SpeechChunk]:
        """The LLM's first piece opens the reply (the user's turn sent before it), a thread sends the rest as
        they arrive, then `flush`, while the reply's audio is yielded as it comes."""
        self._reply, pieces, errors = None, iter(llm), []
        if (first := next(pieces, None)) is None:
            raise TalkError("the LLM's reply was empty")
        key = uuid.uuid4().hex
        self._reply = reply = self._run(self.conv.say(first, key))
        self._feeder = threading.Thread(target=self._feed, args=(llm, pieces, key, errors), daemon=True,
                                        name="csmserve-talk-send")
        self._feeder.start()
        try:
            while (event := self._run(reply.events.get())) is not None:
                if isinstance(event, ReplyAudio):
                    yield SpeechChunk(None, from_pcm16(event.pcm), event.segment, event.text)
        finally:
            llm.stop.set()  # the reply was left: no more text (after a cancel it would start another turn)
        if reply.error is not None:
            raise self._error(ConversationError(reply.error))
        self._feeder.join()
        if errors:  # the LLM failed mid-reply: what it had said was spoken
            raise errors[0]
        yield SpeechChunk(None, np.zeros(0, np.float32), 0, None, True, reply.finish_reason)

    def end(self, frames: int) -> None:
        self._run(self._cut(frames * FRAME_MS))

    def close(self) -> None:
        if self._feeder is not None:
            self._feeder.join()  # it stops at the LLM's next line (llm.stop)
        self._run(self.conv.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def _feed(self, llm: LLMStream, pieces: Iterator[str], key: str, errors: list[Exception]) -> None:
        try:
            for piece in pieces:
                self._run(self._say(llm, key, piece))
        except Exception as e:  # noqa: BLE001 - raised after the reply
            errors.append(e)
        try:
            self._run(self._say(llm, key, None))
        except TalkError as e:
            errors.append(e)

    async def _say(self, llm: LLMStream, key: str, piece: str | None) -> None:
        """A piece of the reply's text (None: its end, `flush`), unless the session left it (checked here,
        on the loop, so none goes after the cancel)."""
        if not llm.stop.is_set():
            await (self.conv.say(piece, key) if piece is not None else self.conv.flush(key))

    async def _cut(self, played_ms: int) -> None:
        """The reply still generating is cancelled keeping `played_ms`; one the server had finished (before
        the cancel came, or cut at its last chunk) is truncated there."""
        reply = self._reply
        if reply is None:
            return
        if not reply.done and (await self.conv.interrupt(audio_end_ms=played_ms)).get("request_id"):
            return
        if reply.error is None and reply.request_id is not None and played_ms < reply.frames * FRAME_MS:
            await self.conv.truncate(reply.request_id, played_ms)

    def _run(self, coro):
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        except Exception as e:  # noqa: BLE001
            raise self._error(e) from None

    def _error(self, e: Exception) -> TalkError:
        """A ConversationError (or a timeout) -> one line naming the server."""
        if isinstance(e, TalkError):
            return e
        why = str(e) or type(e).__name__
        return TalkError(why if why.startswith("csmserve") else f"csmserve at {self.conv.ws_url}: {why}")
