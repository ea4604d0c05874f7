"""The engine loop on its own thread. `EngineClient` is its only door.

One iteration: drain the inbox (submit / abort) -> Scheduler.schedule() -> runner.admit/prefill/step
(launched, not waited) -> read the PREVIOUS step's results (pinned host copies) -> Scheduler.update
-> per-request AudioChunks to each request's sink.

A failed step fails the requests it held and the engine goes on, except after an error that leaves
the device unusable (a CUDA device-side assert, an illegal address: `device_lost`): then `fatal`
names it, every later request is refused at once with that reason, and the server's /ready and
/health answer 503, so an orchestrator restarts the process.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import EngineConfig
from .pacing import LaunchPacer
from .prefix_cache import PrefixCache, default_prefix_cache_bytes
from .request import AudioChunk, Request
from .runner import ModelRunner, StepOutput
from .scheduler import RequestOutput, Scheduler, SchedulerBusy

log = logging.getLogger("csmserve.engine")
DEVICE_LOST = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
               "CUDA-capable device", "cudaErrorLaunchFailure")


def device_lost(error: BaseException) -> bool:
    """An error after which the CUDA context cannot run anything again (only a new process can)."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(error, accel)) or any(s in str(error) for s in DEVICE_LOST)

Sink = Callable[[AudioChunk | BaseException], None]


@dataclass
class _Stream:
    """Host-side accumulation of one request's frames into chunks."""

    request: Request
    sink: Sink
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
        self.sink(AudioChunk(self.request.request_id, audio, codes, self.emitted_frames, final, reason,
                             self.segment, segment_end=segment_end or (reason if final else None)))
        self.emitted_frames += len(codes)
        self.segment_chunks += 1
        self.codes, self.pcm = [], []


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, start: bool = True) -> None:
        self.runner, self.config = runner, config
        cache_bytes = config.prefix_cache_bytes
        if cache_bytes is None:
            cache_bytes = default_prefix_cache_bytes(runner.device.type)
        self.prefix_cache = PrefixCache(cache_bytes, runner.kv.bytes_per_position) if cache_bytes > 0 else None
        self.scheduler = Scheduler(config, runner.cfg.num_codebooks, self.prefix_cache)
        self.num_codebooks = runner.cfg.num_codebooks
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, _Stream] = {}
        self.stats = {"frames": 0, "steps": 0}
        self._prev: tuple[int, StepOutput] | None = None  # the launched step whose results are not read yet
        self.fatal: str | None = None  # set once the device is lost: the engine only refuses from then on
        self.pacer = LaunchPacer()  # EngineConfig.late_launch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="csmserve-engine", daemon=True)
        if start:  # start=False: tests drive step() by hand, frame by frame
            self._thread.start()

    # ---- thread-safe entry points
    def submit(self, request: Request, sink: Sink) -> None:
        request.arrival_time = time.perf_counter()
        self.inbox.put(("add", request, sink))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id, None))

    def append(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> None:
        """One more segment (text frames) for an open long-form request (Request.open)."""
        self.inbox.put(("append", request_id, (tokens, mask)))

    def close(self, request_id: str) -> None:
        """No more segments for an open request: it ends after the ones it has."""
        self.inbox.put(("close", request_id, None))

    def shutdown(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None, None))
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def idle(self) -> bool:
        return self._prev is None and not self.scheduler.has_unfinished()

    @property
    def waiting_for_input(self) -> bool:
        """Nothing to compute: only requests idling for their next segment's text, if any."""
        return self._prev is None and not self.scheduler.has_work()

    # ---- the loop
    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                self.run_once()

    def run_once(self) -> None:
        """One loop iteration: a step (a failed one fails its requests, the engine goes on), or after a
        lost device one refusal."""
        if self.fatal is not None:
            self._refuse(block=True)
            return
        try:
            self.step(block=self.waiting_for_input)
        except Exception as e:
            log.exception("engine step failed")
            self._prev = None
            self._fail_all(e)
            if device_lost(e):
                self.fatal = f"{type(e).__name__}: {e}".splitlines()[0]
                log.critical("the device is lost (%s); restart the process", self.fatal)

    def _refuse(self, block: bool) -> None:
        """After a lost device: answer every new request with the reason at once (never a hang)."""
        try:
            kind, a, b = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        if kind == "add":
            b(RuntimeError(f"the engine is down after a device error ({self.fatal}); the process must be "
                           f"restarted"))

    def step(self, block: bool = False) -> None:
        if not self.config.overlap_steps and self._prev is not None:
            self._prev[1].wait()  # admit what arrived during the step in flight into the next one
        elif self.config.late_launch and self._prev is not None:
            at = self.pacer.launch_at()
            delay = 0.0 if at is None else at - time.perf_counter()
            if delay > 2e-4:
                time.sleep(delay)  # requests arriving meanwhile join this step
        self._drain(block)
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self.runner.admit(batch.admissions)
        self.runner.resume(batch.resumes)
        self.runner.prefill(batch.prefills)
        self.runner.store_prefixes(batch.prefix_stores)
        out = self.runner.step(batch.decode_slots)
        if out is not None:  # the launch cost of a frame step, not of an empty iteration
            self.pacer.launched(time.perf_counter() - t0)
        if self._prev is not None:
            waited = not self._prev[1].done()
            self._prev[1].wait()
            self.pacer.step_done(time.perf_counter(), waited)
            self._collect(*self._prev)
        if out is None:
            self.pacer.idle()
        self._prev = (batch.step, out) if out is not None else None

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, a, b = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._add(a, b)
            elif kind == "abort":
                self._abort(a)
            elif kind == "append":
                self._append(a, *b)
            elif kind == "close":
                req = self.scheduler.close(a)
                if req is not None and a in self.streams:
                    st = self.streams.pop(a)
                    st.segment = max(0, req.segment - 1)  # the empty final chunk closes the last segment
                    st.flush(True, req.status.finish_reason, self.num_codebooks)

    def _add(self, request: Request, sink: Sink) -> None:
        try:
            self.scheduler.add(request)
        except (SchedulerBusy, ValueError) as e:
            sink(e)
            return
        self.streams[request.request_id] = _Stream(request, sink)

    def _abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None and request_id in self.streams:
            self.streams.pop(request_id).flush(True, "abort", self.num_codebooks)

    def _append(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> None:
        try:
            self.scheduler.append(request_id, tokens, mask)
        except ValueError as e:
            self.scheduler.abort(request_id)
            st = self.streams.pop(request_id, None)
            if st is not None:
                st.sink(e)

    def _collect(self, step: int, out: StepOutput) -> None:
        codes, pcm = out.wait()
        self.stats["steps"] += 1
        for o in self.scheduler.update(step, codes):
            self._deliver(o, pcm)

    def _deliver(self, o: RequestOutput, pcm: np.ndarray | None) -> None:
        st = self.streams.get(o.request_id)
        if st is None:
            return
        if len(o.codes):
            self.stats["frames"] += 1
            st.codes.append(o.codes)
            if pcm is not None:
                st.pcm.append(pcm[o.row].copy())
        want = self.config.first_chunk_frames if st.segment_chunks == 0 else self.config.chunk_frames
        if o.finish_reason is not None:
            del self.streams[o.request_id]
            st.flush(True, o.finish_reason, self.num_codebooks)
        elif o.segment_end is not None:  # chunks never span segments; this one says where the segment ends
            st.flush(False, None, self.num_codebooks, segment_end=o.segment_end)
            st.segment, st.segment_chunks = o.segment + 1, 0
        elif len(st.codes) >= want:
            st.flush(False, None, self.num_codebooks)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.streams):
            self.scheduler.abort(rid)
            self.streams.pop(rid).sink(RuntimeError(f"engine step failed: {error}"))


