"""What every route shares: the model, the voice store, the limits, the metrics, the one path
from (voice, context, text) to prompt frames to a stream of AudioChunks, and the WebSocket's
conversation sessions (Sessions: bounded, LRU, idle timeout)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..audio import AudioDecodeError, AudioTooLongError, decode_audio_24k
from ..config import ServerConfig
from ..engine.request import AudioChunk, Request, SamplingParams
from ..engine.scheduler import SchedulerBusy
from ..voices import ResolvedVoice, VoiceBackend, VoiceNotFoundError
from .errors import APIError, bad_request
from .metrics import Metrics
from .schemas import ContextTurn, SamplingFields, VoiceRef, WsRequest

if TYPE_CHECKING:
    from ..api import CSM, Segment

log = logging.getLogger("csmserve.server")
FRAME_SECONDS = 0.08
_SETTINGS = ("voice", "speaker", "temperature", "top_k", "top_p", "seed", "max_audio_length_ms", "output_format")


@dataclass
class SessionTurn:
    """One turn of a conversation: `assistant` (generated here, one Segment per sentence/clause as it was
    spoken) or `user` (given with `add_context`, its audio encoded with Mimi once, on arrival)."""

    role: str
    segments: list  # [Segment] with codes (int16: values < 2051) or text only

    @property
    def frames(self) -> int:
        return sum(0 if s.codes is None else len(s.codes) for s in self.segments)


@dataclass
class Session:
    """A WebSocket `context_id`: its voice and settings, its fixed context and its turns, across
    connections, until `close`, the idle timeout or eviction."""

    context_id: str
    voice: str | VoiceRef = "alloy"
    fields: SamplingFields = field(default_factory=SamplingFields)
    output_format: str = "pcm_s16le"
    context: list = field(default_factory=list)  # [Segment] given with `context` (encoded once)
    turns: list[SessionTurn] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0  # turns generating now: never expired or evicted meanwhile

    def update(self, msg: WsRequest) -> None:
        given = msg.model_fields_set
        for name in _SETTINGS:
            if name in given and getattr(msg, name) is not None:
                if name == "voice":
                    self.voice = msg.voice
                elif name == "output_format":
                    self.output_format = msg.output_format
                else:
                    self.fields = self.fields.model_copy(update={name: getattr(msg, name)})

    def history(self) -> list:
        """The turns' Segments, oldest first: the conversation context of the next turn."""
        return [s for t in self.turns for s in t.segments]

    def drop_oldest_segment(self) -> bool:
        """Forget the oldest segment of the conversation (the prompt would not fit); False when none is left."""
        while self.turns and not self.turns[0].segments:
            self.turns.pop(0)
        if not self.turns:
            return False
        self.turns[0].segments.pop(0)
        if not self.turns[0].segments:
            self.turns.pop(0)
        return True


