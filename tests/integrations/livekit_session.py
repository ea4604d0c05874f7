"""A real livekit-agents AgentSession without a room: a microphone, a speech-to-text, an LLM and a speaker
standing in for the room's, each driven by the test. Shared by the LiveKit tests."""
from __future__ import annotations

import asyncio
import time

import numpy as np
from livekit import rtc
from livekit.agents import DEFAULT_API_CONNECT_OPTIONS, AgentSession, llm, stt
from livekit.agents.voice import io

from helpers import chunks

SILENCE_S = 0.1  # silence after each utterance: the stand-in STT's end of speech


def frames_of(pcm: bytes, rate: int = 16_000) -> list[rtc.AudioFrame]:
    return [rtc.AudioFrame(c, rate, 1, len(c) // 2) for c in chunks(pcm, rate)]


class Mic(io.AudioInput):
    """The user's microphone: the frames the test says, then silence."""

    def __init__(self) -> None:
        super().__init__(label="mic")
        self._q: asyncio.Queue[rtc.AudioFrame] = asyncio.Queue()

    def say(self, pcm: bytes) -> None:
        for f in frames_of(pcm) + frames_of(b"\0\0" * int(SILENCE_S * 16_000)):
            self._q.put_nowait(f)

    async def __anext__(self) -> rtc.AudioFrame:
        return await self._q.get()


class STT(stt.STT):
    """Hears speech in any non-zero frame: START_OF_SPEECH and an interim transcript at its first frame (the
    barge-in, with no VAD), the final transcript and END_OF_SPEECH at the first silent frame after it."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__(capabilities=stt.STTCapabilities(streaming=True, interim_results=True))
        self.texts = list(texts)

    async def _recognize_impl(self, buffer, *, language=None, conn_options=None):
        raise NotImplementedError

    def stream(self, *, language=None, conn_options=DEFAULT_API_CONNECT_OPTIONS) -> stt.RecognizeStream:
        return _Recognition(stt=self, conn_options=conn_options)


class _Recognition(stt.RecognizeStream):
    async def _run(self) -> None:
        speaking, text = False, ""
        async for f in self._input_ch:
            if isinstance(f, self._FlushSentinel):
                continue
            loud = bool(np.frombuffer(f.data, "<i2").any())
            if loud and not speaking:
                speaking, text = True, self._stt.texts.pop(0)
                self._send(stt.SpeechEventType.START_OF_SPEECH)
                self._send(stt.SpeechEventType.INTERIM_TRANSCRIPT, text)
            elif not loud and speaking:
                speaking = False
                self._send(stt.SpeechEventType.FINAL_TRANSCRIPT, text)
                self._send(stt.SpeechEventType.END_OF_SPEECH)

    def _send(self, kind: stt.SpeechEventType, text: str | None = None) -> None:
        alts = [stt.SpeechData(language="en", text=text)] if text is not None else []
        self._event_ch.send_nowait(stt.SpeechEvent(type=kind, alternatives=alts))


class LLM(llm.LLM):
    """Each reply: the next of `replies`, its pieces streamed as the LLM's chunks."""

    def __init__(self, replies: list[list[str]]) -> None:
        super().__init__()
        self.replies = list(replies)

    def chat(self, *, chat_ctx, tools=None, conn_options=DEFAULT_API_CONNECT_OPTIONS, **_) -> llm.LLMStream:
        return _Completion(self, self.replies.pop(0), chat_ctx=chat_ctx, tools=tools or [],
                           conn_options=conn_options)


class _Completion(llm.LLMStream):
    def __init__(self, model: LLM, pieces: list[str], **kw) -> None:
        self.pieces = pieces
        super().__init__(model, **kw)

    async def _run(self) -> None:
        for p in self.pieces:
            self._event_ch.send_nowait(llm.ChatChunk(id="c", delta=llm.ChoiceDelta(role="assistant", content=p)))


class Speaker(io.AudioOutput):
    """The room's audio output, played by the test. A segment plays to its end when flushed, unless `cut`
    names it (its index among the segments it accepted): then it is still playing, and stops at that many
    seconds when cleared (the barge-in). While `accepting` is clear, capture_frame waits, as the room's
    output does before the listener has subscribed: nothing reaches the speaker."""

    def __init__(self, sample_rate: int = 24_000) -> None:
        super().__init__(label="speaker", capabilities=io.AudioOutputCapabilities(pause=False),
                         sample_rate=sample_rate)
        self.accepting = asyncio.Event()
        self.accepting.set()
        self.cut: dict[int, float] = {}
        self.segments: list[list[rtc.AudioFrame]] = []  # the frames of each segment it accepted
        self.reports: list[tuple[float, bool]] = []  # (playback_position, interrupted), one per segment
        self._open = False  # the last segment has frames and no report yet
        self._capturing = False

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await self.accepting.wait()
        await super().capture_frame(frame)
        if not self._capturing:
            self._capturing, self._open = True, True
            self.segments.append([])
            self.on_playback_started(created_at=time.time())
        self.segments[-1].append(frame)

    def flush(self) -> None:
        super().flush()
        self._capturing = False
        if self._open and len(self.segments) - 1 not in self.cut:
            self._report(self.pushed, False)

    def clear_buffer(self) -> None:
        if self._open:
            self._report(min(self.cut.get(len(self.segments) - 1, 0.0), self.pushed), True)

    @property
    def pushed(self) -> float:
        return sum(f.duration for f in self.segments[-1]) if self.segments else 0.0

    def _report(self, position: float, interrupted: bool) -> None:
        position = round(position, 6)  # (a sum of frame durations)
        self._open = False
        self.reports.append((position, interrupted))
        asyncio.get_running_loop().call_soon(
            lambda: self.on_playback_finished(playback_position=position, interrupted=interrupted))


def session(tts, texts: list[str], replies: list[list[str]], rate: int = 24_000) -> tuple[AgentSession, Mic, Speaker]:
    """An AgentSession around `tts`: turns end on the STT's end of speech at once, a transcript interrupts."""
    s = AgentSession(stt=STT(texts), llm=LLM(replies), tts=tts, vad=None, aec_warmup_duration=None, turn_handling={
        "turn_detection": "stt", "endpointing": {"min_delay": 0.0, "max_delay": 0.5},
        "interruption": {"mode": "vad", "resume_false_interruption": False, "min_duration": 0.0},
        "preemptive_generation": {"enabled": False}})
    mic, speaker = Mic(), Speaker(rate)
    s.input.audio, s.output.audio = mic, speaker
    return s, mic, speaker


def watch(conv) -> list[dict]:
    """Every message the conversation sends and receives over the WebSocket, in order ({"sent": msg} or
    {"got": msg}; received audio without its samples)."""
    log: list[dict] = []
    send, dispatch = conv._send, conv._dispatch

    async def sent(msg: dict) -> None:
        log.append({"sent": msg})
        await send(msg)

    def got(m: dict) -> None:
        log.append({"got": {k: v for k, v in m.items() if k != "audio"}})
        dispatch(m)

    conv._send, conv._dispatch = sent, got
    return log
