"""Host -> device inputs without a host sync: a ring of pinned host buffers and one device buffer.

`put(a)` copies a numpy array [n, F] into the next pinned host buffer and issues one asynchronous
copy into the device buffer's first n rows, returning that view. A host buffer is reused only once
the copy that read it has run (an event per buffer, `depth` steps old: in practice never waited on).
Everything is allocated once; a `put` larger than the buffer raises (size it for the worst case).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class Staging:
    def __init__(self, rows: int, width: int, device: torch.device, dtype: torch.dtype = torch.int64,
                 depth: int = 4) -> None:
        self.rows, self.width, self.device = rows, width, device
        cuda = device.type == "cuda"
        self.host = [torch.zeros(rows, width, dtype=dtype, pin_memory=cuda) for _ in range(depth if cuda else 1)]
        self.dev = torch.zeros(rows, width, dtype=dtype, device=device)
        # one per host buffer, recorded again at each reuse (one never recorded: synchronize() returns at once)
        self.events = [torch.cuda.Event() for _ in self.host] if cuda else []
        self._i = 0

    def put(self, a: np.ndarray) -> Tensor:
        """a [n, width] (n <= rows) -> the device view [n, width] it will hold (stream-ordered)."""
        n = a.shape[0]
        if n > self.rows or a.shape[1] != self.width:
            raise ValueError(f"staging holds [{self.rows}, {self.width}], got {a.shape}")
        if self.device.type != "cuda":
            self.dev[:n].copy_(torch.from_numpy(np.ascontiguousarray(a)))
            return self.dev[:n]
        i = self._i
        self._i = (i + 1) % len(self.host)
        self.events[i].synchronize()  # the copy that last read this buffer has run (depth steps ago)
        host = self.host[i]
        host.numpy()[:n] = a
        self.dev[:n].copy_(host[:n], non_blocking=True)
        self.events[i].record()
        return self.dev[:n]
