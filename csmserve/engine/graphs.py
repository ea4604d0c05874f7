"""One CUDA graph per batch bucket covering a whole frame step (backbone, depth loop, sampling, codec)."""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .runner import ModelRunner, StepOutput


class FrameGraphs:
    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner
        self.buckets = runner.buckets
        dev, n = runner.device, runner.buckets[-1]
        K = runner.cfg.num_codebooks
        self.slot_ids = torch.full((n,), runner.scratch, dtype=torch.long, device=dev)  # static input
        # two host buffer sets: the host reads step N's results while step N+1 runs
        self.host_ids = [torch.full((n,), runner.scratch, dtype=torch.long).pin_memory() for _ in range(2)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple] = {}
        self.host_codes = [torch.zeros(n, K, dtype=torch.long).pin_memory() for _ in range(2)]
        fs = runner.codec.frame_size if runner.codec is not None else 0
        self.host_pcm = [torch.zeros(n, fs, dtype=torch.float32).pin_memory() if fs else None for _ in range(2)]
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

    def run(self, slots: list[int]) -> "StepOutput":
        from .runner import StepOutput

        # buffer set `flip` was last used two steps ago, whose event the caller has already waited on
        n, i = len(slots), self.flip
        self.flip ^= 1
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        ids, host_codes, host_pcm = self.host_ids[i], self.host_codes[i], self.host_pcm[i]
        ids[:n] = torch.tensor(slots)
        ids[n:b] = self.runner.scratch
        self.slot_ids[:b].copy_(ids[:b], non_blocking=True)
        self.graphs[b].replay()
        codes, pcm = self.outputs[b]
        host_codes[:n].copy_(codes[:n], non_blocking=True)
        if pcm is not None:
            host_pcm[:n].copy_(pcm[:n].float(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepOutput(list(slots), host_codes, host_pcm if pcm is not None else None, event)