class EngineClient:
    """Submit requests and read their chunks, from plain threads or from asyncio."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def append(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> None:
        """Another segment (text frames [n, 33]) for an open long-form request; ignored once it ended."""
        self.engine.append(request_id, tokens, mask)

    def close(self, request_id: str) -> None:
        """No more segments for an open long-form request."""
        self.engine.close(request_id)

    def stream(self, request: Request, on_submit: Callable[[], None] | None = None) -> Iterator[AudioChunk]:
        q = self._submit(request)
        if on_submit is not None:
            on_submit()
        done = False
        try:
            for item in _until_final(q):
                done = item.final
                yield item
        except Exception:  # an engine error ended it (GeneratorExit, an early close, is not one)
            done = True
            raise
        finally:
            if not done:  # the caller stopped iterating: free the slot
                self.engine.abort(request.request_id)

    async def astream(self, request: Request, on_submit: Callable[[], None] | None = None
                      ) -> AsyncIterator[AudioChunk]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self.engine.submit(request, lambda item: loop.call_soon_threadsafe(q.put_nowait, item))
        if on_submit is not None:
            on_submit()
        done = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.final
                yield item
                if done:
                    return
        finally:
            if not done:  # client went away: free the slot at the next frame boundary
                self.engine.abort(request.request_id)

    def run(self, requests: list[Request]) -> list[list[AudioChunk]]:
        """Submit all, wait for all; chunks per request in order."""
        queues = [self._submit(r) for r in requests]
        return [list(_until_final(q)) for q in queues]

    def _submit(self, request: Request) -> queue.SimpleQueue:
        q: queue.SimpleQueue = queue.SimpleQueue()
        self.engine.submit(request, q.put)
        return q


def _until_final(q: queue.SimpleQueue) -> Iterator[AudioChunk]:
    """A request's chunks from its queue, through the final one; an engine error is raised here."""
    while True:
        item = q.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.final:
            return
