"""Frozen configuration records, built once at the edge (the command line) and passed down whole:
EngineConfig, ServerConfig, RayConfig; and the codec's fixed units every layer counts in.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SAMPLE_RATE = 24_000  # Hz: Mimi's audio (and OpenAI's pcm)
FRAME_MS = 80  # one Mimi frame (12.5 Hz)
FRAME_SAMPLES = SAMPLE_RATE * FRAME_MS // 1000  # 1920
# a reader's pace (speech is ~15 characters/s): the cap per character of a request that names no length
# (ServerConfig.audio_ms_per_char); where random weights (dummy, dummy-tiny), which never end a sentence, stop
AUDIO_MS_PER_CHAR = 150


def reading_ms(chars: int, ms_per_char: int = AUDIO_MS_PER_CHAR) -> int:
    """A reader's length for `chars` characters of text, in ms: ms_per_char each, at least 1 s."""
    return max(1000, ms_per_char * chars)

WEIGHTS = ("bf16", "fp8", "fp8-all")  # EngineConfig.weights
MPS_MODES = ("auto", "on", "off")  # RayConfig.mps
# OpenAI's TTS model ids: a request's `model` naming one of them means the base model (as the server's own name
# and "csm-1b" do), so unmodified clients (the OpenAI SDK, Open WebUI, Pipecat, LiveKit) keep working
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-03-20", "gpt-4o-mini-tts-2025-12-15")
# a LoRA adapter's name (a request's `model`): letters, digits and . _ - : / @ + (a hub id reads as one), 1-128
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


