"""A LiveKit Agents TTS that speaks with Sesame CSM through a csmserve server and hears the conversation.

    from csmserve.integrations.livekit import TTS, ConversationAgent
    tts = TTS(base_url="http://localhost:8000", voice="alloy")
    session = AgentSession(stt=..., llm=..., tts=tts, vad=...)
    await session.start(agent=ConversationAgent(instructions="You are a friendly voice assistant."), room=room)

`TTS` keeps ONE csmserve conversation (a `context_id`) per instance: every `stream()` is one turn of it.
`ConversationAgent` gives it the user's audio and transcripts as context, and cuts an interrupted reply at
what the speaker played: a `PlaybackTap` on the session's audio output matches each playback report (which
carries no identity) to the replies whose tagged frames (`REPLY_KEY`) its segment holds. The design, in
full: docs/integrations.md ("LiveKit Agents").

Needs `pip install 'csmserve[livekit]'`.
"""
from __future__ import annotations

import asyncio
import math
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterable
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
from livekit.agents.voice import io  # noqa: E402

try:  # the SpeechHandle a tts_node runs for: livekit-agents keeps it in a context variable
    from livekit.agents.voice.agent_activity import _SpeechHandleContextVar as _SPEECH  # noqa: E402
except ImportError:  # (without it, a finished reply that never reached the speaker is not cut)
    _SPEECH = None

from csmserve.config import FRAME_MS, SAMPLE_RATE  # noqa: E402
from csmserve.integrations.conversation import Conversation, ConversationError, ReplyAudio  # noqa: E402

PREROLL_S = 0.5  # user audio kept from before START_OF_SPEECH (the VAD confirms speech late)
REPLY_KEY = "csmserve.reply"  # AudioFrame.userdata: the reply (stream) whose audio the frame is
MAX_REPLIES = 16  # replies awaiting their playback report; past it the oldest is forgotten (TTS(max_replies=))


def _ms(seconds: float) -> int:
    """Seconds of audio -> whole 80 ms frames, in ms (float sums of frame durations: 0.16 may read 0.15999...)."""
    return int(seconds * 1000 + 1e-3) // FRAME_MS * FRAME_MS


@dataclass
class _Reply:
    """A reply whose audio went to the agent, until its playback is settled (reported or known unheard)."""

    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # ^ (request_id | None, frames the server keeps of it) once it finished or was cancelled
    session: bool = False  # its frames went to the session's audio output (ConversationAgent.tts_node)
    captured: float = 0.0  # seconds of it the audio output accepted
    untagged: float = 0.0  # TTS._untagged when it went to the session: more since, and it may be among them


