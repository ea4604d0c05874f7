"""The typed messages between API workers and the engine-core process (pickled, one per send).

Worker -> engine: Hello (once), Submit, Abort, Append, Close, Encode, LoadAdapter, UnloadAdapter, ListAdapters.
Engine -> worker: Welcome (once), outputs.EngineStep (one per step with rows or events for that
worker, or a heartbeat), Reply (to an Encode or one of the three adapter calls: the calls with a call_id).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from csmserve.config import EngineConfig
from csmserve.engine.request import Request


@dataclass(frozen=True)
class EngineInfo:
    """What a worker needs to build prompts for this engine without loading the model."""

    model: str
    model_dir: str | None  # holds tokenizer.json (None: byte tokenizer of the dummy models)
    num_codebooks: int
    audio_vocab_size: int
    model_max_seq_len: int
    frame_size: int
    has_codec: bool
    engine: EngineConfig  # as running (max_slots sized)

    @staticmethod
    def of(csm, engine) -> "EngineInfo":
        c = csm.config
        return EngineInfo(csm.model_name, None if csm.model_dir is None else str(csm.model_dir), c.num_codebooks,
                          c.audio_vocab_size, c.max_seq_len, csm.frame_size,
                          bool(getattr(csm, "has_codec", csm.mimi is not None)), engine.config)


@dataclass(frozen=True)
class Hello:
    client_id: int


@dataclass(frozen=True)
class Welcome:
    info: EngineInfo
    ring: dict  # OutputRing.spec()
    pid: int | None = None  # the engine process's: a closed connection with it alive means this worker was dropped


@dataclass(frozen=True)
class Submit:
    request: Request  # its handle names the worker (outputs.CLIENT_SHIFT)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Append:
    request_id: str
    tokens: np.ndarray  # [n, K+1]
    mask: np.ndarray


@dataclass(frozen=True)
class Close:
    request_id: str


@dataclass(frozen=True)
class Encode:
    call_id: int
    audio: np.ndarray  # [n] float32 mono 24 kHz


@dataclass(frozen=True)
class LoadAdapter:
    """Serve the PEFT adapter directory at `path` (on the engine's machine) as `name` (a request's Request.adapter)."""

    call_id: int
    name: str
    path: str


@dataclass(frozen=True)
class UnloadAdapter:
    call_id: int
    name: str


@dataclass(frozen=True)
class ListAdapters:
    call_id: int


@dataclass(frozen=True)
class Reply:
    call_id: int
    # Encode: the codes [frames, K] int64; LoadAdapter / UnloadAdapter: the adapter's info; ListAdapters: name -> info
    result: np.ndarray | dict | None
    error: tuple[str, str] | None  # outputs.error_payload (exception class name, message)
