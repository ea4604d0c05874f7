"""Frozen configuration records, built once at the edge (cli / server) and copied field by field.

ModelConfig (backbone / depth / codec dims) and ServerConfig live here too.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # concurrent requests; a slot owns backbone KV, depth KV, sampler and codec rows. None: as many as
    # fit in free GPU memory (CSM sizes it when it starts the engine; 8 on the CPU)
    max_slots: int | None = None
    max_waiting: int = 1024  # queued requests beyond the slots; past it add() raises SchedulerBusy
    max_seq_len: int = 2048  # backbone positions per slot: prompt frames + generated frames
    prefill_token_budget: int = 512  # prompt positions prefilled per engine step, over all slots
    max_prefill_chunk: int = 512  # prompt positions prefilled per step for one slot
    first_chunk_frames: int = 1  # frames in a request's first AudioChunk (time to first audio)
    chunk_frames: int = 4  # frames in each later AudioChunk
    # True: launch frame step N+1 before reading step N's results (the GPU never waits for the host);
    # False: launch it once step N is done, so a request arriving during step N starts in N+1, one
    # frame step sooner under load, at the cost of the host's scheduling time between steps
    overlap_steps: bool = True
    # with overlap: launch step N+1 as late as it can still start when N ends (engine/pacing.py), so
    # requests arriving during N join N+1 (measured: ~9 ms less time to first audio at 1-64 streams,
    # the same frames/s; docs/benchmarks.md)
    late_launch: bool = True
    # prompt-prefix cache (backbone KV of voices' / conversations' prompt prefixes kept on the device, LRU):
    # bytes at most; None = 2 GiB on CUDA, 64 MiB on the CPU; 0 disables
    prefix_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_slots", "max_seq_len", "prefill_token_budget", "max_prefill_chunk",
                     "first_chunk_frames", "chunk_frames"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError(f"EngineConfig.prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.max_waiting < 0:
            raise ValueError(f"EngineConfig.max_waiting must be >= 0, got {self.max_waiting}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP/WebSocket edge: where to listen, who may call, and the limits on one request.

    Every field is a `csmserve serve` flag and a CSMSERVE_<FIELD> environment variable."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # checked against `Authorization: Bearer <key>`; None = open
    model_name: str = "sesame/csm-1b"  # the id /v1/models reports
    voices_db: str | None = None  # SQLite path or postgresql:// URL; None = $XDG_DATA_HOME/csmserve/voices.db
    max_input_chars: int = 4096  # OpenAI's maxLength for `input`
    max_body_bytes: int = 32 * 2**20  # any request body (JSON with base64 context audio, multipart)
    max_upload_bytes: int = 10 * 2**20  # one audio file (voice sample, one context turn), OpenAI's 10 MiB
    max_clip_seconds: float = 60.0  # one decoded reference / context clip
    max_context_turns: int = 16  # context turns in one request (and kept per WebSocket context_id)
    max_audio_length_ms: int = 90_000  # the largest max_audio_length_ms a request may ask for
    default_audio_length_ms: int = 30_000  # when the request does not say
    # generations in flight (HTTP + WebSocket); past it: 429. None: bounded by the engine alone (its
    # slots plus max_waiting queued; past that 503 server_busy)
    max_concurrent_requests: int | None = None
    cors_origins: tuple[str, ...] = ()
    # WebSocket conversation sessions (a context_id's voice, settings and turns, across connections)
    session_idle_s: float = 600.0  # a session unused this long is forgotten
    max_sessions: int = 1024  # past it, the least recently used idle session is forgotten
    max_session_turns: int = 64  # turns kept per session (both sides); the oldest are dropped
    max_session_frames: int = 2048  # audio frames kept per session (the model's whole context); oldest dropped

    def __post_init__(self) -> None:
        for name in ("max_input_chars", "max_body_bytes", "max_upload_bytes", "max_context_turns",
                     "max_concurrent_requests", "max_sessions", "max_session_turns", "max_session_frames"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_clip_seconds <= 0:
            raise ValueError(f"ServerConfig.max_clip_seconds must be > 0, got {self.max_clip_seconds}")
        if self.session_idle_s <= 0:
            raise ValueError(f"ServerConfig.session_idle_s must be > 0, got {self.session_idle_s}")
        if not 80 <= self.default_audio_length_ms <= self.max_audio_length_ms:
            raise ValueError("ServerConfig needs 80 <= default_audio_length_ms <= max_audio_length_ms")


@dataclass(frozen=True, slots=True)
class RayConfig:
    """`csmserve serve --ray`: the Ray Serve application (csmserve/ray/). One replica = one engine;
    every field is a `csmserve serve` flag and a CSMSERVE_<FIELD> variable, like the others."""

    ray_address: str | None = None  # None: start a local Ray instance; "auto": join the running cluster
    app_name: str = "csmserve"
    num_replicas: int = 1  # fixed replica count (ignored when min/max_replicas autoscale)
    min_replicas: int | None = None  # either of min/max set: autoscale between them
    max_replicas: int | None = None
    # autoscaling target of ongoing requests (streams + open WebSockets) per replica; None: 3/4 of --max-slots
    target_ongoing_requests: float | None = None
    # Ray's own cap per replica (it routes elsewhere past it); None: --max-slots + --max-waiting (no cap: 5120)
    max_ongoing_requests: int | None = None
    gpus_per_replica: float | None = None  # fractions share a GPU; None: 1, or 0 with --device cpu
    cpus_per_replica: float = 1.0
    health_check_period_s: float = 2.0  # Ray calls each replica's check_health this often
    health_check_timeout_s: float = 30.0
    # bounded-load affinity: a request with a voice / conversation key goes to its preferred replica while
    # that replica's ongoing requests are under load_factor x the mean (+1); then to the next in its order
    affinity_load_factor: float = 1.25
    report_interval_s: float = 0.5  # each replica's state + metrics -> the directory (/ready, /metrics)

    def __post_init__(self) -> None:
        for name in ("num_replicas", "min_replicas", "max_replicas", "max_ongoing_requests"):
            if getattr(self, name) is not None and getattr(self, name) < (0 if name == "min_replicas" else 1):
                raise ValueError(f"RayConfig.{name} must be >= {0 if name == 'min_replicas' else 1}, "
                                 f"got {getattr(self, name)}")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("RayConfig needs min_replicas <= max_replicas")
        for name in ("target_ongoing_requests", "cpus_per_replica", "health_check_period_s",
                     "health_check_timeout_s", "report_interval_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"RayConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise ValueError(f"RayConfig.gpus_per_replica must be >= 0, got {self.gpus_per_replica}")
        if self.affinity_load_factor < 1:
            raise ValueError(f"RayConfig.affinity_load_factor must be >= 1, got {self.affinity_load_factor}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None