class Sessions:
    """The conversation sessions by context_id: LRU, bounded in number and per session (turns, frames),
    forgotten after `session_idle_s` unused (checked on every access)."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        self.expire()
        return len(self._by_id)

    def __contains__(self, context_id: str) -> bool:
        return self.get(context_id) is not None

    def get(self, context_id: str) -> Session | None:
        self.expire()
        s = self._by_id.get(context_id)
        if s is not None:
            self.touch(s)
        return s

    def open(self, context_id: str) -> Session:
        """The session of `context_id`, created (empty) if there is none."""
        s = self.get(context_id)
        if s is None:
            while len(self._by_id) >= self.config.max_sessions and self._evict_one():
                pass
            s = self._by_id[context_id] = Session(context_id, last_used=self.clock())
        return s

    def touch(self, s: Session) -> None:
        s.last_used = self.clock()
        if self._by_id.get(s.context_id) is s:
            self._by_id.move_to_end(s.context_id)

    def drop(self, context_id: str) -> None:
        self._by_id.pop(context_id, None)

    def expire(self) -> None:
        cutoff = self.clock() - self.config.session_idle_s
        for cid, s in list(self._by_id.items()):  # least recently used first
            if s.last_used > cutoff:
                break
            if not s.busy:
                del self._by_id[cid]

    def _evict_one(self) -> bool:
        for cid, s in self._by_id.items():
            if not s.busy:
                del self._by_id[cid]
                return True
        return False

    def add_turn(self, s: Session, turn: SessionTurn) -> None:
        """Append a turn; then the oldest go while the session holds more turns or frames than allowed."""
        for seg in turn.segments:
            if seg.codes is not None:
                seg.codes = np.asarray(seg.codes, dtype=np.int16)
        s.turns.append(turn)
        while len(s.turns) > self.config.max_session_turns:
            s.turns.pop(0)
        while len(s.turns) > 1 and sum(t.frames for t in s.turns) > self.config.max_session_frames:
            s.turns.pop(0)
        self.touch(s)


class ServerState:
    def __init__(self, csm: CSM | None, config: ServerConfig, store: VoiceBackend) -> None:
        self.csm, self.config, self.store = csm, config, store
        self.active = 0  # generations in flight, HTTP and WebSocket
        self.last_prompt: tuple[np.ndarray, np.ndarray] | None = None  # tokens, mask last submitted (tests)
        self.sessions = Sessions(config)  # WebSocket conversation sessions by context_id
        self.metrics = Metrics(config.model_name, self._num_running, self._num_waiting, self._prefix_stats)

    # ---- readiness and limits
    @property
    def ready(self) -> bool:
        return self.csm is not None and bool(getattr(self.csm, "ready", True))

    def require_ready(self) -> CSM:
        if not self.ready:
            raise APIError(503, "the model is still loading; retry when GET /ready answers 200", "model_not_ready")
        fatal = self.engine_fatal()
        if fatal is not None:
            raise APIError(503, f"the engine is down after a device error ({fatal}); the process must be restarted",
                           "engine_failed")
        return self.csm

    def engine_fatal(self) -> str | None:
        """The device error that stopped the engine, if any (never starts the engine)."""
        return getattr(self._engine(), "fatal", None)

    def _engine(self):
        if not self.ready:  # CSM.client would start the engine
            return None
        return getattr(self.csm.client, "engine", None)

    def _scheduler(self):
        return getattr(self._engine(), "scheduler", None)

    def _num_running(self) -> float:
        s = self._scheduler()
        return float(s.num_running + s.num_prefilling) if s is not None else 0.0

    def _num_waiting(self) -> float:
        s = self._scheduler()
        return float(s.num_waiting) if s is not None else 0.0

    def _prefix_stats(self) -> dict:
        """The engine's prefix-cache counters (hits, misses, ...); {} without an engine or a cache."""
        cache = getattr(self._engine(), "prefix_cache", None)
        return dict(cache.stats) if cache is not None else {}

    def check_input(self, text: str, param: str = "input") -> str:
        if not text.strip():
            raise APIError(400, f"'{param}' must not be empty", "empty_input", param)
        if len(text) > self.config.max_input_chars:
            raise APIError(400, f"'{param}' is {len(text)} characters; the limit is {self.config.max_input_chars}",
                           "input_too_long", param)
        return text

    def audio_length_ms(self, asked: int | None) -> int:
        if asked is None:
            return self.config.default_audio_length_ms
        if asked > self.config.max_audio_length_ms:
            raise bad_request(f"max_audio_length_ms is {asked}; the limit is {self.config.max_audio_length_ms}",
                              "max_audio_length_ms")
        return asked

    # ---- voices and context
    async def resolve_voice(self, voice: str | VoiceRef, param: str = "voice") -> ResolvedVoice:
        key = voice.id if isinstance(voice, VoiceRef) else voice
        try:
            return await asyncio.to_thread(self.store.resolve, key)
        except VoiceNotFoundError:
            raise APIError(404, f"voice {key!r} not found; GET /v1/audio/voices lists the voices",
                           "voice_not_found", param) from None

    async def encode_clip(self, data: bytes, param: str) -> np.ndarray:
        """Audio file bytes -> Mimi codes [T, 32] (decode, downmix, resample to 24 kHz, encode)."""
        if len(data) > self.config.max_upload_bytes:
            raise APIError(413, f"'{param}' is {len(data)} bytes; the limit is {self.config.max_upload_bytes}",
                           "file_too_large", param)
        csm = self.require_ready()
        try:
            pcm = await asyncio.to_thread(decode_audio_24k, data, self.config.max_clip_seconds)
        except AudioTooLongError as e:
            raise bad_request(f"'{param}': {e}", param, "audio_too_long") from None
        except AudioDecodeError as e:
            raise bad_request(f"'{param}' is not audio we can read: {e}", param, "invalid_audio") from None
        if pcm.size < 1920:
            raise bad_request(f"'{param}' is shorter than one 80 ms frame", param, "audio_too_short")
        return await asyncio.to_thread(csm.encode_audio, pcm)

    async def context_segments(self, turns: Sequence[ContextTurn], param: str = "context") -> list[Segment]:
        from ..api import Segment

        if len(turns) > self.config.max_context_turns:
            raise bad_request(f"'{param}' has {len(turns)} turns; the limit is {self.config.max_context_turns}",
                              param, "context_too_long")
        out = []
        for i, turn in enumerate(turns):
            p = f"{param}[{i}]"
            if turn.voice_id is not None:
                v = await asyncio.to_thread(self.store.get, turn.voice_id)
                if v is None:
                    raise APIError(404, f"voice {turn.voice_id!r} not found", "voice_not_found", f"{p}.voice_id")
                out.append(Segment(turn.speaker, turn.text or v.transcript, codes=v.codes))
            elif turn.audio is not None:
                out.append(Segment(turn.speaker, turn.text, codes=await self.encode_clip(
                    _b64decode(turn.audio, f"{p}.audio", self.config.max_upload_bytes), f"{p}.audio")))
            else:
                out.append(Segment(turn.speaker, turn.text))
        return out

    def prompt(self, text: str, speaker: int, segments: Sequence[Segment], max_audio_length_ms: int,
               param: str = "context") -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Prompt frames and the context's turn boundaries (the prefix cache's shorter candidates)."""
        try:
            tokens, mask, bounds = self.require_ready().prompt_and_boundaries(
                text, speaker=speaker, context=list(segments), max_audio_length_ms=max_audio_length_ms)
        except ValueError as e:
            raise bad_request(str(e), param, "context_too_long" if "too long" in str(e) else "invalid_value") from None
        self.last_prompt = (tokens, mask)
        return tokens, mask, bounds

    async def build_request(self, text: str, voice: str | VoiceRef, fields: SamplingFields,
                            turns: Sequence[ContextTurn] = (), extra: Sequence[Segment] = (),
                            long_form: bool = False) -> tuple[Request, int]:
        """The routes' whole path to a Request (and the speaker it speaks as): the voice's clip, then
        the context turns, then `extra`, then `text`. long_form: text of several sentences is spoken
        sentence by sentence in one slot (each seeing the earlier ones; max_audio_length_ms per sentence)."""
        from ..api import Segment
        from ..text import split_sentences
        from ..tokenizer import segment_ids, text_frames

        texts = split_sentences(text) if long_form else []
        if len(texts) > 1:
            request, speaker = await self.build_request(texts[0], voice, fields, turns, extra)
            csm, k = self.require_ready(), request.tokens.shape[1] - 1
            first = text_frames(segment_ids(csm.tokenizer, speaker, texts[0]), k)[0]
            request.context_len = request.prompt_len - len(first)
            request.segments = deque(text_frames(segment_ids(csm.tokenizer, speaker, t), k) for t in texts[1:])
            return request, speaker

        self.require_ready()
        max_ms = self.audio_length_ms(fields.max_audio_length_ms)
        resolved = await self.resolve_voice(voice)
        segments = [Segment(resolved.speaker, resolved.voice.transcript, codes=resolved.voice.codes)] \
            if resolved.voice is not None else []
        segments += await self.context_segments(turns)
        segments += list(extra)
        speaker = fields.speaker if fields.speaker is not None else resolved.speaker
        tokens, mask, bounds = self.prompt(text, speaker, segments, max_ms)
        params = SamplingParams(temperature=fields.temperature, top_k=fields.top_k, top_p=fields.top_p,
                                seed=fields.seed, max_audio_length_ms=max_ms)
        csm = self.require_ready()
        target = len(segment_ids(csm.tokenizer, speaker, text))  # the target turn's text frames
        # voice clip + context turns form the reusable prefix: the engine's prefix cache keys on it
        return Request(tokens, mask, params=params, prefix_len=max(0, len(tokens) - target),
                       prefix_boundaries=tuple(bounds)), speaker

    # ---- generation
    async def stream(self, request: Request, arrival: float,
                     on_submit: Callable[[], None] | None = None) -> AsyncIterator[AudioChunk]:
        """The engine's chunks with the concurrency limit and the metrics around them. Closing this
        generator early (client gone, cancel) aborts the request and frees its slot. on_submit: called
        once the engine has the request (an open long-form request may then be appended to)."""
        csm = self.require_ready()
        limit = self.config.max_concurrent_requests
        if limit is not None and self.active >= limit:
            raise APIError(429, f"too many concurrent requests ({self.config.max_concurrent_requests}); retry later",
                           "too_many_requests")
        self.active += 1
        agen = csm.client.astream(request, on_submit=on_submit) if on_submit is not None \
            else csm.client.astream(request)
        frames, reason, first = 0, "abort", None
        try:
            async for chunk in agen:
                if first is None and len(chunk.codes):
                    first = time.perf_counter()
                    self.metrics.ttfa.observe(first - arrival)
                    admitted = getattr(request, "admit_time", None)
                    self.metrics.queue_time.observe((admitted or first) - (request.arrival_time or arrival))
                frames += len(chunk.codes)
                if chunk.final:
                    reason = chunk.finish_reason or "eos"
                yield chunk
        except SchedulerBusy as e:
            raise APIError(503, str(e), "server_busy") from None
        except ValueError as e:  # the engine refused the prompt
            raise bad_request(str(e), "input", "invalid_prompt") from None
        finally:
            await agen.aclose()  # GeneratorExit at the engine's queue: abort, slot freed at the next frame
            self.active -= 1
            self._account(arrival, frames, reason)

    def _account(self, arrival: float, frames: int, reason: str) -> None:
        wall = time.perf_counter() - arrival
        self.metrics.frames.inc(frames)
        self.metrics.audio_seconds.inc(frames * FRAME_SECONDS)
        self.metrics.e2e.observe(wall)
        self.metrics.finished(reason)
        if frames:
            self.metrics.rtf.observe(wall / (frames * FRAME_SECONDS))


def _b64decode(data: str, param: str, limit: int) -> bytes:
    if len(data) > limit * 4 // 3 + 4:
        raise APIError(413, f"'{param}' decodes to more than {limit} bytes", "file_too_large", param)
    if data.startswith("data:") and "," in data:  # a data: URL
        data = data.split(",", 1)[1]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"'{param}' is not valid base64", param, "invalid_base64") from None
