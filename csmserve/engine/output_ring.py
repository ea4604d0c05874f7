"""Where a frame step's results land on the host: a ring of output buffers, one per step in flight.

codes [R, B, K] int64 and pcm [R, B, frame_size] float32 (B = the largest batch), plus a header
[R] int64 holding the id of the step last launched into each buffer. On CUDA the buffers are pinned,
so the step's device-to-host copies are asynchronous. With `path` they live in a shared-memory file
(engine-core process): API workers map the same file read-only (`OutputRing.attach`) and read their
rows of step s from buffer `ring` after the engine's message for s, then check the header still says
s (the buffer is reused R steps later: a worker that far behind sees the mismatch, never torn data).
"""
from __future__ import annotations

import mmap
import os

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def _layout(slots: int, rows: int, K: int, frame_size: int) -> list[tuple[str, tuple, np.dtype]]:
    out = [("header", (slots,), np.dtype(np.int64)), ("codes", (slots, rows, K), np.dtype(np.int64))]
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
            self.header = views["header"]
            self.codes = torch.from_numpy(views["codes"])
            self.pcm = torch.from_numpy(views["pcm"]) if frame_size else None
            if cuda:  # page-locked for asynchronous device-to-host copies straight into shared memory
                ptr = self.codes.data_ptr() - 8 * slots  # the mapping's start (header first)
                err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister of the output ring failed ({err})")
                self._registered = ptr
        self.header[:] = -1
        self._next = 0

    def next(self) -> int:
        """The buffer the next step writes into."""
        i = self._next
        self._next = (i + 1) % self.slots
        return i

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
        """Read-only numpy views of an engine's ring file: header, codes, pcm."""
        layout = _layout(spec["slots"], spec["rows"], spec["K"], spec["frame_size"])
        with open(spec["path"], "rb") as f:
            mm = mmap.mmap(f.fileno(), _nbytes(layout), access=mmap.ACCESS_READ)
        return _views(mm, layout)


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

    def done(self) -> bool:
        """Finished already (reading it will not wait)."""
        return self.event is None or self.event.query()

    def wait(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self.event is not None:
            self.event.synchronize()
        n = len(self.slots)
        return self.codes[:n].numpy(), None if self.pcm is None else self.pcm[:n].numpy()