class TTS(tts.TTS):
    """LiveKit TTS over csmserve's WebSocket, with the user's audio as context (module docstring)."""

    def __init__(self, *, base_url: str = "http://localhost:8000", voice: str = "alloy", api_key: str | None = None,
                 context_id: str | None = None, speaker: int | None = None, user_speaker: int = 1,
                 temperature: float | None = None, top_k: int | None = None, seed: int | None = None,
                 max_audio_length_ms: int | None = None, max_segment_length_ms: int | None = None,
                 max_replies: int = MAX_REPLIES) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True), sample_rate=SAMPLE_RATE, num_channels=1)
        if max_replies < 1:
            raise ValueError(f"max_replies must be at least 1, got {max_replies}")
        self.conversation = Conversation(base_url, voice=voice, api_key=api_key, context_id=context_id,
                                         speaker=speaker, user_speaker=user_speaker, temperature=temperature,
                                         top_k=top_k, seed=seed, max_audio_length_ms=max_audio_length_ms,
                                         max_segment_length_ms=max_segment_length_ms)
        self.cuts: list[dict] = []  # each truncate sent: {"request_id", "played_ms", "num_frames"}
        self.max_replies = max_replies
        self._replies: OrderedDict[str, _Reply] = OrderedDict()  # by stream key, oldest first
        self._untagged = 0.0  # seconds of audio without REPLY_KEY the output accepted (a tts_node's own frames)
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

    # ---- playback (ConversationAgent: attach in on_enter, in_session in tts_node)
    def attach(self, output: io.AgentOutput) -> PlaybackTap | None:
        """Put a PlaybackTap on `session.output`'s audio, once. -> the tap (None: no audio output)."""
        tap = self.tap_of(output.audio)
        if tap is None and output.audio is not None:
            output.audio = tap = PlaybackTap(self, output.audio)
        return tap

    def tap_of(self, audio: io.AudioOutput | None) -> PlaybackTap | None:
        """This TTS's PlaybackTap in an audio output's chain, if it has one."""
        while audio is not None and not (isinstance(audio, PlaybackTap) and audio.csm is self):
            audio = audio.next_in_chain
        return audio

    def in_session(self, key: str, speech=None) -> None:
        """Reply `key`'s audio goes to the session's audio output, for `speech` (a SpeechHandle, if known):
        when the speech is over, the reply was heard as far as the output reported, or not at all."""
        reply = self._replies.get(key)
        if reply is None or reply.session:
            return
        reply.session, reply.untagged = True, self._untagged
        if speech is not None:
            speech.add_done_callback(lambda _: self._speech_done(key))

    def _track(self, key: str) -> _Reply:
        reply = self._replies[key] = _Reply()
        while len(self._replies) > self.max_replies:  # a reply never played here (a synthesize() spoken elsewhere)
            self._replies.popitem(last=False)
        return reply

    def _captured(self, key: str | None, seconds: float) -> None:
        if key is None:
            self._untagged += seconds
        elif (reply := self._replies.get(key)) is not None:
            reply.captured += seconds

    def _reached(self, reply: _Reply) -> float | None:
        """Seconds of the session's reply the output accepted; None if unknown (not the session's, or audio
        without a REPLY_KEY went to the output since: a tts_node that makes its own frames)."""
        return reply.captured if reply.session and self._untagged == reply.untagged else None

    def _played(self, key: str, seconds: float, interrupted: bool) -> None:
        """The output's report on reply `key`: `seconds` of it played."""
        reply = self._replies.pop(key, None)
        if reply is not None and interrupted:
            self._spawn(self._cut(reply, _ms(seconds)))

    def _speech_done(self, key: str) -> None:
        reply = self._replies.pop(key, None)  # reported already, or never will be
        if reply is not None and self._reached(reply) == 0:  # none of it reached the speaker
            self._spawn(self._cut(reply, 0))

    async def _cut(self, reply: _Reply, played_ms: int) -> None:
        """Truncate the reply's turn to `played_ms` unless the server keeps no more than that already."""
        try:
            request_id, frames = await asyncio.wait_for(asyncio.shield(reply.done), timeout=30)
            if request_id is not None and played_ms < frames * FRAME_MS:
                msg = await self.conversation.truncate(request_id, played_ms)
                self.cuts.append({"request_id": request_id, "played_ms": played_ms,
                                  "num_frames": msg.get("num_frames", 0)})
        except (ConversationError, asyncio.TimeoutError):
            pass

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class PlaybackTap(io.AudioOutput):
    """Wraps the session's audio output, passing everything through. An output reports once per segment it
    accepted audio for, in order, so each report goes to the replies (REPLY_KEY) of the oldest unreported
    segment; a reply the output took none of is in no segment and never takes or shifts a report."""

    def __init__(self, csm: TTS, next_in_chain: io.AudioOutput) -> None:
        super().__init__(label="csmserve", capabilities=io.AudioOutputCapabilities(pause=True),
                         next_in_chain=next_in_chain, sample_rate=next_in_chain.sample_rate)
        self.csm = csm
        self._segments: deque[list[list]] = deque()  # accepted, not reported: runs of [key, start_s, seconds]
        self._capturing = False

    @property
    def sample_rate(self) -> int | None:
        return self.next_in_chain.sample_rate

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await self.next_in_chain.capture_frame(frame)  # counted once the output below took it (as LiveKit's
        await super().capture_frame(frame)  # own wrappers count): a capture cancelled there begins nothing
        if not self._capturing:
            self._capturing = True
            self._segments.append([])
        runs, key = self._segments[-1], frame.userdata.get(REPLY_KEY)
        if runs and runs[-1][0] == key:
            runs[-1][2] += frame.duration
        else:
            runs.append([key, runs[-1][1] + runs[-1][2] if runs else 0.0, frame.duration])
        self.csm._captured(key, frame.duration)

    def flush(self) -> None:
        super().flush()
        self._capturing = False
        self.next_in_chain.flush()

    def clear_buffer(self) -> None:
        self.next_in_chain.clear_buffer()

    def on_playback_finished(self, *, playback_position: float, interrupted: bool,
                             synchronized_transcript: str | None = None) -> None:
        if self._segments:  # (none: a segment begun before the tap was put on)
            for key, start, seconds in self._segments.popleft():
                if key is not None:
                    self.csm._played(key, min(max(playback_position - start, 0.0), seconds), interrupted)
        super().on_playback_finished(playback_position=playback_position, interrupted=interrupted,
                                     synchronized_transcript=synchronized_transcript)


