"""The `serve` flags: one for every ServerConfig, EngineConfig and RayConfig field, each mirrored by a
CSMSERVE_<FIELD> environment variable (flag > environment > default). Every flag's help (`_HELP`) says what it
does and its real default (`_UNSET`: what a None default means).

    csmserve serve --model sesame/csm-1b --port 8000 --api-key secret --max-slots 64
    CSMSERVE_API_KEY=secret CSMSERVE_MAX_SLOTS=64 csmserve serve
    csmserve serve --ray --num-replicas 2 --gpus-per-replica 0.5 --max-slots 512   # Ray Serve (csmserve/ray/)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

from csmserve.config import EngineConfig, RayConfig, ServerConfig

ENV_PREFIX = "CSMSERVE_"
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
BOOLS = "true/false, 1/0, yes/no or on/off"
LORA_DIR_SLOTS = 8  # pool slots --lora-dir adds when --max-loras is not given (54 MB a slot at rank 32, CSM-1B)

_MODEL_FLAGS = {  # name -> default (None: _UNSET says what it means)
    "model": "sesame/csm-1b", "device": None, "dtype": None, "codec": None, "codec_dtype": None, "log_level": "info"}
_HELP = {
    # the model
    "model": "hub id, local directory, dummy / dummy-tiny (random weights, no download), or paced (no model: a "
             "stand-in engine at the H200's measured step times, to measure the server's data path on a CPU)",
    "device": "cpu or cuda",
    "dtype": "the model's dtype: float32 or bfloat16",
    "codec": "Mimi's weights: a kyutai/mimi directory or moshi safetensors",
    "codec_dtype": "Mimi's dtype: float32 or bfloat16 (docs/benchmarks.md compares them)",
    "log_level": "debug, info, warning or error",
    # ServerConfig: listening and access
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require 'Authorization: Bearer KEY' on the /v1 routes and the WebSocket",
    "model_name": "the model id /v1/models reports",
    "voices_db": "stored voices: an SQLite file, or a postgresql:// URL shared by every replica",
    "voices_db_timeout_s": "postgresql:// voices DB: statement timeout (503)",
    "cors_origins": "comma-separated origins whose pages may call this server (* any); a page of another site "
                    "gets 403, this server's own page is always served",
    "api_workers": "API worker processes beside the engine-core process; 0: one process, the engine on a thread",
    "engine_stall_s": "engine silent this long: /health 503",
    # request limits
    "max_input_chars": "characters of a request's `input` (OpenAI's limit)",
    "max_body_bytes": "bytes of any request body (JSON with base64 context audio, multipart)",
    "max_upload_bytes": "bytes of one audio file (a voice sample, a context turn)",
    "max_clip_seconds": "seconds of one decoded reference or context clip",
    "max_context_turns": "context turns of one request (and of a WebSocket session's fixed context)",
    "max_context_chars": "characters of one context turn's text",
    "max_context_total_chars": "characters of all of one request's context turns",
    "max_audio_length_ms": "the most max_audio_length_ms a request may ask for: no request holds a slot longer",
    "default_audio_length_ms": "a request that names no length gets --audio-ms-per-char of audio per character "
                               "of its text, at least this much",
    "audio_ms_per_char": "a request that names no length gets this much audio per character of its text "
                         "(speech is ~15 characters/s)",
    "max_segment_ms": "cap on each sentence of a long input or a WebSocket turn, unless the request sets "
                      "max_segment_length_ms",
    "max_concurrent_requests": "generations in flight, HTTP and WebSocket, all API workers together; past it 429",
    "max_voices": "voices stored (POST /v1/audio/voices; past it 409)",
    # audio encoding
    "mp3_compression_level": "LAME's quality: 0 (best, slowest) .. 9",
    "opus_complexity": "libopus' complexity: 0 .. 10 (most CPU)",
    "native_codecs": "mp3 and opus through libmp3lame and libopus called directly (less CPU per stream); "
                     "false: through PyAV / libav",
    "encode_threads": "threads per API worker encoding a compressed stream's chunks after its first (libav "
                      "releases the GIL); 0: on the event loop",
    "max_lead_s": "while an API worker's CPU is saturated, a response this many seconds of audio ahead of real "
                  "time waits before its next chunk is encoded, so first chunks go first; 0: never",
    "max_reader_lag_s": "a client reading this many seconds behind real time is dropped (its slot freed); also "
                        "the longest one response write may stall",
    # slow clients
    "header_timeout_s": "seconds for a request's headers to arrive (408)",
    "body_timeout_s": "seconds for a request's body, plus 1 s per --body-min-rate bytes received (408)",
    "body_min_rate": "bytes/s a slow body earns an extra second of --body-timeout-s with",
    "keep_alive_s": "an idle keep-alive connection is closed after this many seconds",
    "max_header_bytes": "bytes of a request's headers (past them 400)",
    "shutdown_timeout_s": "seconds open streams get after SIGTERM, then cut",
    # WebSocket sessions
    "session_idle_s": "a WebSocket session (context_id) unused this many seconds is forgotten",
    "max_sessions": "WebSocket sessions kept; past it the least recently used idle one is forgotten",
    "max_session_turns": "turns kept per session, both sides; the oldest are dropped",
    "max_session_frames": "audio frames kept per session; the oldest turns are dropped",
    "max_ws_message_bytes": "bytes of one WebSocket message: past it an error, past twice it the connection "
                            "is closed (1009)",
    "ws_turn_idle_s": "a WebSocket turn's text unflushed this many seconds is flushed",
    "ws_ping_interval_s": "seconds between the server's pings of each WebSocket",
    "ws_ping_timeout_s": "a WebSocket whose pong is this late is closed (1011)",
    # EngineConfig
    "max_slots": "concurrent requests on the engine (a slot holds a request's KV caches, sampler and codec rows)",
    "max_loras": "adapters on the GPU at once (pool slots, LRU); 0: one per --lora, +8 with --lora-dir",
    "max_lora_rank": "the largest adapter rank the pool takes (larger: refused)",
    "max_cpu_loras": "adapters loaded at once, in pinned host memory (one more: 409)",
    "max_lora_wait_s": "a request waits this long for a pool slot held by other adapters, then 503",
    "lora_merge": "one adapter in every row: merged (base speed, 2 GiB more)",
    "lora_dir": "POST /v1/load_lora_adapter reads adapters under this directory only",
    "max_waiting": "requests queued beyond the slots; past it 503 server_busy",
    "max_seq_len": "positions per slot: prompt frames + generated frames",
    "prefill_token_budget": "prompt positions prefilled per engine step over all slots",
    "max_prefill_chunk": "prompt positions prefilled per step for one slot",
    "first_chunk_frames": "80 ms frames in a request's first audio chunk",
    "chunk_frames": "80 ms frames in each later chunk (until the stream is --chunk-grow-lead-ms ahead)",
    "max_chunk_ms": "a stream well ahead of real time gets chunks of up to this much audio (fewer messages "
                    "and encoder calls); <= chunk frames x 80: never larger",
    "chunk_grow_lead_ms": "chunks grow only while a stream's audio is this far ahead of real time; a chunk then "
                          "holds half the lead beyond it, at most --max-chunk-ms",
    "first_frame_from_prefill": "on an idle engine the prefill takes the prompt's last frame too and the first "
                                "frame runs from its hidden state (one backbone pass less before first audio)",
    "prefix_cache_bytes": "bytes of backbone KV kept for voices' and conversations' prompt prefixes (LRU); "
                          "0: no prefix cache",
    "weights": "the GEMMs' weights: bf16, fp8 (the depth decoder in FP8) or fp8-all (the backbone too)",
    "codec_stream": "CUDA: Mimi's decode of a frame on a stream of its own, beside the next frame's "
                    "generation; false: one after the other in one graph",
    "reader_wait_s": "seconds the engine waits for an API worker that has not read its previous results before "
                     "reusing their buffer (a busy worker slows the engine instead of losing streams)",
    "trace_requests": "a directory: each server process writes per-request timelines, engine steps and GC "
                      "pauses there; python bench/trace_report.py DIR joins them",
    # RayConfig
    "ray_address": "the Ray cluster to join: 'auto' (the running one) or an address",
    "app_name": "the Ray Serve application's name",
    "num_replicas": "replicas (each a whole `serve` unit: an engine and its API workers) when not autoscaling",
    "min_replicas": "autoscale: fewest replicas (this or --max-replicas turns autoscaling on)",
    "max_replicas": "autoscale: most replicas",
    "target_ongoing_requests": "autoscale: active streams per replica to aim at",
    "gpus_per_replica": "GPUs per replica; fractions share one",
    "mps": "NVIDIA MPS for GPU shares: auto|on|off",
    "cpus_per_replica": "CPUs Ray reserves per replica",
    "health_check_period_s": "seconds between a replica's health checks",
    "health_check_timeout_s": "seconds a replica's health check may take before it counts as failed",
    "affinity_load_factor": "a voice / first turn / adapter stays on its replica while that one's connections "
                            "are under this x the mean (HAProxy's hash-balance-factor)",
    "report_interval_s": "seconds between a replica's reports to the directory (/ready, /metrics, the ingress)",
    "ingress_replicas": "HAProxy ingresses on --host:--port, at most one per node (the nodes that take traffic)",
    "ingress_cpus": "CPUs Ray reserves per ingress (HAProxy)",
    "ingress_body_bytes": "request body bytes the ingress reads for a routing key (HAProxy's tune.bufsize; a "
                          "key past them: least loaded)",
}
_UNSET = {  # what a None default means
    "device": "cuda if available", "dtype": "bfloat16 on cuda, float32 on cpu", "codec": "beside the model",
    "codec_dtype": "bfloat16 on cuda, float32 on cpu",
    "api_key": "none: open to all", "model_name": "--model", "voices_db": "$XDG_DATA_HOME/csmserve/voices.db",
    "api_workers": "every core but three, 1 to 32",
    "default_audio_length_ms": "30000 on real weights, 1000 on random ones, which never end a sentence",
    "max_concurrent_requests": "no limit but the engine's: --max-slots + --max-waiting, then 503",
    "max_slots": "as many as fit in free GPU memory, at most 4096; 8 on the CPU; 2048 with --model paced",
    "prefix_cache_bytes": "half the GPU's memory left free, at least 2 GiB (a GPU share: 2 GiB); 64 MiB on CPU",
    "trace_requests": "off",
    "lora_dir": "none: that route is off",
    "ray_address": "a Ray instance of our own",
    "min_replicas": "1 when autoscaling", "max_replicas": "--min-replicas, at least 1",
    "target_ongoing_requests": "3/4 of --max-slots",
    "gpus_per_replica": "1, or 0 with --device cpu",
}
# the server's flags in groups (the rest of a config's fields: its class's group)
_GROUPS = {
    "listening and access": ("host", "port", "api_key", "cors_origins", "model_name", "voices_db",
                             "voices_db_timeout_s", "api_workers",
                             "shutdown_timeout_s", "engine_stall_s"),
    "request limits": ("max_input_chars", "max_body_bytes", "max_upload_bytes", "max_clip_seconds",
                       "max_context_turns", "max_context_chars", "max_context_total_chars", "max_audio_length_ms",
                       "default_audio_length_ms", "audio_ms_per_char", "max_segment_ms", "max_concurrent_requests",
                       "max_voices"),
    "audio encoding": ("mp3_compression_level", "opus_complexity", "native_codecs", "encode_threads", "max_lead_s",
                       "max_reader_lag_s"),
    "slow clients": ("header_timeout_s", "body_timeout_s", "body_min_rate", "keep_alive_s", "max_header_bytes"),
    "WebSocket sessions": ("session_idle_s", "max_sessions", "max_session_turns", "max_session_frames",
                           "max_ws_message_bytes", "ws_turn_idle_s", "ws_ping_interval_s", "ws_ping_timeout_s"),
    "LoRA adapters": ("lora_dir", "max_loras", "max_lora_rank", "max_cpu_loras", "max_lora_wait_s", "lora_merge"),
}
_METAVARS = {"model": "ID|PATH", "codec": "PATH", "codec_dtype": "DTYPE", "log_level": "LEVEL", "host": "HOST",
             "port": "PORT", "api_key": "KEY", "model_name": "NAME", "voices_db": "PATH|URL", "cors_origins": "ORIGINS",
             "weights": "bf16|fp8|fp8-all", "trace_requests": "DIR", "lora_dir": "DIR", "ray_address": "ADDRESS",
             "app_name": "NAME"}
_SUFFIXES = (("_ms", "MS"), ("_s", "SECONDS"), ("_seconds", "SECONDS"), ("_bytes", "BYTES"), ("_rate", "BYTES/S"))


def parse_bool(s: str) -> bool:
    v = str(s).strip().lower()
    if v in TRUE or v in FALSE:
        return v in TRUE
    raise argparse.ArgumentTypeError(f"{s!r} is not a boolean: use {BOOLS}")


def _parser_for(type_name: str) -> Callable[[str], Any]:
    if type_name.startswith("bool"):
        return parse_bool
    if type_name.startswith("int"):
        return int
    if type_name.startswith("float"):
        return float
    if type_name.startswith("tuple"):
        return lambda s: tuple(x.strip() for x in s.split(",") if x.strip())
    return str


def _env_default(name: str, default: Any, parse: Callable[[str], Any]) -> Any:
    raw = os.environ.get(ENV_PREFIX + name.upper())
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as e:
        why = f": {e}" if isinstance(e, argparse.ArgumentTypeError) else ""
        raise SystemExit(f"csmserve serve: {ENV_PREFIX}{name.upper()}={raw!r} is not a valid value{why}") from None


def _shown(value: Any) -> str:
    """A default as the command line writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} = {value >> 20} MiB"
    return str(value)


