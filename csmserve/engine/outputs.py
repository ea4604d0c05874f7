"""What the engine hands out once per step, and the client-side router that turns it into AudioChunks.

The engine core emits one `EngineStep` per step for each client (the in-process API, or one API
worker process): the live rows of the frame step that belong to that client's requests
(vectorised: `StepRows` minus the Request objects; codes and PCM stay in the step's output buffer,
a shared-memory ring between processes), sparse `Event`s for requests that ended without a row
(abort, close while idle) or were refused, and the engine's counters.

`Router` (one per client) keeps a `_Stream` per request handle: it groups each request's frames into
chunks (the first after `first_chunk_frames`, then `chunk_frames`; long-form: never spanning two
segments) and hands each chunk to the request's sink. A consumer is woken at most once per step.
It also drops readers that fall far behind real time (`max_lag_s`): their request is aborted.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from csmserve.engine.request import AudioChunk

FRAME_S = 0.08

# Event.kind
CLIENT_SHIFT = 40  # Request.handle = client << CLIENT_SHIFT | n: a step's rows are routed by client


def client_of(handle: int) -> int:
    return handle >> CLIENT_SHIFT


EV_FINAL = 0  # the request ended without a row this step (aborted, closed while idle); payload: reason
EV_ERROR = 1  # the request was refused or failed; payload: (exception class name, message)
EV_ADMITTED = 2  # the request got a slot; payload: seconds it waited (metrics)


@dataclass
class Event:
    handle: int
    kind: int
    payload: object = None
    segment: int = 0


@dataclass
class EngineStats:
    running: int = 0  # requests holding a slot and generating (or prefilling)
    waiting: int = 0
    idle: int = 0  # long-form requests holding a slot while waiting for text
    free_slots: int = 0
    max_slots: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_hit_positions: int = 0
    prefix_stores: int = 0
    prefix_evictions: int = 0
    steps: int = 0
    frames: int = 0
    fatal: str | None = None  # the device error that stopped the engine
    reader_waits: int = 0  # steps that waited for a worker to read the output ring (EngineConfig.reader_wait_s)
    reader_wait_s: float = 0.0


@dataclass
class EngineStep:
    """One step's results for one client. codes/pcm rows: `rows` index the step's output buffer."""

    step: int
    ring: int  # output buffer (ring slot) holding this step's codes [B, K] and PCM [B, frame_size]
    rows: np.ndarray  # [M] int64
    handles: np.ndarray  # [M] int64
    frame_start: np.ndarray  # [M] int64
    segment: np.ndarray  # [M] int64
    has_frame: np.ndarray  # [M] bool
    end: np.ndarray  # [M] uint8 (scheduler.END_*): the row ends its segment
    final: np.ndarray  # [M] bool: the row ends its request
    events: list[Event] = field(default_factory=list)
    stats: EngineStats | None = None


class SlowReaderError(RuntimeError):
    """The client read the audio far slower than real time; its request was aborted."""


@dataclass
class Progress:
    """The consumer's side of a stream: frames it has taken (for the slow-reader bound)."""

    frames: int = 0


@dataclass
class _Stream:
    request_id: str
    sink: Callable[[AudioChunk | BaseException], None]
    first_chunk_frames: int
    chunk_frames: int
    max_lag_s: float | None = None
    progress: Progress | None = None
    codes: list[np.ndarray] = field(default_factory=list)  # [1, K] each
    pcm: list[np.ndarray] = field(default_factory=list)  # [frame_size] each
    emitted_frames: int = 0
    first_audio_time: float | None = None
    segment: int = 0  # long-form: the segment being accumulated
    segment_chunks: int = 0  # chunks sent for it (its first one is small: time to audio after a seam)

    def flush(self, final: bool, reason: str | None, num_codebooks: int, segment_end: str | None = None) -> None:
        codes = np.concatenate(self.codes) if self.codes else np.zeros((0, num_codebooks), np.int64)
        audio = np.concatenate(self.pcm) if self.pcm else np.zeros(0, np.float32)
        if len(codes) and self.first_audio_time is None:
            self.first_audio_time = time.perf_counter()
        self.sink(AudioChunk(self.request_id, audio, codes, self.emitted_frames, final, reason, self.segment,
                             segment_end=segment_end or (reason if final else None)))
        self.emitted_frames += len(codes)
        self.segment_chunks += 1
        self.codes, self.pcm = [], []

    def too_slow(self, now: float) -> bool:
        """The consumer is more than max_lag_s of audio behind real time (playback since first audio)."""
        if self.max_lag_s is None or self.progress is None or self.first_audio_time is None:
            return False
        behind = now - self.first_audio_time - self.progress.frames * FRAME_S
        return behind > self.max_lag_s and self.emitted_frames - self.progress.frames > self.max_lag_s / FRAME_S


