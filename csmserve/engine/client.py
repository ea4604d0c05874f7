"""Engine clients: how a caller submits requests and reads their chunks, sync and async.

`ClientBase` is what every client does (a Router of its own requests, sinks, stream/astream/run);
`EngineClient` is the engine on a thread of this process (the `CSM` Python API, tests);
remote.py's `RemoteEngineClient` is an API worker's door to the engine-core process (the same surface).
That surface is all its callers (CSM, the server) use of the engine: submit through stream/astream/run,
abort, append, close, `stats()` (the counters: running, waiting, the prefix cache's), `fatal`; LoRA adapters:
`load_adapter(name, path)`, `unload_adapter(name)`, `adapters()` (blocking calls); a stream the engine cannot
queue raises `SchedulerBusy` (imported from here).
"""
from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from csmserve.engine.outputs import EngineStats, Progress, Router
from csmserve.engine.request import AudioChunk, Request
from csmserve.engine.scheduler import SchedulerBusy

__all__ = ["ClientBase", "EngineClient", "SchedulerBusy"]

if TYPE_CHECKING:
    from csmserve.engine.engine import Engine


class ClientBase:
    """What every engine client does: a Router of its own requests, chunks to sinks, sync and async."""

    # time.monotonic() of the engine's last message (remote.py: an engine in another process that may hang while
    # its connection stays open); None: the engine runs in this process, nothing to watch
    last_word: float | None = None

    def __init__(self, router: Router, client_id: int = 0) -> None:
        self.router = router
        self.client_id = client_id
        self._feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _LoopFeed

    # ---- to implement: how messages reach the engine
    def _start(self, request: Request, sink: Callable, max_lag_s: float | None = None,
               progress: Progress | None = None) -> None:
        """Register the request's sink with the router (chunks or an exception go there), then send it."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def append(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> None:
        """Another segment (text frames [n, 33]) for an open long-form request; ignored once it ended."""
        raise NotImplementedError

    def close(self, request_id: str) -> None:
        """No more segments for an open long-form request."""
        raise NotImplementedError

    def load_adapter(self, name: str, path: str) -> dict:
        """Serve the PEFT adapter directory `path` as `name` (Request.adapter) -> its info (name, rank, bytes, ...).
        LoraError: an adapter that cannot be served right; ValueError: a name taken, an engine without adapters;
        AdapterLimitError: max_cpu_loras adapters loaded already."""
        raise NotImplementedError

    def unload_adapter(self, name: str) -> dict:
        """Stop serving `name`: refused for new requests at once; its requests in flight finish with it.
        UnknownAdapterError."""
        raise NotImplementedError

    def adapters(self) -> dict[str, dict]:
        """name -> info (rank, bytes, resident, running, queued, requests, loads, load_s) of every adapter served."""
        raise NotImplementedError

    # ---- shared
    def stream(self, request: Request, on_submit: Callable[[], None] | None = None) -> Iterator[AudioChunk]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._start(request, q.put)
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
                self.abort(request.request_id)

    async def astream(self, request: Request, on_submit: Callable[[], None] | None = None,
                      max_lag_s: float | None = None) -> AsyncIterator[AudioChunk]:
        """max_lag_s: abort the request (SlowReaderError) once this consumer is that far behind real time."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        progress = Progress()
        self._start(request, self._async_sink(loop, q, request.request_id), max_lag_s, progress)
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
                progress.frames += len(item.codes)
                yield item
                if done:
                    return
        finally:
            if not done:  # client went away: free the slot at the next frame boundary
                self.abort(request.request_id)

    def _async_sink(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, request_id: str) -> Callable:
        with _FEEDS_LOCK:  # streams start on their loops' threads, maybe several at once
            feed = self._feeds.get(loop)
            if feed is None:
                feed = self._feeds[loop] = _LoopFeed(loop, lambda rid: self.abort(rid))

        def sink(item) -> None:
            feed.put(q, item, request_id)
        return sink

    # run()'s requests in flight at once, where the engine's own bound is not known here (its queue, past its slots,
    # refuses more: SchedulerBusy)
    RUN_WINDOW = 256

    @property
    def run_window(self) -> int:
        return self.RUN_WINDOW

    def run(self, requests: list[Request]) -> list[list[AudioChunk]]:
        """Submit all, at most run_window in flight (the next as the oldest ends), wait for all; chunks per request
        in order. ValueError: a request twice (it runs once)."""
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("the same request is in the list twice: a Request runs once (build one per text)")
        queues: list[queue.SimpleQueue] = []

        def start(r: Request) -> None:
            q: queue.SimpleQueue = queue.SimpleQueue()
            self._start(r, q.put)
            queues.append(q)

        w = max(1, self.run_window)
        for r in requests[:w]:
            start(r)
        out = []
        for i in range(len(requests)):
            out.append(list(_until_final(queues[i])))
            if i + w < len(requests):
                start(requests[i + w])
        return out

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (running, waiting, prefix-cache hits, fatal)."""
        return self.router.stats

    @property
    def fatal(self) -> str | None:
        """The error that stopped the engine (a lost device, an engine process gone), if any."""
        return self.stats().fatal


class EngineClient(ClientBase):
    """The engine on a thread of this process (the `CSM` Python API, tests): submit, abort, append,
    close through its inbox; chunks come back through the engine's router, on the engine's thread."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.router)
        self.engine = engine

    @property
    def run_window(self) -> int:
        """Twice the engine's slots, within what its queue takes (other callers may queue beside run's)."""
        slots = self.engine.scheduler.max_slots
        return min(2 * slots, slots + self.engine.config.max_waiting)

    def _start(self, request: Request, sink: Callable, max_lag_s: float | None = None,
               progress: Progress | None = None) -> None:
        tr = self.engine.tracer
        if tr is not None and request.request_id in tr.pending:  # a server's request (the API's: not stamped)
            tr.stamp(request.request_id, sent=time.perf_counter())
        self.engine.submit(request, sink, max_lag_s, progress)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def append(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> None:
        self.engine.append(request_id, tokens, mask)

    def close(self, request_id: str) -> None:
        self.engine.close(request_id)

    def load_adapter(self, name: str, path) -> dict:
        """path: a directory, or a LoraAdapter read already (engine.read_adapter)."""
        return self.engine.load_adapter(name, path).result()

    def unload_adapter(self, name: str) -> dict:
        return self.engine.unload_adapter(name).result()

    def adapters(self) -> dict[str, dict]:
        return self.engine.adapters()

    def stats(self) -> EngineStats:
        return self.engine.engine_stats()

    @property
    def fatal(self) -> str | None:
        return self.engine.fatal


def _until_final(q: queue.SimpleQueue) -> Iterator[AudioChunk]:
    """A request's chunks from its queue, through the final one; an engine error is raised here."""
    while True:
        item = q.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.final:
            return


_FEEDS_LOCK = threading.Lock()


class _LoopFeed:
    """Chunks for one event loop's async streams, handed over from the delivering thread with one wake-up a burst
    (a step's chunks), not one a chunk (call_soon_threadsafe is a self-pipe write and a GIL hand-off): 1,024 chunks
    cost the delivering thread 0.36 ms, not 2.33 (the engine thread in-process; docs/benchmarks.md, "The parts")."""

    def __init__(self, loop: asyncio.AbstractEventLoop, abort: Callable[[str], None]) -> None:
        self.loop, self.abort = loop, abort
        self.items: collections.deque = collections.deque()  # (queue, item, request_id), in delivery order
        self.woken = False  # a drain is scheduled and has not begun
        self._lock = threading.Lock()  # put's append + wake against drain's clear + pops

    def put(self, q: asyncio.Queue, item, request_id: str) -> None:
        with self._lock:
            self.items.append((q, item, request_id))
            if self.woken and not self.loop.is_closed():  # closed: its drain will never run
                return
            self.woken = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed with its streams unread (asyncio.run returned): nobody reads them,
            self._drop()  # so free their slots; raising here would fail the step for every row

    def _drain(self) -> None:
        with self._lock:
            self.woken = False
            items, self.items = self.items, collections.deque()
        for q, item, _ in items:
            q.put_nowait(item)

    def _drop(self) -> None:
        with self._lock:
            self.woken = False
            items, self.items = self.items, collections.deque()
        for rid in dict.fromkeys(r for _, _, r in items):
            self.abort(rid)
