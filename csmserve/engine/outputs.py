"""What the engine hands out once per step, and the client-side router that turns it into AudioChunks.

The engine core emits one `EngineStep` per step for each client (the in-process API, or one API
worker process): the live rows of the frame step that belong to that client's requests
(vectorised: `StepRows` minus the Request objects; codes and PCM stay in the step's output buffer,
a shared-memory ring between processes), sparse `Event`s for requests that ended without a row
(abort, close while idle) or were refused, and the engine's counters.

`Router` (one per client) scatters each step's frames into per-stream buffers (vectorised) and groups
them into chunks (the first after `first_chunk_frames`, then `chunk_frames`, growing with the stream's
lead over real time up to `max_chunk_ms`; long-form: never spanning two segments), handing each chunk
to the request's sink; only streams that flush, end or fail touch Python objects. A consumer is woken
at most once per step. It also drops readers that fall far behind real time (`max_lag_s`): their
request is aborted.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from csmserve.config import FRAME_MS
from csmserve.engine.request import END_REASONS, AudioChunk

FRAME_S = FRAME_MS / 1000

CLIENT_SHIFT = 40  # Request.handle = client << CLIENT_SHIFT | n: a step's rows are routed by client


def client_of(handle: int) -> int:
    return handle >> CLIENT_SHIFT


# Event.kind
EV_FINAL = 0  # the request ended without a row this step (aborted, closed while idle); payload: reason
EV_ERROR = 1  # the request was refused or failed; payload: (exception class name, message)


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
    """A request's Python side, touched only when it flushes a chunk, ends or fails; its pending frames
    live in the Router's slab at `index`."""

    request_id: str
    sink: Callable[[AudioChunk | BaseException], None]
    index: int  # its row of the Router's slab
    max_lag_s: float | None = None
    progress: Progress | None = None
    emitted_frames: int = 0
    first_audio_time: float | None = None
    segment: int = 0  # long-form: the segment being accumulated

    def too_slow(self, now: float) -> bool:
        """The consumer is more than max_lag_s of audio behind real time (playback since first audio)."""
        if self.max_lag_s is None or self.progress is None or self.first_audio_time is None:
            return False
        behind = now - self.first_audio_time - self.progress.frames * FRAME_S
        return behind > self.max_lag_s and self.emitted_frames - self.progress.frames > self.max_lag_s / FRAME_S


