"""One CUDA graph per batch bucket covering a whole frame step (backbone, depth loop, sampling, codec).

With `codec` (EngineConfig.codec_stream) the frame step is two graphs per bucket on two streams: the
generation (backbone, depth decoder, sampling) on the launching stream, then Mimi's decode of those codes
on a stream of its own, so the decode of frame t runs beside the generation of frame t+1 (at batch 1
both are chains of small kernels that leave most of the GPU idle). The protocol, per step:

    main:  wait(snapshot of step t-1) ; ids H2D ; generate graph ; codes D2H ; record gen_done[r]
    codec: wait(gen_done[r]) ; copy ids, codes into its own inputs ; record snapshot ;
           codec graph ; pcm D2H ; record done[r]

The codec stream reads the main stream's buffers only in its snapshot, and the main stream writes them
again only after that snapshot (its first wait); the codec's per-row state is touched only on the
codec stream (the runner resets rows there too). The two kinds of graph have separate memory pools:
they run at the same time.

With a LoRA pool the generation is captured twice per bucket, with the LoRA kernels and without: a step whose
rows have no adapter replays the plain one and pays nothing for the pool (the LoRA variant measured +35% at batch
1 with every row on the base: its kernels' tickets and counters). The variants share one pool and the decode.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from csmserve.engine.output_ring import OutputRing, StepOutput


class FrameGraphs:
    """step(slot_ids [b], lora) -> (codes [b, K], pcm [b, frame] | None): the runner's frame step, captured at
    every bucket b and each of `variants` (lora: the rows' adapters read, or no LoRA at all); its results copied
    into `ring` (host) after each replay. codec(codes [b, K], slot_ids [b]) -> pcm [b, frame]: given, step returns
    (codes, None) and the decode is captured apart, for `codec_stream`."""

    def __init__(self, step: Callable[[Tensor], tuple], buckets: list[int], scratch: int, ring: OutputRing,
                 device: torch.device, codec: Callable[[Tensor, Tensor], Tensor] | None = None,
                 codec_stream: torch.cuda.Stream | None = None, first: Callable[[Tensor], tuple] | None = None,
                 first_buckets: list[int] | None = None, variants: tuple[bool, ...] = (False,)) -> None:
        # first: a second step function (the runner's first frame from the prefill's h0), captured at first_buckets
        # (a prefix of buckets) on the same stream and pool as `step`, sharing the inputs and the decode graphs
        self.step, self.buckets, self.scratch, self.ring, self.variants = step, buckets, scratch, ring, variants
        self.first = first
        self.first_buckets = [b for b in (first_buckets or []) if b in buckets] if first is not None else []
        # keyed (bucket, lora)
        self.first_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.first_outputs: dict[tuple[int, bool], tuple] = {}
        self.codec, self.codec_stream = codec, codec_stream
        n = buckets[-1]
        self.slot_ids = torch.full((n,), scratch, dtype=torch.long, device=device)  # static input
        # two host id buffers: the one written now was last read by the step before the previous one,
        # whose results the host has already waited for
        self.host_ids = [torch.full((n,), scratch, dtype=torch.long).pin_memory() for _ in range(2)]
        # one completion event per ring buffer, recorded again each time its buffer is reused (the step
        # that used it last has been read by then): no allocation per step. Timed with the codec stream:
        # the pacer needs when the generation ended (StepOutput.codec_lag_s)
        timed = codec is not None
        self.events = [torch.cuda.Event(enable_timing=timed) for _ in range(ring.slots)]
        self.gen_events = [torch.cuda.Event(enable_timing=True) for _ in range(ring.slots)] if timed else None
        self.snapshot = torch.cuda.Event() if timed else None  # never recorded yet: a wait on it returns at once
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.codec_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], tuple] = {}
        self.pcm: dict[int, Tensor] = {}
        self.flip = 0
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        if stream == self.codec_stream:  # the pool handed the codec stream out again: capture on another
            stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                ids = self.slot_ids[:b]
                for v in self.variants:
                    for fn, graphs, outputs in [(self.step, self.graphs, self.outputs)] + (
                            [(self.first, self.first_graphs, self.first_outputs)] if b in self.first_buckets else []):
                        for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                            fn(ids, v)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, pool=pool, stream=stream):
                            outputs[b, v] = fn(ids, v)
                        pool = g.pool() if pool is None else pool
                        graphs[b, v] = g
        torch.cuda.current_stream().wait_stream(stream)
        if self.codec is not None:
            self._capture_codec()
        torch.cuda.synchronize()

    def _capture_codec(self) -> None:
        """The decode graphs, captured on the codec stream: cuBLAS gives each capturing stream its own workspace,
        and a graph keeps the one it was captured with, so the two kinds never share one while they run at the
        same time (captured on one stream, they did: GEMMs of 3+ rows came out wrong)."""
        pool, cs = None, self.codec_stream
        # the codec graphs' own static inputs, written only on the codec stream (codes: as the generation's)
        self.codec_ids = torch.full_like(self.slot_ids, self.scratch)
        self.codec_codes = torch.zeros_like(self.outputs[self.buckets[-1], self.variants[0]][0])
        cs.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(cs):
            for b in sorted(self.buckets, reverse=True):
                cids, ccodes = self.codec_ids[:b], self.codec_codes[:b]
                for _ in range(2):  # on the scratch row: no stream's state is touched
                    self.codec(ccodes, cids)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=cs):
                    self.pcm[b] = self.codec(ccodes, cids)
                pool = g.pool() if pool is None else pool
                self.codec_graphs[b] = g
        torch.cuda.current_stream().wait_stream(cs)

    def run(self, slots: np.ndarray, ring: int, first: bool = False, lora: bool = False) -> StepOutput:
        """first: replay the `first` step's graph where one was captured for the bucket, else the plain one.
        lora: some row has an adapter (the LoRA variant: captured only where `variants` has it)."""
        n, i = len(slots), self.flip
        self.flip ^= 1
        key = self.buckets[bisect.bisect_left(self.buckets, n)], lora
        b = key[0]
        first = first and key in self.first_graphs
        ids = self.host_ids[i]
        ids.numpy()[:n] = slots
        ids[n:b] = self.scratch
        main = torch.cuda.current_stream()
        if self.snapshot is not None:
            main.wait_event(self.snapshot)  # the codec stream has its copy of the last step's ids and codes
        self.slot_ids[:b].copy_(ids[:b], non_blocking=True)
        (self.first_graphs if first else self.graphs)[key].replay()
        codes, pcm = (self.first_outputs if first else self.outputs)[key]
        out = self.ring
        host_codes = out.codes[ring]
        host_pcm = out.pcm[ring] if pcm is not None or self.codec is not None else None
        host_codes[:n].copy_(codes[:n], non_blocking=True)
        event = self.events[ring]
        if self.codec is None:
            if pcm is not None:
                host_pcm[:n].copy_(pcm[:n], non_blocking=True)  # float32 already (frame_step)
            event.record()
            return StepOutput(slots, host_codes, host_pcm, event, ring)
        gen = self.gen_events[ring]
        gen.record()
        cs = self.codec_stream
        with torch.cuda.stream(cs):
            cs.wait_event(gen)
            self.codec_ids[:b].copy_(self.slot_ids[:b])
            self.codec_codes[:b].copy_(codes)
            self.snapshot.record()
            self.codec_graphs[b].replay()
            host_pcm[:n].copy_(self.pcm[b][:n], non_blocking=True)
            event.record()
        return StepOutput(slots, host_codes, host_pcm, event, ring, gen)