_REASONS = (None, "eos", "length")


class Router:
    """Client side: EngineStep -> AudioChunks per request. Not thread-safe: one thread delivers."""

    def __init__(self, num_codebooks: int, first_chunk_frames: int = 1, chunk_frames: int = 4,
                 abort: Callable[[str], None] | None = None) -> None:
        self.num_codebooks = num_codebooks
        self.first_chunk_frames, self.chunk_frames = first_chunk_frames, chunk_frames
        self.abort = abort  # called with the request id of a reader dropped for lagging
        self.streams: dict[int, _Stream] = {}
        self.stats = EngineStats()

    def open(self, handle: int, request_id: str, sink: Callable[[AudioChunk | BaseException], None],
             max_lag_s: float | None = None, progress: Progress | None = None) -> None:
        self.streams[handle] = _Stream(request_id, sink, self.first_chunk_frames, self.chunk_frames,
                                       max_lag_s, progress)

    def fail(self, handle: int, error: BaseException) -> None:
        st = self.streams.pop(handle, None)
        if st is not None:
            st.sink(error)

    def fail_all(self, error: BaseException) -> None:
        for h in list(self.streams):
            self.fail(h, error)

    def deliver(self, out: EngineStep, codes: np.ndarray | None, pcm: np.ndarray | None) -> None:
        """codes [M, K] / pcm [M, frame_size]: the rows of `out`, in its order (already gathered)."""
        if out.stats is not None:
            self.stats = out.stats
        streams, now = self.streams, None
        has_frame, ends, final = out.has_frame.tolist(), out.end.tolist(), out.final.tolist()  # no numpy scalars per row
        handles = out.handles.tolist()  # only this client's rows
        # requests' first frames first: their consumers wake (and encode, and write) before the rest of the step's
        order = np.argsort(out.frame_start != 0, kind="stable").tolist() if len(handles) > 1 else range(len(handles))
        for i in order:
            h = handles[i]
            st = streams.get(h)
            if st is None:
                continue
            if has_frame[i]:
                st.codes.append(codes[i:i + 1])
                if pcm is not None:
                    st.pcm.append(pcm[i])
            end = ends[i]
            if final[i]:
                del streams[h]
                st.flush(True, _REASONS[end], self.num_codebooks)
            elif end:  # chunks never span segments; this one (maybe without codes) says where the segment ends
                st.flush(False, None, self.num_codebooks, segment_end=_REASONS[end])
                st.segment, st.segment_chunks = int(out.segment[i]) + 1, 0
            elif len(st.codes) >= (st.first_chunk_frames if st.segment_chunks == 0 else st.chunk_frames):
                st.flush(False, None, self.num_codebooks)
                if st.max_lag_s is not None:
                    now = now or time.perf_counter()
                    if st.too_slow(now):
                        self._drop_slow(h, st)
        for ev in out.events:
            self.event(ev)

    def event(self, ev: Event) -> None:
        st = self.streams.get(ev.handle)
        if st is None:
            return
        if ev.kind == EV_FINAL:
            del self.streams[ev.handle]
            st.segment = ev.segment
            st.flush(True, ev.payload, self.num_codebooks)
        elif ev.kind == EV_ERROR:
            del self.streams[ev.handle]
            st.sink(error_from(ev.payload))

    def _drop_slow(self, handle: int, st: _Stream) -> None:
        del self.streams[handle]
        if self.abort is not None:
            self.abort(st.request_id)
        st.sink(SlowReaderError(f"the client read the audio more than {st.max_lag_s:g} s behind real time; "
                                f"the request was stopped"))


def error_payload(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def error_from(payload: tuple[str, str]) -> BaseException:
    """An engine-side error, rebuilt on the client side as the same kind (busy / bad request / failure)."""
    from csmserve.engine.scheduler import SchedulerBusy

    name, message = payload
    if name == "SchedulerBusy":
        return SchedulerBusy(message)
    if name == "ValueError":
        return ValueError(message)
    return RuntimeError(message)
