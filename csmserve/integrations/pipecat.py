"""A Pipecat TTS service that speaks with Sesame CSM through a csmserve server and hears the conversation.

    from csmserve.integrations.pipecat import CSMTTSService
    tts = CSMTTSService(url="http://localhost:8000", voice="alloy", llm_context=context)
    pipeline = Pipeline([transport.input(), stt, user_aggregator, llm, tts, transport.output(), assistant_aggregator])

The service keeps ONE csmserve conversation (a `context_id`) for the whole session: the user's audio
(between UserStartedSpeakingFrame and UserStoppedSpeakingFrame, plus a little from before) and transcript
go in as a context turn before the next reply, and an interruption cuts the reply, in CSM's context, at
what was played (playout.py). The design, in full: docs/integrations.md ("Pipecat").

Needs `pip install 'csmserve[pipecat]'`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from csmserve.extras import require

require("pipecat", "pipecat", "csmserve.integrations.pipecat", package="pipecat-ai")

from pipecat.frames.frames import (  # noqa: E402
    CancelFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMFullResponseStartFrame,
    StartFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection  # noqa: E402
from pipecat.services.settings import TTSSettings  # noqa: E402
from pipecat.services.tts_service import TTSService  # noqa: E402

from csmserve.config import FRAME_MS, SAMPLE_RATE  # noqa: E402
from csmserve.integrations.conversation import Conversation, ConversationError, Reply, ReplyAudio  # noqa: E402
from csmserve.integrations.playout import Playout  # noqa: E402

PREROLL_S = 0.5  # user audio kept from before UserStartedSpeakingFrame (the VAD confirms speech late)


class CSMTTSService(TTSService):
    """Pipecat TTS over csmserve's WebSocket, with the user's audio as context (module docstring)."""

    def __init__(self, *, url: str = "http://localhost:8000", voice: str = "alloy", api_key: str | None = None,
                 context_id: str | None = None, speaker: int | None = None, user_speaker: int = 1,
                 llm_context: Any = None, temperature: float | None = None, top_k: int | None = None,
                 seed: int | None = None, max_audio_length_ms: int | None = None, max_segment_length_ms: int | None = None,
                 clock: Callable[[], float] = time.monotonic, **kwargs) -> None:
        # sentences arrive stripped: csmserve's own splitter needs the space after each one
        kwargs.setdefault("append_trailing_space", True)
        super().__init__(push_stop_frames=True, push_start_frame=True, push_text_frames=True,
                         sample_rate=SAMPLE_RATE, settings=TTSSettings(model="csm-1b", voice=voice, language=None),
                         **kwargs)
        self.conversation = Conversation(url, voice=voice, api_key=api_key, context_id=context_id, speaker=speaker,
                                         user_speaker=user_speaker, temperature=temperature, top_k=top_k, seed=seed,
                                         max_audio_length_ms=max_audio_length_ms,
                                         max_segment_length_ms=max_segment_length_ms)
        self.playout = Playout(clock)
        self.llm_context = llm_context
        self.cuts: list[dict] = []  # each interruption's cut: {"key", "request_id", "played_ms", "num_frames"}
        self._pumps: dict[str, asyncio.Task] = {}
        self._finished: dict[str, str] = {}  # replies done generating, maybe still playing: key -> request_id
        self._capturing = False  # between UserStartedSpeakingFrame and UserStoppedSpeakingFrame
        self._preroll: list[bytes] = []
        self._preroll_rate = 16_000
        self._user_pending = False  # a user turn whose transcript is still to come
        self._user_text = ""

    def can_generate_metrics(self) -> bool:
        return True

    # ---- lifecycle
    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        try:
            await self.conversation.connect()
            await self._call_event_handler("on_connected")
        except ConversationError as e:
            await self.push_error(error_msg=str(e))

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)
        await self._close()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._close()

    async def _close(self) -> None:
        for task in list(self._pumps.values()):
            await self.cancel_task(task)
        self._pumps.clear()
        await self.conversation.close()
        await self._call_event_handler("on_disconnected")

    # ---- the user's side
    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        if isinstance(frame, InputAudioRawFrame):
            self._hear(frame)
        elif isinstance(frame, UserStartedSpeakingFrame):
            if self._user_pending:  # the user spoke again before any reply: that turn stays a turn
                self._end_user_turn()
            self._capturing = True
            self.conversation.discard_user_audio()
            for pcm in self._preroll:
                self.conversation.add_user_audio(pcm, self._preroll_rate)
            self._preroll = []
        elif isinstance(frame, UserStoppedSpeakingFrame):
            self._capturing, self._user_pending = False, True
        elif isinstance(frame, TranscriptionFrame):
            self._user_text = f"{self._user_text} {frame.text}".strip()
        elif isinstance(frame, LLMFullResponseStartFrame):
            self._end_user_turn()
        elif isinstance(frame, InterruptionFrame):
            await self._cut()  # before Pipecat drops the audio contexts and any later text goes out
        await super().process_frame(frame, direction)

    def _hear(self, frame: InputAudioRawFrame) -> None:
        if self._capturing:
            self.conversation.add_user_audio(frame.audio, frame.sample_rate, frame.num_channels)
            return
        if frame.num_channels != 1:
            return
        self._preroll_rate = frame.sample_rate
        self._preroll.append(frame.audio)
        while sum(map(len, self._preroll)) > PREROLL_S * frame.sample_rate * 2 and len(self._preroll) > 1:
            self._preroll.pop(0)

    def _end_user_turn(self) -> None:
        """Before the reply to it: the user's turn (audio and transcript) goes in as context."""
        if not (self._user_pending or self._user_text):
            return
        text = self._user_text or self._context_user_text()
        self.conversation.end_user_turn(text)
        self._user_pending, self._user_text = False, ""

    def _context_user_text(self) -> str:
        if self.llm_context is None:
            return ""
        for m in reversed(list(self.llm_context.get_messages())):
            if isinstance(m, dict) and m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, list):
                    content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
                return content if isinstance(content, str) else ""
        return ""

    # ---- the assistant's side
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Text of the turn `context_id` as it comes; its audio arrives through the reply's pump."""
        self._end_user_turn()  # a TTSSpeakFrame has no LLMFullResponseStartFrame before it
        try:
            reply = await self.conversation.say(text, key=context_id)
        except ConversationError as e:
            yield ErrorFrame(error=str(e))
            yield TTSStoppedFrame(context_id=context_id)
            return
        await self.start_tts_usage_metrics(text)
        if context_id not in self._pumps:
            self._pumps[context_id] = self.create_task(self._pump(reply), name=f"csm-reply-{context_id}")
        yield None

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The turn's text is complete (Pipecat calls this at the end of the LLM's response)."""
        key = context_id or self.get_active_audio_context_id()
        try:
            await self.conversation.flush(key)
        except ConversationError as e:
            await self.push_error(error_msg=str(e))

    async def _pump(self, reply: Reply) -> None:
        """The reply's audio into its Pipecat audio context, then its end."""
        key = reply.key
        try:
            async for event in reply:
                if isinstance(event, ReplyAudio) and self.audio_context_available(key):
                    self.playout.pushed(key, event.num_frames)
                    await self.append_to_audio_context(key, TTSAudioRawFrame(event.pcm, SAMPLE_RATE, 1,
                                                                             context_id=key))
        except ConversationError as e:
            await self.push_error(error_msg=str(e))
        finally:
            self._pumps.pop(key, None)
        if reply.done and not reply.cancelled:
            for done in [k for k in self._finished if self.playout.finished(k)]:  # heard to the end
                del self._finished[done]
                self.playout.forget(done)
            if reply.request_id is not None:
                self._finished[key] = reply.request_id
            if self.audio_context_available(key):
                await self.append_to_audio_context(key, TTSStoppedFrame(context_id=key))
                await self.remove_audio_context(key)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        await self.stop_all_metrics()
        task = self._pumps.pop(context_id, None)
        if task is not None:
            await self.cancel_task(task)
        await super().on_audio_context_interrupted(context_id)

    async def _cut(self) -> None:
        """Barge-in: the reply generating is cancelled on the server and kept up to what was played; a
        finished reply still playing is truncated there (its audio context may be long gone: Pipecat
        hands audio on faster than it plays)."""
        now = self.playout.clock()
        try:
            generating = next(iter(self.conversation.replies), None)
            if generating is not None:
                played = self.playout.played_ms(generating.key, now)
                msg = await self.conversation.interrupt(audio_end_ms=played)
                if msg.get("request_id") is None and generating.done:  # it finished before the cancel came
                    if generating.request_id is not None and played < generating.frames * FRAME_MS:
                        msg = await self.conversation.truncate(generating.request_id, played)
                self._record(generating.key, played, msg)
            for key, request_id in list(self._finished.items()):
                if not self.playout.finished(key, now):
                    played = self.playout.played_ms(key, now)
                    self._record(key, played, await self.conversation.truncate(request_id, played))
        except (ConversationError, asyncio.TimeoutError) as e:
            await self.push_error(error_msg=f"csmserve: {e}")
        finally:
            self._finished.clear()
            self.playout.reset()  # the transport drops what it had queued

    def _record(self, key: str, played_ms: int, msg: dict) -> None:
        self.cuts.append({"key": key, "request_id": msg.get("request_id"), "played_ms": played_ms,
                          "num_frames": msg.get("num_frames", 0)})
