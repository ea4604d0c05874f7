"""A LiveKit Agents TTS that speaks with Sesame CSM through a csmserve server and hears the conversation.

    from csmserve.integrations.livekit import TTS, ConversationAgent
    tts = TTS(base_url="http://localhost:8000", voice="alloy")
    session = AgentSession(stt=..., llm=..., tts=tts, vad=...)
    await session.start(agent=ConversationAgent(instructions="You are a friendly voice assistant."), room=room)

`TTS` keeps ONE csmserve conversation (a WebSocket `context_id`) per instance: every `stream()` (one
agent reply) is one turn of it, its text going in as the LLM writes it, and the server keeps each
turn's generated codes. `ConversationAgent` (or your Agent subclass with its three hooks) gives it the
user's side: the STT input audio of each user turn (between the STT's START_OF_SPEECH and
END_OF_SPEECH, with a little audio from before; all of it if the STT sends neither) and the turn's
transcript go in as a context turn before the next reply, so CSM answers in the conversation's prosody.

An interruption (LiveKit closes the reply's stream) cancels the turn on the server at once (its slot is
free at the next frame), keeping what had reached the agent; when the session's audio output reports
the playback position (`playback_finished`), the turn is truncated there: CSM's context holds exactly
what the user heard. (One reply plays at a time, as in AgentSession.)

Needs `pip install 'csmserve[livekit]'`.
"""
from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterable, AsyncGenerator
from dataclasses import dataclass, field

from csmserve.extras import require

require("livekit.agents", "livekit", "csmserve.integrations.livekit", package="livekit-agents")

from livekit import rtc  # noqa: E402
from livekit.agents import (  # noqa: E402
    DEFAULT_API_CONNECT_OPTIONS,
    Agent,
    APIConnectionError,
    APIConnectOptions,
    llm,
    stt,
    tts,
)

from csmserve.config import FRAME_MS, SAMPLE_RATE  # noqa: E402
from csmserve.integrations.conversation import Conversation, ConversationError, ReplyAudio  # noqa: E402

PREROLL_S = 0.5  # user audio kept from before START_OF_SPEECH (the VAD confirms speech late)