_BOUNDS = {">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, "> 0": lambda v: v > 0}


def _require(cfg: object, bound: str, names: str) -> None:
    """ValueError naming the first of the fields `names` (space-separated) that is set (not None) and not `bound`."""
    for name in names.split():
        v = getattr(cfg, name)
        if v is not None and not _BOUNDS[bound](v):
            raise ValueError(f"{type(cfg).__name__}.{name} must be {bound}, got {v}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # concurrent requests; a slot owns backbone KV, depth KV, sampler and codec rows. None: as many as
    # fit in free GPU memory (CSM sizes it when it starts the engine; 8 on the CPU)
    max_slots: int | None = None
    max_waiting: int = 1024  # queued requests beyond the slots; past it add() raises SchedulerBusy
    max_seq_len: int = 2048  # backbone positions per slot: prompt frames + generated frames
    # prompt positions prefilled per engine step, over all slots: one graphed pass over the packed tokens
    # of every prompt admitted (a 12-frame prompt is 12 positions). Measured on the H200 (docs/benchmarks.md),
    # 1,024 WebSocket conversations (~300 positions a turn) first audio p50 / p99: 1.9 / 2.0 s at 2048,
    # 107 / 328 ms at 4096, 107 / 190 ms at 8192; a burst of 2,048 arrivals p99 2.6 s, 0.67 s, 0.28 s
    prefill_token_budget: int = 8192
    max_prefill_chunk: int = 512  # prompt positions prefilled per step for one slot
    first_chunk_frames: int = 1  # frames in a request's first AudioChunk (time to first audio)
    # frames in each later AudioChunk. A playback started at the first byte with a buffer of b ms runs dry
    # when the chunk of frames [a, a + c) lands after its first frame is due: its margin is b - (c - 1) * s
    # + a * (80 - s) for a frame step of s ms; at 2,048 streams (s ~74 ms) c = 4 leaves ~80 ms early in a
    # stream against one slow step, c = 2 ~230 ms (docs/benchmarks.md)
    chunk_frames: int = 2
    # fewer, larger chunks (one message, write and encoder call each) once a stream is ahead of real time
    # (engine/outputs.py Router): while its lead (audio handed out - wall time since its first chunk) exceeds
    # chunk_grow_lead_ms, a later chunk holds half the excess, at most max_chunk_ms (960 ms: 12 frames); under
    # it, chunk_frames. max_chunk_ms <= chunk_frames x 80: no growth
    max_chunk_ms: int = 1000
    chunk_grow_lead_ms: int = 500
    # a step of first frames only, whose prompts this step's prefill completes: the prefill takes each prompt's
    # last frame too and the depth decoder runs from its hidden state (no second backbone pass: time to first
    # audio); False: the last frame enters through the first frame step
    first_frame_from_prefill: bool = True
    # prompt-prefix cache (backbone KV of voices' / conversations' prompt prefixes kept on the device, LRU): bytes at
    # most; None = on CUDA half the memory the slots and graphs leave free (at least 2 GiB: 1,024 growing
    # conversations need tens of GB; measured in docs/benchmarks.md), 64 MiB on the CPU; 0 disables
    prefix_cache_bytes: int | None = None
    # weights of the GEMMs: bf16 (the model's dtype), fp8 (depth decoder in FP8 e4m3, per-channel
    # scales, dynamic per-row activation scales; Hopper's FP8 GEMM, a dequantized fallback elsewhere;
    # at 1-2 rows on CUDA weight-only in kernels/gemv.py), fp8-all (the backbone too). models/fp8.py
    weights: str = "bf16"
    # CUDA: Mimi's decode of frame t on a stream of its own, beside the generation of frame t+1 (engine/graphs.py;
    # docs/benchmarks.md); False: both in one graph, one after the other
    codec_stream: bool = True
    # an API worker that has not read a step's rows when the engine needs that output-ring buffer again: the
    # engine waits up to this long for it (slowing down instead of losing streams); past it that worker's
    # streams there end with an error, and the engine waits for it no more until it catches up
    reader_wait_s: float = 2.0
    # a directory: every process of the server appends per-request stamps, engine steps and GC pauses to its
    # own file there (engine/trace.py; bench/trace_report.py joins them); None: off
    trace_requests: str | None = None
    # LoRA fine-tunes served beside the base in the same batches (models/lora.py, engine/adapters.py): GPU pool
    # slots, the adapters resident at once (LRU; each A and B of every projection padded to max_lora_rank: ~1.7 MB
    # per rank per slot on CSM-1B, 64 slots x rank 16 = 1.7 GB); 0: no pool, no LoRA kernels in the graphs
    max_loras: int = 0
    max_lora_rank: int = 32  # the largest rank an adapter may have (unsloth's CSM recipe: 32); a larger one is refused
    max_cpu_loras: int = 256  # adapters loaded (by name, their weights in pinned host memory) at most
    # a request whose adapter has no pool slot (every slot held by running requests of other adapters) waits in the
    # queue this many seconds at most, then ends with AdapterPoolFullError (the server's 503 adapter_pool_full)
    max_lora_wait_s: float = 10.0
    # a step whose every row has one adapter runs it merged into the weights (the base's speed; engine/runner.py),
    # at the cost of a copy of the LoRA'd weights on the GPU (~2 GiB for CSM-1B in bf16; FP8 weights never merge)
    lora_merge: bool = True

    def __post_init__(self) -> None:
        _require(self, ">= 1", "max_slots max_seq_len prefill_token_budget max_prefill_chunk first_chunk_frames "
                               "chunk_frames max_lora_rank max_cpu_loras")
        _require(self, ">= 0", "max_chunk_ms chunk_grow_lead_ms prefix_cache_bytes reader_wait_s max_waiting max_loras")
        _require(self, "> 0", "max_lora_wait_s")
        if self.weights not in WEIGHTS:
            raise ValueError(f"EngineConfig.weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP/WebSocket edge: where to listen, who may call, and the limits on one request.

    Every field is a `csmserve serve` flag and a CSMSERVE_<FIELD> environment variable."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # checked against `Authorization: Bearer <key>`; None = open
    model_name: str = "sesame/csm-1b"  # the id /v1/models reports
    voices_db: str | None = None  # SQLite path or postgresql:// URL; None = $XDG_DATA_HOME/csmserve/voices.db
    # voices stored at most (POST /v1/audio/voices past it: 409 too_many_voices): any caller may store one (every
    # caller where no api_key is set), ~48 KB each, and GET /v1/audio/voices lists them all
    max_voices: int = 10_000
    # a postgresql:// voices_db: every statement's timeout (past it the request gets 503 voices_db_unavailable, not a
    # worker thread held by a server that stopped answering) and the connect timeout where the URL names none
    voices_db_timeout_s: float = 10.0
    max_input_chars: int = 4096  # OpenAI's maxLength for `input`
    max_body_bytes: int = 32 * 2**20  # any request body (JSON with base64 context audio, multipart)
    max_upload_bytes: int = 10 * 2**20  # one audio file (voice sample, one context turn), OpenAI's 10 MiB
    max_clip_seconds: float = 60.0  # one decoded reference / context clip
    max_context_turns: int = 16  # context turns in one request (and kept per WebSocket context_id)
    max_context_chars: int = 4096  # the text of one context turn (checked before anything is tokenized)
    max_context_total_chars: int = 16384  # the text of all context turns of one request / message
    # the largest max_audio_length_ms (the whole response) a request may ask for: no request holds a
    # slot for longer than this much audio
    max_audio_length_ms: int = 600_000
    # a request that does not say gets audio_ms_per_char x its characters, at least default_audio_length_ms, at
    # most max_audio_length_ms. None: 30 s on real weights (the cap only stops a sentence that never ends), 1 s
    # on random weights (dummy, dummy-tiny: they never end one, so the reading length is where they stop)
    default_audio_length_ms: int | None = None
    audio_ms_per_char: int = AUDIO_MS_PER_CHAR
    # one sentence of a multi-sentence request (or a WebSocket turn) at most, unless the request says
    # max_segment_length_ms: a sentence that never ends cannot eat the whole response's budget
    max_segment_ms: int = 20_000
    # generations in flight (HTTP + WebSocket); past it: 429. None: bounded by the engine alone (its
    # slots plus max_waiting queued; past that 503 server_busy)
    max_concurrent_requests: int | None = None
    cors_origins: tuple[str, ...] = ()
    # encoder effort: LAME's quality 0 (best, slowest) .. 9 and libopus' complexity 0..10; the defaults
    # cost 5.0 and 2.8 ms of CPU per second of audio (LAME's 3 and opus' 10: 8.6 and 10; docs/benchmarks.md)
    mp3_compression_level: int = 7
    opus_complexity: int = 5
    # mp3 / opus through libmp3lame / libopus called directly (audio/lame.py, audio/opus.py; the same codec
    # settings, less CPU per stream); False: through PyAV / libav (what it replaced; an A/B through the server)
    native_codecs: bool = True
    # a client reading the audio this many seconds behind real time (playback from its first chunk)
    # has its request stopped and its slot freed; also the longest a response write may stall
    max_reader_lag_s: float = 30.0
    # while an API worker's event loop is saturated (encoding), a response already this many seconds of
    # audio ahead of real time waits before its next chunk is encoded (server/lead.py); 0: never
    max_lead_s: float = 1.0
    # threads per API worker that encode a compressed stream's chunks after its first (libav releases the GIL),
    # so the event loop stays free for first chunks; 0: on the event loop (until measured on the H200)
    encode_threads: int = 0
    # API worker processes beside the engine-core process (csmserve serve); 0: one process, the engine
    # on a thread of it; None: from the CPU count
    api_workers: int | None = None
    # slow clients (server/timeouts.py): a request's headers must arrive within header_timeout_s (408,
    # closed); its body within body_timeout_s plus 1 s per body_min_rate bytes received (408); an idle
    # keep-alive connection is closed after keep_alive_s; headers past max_header_bytes are a 400
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    body_min_rate: int = 16384  # bytes/s
    keep_alive_s: float = 5.0
    max_header_bytes: int = 16384
    # on SIGTERM / Ctrl-C the server takes no new requests and gives open streams this long to end, then cuts them
    shutdown_timeout_s: float = 15.0
    # API workers: the engine process silent this long (no step, no heartbeat: a GPU hang, a deadlock) turns /health
    # and /ready 503 engine_stalled until it sends again; its open streams are kept (it may only be slow)
    engine_stall_s: float = 30.0
    # WebSocket conversation sessions (a context_id's voice, settings and turns, across connections)
    session_idle_s: float = 600.0  # a session unused this long is forgotten
    max_sessions: int = 1024  # past it, the least recently used idle session is forgotten
    max_session_turns: int = 64  # turns kept per session (both sides); the oldest are dropped
    max_session_frames: int = 2048  # audio frames kept per session (the model's whole context); oldest dropped
    # one WebSocket message (JSON text; context audio in base64): past it an `error`, the connection lives
    # on; past twice it the WebSocket layer closes the connection (1009) before buffering it whole
    max_ws_message_bytes: int = 16 * 2**20
    # a WebSocket turn that got text but no flush: flushed by the server after this long without new text
    # (what was sent is spoken, `flush_done` says `idle_timeout`), so its engine slot is freed
    ws_turn_idle_s: float = 30.0
    # the server pings every WebSocket this often and closes one whose pong has not come this long after (1011):
    # a dead peer's slot and session freed; a pong waits behind the audio the client has not read yet
    ws_ping_interval_s: float = 20.0
    ws_ping_timeout_s: float = 20.0
    # POST /v1/load_lora_adapter reads adapter directories under this directory only (a relative lora_path is
    # taken from it; one that resolves outside it, through `..` or a symlink, is refused); None: that route is
    # off (403): `--lora` at start still loads any path (the operator's own)
    lora_dir: str | None = None

    @property
    def base_models(self) -> tuple[str, ...]:
        """The `model` values that mean the base model: model_name, "csm-1b" and OpenAI's TTS ids (/v1/models)."""
        return tuple(dict.fromkeys((self.model_name, "csm-1b", *OPENAI_MODELS)))

    def check_adapter_name(self, name: str) -> str:
        """A LoRA adapter's name (`--lora`, the load route) -> itself; ValueError saying why it cannot be one."""
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"adapter name {str(name)[:140]!r}: use 1-128 letters, digits and . _ - : / @ + "
                             "(starting with a letter or digit)")
        if name in self.base_models:
            raise ValueError(f"adapter name {name!r} is a name of the base model ({', '.join(self.base_models)})")
        return name

    def audio_floor_ms(self, random_weights: bool) -> int:
        """default_audio_length_ms, or where it is None its default for these weights (see there)."""
        if self.default_audio_length_ms is not None:
            return self.default_audio_length_ms
        return 1000 if random_weights else 30_000

    def __post_init__(self) -> None:
        _require(self, ">= 1", "max_input_chars max_body_bytes max_upload_bytes max_context_turns max_segment_ms "
                               "audio_ms_per_char max_context_chars max_context_total_chars max_concurrent_requests "
                               "max_sessions max_session_turns max_session_frames max_ws_message_bytes body_min_rate "
                               "max_header_bytes max_voices")
        _require(self, ">= 0", "max_lead_s encode_threads api_workers shutdown_timeout_s")
        _require(self, "> 0", "max_clip_seconds max_reader_lag_s session_idle_s ws_turn_idle_s header_timeout_s "
                              "body_timeout_s keep_alive_s voices_db_timeout_s ws_ping_interval_s ws_ping_timeout_s")
        _require(self, ">= 1", "engine_stall_s")  # 4 of the engine's heartbeats (core.HEARTBEAT_S): no flapping
        if not 0 <= self.mp3_compression_level <= 9 or not 0 <= self.opus_complexity <= 10:
            raise ValueError("ServerConfig needs mp3_compression_level in 0..9 and opus_complexity in 0..10")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port must be in 0..65535, got {self.port}")
        if self.default_audio_length_ms is not None and \
                not 80 <= self.default_audio_length_ms <= self.max_audio_length_ms:
            raise ValueError("ServerConfig needs 80 <= default_audio_length_ms <= max_audio_length_ms")


INGRESS_BODY_BYTES = (16384, 16 << 20)  # RayConfig.ingress_body_bytes: HAProxy's tune.bufsize, its default .. 16 MiB


@dataclass(frozen=True, slots=True)
class RayConfig:
    """`csmserve serve --ray`: the Ray Serve application (csmserve/ray/). One replica = one `csmserve serve` unit
    (an engine-core process and its API workers) on a port of its own; HAProxy ingresses route to them. Every
    field is a `csmserve serve` flag and a CSMSERVE_<FIELD> variable, like the others."""

    ray_address: str | None = None  # None: start a Ray instance of our own; "auto" / an address: join that cluster
    app_name: str = "csmserve"
    num_replicas: int = 1  # fixed replica count (ignored when min/max_replicas autoscale)
    min_replicas: int | None = None  # either of min/max set: autoscale between them
    max_replicas: int | None = None
    # autoscaling target of active streams (the engine's requests running + waiting) per replica; None: 3/4 of
    # --max-slots
    target_ongoing_requests: float | None = None
    gpus_per_replica: float | None = None  # fractions share a GPU; None: 1, or 0 with --device cpu
    # replicas sharing a GPU under NVIDIA MPS (csmserve/ray/mps.py: a private daemon of an own Ray instance): auto
    # (where it runs), on (an error where it cannot), off (their CUDA contexts take turns)
    mps: str = "auto"
    cpus_per_replica: float = 1.0  # what Ray reserves per replica (its API workers: --api-workers)
    health_check_period_s: float = 2.0  # Ray calls each replica's check_health this often
    health_check_timeout_s: float = 30.0
    # bounded-load affinity: a voice / first-turn / adapter key goes to its replica on the hash ring while that
    # replica's connections are under load_factor x the mean (HAProxy's hash-balance-factor, x100)
    affinity_load_factor: float = 1.25
    report_interval_s: float = 0.5  # each replica's state + metrics -> the directory (/ready, /metrics, HAProxy)
    ingress_replicas: int = 1  # HAProxy ingresses on --host:--port, at most one per node (the nodes taking traffic)
    ingress_cpus: float = 1.0  # what Ray reserves per ingress (HAProxy's threads)
    # the request body HAProxy buffers to read a routing key from it (its tune.bufsize); a larger body is routed
    # by what its first this-many bytes say (a key past them: least loaded). HAProxy holds about one such buffer
    # per open stream (1,000 streams: 325 MiB of RSS at 256 KiB, 45 MiB at 16 KiB; docs/scale-out.md)
    ingress_body_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        _require(self, ">= 1", "num_replicas min_replicas max_replicas ingress_replicas")
        _require(self, ">= 0", "gpus_per_replica ingress_cpus")
        if not round(self.affinity_load_factor * 100) > 100:  # HAProxy's hash-balance-factor: 0 or more than 100
            raise ValueError(f"RayConfig.affinity_load_factor must be at least 1.01 (HAProxy's hash-balance-factor "
                             f"over 100), got {self.affinity_load_factor}")
        _require(self, "> 0", "target_ongoing_requests cpus_per_replica health_check_period_s health_check_timeout_s "
                              "report_interval_s")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("RayConfig needs min_replicas <= max_replicas")
        if self.mps not in MPS_MODES:
            raise ValueError(f"RayConfig.mps must be one of {', '.join(MPS_MODES)}, got {self.mps!r}")
        lo, hi = INGRESS_BODY_BYTES
        if not lo <= self.ingress_body_bytes <= hi:
            raise ValueError(f"RayConfig.ingress_body_bytes must be in [{lo}, {hi}], got {self.ingress_body_bytes}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None
