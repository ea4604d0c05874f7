"""Where a frame step's results land on the host: a ring of output buffers, one per step in flight.

codes [R, B, K] int64 and pcm [R, B, frame_size] float32 (B = the largest batch), plus a header
[R] int64 holding the id of the step last launched into each buffer. On CUDA the buffers are pinned,
so the step's device-to-host copies are asynchronous. With `path` they live in a shared-memory file
(engine-core process): API workers map the same file (`OutputRing.attach`: the buffers read-only) and
read their rows of step s from buffer `ring` after the engine's message for s, then check the header
still says s (the buffer is reused R steps later: a worker that far behind sees the mismatch, never
torn data). Each worker then writes s into its entry of `acks` [READERS] int64 (the file's first
region): before the engine launches a step into a buffer it checks that every worker that had rows in
the buffer's last step has read them (`lagging`), and waits for one that has not (engine.py).
"""
from __future__ import annotations

import mmap
import os

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


READERS = 1024  # ack entries: a worker's is client_id % READERS (ids are unique per start)


def _layout(slots: int, rows: int, K: int, frame_size: int) -> list[tuple[str, tuple, np.dtype]]:
    out = [("acks", (READERS,), np.dtype(np.int64)), ("header", (slots,), np.dtype(np.int64)),
           ("codes", (slots, rows, K), np.dtype(np.int64))]
    if frame_size:
        out.append(("pcm", (slots, rows, frame_size), np.dtype(np.float32)))
    return out


def _nbytes(layout) -> int:
    return sum(int(np.prod(shape)) * dt.itemsize for _, shape, dt in layout)


class OutputRing:
    def __init__(self, slots: int, rows: int, K: int, frame_size: int, cuda: bool = False,
                 path: str | None = None) -> None:
        self.slots, self.rows, self.K, self.frame_size, self.path = slots, rows, K, frame_size, path
        layout = _layout(slots, rows, K, frame_size)
        self._registered = None
        if path is None:
            mk = (lambda shape, dt: torch.zeros(shape, dtype=dt, pin_memory=cuda))
            self.acks = np.zeros(READERS, np.int64)
            self.header = np.zeros(slots, np.int64)
            self.codes = mk((slots, rows, K), torch.int64)
            self.pcm = mk((slots, rows, frame_size), torch.float32) if frame_size else None
        else:
            size = _nbytes(layout)
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            views = _views(self._mm, layout)
            self.acks, self.header = views["acks"], views["header"]
            self.codes = torch.from_numpy(views["codes"])
            self.pcm = torch.from_numpy(views["pcm"]) if frame_size else None
            if cuda:  # page-locked for asynchronous device-to-host copies straight into shared memory
                ptr = self.acks.ctypes.data  # the mapping's start (acks first)
                err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister of the output ring failed ({err})")
                self._registered = ptr
        self.header[:] = -1
        self.acks[:] = -1
        self.readers: list[tuple[int, ...]] = [()] * slots  # [R] the clients that had rows in each buffer's step
        self._next = 0

    def next(self) -> int:
        """The buffer the next step writes into."""
        i = self._next
        self._next = (i + 1) % self.slots
        return i

    def upcoming_step(self) -> int:
        """The step whose results the next step overwrites (-1: none yet)."""
        return int(self.header[self._next])

    def lagging(self) -> list[int]:
        """The clients that have not yet read their rows of that step (their acks behind it)."""
        r = self._next
        step = self.header[r]
        return [c for c in self.readers[r] if self.acks[c % READERS] < step]

    def forget(self, client: int) -> None:
        """A client that left: it never lags (until a client with the same entry acks a step)."""
        self.acks[client % READERS] = np.iinfo(np.int64).max

    def caught_up(self, client: int, step: int) -> bool:
        """The client has read its rows of every step up to `step`."""
        return bool(self.acks[client % READERS] >= step)

    def close(self) -> None:
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        if self.path is not None:
            self.header = self.codes = self.pcm = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def spec(self) -> dict:
        """What a worker needs to attach."""
        return {"path": self.path, "slots": self.slots, "rows": self.rows, "K": self.K, "frame_size": self.frame_size}

    @staticmethod
    def attach(spec: dict) -> dict[str, np.ndarray]:
        """Numpy views of an engine's ring file: header, codes, pcm read-only; acks (a worker writes its
        own entry)."""
        layout = _layout(spec["slots"], spec["rows"], spec["K"], spec["frame_size"])
        with open(spec["path"], "r+b") as f:
            mm = mmap.mmap(f.fileno(), _nbytes(layout), access=mmap.ACCESS_WRITE)
        views = _views(mm, layout)
        for name, v in views.items():
            if name != "acks":
                v.flags.writeable = False
        return views


def _views(mm: mmap.mmap, layout) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for name, shape, dt in layout:
        n = int(np.prod(shape))
        out[name] = np.frombuffer(mm, dtype=dt, count=n, offset=off).reshape(shape)
        off += n * dt.itemsize
    return out


@dataclass
class StepOutput:
    """A frame step's results in host memory (ring buffer `ring`); valid once `event` has completed."""

    slots: np.ndarray  # [B] the decode slots, in row order
    codes: Tensor  # [B, K] int64 (host)
    pcm: Tensor | None  # [B, frame_size] float32
    event: torch.cuda.Event | None
    ring: int = -1
    # with the codec on its own stream (engine/graphs.py): the generation's end, before Mimi's decode
    gen_event: torch.cuda.Event | None = None

    def codec_lag_s(self) -> float:
        """Once done: how long after the generation the decode ended (0 without a codec stream). The next
        step's generation may start at the generation's end, so that is what the launch pacer aims at."""
        if self.gen_event is None or self.event is None:
            return 0.0
        return max(0.0, self.gen_event.elapsed_time(self.event) / 1e3)

    def done(self) -> bool:
        """Finished already (reading it will not wait)."""
        return self.event is None or self.event.query()

    def wait(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self.event is not None:
            self.event.synchronize()
        n = len(self.slots)
        return self.codes[:n].numpy(), None if self.pcm is None else self.pcm[:n].numpy()