class SynthesizeStream(tts.SynthesizeStream):
    """One agent reply: one turn of the conversation. Its frames carry its key (REPLY_KEY)."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._csm: TTS = tts

    async def __anext__(self) -> tts.SynthesizedAudio:
        ev = await super().__anext__()
        ev.frame.userdata[REPLY_KEY] = ev.segment_id
        return ev

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        conv, key = self._csm.conversation, uuid.uuid4().hex
        output_emitter.initialize(request_id=key, sample_rate=SAMPLE_RATE, num_channels=1, mime_type="audio/pcm",
                                  stream=True)
        output_emitter.start_segment(segment_id=key)
        started = asyncio.Event()
        state: dict = {"reply": None, "tracked": None}

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
                    if state["tracked"] is None:
                        state["tracked"] = self._csm._track(key)
                    output_emitter.push(event.pcm)
            if state["tracked"] is not None and reply.done and reply.error is None:
                state["tracked"].done.set_result((reply.request_id, reply.frames))

        tasks = [asyncio.create_task(send()), asyncio.create_task(receive())]
        try:
            await asyncio.gather(*tasks)
        except ConversationError as e:
            raise APIConnectionError(str(e)) from None
        finally:
            for t in tasks:
                t.cancel()
            reply, tracked = state["reply"], state["tracked"]
            if reply is not None and not reply.done and not reply.cancelled:  # interrupted: stop it now
                await asyncio.shield(self._cancel(reply, tracked))
            if tracked is not None and not tracked.done.done():  # failed, or cancelled with another reply
                tracked.done.set_result((None, 0))
        output_emitter.end_segment()

    async def _cancel(self, reply, tracked: _Reply | None) -> None:
        """Cancel the turn on the server, keeping what reached the session's speaker (all the agent received
        if the audio is not the session's); the playback report cuts it further."""
        frames = reply.frames
        if tracked is not None and (reached := self._csm._reached(tracked)) is not None:
            # the session stopped forwarding it too: what the output accepted is final
            frames = min(frames, math.ceil(reached * 1000 / FRAME_MS - 1e-6))
        try:
            msg = await self._csm.conversation.interrupt(audio_end_ms=frames * FRAME_MS)
        except (ConversationError, asyncio.TimeoutError):
            return
        if tracked is not None and not tracked.done.done():
            if msg.get("request_id") is None and reply.done:  # it finished before the cancel came: whole
                tracked.done.set_result((reply.request_id, reply.frames))
            else:
                tracked.done.set_result((msg.get("request_id"), msg.get("num_frames", 0)))


class ConversationAgent(Agent):
    """An Agent whose four hooks let `TTS` hear the user (STT input audio, speech events, transcripts) and
    the speaker (playback reports, which replies go to it). Subclass it, or copy the hooks into your Agent."""

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
        if csm is not None:
            csm.attach(self.session.output)

    async def tts_node(self, text: AsyncIterable[str], model_settings) -> AsyncGenerator[rtc.AudioFrame, None]:
        """The default TTS node; tells the TTS which replies go to its tapped audio output (and for which
        speech), and resamples to the output's rate here, keeping each frame's REPLY_KEY (the session's
        resampler would make new frames without it)."""
        csm, out = self._csm_tts(), self.session.output.audio
        speech = _SPEECH.get(None) if _SPEECH is not None else None
        if csm is not None and csm.tap_of(out) is None:
            csm = None  # (on_enter did not put the tap on: these replies' playback is not known)
        rate = out.sample_rate if out is not None else None
        resampler: rtc.AudioResampler | None = None
        last: dict = {}
        async for frame in Agent.default.tts_node(self, text, model_settings):
            key = frame.userdata.get(REPLY_KEY)
            if csm is not None and key is not None:
                csm.in_session(key, speech)
            if rate is None or frame.sample_rate == rate:
                yield frame
                continue
            if resampler is None:
                resampler = rtc.AudioResampler(frame.sample_rate, rate, num_channels=frame.num_channels)
            last = frame.userdata
            for f in resampler.push(frame):
                f.userdata.update(last)
                yield f
        if resampler is not None:
            for f in resampler.flush():
                f.userdata.update(last)
                yield f
