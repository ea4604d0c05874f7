"""One CUDA graph per batch bucket covering a whole frame step (backbone, depth loop, sampling, codec)."""
from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from csmserve.engine.output_ring import OutputRing, StepOutput


class FrameGraphs:
    """step(slot_ids [b]) -> (codes [b, K], pcm [b, frame] | None): the runner's frame step, captured at
    every bucket b; its results copied into `ring` (host) after each replay."""

    def __init__(self, step: Callable[[Tensor], tuple], buckets: list[int], scratch: int, ring: OutputRing,
                 device: torch.device) -> None:
        self.step, self.buckets, self.scratch, self.ring = step, buckets, scratch, ring
        n = buckets[-1]
        self.slot_ids = torch.full((n,), scratch, dtype=torch.long, device=device)  # static input
        # two host id buffers: the one written now was last read by the step before the previous one,
        # whose results the host has already waited for
        self.host_ids = [torch.full((n,), scratch, dtype=torch.long).pin_memory() for _ in range(2)]
        # one completion event per ring buffer, recorded again each time its buffer is reused (the step
        # that used it last has been read by then): no allocation per step
        self.events = [torch.cuda.Event() for _ in range(ring.slots)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple] = {}
        self.flip = 0
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                ids = self.slot_ids[:b]
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                    self.step(ids)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.outputs[b] = self.step(ids)
                pool = g.pool() if pool is None else pool
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, slots: np.ndarray, ring: int) -> StepOutput:
        n, i = len(slots), self.flip
        self.flip ^= 1
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        ids = self.host_ids[i]
        ids.numpy()[:n] = slots
        ids[n:b] = self.scratch
        self.slot_ids[:b].copy_(ids[:b], non_blocking=True)
        self.graphs[b].replay()
        codes, pcm = self.outputs[b]
        out = self.ring
        host_codes = out.codes[ring]
        host_pcm = out.pcm[ring] if pcm is not None else None
        host_codes[:n].copy_(codes[:n], non_blocking=True)
        if pcm is not None:
            host_pcm[:n].copy_(pcm[:n], non_blocking=True)  # float32 already (frame_step)
        event = self.events[ring]
        event.record()
        return StepOutput(slots, host_codes, host_pcm, event, ring)