def _add(group: argparse._ArgumentGroup, name: str, default: Any, parse: Callable[[str], Any]) -> None:
    shown = _UNSET.get(name, "not set") if default is None else _shown(default)
    env = os.environ.get(ENV_PREFIX + name.upper())
    if env:
        shown += f"; {ENV_PREFIX}{name.upper()} is set"
    kw: dict[str, Any] = dict(dest=name, type=parse, default=_env_default(name, default, parse),
                              help=f"{_HELP.get(name, name.replace('_', ' '))} (default: {shown})")
    if parse is parse_bool:
        kw.update(nargs="?", const=True, metavar="BOOL")
    else:
        kw["metavar"] = _METAVARS.get(name) or next((m for suffix, m in _SUFFIXES if name.endswith(suffix)),
                                                    {int: "N", float: "X"}.get(parse, name.upper()))
    group.add_argument("--" + name.replace("_", "-"), **kw)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP/WebSocket server", usage="%(prog)s [--FLAG VALUE ...]",
        description=f"Every flag also reads {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}API_KEY=secret); a flag given "
                    f"wins. BOOL: {BOOLS}; the flag alone is true. docs/api.md and docs/reliability.md say more.")
    model = p.add_argument_group("model")
    for name, default in _MODEL_FLAGS.items():
        _add(model, name, default, str)
    model.add_argument("--ray", action="store_true", default=_env_default("ray", False, parse_bool),
                       help="serve on Ray Serve: replicas behind HAProxy on one port (the 'ray' flags; "
                            "pip install 'csmserve[ray]'; docs/scale-out.md)")
    group_of = {name: title for title, names in _GROUPS.items() for name in names}
    groups = {title: p.add_argument_group(title) for title in _GROUPS}
    env = os.environ.get(ENV_PREFIX + "LORA")
    groups["LoRA adapters"].add_argument(
        "--lora", action="extend", metavar="NAME=PATH", type=_lora_args, default=None,
        help="serve the PEFT / unsloth adapter directory PATH as NAME (a request's `model`); any number, or "
             "comma-separated (default: none"
             + (f"; {ENV_PREFIX}LORA is set" if env else "") + ")")
    for title, cls in (("server", ServerConfig), ("engine", EngineConfig), ("ray (with --ray)", RayConfig)):
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            if f.name == "model_name":
                default = None  # not given: --model
            key = group_of.get(f.name, title)
            if key not in groups:
                groups[key] = p.add_argument_group(key)
            _add(groups[key], f.name, default, _parser_for(str(f.type)))
    return p


