"""CUDA graphs of the prefill for a few short chunks: time to first audio without hundreds of launches.

An eager prefill of a 12-frame prompt costs ~15 ms of launches on the H200 (16 layers x ~15 ops, the
GPU mostly idle); replayed from a graph it costs its weight reads (~1 ms). Shapes are bucketed:
chunks C in (1, 2, 4), chunk length S in powers of two up to max_prefill_chunk, and keys read T = S
(every chunk starts at position 0: a fresh prompt) or max_seq_len (a continuation or a prefix-cache
hit). Padding follows the eager prefill: padded tokens write to the scratch slot at position 0.

Inputs travel as one packed int64 array [C, S, 2W + 2] (tokens, mask, position, slot) through a
pinned staging tensor (torch's host allocator keeps it until the copy is done): no host sync.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from .request import PrefillChunk

if TYPE_CHECKING:
    from .runner import ModelRunner

CHUNK_BUCKETS = (1, 2, 4)


def length_buckets(max_len: int, smallest: int = 16) -> list[int]:
    out, s = [], smallest
    while s < max_len:
        out.append(s)
        s *= 2
    return out + [max_len]


def pack(chunks: list[PrefillChunk], C: int, S: int, width: int, scratch: int) -> np.ndarray:
    """[C, S, 2W + 2] int64: tokens, mask, position, slot; padding -> scratch slot, position 0."""
    a = np.zeros((C, S, 2 * width + 2), np.int64)
    a[..., -1] = scratch
    for i, c in enumerate(chunks):
        n = len(c.tokens)
        a[i, :n, :width] = c.tokens
        a[i, :n, width:2 * width] = c.mask
        a[i, :n, -2] = np.arange(c.start, c.start + n)
        a[i, :n, -1] = c.slot
    return a


class PrefillGraphs:
    def __init__(self, runner: "ModelRunner", max_chunk: int) -> None:
        self.runner = runner
        self.width = runner.cfg.frame_width
        self.lengths = length_buckets(min(max_chunk, runner.max_seq_len))
        self.inputs: dict[tuple[int, int], Tensor] = {}  # (C, S) -> static packed input [C, S, 2W+2]
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}  # (C, S, T)
        self.capture()

    def bucket(self, chunks: list[PrefillChunk]) -> tuple[int, int, int] | None:
        """The graph for these chunks, or None (too many or too long: the eager prefill takes them)."""
        n, longest = len(chunks), max(len(c.tokens) for c in chunks)
        if n > CHUNK_BUCKETS[-1] or longest > self.lengths[-1]:
            return None
        C = CHUNK_BUCKETS[bisect.bisect_left(CHUNK_BUCKETS, n)]
        S = self.lengths[bisect.bisect_left(self.lengths, longest)]
        fresh = all(c.start == 0 for c in chunks)
        return C, S, S if fresh else self.runner.max_seq_len

    def _forward(self, packed: Tensor, T: int) -> None:
        r, W = self.runner, self.width
        tokens, mask, pos, slot_tok = packed[..., :W], packed[..., W:2 * W].bool(), packed[..., -2], packed[..., -1]
        r.kv.set_prefill(slot_tok, T)
        r.model.forward_backbone(tokens, mask, pos, r.kv)

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        pool, stream = None, torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for C in CHUNK_BUCKETS:
                for S in self.lengths:
                    packed = torch.zeros(C, S, 2 * self.width + 2, dtype=torch.long, device=r.device)
                    packed[..., -1] = r.scratch  # warm-up and capture write only the scratch slot
                    self.inputs[C, S] = packed
                    for T in sorted({S, r.max_seq_len}):
                        for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                            self._forward(packed, T)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, pool=pool, stream=stream):
                            self._forward(packed, T)
                        pool = g.pool() if pool is None else pool
                        self.graphs[C, S, T] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, chunks: list[PrefillChunk], key: tuple[int, int, int]) -> None:
        C, S, T = key
        host = torch.from_numpy(pack(chunks, C, S, self.width, self.runner.scratch)).pin_memory()
        self.inputs[C, S].copy_(host, non_blocking=True)
        self.graphs[key].replay()