@dataclass
class _Heard:
    """A reply whose audio went to the agent: what the playback report cuts."""

    frames: int = 0
    request_id: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class TTS(tts.TTS):
    """LiveKit TTS over csmserve's WebSocket, with the user's audio as context (module docstring)."""

    def __init__(self, *, base_url: str = "http://localhost:8000", voice: str = "alloy", api_key: str | None = None,
                 context_id: str | None = None, speaker: int | None = None, user_speaker: int = 1,
                 temperature: float | None = None, top_k: int | None = None, seed: int | None = None,
                 max_audio_length_ms: int | None = None, max_segment_length_ms: int | None = None) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True), sample_rate=SAMPLE_RATE, num_channels=1)
        self.conversation = Conversation(base_url, voice=voice, api_key=api_key, context_id=context_id,
                                         speaker=speaker, user_speaker=user_speaker, temperature=temperature,
                                         top_k=top_k, seed=seed, max_audio_length_ms=max_audio_length_ms,
                                         max_segment_length_ms=max_segment_length_ms)
        self.cuts: list[dict] = []  # each interruption's cut: {"request_id", "played_ms", "num_frames"}
        self._heard: deque[_Heard] = deque()  # replies sent to the agent whose playback is not reported yet
        self._capturing: bool | None = None  # None: the STT sends no speech events (keep all audio)
        self._preroll: deque[rtc.AudioFrame] = deque()
        self._tasks: set[asyncio.Task] = set()

    @property
    def model(self) -> str:
        return "csm-1b"

    @property
    def provider(self) -> str:
        return "csmserve"

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        return SynthesizeStream(tts=self, conn_options=conn_options)

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
                   ) -> tts.ChunkedStream:
        return self._synthesize_with_stream(text, conn_options=conn_options)

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await self.conversation.close()

    # ---- the user's side (ConversationAgent calls these)
    def hear(self, frame: rtc.AudioFrame) -> None:
        """A frame of the STT's input audio."""
        if self._capturing:
            self.conversation.add_user_audio(bytes(frame.data), frame.sample_rate, frame.num_channels)
            return
        self._preroll.append(frame)  # (the start of speech is confirmed after it began)
        while sum(f.duration for f in self._preroll) > PREROLL_S and len(self._preroll) > 1:
            self._preroll.popleft()
        if self._capturing is None:  # no speech events from this STT (yet): every frame counts
            self.conversation.add_user_audio(bytes(frame.data), frame.sample_rate, frame.num_channels)

    def speech_event(self, ev: stt.SpeechEvent) -> None:
        """The STT's events mark where the user's speech starts and ends."""
        if ev.type == stt.SpeechEventType.START_OF_SPEECH:
            if not self._capturing:  # the turn's audio: from a little before the start
                self.conversation.discard_user_audio()
                for f in self._preroll:
                    self.conversation.add_user_audio(bytes(f.data), f.sample_rate, f.num_channels)
            self._preroll.clear()
            self._capturing = True
        elif ev.type == stt.SpeechEventType.END_OF_SPEECH:
            self._capturing = False

    def end_user_turn(self, text: str) -> None:
        """The user's turn is complete (its transcript): it goes in as context before the next reply."""
        self.conversation.end_user_turn(text)

    # ---- playback (ConversationAgent subscribes this to the session's audio output)
    def playback_finished(self, ev) -> None:
        """The audio output's report on the reply that played last (livekit PlaybackFinishedEvent)."""
        if not self._heard:
            return
        heard = self._heard.popleft()
        played = int(ev.playback_position * 1000) // FRAME_MS * FRAME_MS
        if ev.interrupted and played < heard.frames * FRAME_MS:
            self._spawn(self._truncate(heard, played))

    async def _truncate(self, heard: _Heard, played_ms: int) -> None:
        try:
            request_id = await asyncio.wait_for(heard.request_id, timeout=30)
            if request_id is not None:
                msg = await self.conversation.truncate(request_id, played_ms)
                self.cuts.append({"request_id": request_id, "played_ms": played_ms,
                                  "num_frames": msg.get("num_frames", 0)})
        except (ConversationError, asyncio.TimeoutError):
            pass

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class SynthesizeStream(tts.SynthesizeStream):
    """One agent reply: one turn of the conversation."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._csm: TTS = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        conv, key = self._csm.conversation, uuid.uuid4().hex
        output_emitter.initialize(request_id=key, sample_rate=SAMPLE_RATE, num_channels=1, mime_type="audio/pcm",
                                  stream=True)
        output_emitter.start_segment(segment_id=key)
        started = asyncio.Event()
        state: dict = {"reply": None, "heard": None}

        async def send() -> None:
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    break  # one segment per stream
                if not data:
                    continue
                state["reply"] = await conv.say(data, key=key)
                self._mark_started()
                started.set()
            if state["reply"] is not None:
                await conv.flush(key)
            started.set()

        async def receive() -> None:
            await started.wait()
            reply = state["reply"]
            if reply is None:
                return
            async for event in reply:
                if isinstance(event, ReplyAudio):
                    if state["heard"] is None:
                        state["heard"] = _Heard()
                        self._csm._heard.append(state["heard"])
                    state["heard"].frames += event.num_frames
                    output_emitter.push(event.pcm)
            if state["heard"] is not None and not state["heard"].request_id.done():
                state["heard"].request_id.set_result(reply.request_id)

        tasks = [asyncio.create_task(send()), asyncio.create_task(receive())]
        try:
            await asyncio.gather(*tasks)
        except ConversationError as e:
            raise APIConnectionError(str(e)) from None
        finally:
            for t in tasks:
                t.cancel()
            reply = state["reply"]
            if reply is not None and not reply.done and not reply.cancelled:  # interrupted: stop it now
                await asyncio.shield(self._cancel(reply, state["heard"]))
        output_emitter.end_segment()

    async def _cancel(self, reply, heard: _Heard | None) -> None:
        """Cancel the turn on the server, keeping all the agent received (cut later at the playback position)."""
        try:
            msg = await self._csm.conversation.interrupt(audio_end_ms=reply.frames * FRAME_MS)
            if heard is not None and not heard.request_id.done():
                heard.request_id.set_result(msg.get("request_id"))
        except (ConversationError, asyncio.TimeoutError):
            if heard is not None and not heard.request_id.done():
                heard.request_id.set_result(None)


class ConversationAgent(Agent):
    """An Agent that lets `csmserve.integrations.livekit.TTS` hear the user: the STT input audio and its
    speech events, each user turn's transcript, and the audio output's playback reports. Subclass it, or
    copy its three hooks into your own Agent."""

    def _csm_tts(self) -> TTS | None:
        for get in (lambda: self.tts, lambda: self.session.tts):
            try:
                t = get()
            except RuntimeError:
                continue
            if isinstance(t, TTS):
                return t
        return None

    async def stt_node(self, audio: AsyncIterable[rtc.AudioFrame], model_settings
                       ) -> AsyncGenerator[stt.SpeechEvent, None]:
        csm = self._csm_tts()

        async def heard() -> AsyncGenerator[rtc.AudioFrame, None]:
            async for frame in audio:
                if csm is not None:
                    csm.hear(frame)
                yield frame

        async for ev in Agent.default.stt_node(self, heard(), model_settings):
            if csm is not None:
                csm.speech_event(ev)
            yield ev

    async def on_user_turn_completed(self, turn_ctx: llm.ChatContext, new_message: llm.ChatMessage) -> None:
        csm = self._csm_tts()
        if csm is not None:
            csm.end_user_turn(new_message.text_content or "")

    async def on_enter(self) -> None:
        csm = self._csm_tts()
        output = self.session.output.audio
        if csm is not None and output is not None:
            output.on("playback_finished", csm.playback_finished)
