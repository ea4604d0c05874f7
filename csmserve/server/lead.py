"""Lead: how far ahead of real time a response is encoded while its API worker's event loop is saturated.

The GPU makes audio faster than real time (1.4-1.7x at 1,024 streams), so for mp3 the workers' CPU is the bound:
with every core busy a new request's first chunk waited seconds. While the loop runs late (`LoopLoad`) or queued
encodes wait (`EncodeQueue.busy`), a stream more than `max_lead_s` of audio ahead of real time waits before its
next chunk is encoded. A worker with spare CPU holds nothing back.
"""
from __future__ import annotations

import asyncio
import time

from csmserve.server.encode_queue import EncodeQueue

BUSY_LAG_S = 0.02  # the loop is saturated while a 10 ms sleep comes back this much late ...
BUSY_HOLD_S = 0.5  # ... and for this long after the last such sample
MAX_WAIT_S = 0.25  # one wait at most, then the stream is looked at again


class LoopLoad:
    """The event loop's lateness, sampled by `run()` (a task of the worker's loop)."""

    def __init__(self, period_s: float = 0.01, busy_lag_s: float = BUSY_LAG_S, hold_s: float = BUSY_HOLD_S) -> None:
        self.period_s, self.busy_lag_s, self.hold_s = period_s, busy_lag_s, hold_s
        self.busy_until = 0.0
        self.task: asyncio.Task | None = None

    @property
    def busy(self) -> bool:
        return time.monotonic() < self.busy_until

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            if now - t - self.period_s > self.busy_lag_s:  # the sleep came back this late
                self.busy_until = now + self.hold_s


class Lead:
    """max_lead_s: seconds of audio a stream may run ahead of real time while `load` or `queue` is busy (0: no
    bound). `queue` also gives the heavy encoders their turns (server/speech.py)."""

    def __init__(self, load: LoopLoad, max_lead_s: float, queue: EncodeQueue | None = None) -> None:
        self.load, self.max_lead_s = load, max_lead_s
        self.queue = queue if queue is not None else EncodeQueue()

    @property
    def busy(self) -> bool:
        return self.load.busy or self.queue.busy

    def start(self) -> None:
        self.load.start()
        self.queue.start()

    def stop(self) -> None:
        self.load.stop()
        self.queue.stop()

    def delay(self, t_first: float, audio_s: float, now: float) -> float:
        """Seconds to wait before encoding more of a stream whose first chunk went at `t_first`, `audio_s` out."""
        if not self.max_lead_s or not self.busy:
            return 0.0
        ahead = audio_s - (now - t_first)
        return min(ahead - self.max_lead_s, MAX_WAIT_S) if ahead > self.max_lead_s else 0.0

    async def wait(self, t_first: float, audio_s: float) -> None:
        d = self.delay(t_first, audio_s, time.monotonic())
        if d > 0:
            await asyncio.sleep(d)
