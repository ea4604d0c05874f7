"""What every route shares: the model, the voice store, the limits, the metrics, the WebSocket's sessions, and
the one path from a speech request to AudioChunks: a route asks `plan` (POST /v1/audio/speech) or `plan_turn`
(a WebSocket turn) once for its SpeechPlan (input checked, voices and context resolved, caps sized, the Request
built by CSM's builders), then streams it (`stream`)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from csmserve.audio import AudioDecodeError, AudioTooLongError, Encoder, decode_audio_24k, make_encoder
from csmserve.config import FRAME_MS, FRAME_SAMPLES, ServerConfig, reading_ms
from csmserve.engine import trace
from csmserve.engine.adapters import AdapterPoolFullError, UnknownAdapterError
from csmserve.engine.client import SchedulerBusy
from csmserve.engine.request import AudioChunk, Request
from csmserve.voices import ALIASES, VOICE_ID_PREFIX, ResolvedVoice, VoiceBackend, VoiceNotFoundError, VoiceStoreError
from csmserve.prompt.segments import segment_spans, split_sentences
from csmserve.server.dialogue import is_dialogue, read_dialogue
from csmserve.server.errors import APIError, bad_request
from csmserve.server.lead import Lead, LoopLoad
from csmserve.server.metrics import Metrics
from csmserve.server.schemas import ContextTurn, SamplingFields, SpeechRequest, VoiceRef
from csmserve.server.sessions import Session, Sessions

if TYPE_CHECKING:
    from csmserve.api import CSM, Segment, TextFeed
    from csmserve.server.dispatch import Counters

log = logging.getLogger("csmserve.server")
# a speech input up to this long (and no context turns) is tokenized on the event loop: tens of microseconds,
# where a thread's result waits for a busy loop to come back to it (a loaded worker's TTFA)
INLINE_CHARS = 2000
# a preset name (`alloy`) is looked up in the voice store at most once a second a worker: a stored voice of that name
# takes the preset over (made through another worker or replica: within this long), while the presets' requests
# otherwise read no store and hop to no thread
ALIAS_RECHECK_S = 1.0


@dataclass(frozen=True)
class RequestArgs:
    """One speech request's choices (ServerState.resolve); `kw()`: what CSM's request builders take."""

    speaker: int
    context: tuple[Segment, ...]
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    max_audio_length_ms: int  # the whole response
    max_segment_length_ms: int | None  # each segment of a long-form request (None: one segment)
    adapter: str | None = None  # None: the base model

    def kw(self) -> dict:
        """CSM's builders' keywords; fit_cap: a cap the slot cannot hold is refused (400), not cut."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**kw, "context": list(self.context), "fit_cap": True}


@dataclass(frozen=True)
class Script:
    """What each segment of a request speaks: its text, speaker id and line (0 for a plain input)."""

    texts: list[str]
    speakers: list[int]
    lines: list[int]


@dataclass(frozen=True)
class SpeechPlan:
    """Everything one speech request needs: the built Request, its choices, what each segment speaks (spans:
    where in a plain `input`), and what the response encodes with."""

    request: Request
    args: RequestArgs
    script: Script
    spans: list[tuple[int, int]] | None = None  # each segment's [start, end) in a plain input
    dialogue: bool = False
    response_format: str = "pcm"
    speed: float = 1.0
    codec_options: dict[str, str] | None = None  # --mp3-compression-level, --opus-complexity
    native_codecs: bool | None = None

    def encoder(self) -> Encoder:
        return make_encoder(self.response_format, speed=self.speed, codec_options=self.codec_options,
                            native=self.native_codecs)


