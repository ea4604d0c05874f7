"""One CUDA graph per batch bucket covering a whole frame step (backbone, depth loop, sampling, codec)."""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .runner import ModelRunner, StepOutput


class FrameGraphs:
    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner
        self.buckets = runner.buckets
        dev, n = runner.device, runner.buckets[-1]
        self.slot_ids = torch.full((n,), runner.scratch, dtype=torch.long, device=dev)  # static input
        # two host id buffers: the one written now was last read by the step before the previous one,
        # whose results the host has already waited for
        self.host_ids = [torch.full((n,), runner.scratch, dtype=torch.long).pin_memory() for _ in range(2)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple] = {}
        self.flip = 0
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                ids = self.slot_ids[:b]
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                    r.frame_step(ids, r.max_seq_len)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.outputs[b] = r.frame_step(ids, r.max_seq_len)
                pool = g.pool() if pool is None else pool
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, slots: np.ndarray, ring: int) -> "StepOutput":
        from .runner import StepOutput

        n, i = len(slots), self.flip
        self.flip ^= 1
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        ids = self.host_ids[i]
        ids.numpy()[:n] = slots
        ids[n:b] = self.runner.scratch
        self.slot_ids[:b].copy_(ids[:b], non_blocking=True)
        self.graphs[b].replay()
        codes, pcm = self.outputs[b]
        out = self.runner.ring
        host_codes = out.codes[ring]
        host_pcm = out.pcm[ring] if pcm is not None else None
        host_codes[:n].copy_(codes[:n], non_blocking=True)
        if pcm is not None:
            host_pcm[:n].copy_(pcm[:n].float(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepOutput(slots, host_codes, host_pcm, event, ring)
