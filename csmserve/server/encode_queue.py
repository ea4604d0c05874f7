"""EncodeQueue: an API worker's compressed-audio encodes (mp3, opus, aac, flac), earliest deadline first, in
bounded slices of its event loop.

Every hop of a request through a worker waits for one turn of the event loop. Encoded inline, a turn ran every
chunk that became ready in it (an engine step hands a worker ~40 chunks, ~1.5 ms each for mp3): 60 ms and more,
and a new request's first audio waited for several (p99 ~900 ms at 1,024 mp3 users). Here each response awaits
`run(deadline, fn)`; one task runs the queued encodes in deadline order, at most `slice_s` per turn, so a hop
waits one slice, and a first chunk (deadline: now) goes before the streams already ahead of real time. `busy`
(an encode waited over `busy_wait_s`, within `hold_s`) feeds server/lead.py.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any, Callable

SLICE_S = 0.002  # encodes per turn of the loop, at most this long (one more may start just before it ends)
BUSY_WAIT_S = 0.05  # saturated: an encode waited this long in the queue ...
BUSY_HOLD_S = 0.5  # ... within this long


class EncodeQueue:
    def __init__(self, slice_s: float = SLICE_S, busy_wait_s: float = BUSY_WAIT_S,
                 hold_s: float = BUSY_HOLD_S) -> None:
        self.slice_s, self.busy_wait_s, self.hold_s = slice_s, busy_wait_s, hold_s
        self.heap: list[tuple[float, int, float, Callable[..., Any], tuple, asyncio.Future]] = []
        self._seq = itertools.count()  # ties: first queued first
        self._wake: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.busy_until = 0.0
        self.ran = 0  # encodes run (tests, metrics)

    @property
    def busy(self) -> bool:
        return time.monotonic() < self.busy_until

    def start(self) -> None:
        if self.task is None:
            self._wake = asyncio.Event()
            self.task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
        for *_, fut in self.heap:
            fut.cancel()
        self.heap.clear()

    async def run(self, deadline: float, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the queue's turn, most urgent `deadline` (time.monotonic()) first; inline when the queue
        is not started (no running app: tests, scripts). A caller cancelled while queued leaves the queue."""
        if self.task is None or self.task.done():
            return fn(*args)
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self.heap, (deadline, next(self._seq), time.monotonic(), fn, args, fut))
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        while True:
            if not self.heap:
                self._wake.clear()
                await self._wake.wait()
                continue
            start, ran = time.monotonic(), 0
            while self.heap and (not ran or time.monotonic() - start < self.slice_s):  # at least one per turn
                _, _, queued, fn, args, fut = heapq.heappop(self.heap)
                if fut.done():  # its response is gone
                    continue
                now = time.monotonic()
                if now - queued > self.busy_wait_s:
                    self.busy_until = now + self.hold_s
                try:
                    fut.set_result(fn(*args))
                except Exception as e:  # noqa: BLE001 - the encode's own error, raised in its response
                    fut.set_exception(e)
                ran += 1
            self.ran += ran
            await asyncio.sleep(0)  # one turn of the loop: the other hops of every request