class ServerState:
    def __init__(self, csm: CSM | None, config: ServerConfig, store: VoiceBackend,
                 sessions_path: str | None = None) -> None:
        self.csm, self.config, self.store = csm, config, store
        self.active = 0  # generations in flight, HTTP and WebSocket
        self.workers: tuple[Counters, int] | None = None  # the server's API workers' counts and this one's index
        self._not_stored: dict[str, float] = {}  # preset name -> when the store last had no voice of that name
        self.headers: list[tuple[bytes, bytes]] = []  # on every response: which worker (and Ray replica) served it
        self.last_prompt: tuple[np.ndarray, np.ndarray] | None = None  # tokens, mask last submitted (tests)
        self.sessions = Sessions(config, path=sessions_path)  # WebSocket conversation sessions by context_id
        self.metrics = Metrics(config.model_name, self.engine_stats)
        self.lead = Lead(LoopLoad(), config.max_lead_s)  # LoopLoad started by the app's lifespan
        self._stall_from: float | None = None  # the engine's last word before the stall under way (engine_stalled)
        # ServerConfig.encode_threads: compressed streams' chunks after the first are encoded there
        self.encode_pool = ThreadPoolExecutor(config.encode_threads, thread_name_prefix="csmserve-encode") \
            if config.encode_threads else None

    # ---- readiness and limits
    @property
    def ready(self) -> bool:
        return self.csm is not None and bool(getattr(self.csm, "ready", True))

    def require_ready(self) -> CSM:
        if not self.ready:
            raise APIError(503, "the model is still loading; retry when GET /ready answers 200", "model_not_ready")
        fatal = self.engine_fatal()
        if fatal is not None:
            raise APIError(503, f"the engine is down ({fatal}); the server must be restarted", "engine_failed")
        return self.csm

    def engine_fatal(self) -> str | None:
        """The error that stopped the engine, if any; never starts the engine."""
        return self.csm.client.fatal if self.ready else None

    def engine_stalled(self) -> float | None:
        """Seconds the engine process has been silent, once past --engine-stall-s (no step, no heartbeat: a GPU
        hang, a deadlock); None while it sends, when it is gone (engine_fatal says so) or in this process. A
        stall's start and end are logged once each (the app's watch calls this between probes)."""
        # getattr: a stand-in client (tests/server/fake_csm.py) has none
        last = getattr(self.csm.client, "last_word", None) if self.ready else None
        if last is None or self.engine_fatal() is not None:
            return None
        silent = time.monotonic() - last
        if silent < self.config.engine_stall_s:
            if self._stall_from is not None:
                log.info("the engine process sends again after %.1f s of silence: /health and /ready answer 200",
                         last - self._stall_from)
                self._stall_from = None
            return None
        if self._stall_from is None:
            self._stall_from = last
            log.warning("the engine process has sent nothing for %.1f s (hung? a GPU hang, a deadlock): /health and "
                        "/ready answer 503 engine_stalled until it sends again; open streams are kept", silent)
        return silent

    def engine_stats(self):
        """The engine's counters (engine.outputs.EngineStats) as of its last step; None before it runs."""
        return self.csm.client.stats() if self.ready else None

    def _check_input(self, text: str, param: str = "input") -> str:
        if not text.strip():
            raise APIError(400, f"'{param}' must not be empty", "empty_input", param)
        if len(text) > self.config.max_input_chars:
            raise APIError(400, f"'{param}' is {len(text)} characters; the limit is {self.config.max_input_chars}",
                           "input_too_long", param)
        return text

    def _audio_length_ms(self, asked: int | None, chars: int = 0) -> int:
        """The whole response's cap: as asked (at most --max-audio-length-ms), else enough for the text
        (--audio-ms-per-char per character, at least --default-audio-length-ms: 30 s, or 1 s on random
        weights, which never end a sentence; at most the limit)."""
        c = self.config
        if asked is None:
            floor = c.audio_floor_ms(getattr(self.csm, "random_weights", False))
            return min(c.max_audio_length_ms, max(floor, c.audio_ms_per_char * chars))
        if asked > c.max_audio_length_ms:
            raise bad_request(f"max_audio_length_ms is {asked}; the limit is {c.max_audio_length_ms}",
                              "max_audio_length_ms")
        return asked

    # ---- a speech request's plan
    async def plan(self, body: SpeechRequest) -> SpeechPlan:
        """POST /v1/audio/speech's body -> its plan. Several sentences are one long-form request; a dialogue
        (server/dialogue.py) too: each voice's clip as its speaker id, then `context`, then every line's
        sentences with their speakers."""
        level = {"mp3": self.config.mp3_compression_level, "opus": self.config.opus_complexity}.get(
            body.response_format)  # the encoder effort (--mp3-compression-level, --opus-complexity)
        encoding = dict(response_format=body.response_format, speed=body.speed, native_codecs=self.config.native_codecs,
                        codec_options=None if level is None else {"compression_level": str(level)})
        if is_dialogue(body):
            voices, segs = read_dialogue(body, self._check_input)
            limit = self.config.max_context_turns
            if len(voices) + len(body.context) > limit:
                raise bad_request(f"the dialogue's {len(voices)} voices and {len(body.context)} context turns are "
                                  f"more than {limit} context turns (--max-context-turns)", "input",
                                  "context_too_long")
            texts, speakers = [t for _, _, t in segs], [s for _, s, _ in segs]
            # the whole script's text sizes the response's cap; each line's sentences get the sentence cap
            args = await self.resolve(body.model_copy(update={"speaker": speakers[0]}), None, body.context,
                                      cast=voices, cast_param="voices" if body.voices else "input",
                                      total_chars=sum(map(len, texts)), segment_chars=max(map(len, texts)),
                                      segmented=True, model=body.model)
            request = await self._build(lambda: self.csm.long_request(texts, speakers=speakers, **args.kw()),
                                        adapter=args.adapter)
            return SpeechPlan(request, args, Script(texts, speakers, [i for i, _, _ in segs]), dialogue=True,
                              **encoding)
        text = self._check_input(body.input)
        short = len(text) <= INLINE_CHARS
        texts = split_sentences(text) if short else await asyncio.to_thread(split_sentences, text)
        long = len(texts) > 1
        args = await self.resolve(body, body.voice, body.context, total_chars=len(text),
                                  segment_chars=max(map(len, texts)) if long else None, segmented=long,
                                  model=body.model)
        csm = self.csm
        request = await self._build(lambda: csm.long_request(texts, **args.kw()) if long else
                                    csm.request(text, **args.kw()), inline=short and not body.context,
                                    adapter=args.adapter)
        texts = texts or [text]
        return SpeechPlan(request, args, Script(texts, [args.speaker] * len(texts), [0] * len(texts)),
                          spans=segment_spans(text, texts), **encoding)

    async def plan_turn(self, session: Session, feed: TextFeed) -> SpeechPlan:
        """A WebSocket turn -> its plan: ONE open long-form request (TextFeed.open) with the session's voice,
        settings and fixed context, then its conversation, whose oldest segments are dropped from the session
        while the prompt would not fit (CSM.history_overflow)."""
        args = await self.resolve(session.fields, session.voice, segments=session.context,
                                  total_chars=self.config.max_input_chars, segmented=True, model=session.model)
        csm, history, cut = self.csm, session.history(), []

        def build() -> Request:
            kw = args.kw()
            cut.append(csm.history_overflow(feed.texts[0], history, **kw))
            return feed.open(**{**kw, "context": kw["context"] + history[cut[0]:]})

        try:
            request = await self._build(build, adapter=args.adapter)
        finally:
            if cut:
                session.drop_oldest_segments(cut[0])
        texts = list(feed.texts)
        return SpeechPlan(request, args, Script(texts, [args.speaker] * len(texts), [0] * len(texts)))

    async def resolve(self, fields: SamplingFields, voice: str | VoiceRef | None = None,
                      turns: Sequence[ContextTurn] = (), segments: Sequence[Segment] = (), *,
                      cast: dict[str, int] | None = None, cast_param: str = "input", total_chars: int,
                      segment_chars: int | None = None, segmented: bool = False,
                      model: str | None = None) -> RequestArgs:
        """The one resolution of a request's choices. The adapter: adapter_for. The speaker: `fields.speaker`,
        else the voice's. The context: the voice's clip, each `cast` voice's clip (as its speaker id there), the
        `turns` (encoded here), then `segments` (a session's fixed context). max_audio_length_ms caps the whole
        (as asked, else sized for `total_chars`; one sentence's max_segment_length_ms too); segmented:
        max_segment_length_ms each segment (as asked, else sized for `segment_chars`, at most --max-segment-ms)."""
        from csmserve.api import Segment

        self.require_ready()
        max_ms = self._audio_length_ms(fields.max_audio_length_ms, total_chars)
        if not segmented and fields.max_segment_length_ms is not None:  # one sentence: its cap is the whole's
            max_ms = min(max_ms, fields.max_segment_length_ms)
        seg_ms = None
        if segmented:
            asked = fields.max_segment_length_ms
            seg_ms = asked or self.config.max_segment_ms
            if segment_chars is not None and asked is None:
                seg_ms = min(seg_ms, reading_ms(segment_chars, self.config.audio_ms_per_char))
            seg_ms = min(max_ms, seg_ms)
        context, bound = [], {}  # bound: voice -> the adapter it is bound to
        resolved = await self._resolve_voice(voice) if voice is not None else None  # None: no voice clip
        if resolved is not None and resolved.voice is not None:
            context.append(Segment.of_voice(resolved.voice, resolved.speaker))
            bound[resolved.voice.name] = resolved.voice.adapter
        for key, speaker in (cast or {}).items():  # a dialogue's voices, each as the id it speaks with there
            clip = (await self._resolve_voice(key, cast_param)).voice
            if clip is not None:
                context.append(Segment.of_voice(clip, speaker))
                bound[clip.name] = clip.adapter
        adapter = self.adapter_for(model, {v: a for v, a in bound.items() if a is not None})
        context += await self.context_segments(turns)
        context += segments
        speaker = fields.speaker if fields.speaker is not None else resolved.speaker if resolved is not None else 0
        return RequestArgs(speaker, tuple(context), fields.temperature, fields.top_k, fields.top_p, fields.seed,
                           max_ms, seg_ms, adapter)

    # ---- LoRA adapters
    @property
    def lora(self) -> bool:
        """The engine has an adapter pool (--max-loras / --lora): a `model` may name an adapter."""
        cfg = getattr(self.csm, "engine_config", None)
        return bool(cfg is not None and cfg.max_loras)

    def adapter_for(self, model: str | None, bound: dict[str, str]) -> str | None:
        """The adapter a request speaks with: `model` naming one wins; a base name or none: the one its voices
        are bound to (two different ones: 400), else the base (None). Without a pool another name is a 404 here;
        with one the engine says at submit whether it is loaded."""
        if model is not None and model not in self.config.base_models:
            if not self.lora:
                raise self.model_not_found(model)
            return model
        names = set(bound.values())
        if len(names) > 1:
            pairs = ", ".join(f"{v}: {a}" for v, a in sorted(bound.items()))
            raise bad_request(f"the voices are bound to different adapters ({pairs}); one request speaks with one: "
                              "name it in 'model'", "model", "adapter_conflict")
        if names and not self.lora:
            name = names.pop()
            raise APIError(404, f"the voice is bound to adapter {name!r}, but this server serves no LoRA adapters "
                           "(--lora / --max-loras)", "model_not_found", "voice")
        return names.pop() if names else None

    def model_not_found(self, model: str) -> APIError:
        base = ", ".join(self.config.base_models)
        where = "no LoRA adapter of that name is loaded" if self.lora else "this server serves no LoRA adapters"
        return APIError(404, f"model {model!r} not found: it is not the base model ({base}) and {where}; "
                        "GET /v1/models lists them", "model_not_found", "model")

    async def adapters(self) -> dict[str, dict]:
        """name -> info of every adapter the engine serves ({} without a pool)."""
        if not self.ready or not self.lora:
            return {}
        return await asyncio.to_thread(lambda: self.csm.adapters)

    async def _build(self, build: Callable[[], Request], param: str = "context", inline: bool = False,
                     adapter: str | None = None) -> Request:
        """build(), one of CSM's request builders, in a thread (a long prompt's tokenizing never blocks the event
        loop), or here with `inline` (see INLINE_CHARS); a prompt that does not fit is a 400."""
        tr = trace.current()
        t_built = [0.0]  # the builder done (in the thread: the rest of the hop is the loop's lag)

        def run() -> Request:
            try:
                request = build()
            except UnknownAdapterError:  # CSM in this process checks the name itself
                raise self.model_not_found(adapter) from None
            except ValueError as e:
                code = "context_too_long" if "too long" in str(e) else "invalid_value"
                raise bad_request(str(e), param, code) from None
            self.last_prompt = (request.tokens, request.mask)
            t_built[0] = time.perf_counter()
            return request

        t0 = time.perf_counter()
        request = run() if inline else await asyncio.to_thread(run)
        if tr is not None:
            tr.stamp(request.request_id, build0=t0, build1=t_built[0], built=time.perf_counter())
        return request

    # ---- voices and context
    async def stored(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw), a voice store call, on a thread; its database failing or past --voices-db-timeout-s:
        503 voices_db_unavailable (it was a 500, or a request that hung as long as the database did)."""
        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except VoiceStoreError as e:
            raise APIError(503, f"{e}; retry later", "voices_db_unavailable") from None

    async def _resolve_voice(self, voice: str | VoiceRef, param: str = "voice") -> ResolvedVoice:
        key = voice.id if isinstance(voice, VoiceRef) else voice
        preset = isinstance(key, str) and not key.startswith(VOICE_ID_PREFIX) and key.lower() in ALIASES
        if preset and time.monotonic() - self._not_stored.get(key, float("-inf")) < ALIAS_RECHECK_S:
            return ResolvedVoice(speaker=ALIASES[key.lower()], voice=None)  # no store read, no thread
        try:
            got = await self.stored(self.store.resolve, key)
        except VoiceNotFoundError:
            raise APIError(404, f"voice {key!r} not found; GET /v1/audio/voices lists the voices",
                           "voice_not_found", param) from None
        if preset and got.voice is None:
            self._not_stored[key] = time.monotonic()
        return got

    def voices_changed(self) -> None:
        """A voice was stored or deleted through this worker: the presets are looked up again."""
        self._not_stored.clear()

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
        if pcm.size < FRAME_SAMPLES:
            raise bad_request(f"'{param}' is shorter than one 80 ms frame", param, "audio_too_short")
        try:
            return await asyncio.to_thread(csm.encode_audio, pcm)
        except TimeoutError:  # the engine process's encoder is behind other clips (RemoteEngineClient.encode)
            raise APIError(503, f"'{param}': the engine did not encode the clip in time (busy with other clips); "
                           "try again", "server_busy", param) from None

    async def context_segments(self, turns: Sequence[ContextTurn], param: str = "context") -> list[Segment]:
        from csmserve.api import Segment

        if len(turns) > self.config.max_context_turns:
            raise bad_request(f"'{param}' has {len(turns)} turns; the limit is {self.config.max_context_turns}",
                              param, "context_too_long")
        cap, total = self.config.max_context_chars, 0  # checked before anything is tokenized
        for i, turn in enumerate(turns):
            if len(turn.text) > cap:
                raise bad_request(f"'{param}[{i}].text' is {len(turn.text)} characters; the limit is {cap}",
                                  f"{param}[{i}].text", "context_too_long")
            total += len(turn.text)
        if total > self.config.max_context_total_chars:
            raise bad_request(f"the text of '{param}' is {total} characters; the limit is "
                              f"{self.config.max_context_total_chars}", param, "context_too_long")
        out = []
        for i, turn in enumerate(turns):
            p = f"{param}[{i}]"
            if turn.voice_id is not None:
                v = await self.stored(self.store.get, turn.voice_id)
                if v is None:
                    raise APIError(404, f"voice {turn.voice_id!r} not found", "voice_not_found", f"{p}.voice_id")
                out.append(Segment(turn.speaker, turn.text or v.transcript, codes=v.codes))
            elif turn.audio is not None:
                out.append(Segment(turn.speaker, turn.text, codes=await self.encode_clip(
                    _b64decode(turn.audio, f"{p}.audio", self.config.max_upload_bytes), f"{p}.audio")))
            else:
                out.append(Segment(turn.speaker, turn.text))
        return out

    # ---- generation
    async def stream(self, request: Request, arrival: float,
                     on_submit: Callable[[], None] | None = None) -> AsyncIterator[AudioChunk]:
        """The engine's chunks within the concurrency limit, with metrics; closing it early aborts the request."""
        csm = self.require_ready()
        limit = self.config.max_concurrent_requests
        if limit is not None and not (self.workers[0].admit(self.workers[1], limit) if self.workers
                                      else self.active < limit):
            raise APIError(429, f"too many concurrent requests ({self.config.max_concurrent_requests}); retry later",
                           "too_many_requests")
        self.active += 1
        tr = trace.current()
        if tr is not None:
            tr.stamp(request.request_id, received=arrival)
        agen = csm.client.astream(request, on_submit=on_submit, max_lag_s=self.config.max_reader_lag_s)
        frames, reason, first = 0, "abort", None
        refused: APIError | None = None  # the engine refused it: an error answer, no generation to count
        try:
            async for chunk in agen:
                if first is None and len(chunk.codes):
                    first = time.perf_counter()
                    if tr is not None:
                        tr.stamp(request.request_id, chunk=first)
                    self.metrics.ttfa.observe(first - arrival)
                    admitted = getattr(request, "admit_time", None)
                    self.metrics.queue_time.observe((admitted or first) - (request.arrival_time or arrival))
                frames += len(chunk.codes)
                if chunk.final:
                    reason = chunk.finish_reason or "eos"
                yield chunk
        except SchedulerBusy as e:
            refused = APIError(503, str(e), "server_busy")
            raise refused from None
        except AdapterPoolFullError as e:  # waited --max-lora-wait-s for a pool slot
            refused = APIError(503, str(e), "adapter_pool_full")
            raise refused from None
        except UnknownAdapterError:  # unloaded (or never loaded): the engine refused it at submit
            refused = self.model_not_found(request.adapter)
            raise refused from None
        except ValueError as e:  # the engine refused the prompt
            refused = bad_request(str(e), "input", "invalid_prompt")
            raise refused from None
        finally:
            await agen.aclose()  # GeneratorExit at the engine's queue: abort, slot freed at the next frame
            self.active -= 1
            if limit is not None and self.workers:
                self.workers[0].release(self.workers[1])
            if tr is not None:  # still pending: it ended before a route wrote its first chunk
                tr.done(request.request_id, end=reason)
            wall = time.perf_counter() - arrival
            self.metrics.frames.inc(frames)
            self.metrics.audio_seconds.inc(frames * FRAME_MS / 1000)
            if refused is None:  # a refusal is an error answer (request_errors), no finished generation
                self.metrics.e2e.observe(wall)
                self.metrics.finished(reason)
            if frames:
                self.metrics.rtf.observe(wall / (frames * FRAME_MS / 1000))


def _b64decode(data: str, param: str, limit: int) -> bytes:
    if len(data) > limit * 4 // 3 + 4:
        raise APIError(413, f"'{param}' decodes to more than {limit} bytes", "file_too_large", param)
    if data.startswith("data:") and "," in data:  # a data: URL
        data = data.split(",", 1)[1]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"'{param}' is not valid base64", param, "invalid_base64") from None