class Router:
    """Client side: EngineStep -> AudioChunks per request. Not thread-safe: one thread delivers.

    A step's rows are scattered at once (numpy, no Python per row) into a slab of pending frames: stream
    row r holds its next chunk's frames at slab rows r*F .. r*F+F-1 (`_codes` [S*F+1, K], `_pcm`
    [S*F+1, frame_size]; the last row is scratch, the target of rows with nothing to keep), with `_n` [S]
    frames pending and `_want` [S] the frames that make its next chunk. Only the streams that flush, end or
    fail in a step touch Python objects. Open handles are kept sorted (`_keys`, their stream rows in
    `_rows`; opens merged in once per step), so a step's handles find their rows by one searchsorted.

    Chunk sizes: a request's (or a long-form segment's) first chunk is `first_chunk_frames`; later ones
    `chunk_frames`, growing while the stream is more than `grow_lead_s` of audio ahead of real time
    (lead = audio handed out - wall time since its first chunk) to half of the lead beyond it, at most
    `max_chunk_frames`. Waiting for a chunk of c frames takes c frame steps of the lead, at most c frames of
    audio while the engine keeps real time, so the lead stays above grow_lead_s: larger chunks never make
    a stream run dry. Under grow_lead_s (an engine slower than real time), chunks stay small."""

    def __init__(self, num_codebooks: int, first_chunk_frames: int = 1, chunk_frames: int = 4,
                 abort: Callable[[str], None] | None = None, max_chunk_frames: int | None = None,
                 grow_lead_s: float = 0.5, clock: Callable[[], float] = time.perf_counter, capacity: int = 0) -> None:
        """capacity: the streams open at once at most (the engine's slots + queue): the slab is that size from the
        first open, never grown, so never copied (a copy at 2,048 -> 4,096 rows held the delivering thread 0.5 s);
        its pages are touched only as rows are used (zeroed allocations are lazy). Past it (or 0) it doubles."""
        self.num_codebooks = num_codebooks
        self.capacity = capacity
        self.first_chunk_frames, self.chunk_frames = first_chunk_frames, chunk_frames
        self.max_chunk_frames = max(chunk_frames, max_chunk_frames or 0)  # None (<= chunk_frames): no growth
        self.grow_lead_s = grow_lead_s
        self.clock = clock
        self.abort = abort  # called with the request id of a reader dropped for lagging
        self.streams: dict[int, _Stream] = {}
        self.stats = EngineStats()
        self._f = max(first_chunk_frames, chunk_frames, self.max_chunk_frames)  # F: frames of a chunk at most
        self._keys = np.zeros(0, np.int64)  # [open + stale] handles, sorted
        self._rows = np.zeros(0, np.int64)  # [open + stale] their stream rows
        self._added: list[tuple[int, int]] = []  # (handle, row) opened since the last merge
        self._free: list[int] = []  # stream rows not in use (a heap: the lowest first, the slab stays compact)
        self._owner = np.zeros(0, np.int64)  # [S] the handle holding each stream row (-1: free)
        self._n = np.zeros(0, np.int64)  # [S]
        self._want = np.zeros(0, np.int64)  # [S]
        self._codes = np.zeros((1, num_codebooks), np.int64)  # [S*F+1, K]
        self._pcm: np.ndarray | None = None  # [S*F+1, frame_size] float32, from the first step with PCM

    @classmethod
    def of(cls, config, num_codebooks: int, abort: Callable[[str], None] | None = None) -> "Router":
        """The router of an EngineConfig's chunking (first_chunk_frames, chunk_frames, max_chunk_ms,
        chunk_grow_lead_ms)."""
        return cls(num_codebooks, config.first_chunk_frames, config.chunk_frames, abort,
                   max_chunk_frames=config.max_chunk_ms // FRAME_MS, grow_lead_s=config.chunk_grow_lead_ms / 1e3,
                   capacity=config.max_slots + config.max_waiting if config.max_slots else 0)

    # ---- streams
    def open(self, handle: int, request_id: str, sink: Callable[[AudioChunk | BaseException], None],
             max_lag_s: float | None = None, progress: Progress | None = None) -> None:
        if handle in self.streams:
            self._close(handle)
        if not self._free:
            self._grow()
        row = heapq.heappop(self._free)
        self._owner[row], self._n[row], self._want[row] = handle, 0, self.first_chunk_frames
        self.streams[handle] = _Stream(request_id, sink, row, max_lag_s, progress)
        self._added.append((handle, row))

    def _grow(self) -> None:
        """The capacity's stream rows at the first open, then twice the rows (at least 64); rows in use keep their
        frames."""
        s, f = len(self._n), self._f
        size = max(64, 2 * s, self.capacity)
        owner = np.full(size, -1, np.int64)
        n, want = np.zeros(size, np.int64), np.zeros(size, np.int64)
        owner[:s], n[:s], want[:s] = self._owner, self._n, self._want
        self._owner, self._n, self._want = owner, n, want
        self._codes = _regrow(self._codes, size * f + 1, s * f)
        if self._pcm is not None:
            self._pcm = _regrow(self._pcm, size * f + 1, s * f)
        self._free.extend(range(s, size))  # each new row above every row in the heap: still a heap

    def _close(self, handle: int) -> _Stream | None:
        """Forget a stream (its row freed; its key goes at the next merge); -> it, if it was open."""
        st = self.streams.pop(handle, None)
        if st is None:
            return None
        self._owner[st.index] = -1
        heapq.heappush(self._free, st.index)
        return st

    def _merge(self) -> None:
        """The streams opened since the last step into the sorted keys; closed ones out."""
        keep = self._owner[self._rows] == self._keys  # [open + stale] False: closed (its row free or reused)
        keys, rows = self._keys[keep], self._rows[keep]
        if self._added:
            new = np.array(self._added, np.int64)  # [A, 2]
            self._added.clear()
            keys, rows = np.concatenate([keys, new[:, 0]]), np.concatenate([rows, new[:, 1]])
            if len(keys) > 1 and not (keys[1:] >= keys[:-1]).all():  # handles mostly arrive in order
                order = np.argsort(keys, kind="stable")
                keys, rows = keys[order], rows[order]
        self._keys, self._rows = keys, rows

    def fail(self, handle: int, error: BaseException) -> None:
        st = self._close(handle)
        if st is not None:
            st.sink(error)

    def fail_all(self, error: BaseException) -> None:
        for h in list(self.streams):
            self.fail(h, error)

    # ---- a step
    def deliver(self, out: EngineStep, codes: np.ndarray | None, pcm: np.ndarray | None) -> None:
        """codes [M, K] / pcm [M, frame_size]: the rows of `out`, in its order (already gathered)."""
        if out.stats is not None:
            self.stats = out.stats
        if len(out.handles) and self.streams:
            self._scatter(out, codes, pcm)
        for ev in out.events:
            self.event(ev)

    def _scatter(self, out: EngineStep, codes: np.ndarray | None, pcm: np.ndarray | None) -> None:
        if self._added or len(self._keys) > 2 * len(self.streams) + 64:
            self._merge()
        handles, keys = out.handles, self._keys
        at = np.searchsorted(keys, handles)  # [M]
        np.minimum(at, len(keys) - 1, out=at)
        rows = self._rows[at]  # [M] each row's stream row (meaningless where not live)
        live = (keys[at] == handles) & (self._owner[rows] == handles)  # [M] its stream is open here
        put = live & out.has_frame  # [M] each stream at most once a step (one slot per request)
        if put.any():
            n = self._n[rows]
            dest = np.where(put, rows * self._f + n, len(self._codes) - 1)  # [M] slab row; the rest to scratch
            self._codes[dest] = codes
            if pcm is not None:
                if self._pcm is None or self._pcm.shape[1] != pcm.shape[1]:
                    self._pcm = np.zeros((len(self._codes), pcm.shape[1]), np.float32)
                self._pcm[dest] = pcm
            self._n[rows[put]] = n[put] + 1
        flush = live & (out.final | (out.end != 0) | (self._n[rows] >= self._want[rows]))
        which = np.flatnonzero(flush)  # [Q] the only rows that touch Python objects
        if not len(which):
            return
        if len(which) > 1:  # requests' first frames first: their consumers wake (and encode, and write) first
            which = which[np.argsort(out.frame_start[which] != 0, kind="stable")]
        q = rows[which]
        wants = self._flush_rows(handles[which].tolist(), self._n[q].tolist(), out.end[which].tolist(),
                                 out.final[which].tolist(), out.segment[which].tolist())
        self._n[q] = 0
        self._want[q] = wants

    def _flush_rows(self, handles: list[int], counts: list[int], ends: list[int], finals: list[bool],
                    segments: list[int]) -> list[int]:
        """-> each flushed stream's next chunk size (its pending count is reset by the caller)."""
        streams, now, wants = self.streams, self.clock(), []
        for h, n, end, final, seg in zip(handles, counts, ends, finals, segments):
            st = streams[h]
            if final:
                self._close(h)
                self._flush(st, n, True, END_REASONS[end], None, now)
                wants.append(0)
            elif end:  # chunks never span segments; this one (maybe without codes) says where the segment ends
                self._flush(st, n, False, None, END_REASONS[end], now)
                st.segment = seg + 1
                wants.append(self.first_chunk_frames)
            else:
                self._flush(st, n, False, None, None, now)
                wants.append(self._next_chunk(st, now))
                if st.max_lag_s is not None and st.too_slow(now):
                    self._drop_slow(h, st)
        return wants

    def _flush(self, st: _Stream, n: int, final: bool, reason: str | None, segment_end: str | None,
               now: float) -> None:
        """Hand the stream's n pending frames to its sink as one AudioChunk (copies: the slab rows are reused)."""
        i = st.index * self._f
        codes = self._codes[i:i + n].copy()  # [n, K]
        audio = self._pcm[i:i + n].flatten() if self._pcm is not None else np.zeros(0, np.float32)  # [n * fs]
        if n and st.first_audio_time is None:
            st.first_audio_time = now
        st.sink(AudioChunk(st.request_id, audio, codes, st.emitted_frames, final, reason, st.segment,
                           segment_end=segment_end or (reason if final else None)))
        st.emitted_frames += n

    def _next_chunk(self, st: _Stream, now: float) -> int:
        """Frames in the stream's next chunk (not the first of its segment): chunk_frames, or while its lead
        over real time exceeds grow_lead_s, half the lead beyond it, at most max_chunk_frames."""
        if self.max_chunk_frames == self.chunk_frames or st.first_audio_time is None:
            return self.chunk_frames
        beyond = st.emitted_frames * FRAME_S - (now - st.first_audio_time) - self.grow_lead_s
        return min(self.max_chunk_frames, max(self.chunk_frames, int(beyond / (2 * FRAME_S)))) if beyond > 0 \
            else self.chunk_frames

    def event(self, ev: Event) -> None:
        st = self.streams.get(ev.handle)
        if st is None:
            return
        if ev.kind == EV_FINAL:
            self._close(ev.handle)
            st.segment = ev.segment
            i = st.index
            self._flush(st, int(self._n[i]), True, ev.payload, None, self.clock())
            self._n[i] = 0
        elif ev.kind == EV_ERROR:
            self._close(ev.handle)
            st.sink(error_from(ev.payload))

    def _drop_slow(self, handle: int, st: _Stream) -> None:
        self._close(handle)
        if self.abort is not None:
            self.abort(st.request_id)
        st.sink(SlowReaderError(f"the client read the audio more than {st.max_lag_s:g} s behind real time; "
                                f"the request was stopped"))


def _regrow(a: np.ndarray, rows: int, keep: int) -> np.ndarray:
    """a [R, ...] -> [rows, ...] zeros holding a's first `keep` rows."""
    out = np.zeros((rows, *a.shape[1:]), a.dtype)
    out[:keep] = a[:keep]
    return out


def error_payload(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def error_from(payload: tuple[str, str]) -> BaseException:
    """An engine-side error (a stream's, or a call's: encode, the adapter calls), rebuilt on the client side as the
    same kind (busy / bad request / failure)."""
    from csmserve.engine.adapters import (AdapterExistsError, AdapterLimitError, AdapterPoolFullError,
                                          UnknownAdapterError)
    from csmserve.engine.scheduler import SchedulerBusy
    from csmserve.models.lora import LoraError

    name, message = payload
    kinds = {c.__name__: c for c in (SchedulerBusy, ValueError, UnknownAdapterError, AdapterLimitError,
                                     AdapterExistsError, LoraError, AdapterPoolFullError)}
    return kinds.get(name, RuntimeError)(message)