def _lora_args(value: str) -> list[tuple[str, str]]:
    """`--lora NAME=PATH[,NAME=PATH...]` (PATH alone: named after its directory) -> [(name, path)]."""
    out = []
    for item in (x.strip() for x in value.split(",")):
        name, sep, path = item.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(item)), item
        if not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"{item!r} is not NAME=PATH")
        out.append((name.strip(), path.strip()))
    return out


def lora_list(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--lora's (name, path) pairs as given, else CSMSERVE_LORA's (a flag given wins, as everywhere)."""
    given = getattr(args, "lora", None)
    if given is not None:
        return given
    env = os.environ.get(ENV_PREFIX + "LORA")
    try:
        return _lora_args(env) if env and env.strip() else []
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{ENV_PREFIX}LORA={env!r}: {e}") from None


def lora_adapters(args: argparse.Namespace) -> dict[str, str]:
    """`--lora`'s adapters, name -> path: each name valid and not the base's, none twice, each path an adapter
    directory the pool can take (ValueError / LoraError: one line, before anything starts; with --ray-address the
    paths are the cluster nodes', not checked here)."""
    server = ServerConfig(model_name=getattr(args, "model_name", None) or args.model)
    out: dict[str, str] = {}
    for name, path in lora_list(args):
        server.check_adapter_name(name)
        if name in out:
            raise ValueError(f"--lora {name}=... is given twice")
        if getattr(args, "ray_address", None) is None:
            from csmserve.models.lora import check_adapter_dir

            check_adapter_dir(path, getattr(args, "max_lora_rank", None))
        out[name] = os.path.expanduser(path)
    return out


def ray_config(args: argparse.Namespace) -> RayConfig:
    return RayConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RayConfig)})


def configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    pick = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}  # noqa: E731
    server = pick(ServerConfig)
    if server["model_name"] is None:  # not set: report --model
        server["model_name"] = args.model
    engine = pick(EngineConfig)
    loras = lora_list(args)
    if (loras or server["lora_dir"]) and not engine["max_loras"]:  # without --max-loras: a slot per --lora, and
        engine["max_loras"] = len(loras) + (LORA_DIR_SLOTS if server["lora_dir"] else 0)  # some for run-time loads
    return ServerConfig(**server), EngineConfig(**engine)
