"""CUDA graphs of the prefill, one per packed-token count: many short prompts in one replay.

A step's prefill chunks (any number, each a slot's next prompt positions) are packed as rows of one
[T, 2W + 2] input (runner.pack_prefill: tokens, mask, position, slot), padded to the next bucket T
(16, 32, ... up to the step's token budget); each row attends to its slot's keys up to its position
through the frame step's attention kernel, so the shape depends on T alone. An eager prefill of a
12-frame prompt costs ~15 ms of launches on the H200 (16 layers x ~15 ops, the GPU mostly idle);
replayed from a graph it costs its weight reads and compute. With a LoRA pool each T is captured with the LoRA
kernels and without (`variants`, as engine/graphs.py's frame step): chunks without an adapter pay nothing for it.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from torch import Tensor

from csmserve.engine.buckets import bucket_sizes


class PrefillGraphs:
    """forward(packed [T, 2W + 2], lora): the runner's packed prefill, captured at every token bucket T and each of
    `variants` over `packed_input` (the staging buffer's device side, the graphs' static input)."""

    def __init__(self, forward: Callable[[Tensor, bool], None], packed_input: Tensor, scratch: int, max_tokens: int,
                 variants: tuple[bool, ...] = (False,)) -> None:
        self.forward, self.variants = forward, variants
        self.buckets = bucket_sizes(max_tokens, smallest=16)
        self.input = packed_input  # static input [max_tokens, 2W + 2]
        self.input.zero_()
        self.input[:, -1] = scratch  # warm-up and capture write only the scratch slot
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (T, lora)
        self.capture()

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    @torch.inference_mode()
    def capture(self) -> None:
        pool, stream = None, torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for T in sorted(self.buckets, reverse=True):
                for v in self.variants:
                    for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                        self.forward(self.input[:T], v)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        self.forward(self.input[:T], v)
                    pool = g.pool() if pool is None else pool
                    self.graphs[T, v] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, packed: Tensor, lora: bool = False) -> None:
        """packed: the staging buffer's first T rows (T a bucket), already holding this step's rows. lora: some
        chunk has an adapter."""
        assert packed.data_ptr() == self.input.data_ptr()
        self.graphs[packed.shape[0], lora].replay()
