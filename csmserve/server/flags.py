"""The `serve` flags: one for every ServerConfig and EngineConfig field, each mirrored by a
CSMSERVE_<FIELD> environment variable (flag > environment > default).

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
_MODEL_FLAGS = {  # name -> (default, help)
    "model": ("sesame/csm-1b", "hub id, local directory, dummy / dummy-tiny (random weights, no download), or "
                               "paced (no model: a stand-in engine at the H200's measured step times, to measure "
                               "the server's data path on a CPU)"),
    "device": (None, "cpu or cuda (default: cuda if available)"),
    "dtype": (None, "float32 or bfloat16 (default: bfloat16 on cuda, float32 on cpu)"),
    "codec": (None, "Mimi weights: a kyutai/mimi dir or moshi safetensors (default: beside the model)"),
    "codec_dtype": (None, "Mimi's dtype: float32 or bfloat16 (default: bfloat16 on cuda, float32 on cpu; "
                          "docs/benchmarks.md compares them)"),
    "log_level": ("info", "debug, info, warning, error"),
}
_HELP = {
    "host": "address to listen on", "port": "port to listen on",
    "api_key": "require 'Authorization: Bearer <key>' on /v1 routes and the WebSocket",
    "model_name": "model id reported by /v1/models (default: --model)",
    "voices_db": "stored voices: an SQLite file, or postgresql://user:pass@host/db shared by a cluster "
                 "(default: $XDG_DATA_HOME/csmserve/voices.db)",
    "cors_origins": "comma-separated origins whose pages may call this server (CORS; * any): a request from "
                    "another site's page (its Origin) is refused with 403, this server's own page is allowed",
    "default_audio_length_ms": "a request that names no length gets at least this much audio, or its text's "
                               "length at --audio-ms-per-char if longer; None: 30000 on real weights, 1000 on "
                               "random ones (dummy / dummy-tiny never end a sentence)",
    "ray_address": "Ray cluster to join ('auto': the running one; default: start a Ray instance of our own)",
    "num_replicas": "replicas (engines) when not autoscaling",
    "min_replicas": "autoscale: fewest replicas", "max_replicas": "autoscale: most replicas",
    "target_ongoing_requests": "autoscale: active streams per replica to aim at; None: 3/4 of --max-slots",
    "gpus_per_replica": "GPUs per replica, fractions share one; None: 1 (0 with --device cpu)",
    "affinity_load_factor": "a voice / first turn / adapter stays on its replica while that one's connections "
                            "are under this x the mean (HAProxy's hash-balance-factor)",
    "report_interval_s": "seconds between a replica's reports to the directory (/ready, /metrics, the ingress)",
    "ingress_replicas": "HAProxy ingresses on --host:--port, at most one per node (the nodes that take traffic)",
    "ingress_cpus": "CPUs Ray reserves for each ingress (HAProxy)",
    "ingress_body_bytes": "request body bytes the ingress reads for a routing key (HAProxy's tune.bufsize; a key "
                          "past them: least loaded)",
    "first_frame_from_prefill": "on an idle engine the prefill takes the prompt's last frame too and the first frame "
                                "runs from its hidden state (one backbone pass less before the first audio)",
    "max_chunk_ms": "a stream well ahead of real time gets chunks of up to this much audio (fewer messages and "
                    "encoder calls); its first chunk stays first_chunk_frames (0: chunk_frames always)",
    "chunk_grow_lead_ms": "chunks grow only while a stream's audio is this far ahead of real time (its lead); "
                          "a chunk then holds half the lead beyond it, at most max_chunk_ms",
    "reader_wait_s": "seconds the engine waits for an API worker that has not read its previous results "
                     "before reusing their buffer (a busy worker slows the engine instead of losing streams)",
    "max_lead_s": "while an API worker's CPU is saturated, a response this many seconds of audio ahead of "
                  "real time waits before its next chunk is encoded, so first chunks go first (0: never)",
    "encode_threads": "threads per API worker encoding mp3/opus/aac/flac chunks after a stream's first one "
                      "(libav releases the GIL), so the event loop stays free for first chunks; 0: on the loop (default)",
    "native_codecs": "mp3 and opus through libmp3lame and libopus called directly (the default; less CPU per "
                     "stream); false: through PyAV / libav",
    "trace_requests": "a directory: each server process writes a per-request timeline (stamps from HTTP "
                      "receipt to the first chunk written), engine steps and GC pauses there; "
                      "python bench/trace_report.py DIR joins them (default: off)",
}


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{s!r} is not a boolean (true/false)")


def _parser_for(type_name: str) -> Callable[[str], Any]:
    if type_name.startswith("bool"):
        return _bool
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
    except ValueError:
        raise SystemExit(f"csmserve serve: {ENV_PREFIX}{name.upper()}={raw!r} is not a valid value") from None


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP/WebSocket server",
                              description="Every flag also reads CSMSERVE_<FLAG> (e.g. CSMSERVE_API_KEY).")
    for name, (default, help_) in _MODEL_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=_env_default(name, default, str),
                       help=f"{help_} [env {ENV_PREFIX}{name.upper()}]")
    p.add_argument("--ray", action="store_true", default=_env_default("ray", False, _bool),
                   help="serve on Ray Serve: replicas of the engine behind one port (the 'ray' flags; "
                        f"pip install 'csmserve[ray]'; docs/scale-out.md) [env {ENV_PREFIX}RAY]")
    for title, cls in (("server", ServerConfig), ("engine", EngineConfig), ("ray (with --ray)", RayConfig)):
        group = p.add_argument_group(title)
        for f in dataclasses.fields(cls):
            parse = _parser_for(str(f.type))
            default = f.default if f.default is not dataclasses.MISSING else None
            if f.name == "model_name":
                default = None  # not given: --model
            help_ = _HELP.get(f.name, f.name.replace("_", " "))
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=parse,
                               default=_env_default(f.name, default, parse),
                               help=f"{help_} (default: {default}) [env {ENV_PREFIX}{f.name.upper()}]")
    return p


def ray_config(args: argparse.Namespace) -> RayConfig:
    return RayConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RayConfig)})


def configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    pick = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}  # noqa: E731
    server = pick(ServerConfig)
    if server["model_name"] is None:  # not set: report --model
        server["model_name"] = args.model
    return ServerConfig(**server), EngineConfig(**pick(EngineConfig))


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)
