"""GPU execution: admissions, batched prefill, and the frame step (graphed per bucket on CUDA).

The frame step reads each slot's next input frame from SlotState, runs one backbone position, the
codebook-0 sample and the 31-step depth loop, writes the generated frame back as the slot's next
input, and (with a codec) runs one batched Mimi streaming-decode step. No host sync inside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from ..models.csm import CSMModel
from ..models.fp8 import quantize_weights
from ..models.mimi import Mimi, MimiStream
from .request import Admission, PrefillChunk, PrefixStore
from .sampler import sample
from .slots import DepthKV, SlotKV, SlotState
from .speculate import RowParams, Speculator


class StreamingCodec(Protocol):
    frame_size: int

    def decode_step(self, codes: Tensor, rows: Tensor) -> Tensor: ...  # [B, K, 1], [B] -> [B, frame_size]

    def reset(self, rows: Tensor) -> None: ...


@dataclass
class StepOutput:
    """A frame step's results in pinned host memory; valid once `event` has completed."""

    slots: list[int]
    codes: Tensor  # [B, K] int64 (host, pinned on CUDA)
    pcm: Tensor | None  # [B, frame_size] float32
    event: torch.cuda.Event | None

    def done(self) -> bool:
        """Finished already (reading it will not wait)."""
        return self.event is None or self.event.query()

    def wait(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self.event is not None:
            self.event.synchronize()
        n = len(self.slots)
        return self.codes[:n].numpy(), None if self.pcm is None else self.pcm[:n].numpy()


class ModelRunner:
    def __init__(self, model: CSMModel, num_slots: int, max_seq_len: int, mimi: "Mimi | None" = None,
                 buckets: list[int] | None = None, use_graphs: bool | None = None, fuse: bool = True,
                 max_prefill_chunk: int = 512, spec_depth: int | None = None, weights: str = "bf16") -> None:
        quantize_weights(model, weights)  # EngineConfig.weights: fp8 swaps the GEMMs' weights in place
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        # one codec row per slot, plus the scratch row that padding points at
        self.codec: StreamingCodec | None = None if mimi is None else MimiStream(mimi, num_slots + 1, "decode", 1)
        self.cfg = model.cfg
        if self.device.type == "cuda":
            model.prepare_heads()
            if fuse:  # fused norm / RoPE / SwiGLU kernels: about a third fewer kernels per frame
                from ..models.llama import fuse_elementwise

                fuse_elementwise()
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.scratch = num_slots
        self.kv = SlotKV(self.cfg, num_slots, max_seq_len, self.dtype, self.device)
        # the prefix cache's tensors: key -> (k, v) [L, Hkv, n, hd]; the index is the scheduler's PrefixCache
        self.prefix_kv: dict[bytes, tuple[Tensor, Tensor]] = {}
        self.state = SlotState(self.cfg, num_slots, self.device)
        self.buckets = buckets or default_buckets(num_slots)
        # draft/verify over codebooks (EngineConfig.spec_depth; it brings its own, longer depth KV)
        self.spec = Speculator(model, spec_depth, self.buckets[-1]) if spec_depth else None
        self.depth_kv = self.spec.kv if self.spec else DepthKV(self.cfg, self.buckets[-1], self.dtype, self.device)
        self.depth_pos = torch.arange(self.cfg.num_codebooks, device=self.device)
        self.audio_mask = torch.tensor([True] * self.cfg.num_codebooks + [False], device=self.device)
        self.host_pos = np.zeros(num_slots + 1, dtype=np.int64)  # mirror of state.pos (torch path's kv bound)
        self.graphs = self.prefill_graphs = None
        if use_graphs if use_graphs is not None else self.device.type == "cuda":
            from .graphs import FrameGraphs
            from .prefill_graphs import PrefillGraphs

            self.graphs = FrameGraphs(self)
            self.prefill_graphs = PrefillGraphs(self, max_prefill_chunk)

    # ---- admissions and prefill (graphed for a few short chunks, else eager) ----
    def admit(self, admissions: list[Admission]) -> None:
        """New requests: load each slot's first input, position and sampling params; reset its codec row;
        copy a cached prompt prefix's KV into the slot's first positions (device to device)."""
        self._load(admissions, reset=True)
        for a in admissions:
            if a.prefix_hit is not None:
                k, v = self.prefix_kv[a.prefix_hit]
                n = k.shape[2]
                self.kv.k[:, a.slot, :, :n].copy_(k)
                self.kv.v[:, a.slot, :, :n].copy_(v)

    def store_prefixes(self, stores: list[PrefixStore]) -> None:
        """After the prefill: drop evicted entries, keep copies of slots' KV[:, :n] (no host sync)."""
        for st in stores:
            for key in st.evict:
                self.prefix_kv.pop(key, None)
            self.prefix_kv[st.key] = (self.kv.k[:, st.slot, :, :st.n].clone(),
                                      self.kv.v[:, st.slot, :, :st.n].clone())

    @property
    def prefix_kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.prefix_kv.values())

    def resume(self, resumes: list[Admission]) -> None:
        """Long-form continuations: the same loads, but the codec row (the audio runs on without a seam)
        and the frame counter (the sampling noise stream) carry over."""
        self._load(resumes, reset=False)

    def _load(self, admissions: list[Admission], reset: bool) -> None:
        if not admissions:
            return
        s = self.state
        slots = torch.tensor([a.slot for a in admissions], device=self.device)
        host = {
            "next_tokens": torch.tensor(np.stack([a.first_tokens for a in admissions]), dtype=torch.long),
            "next_mask": torch.tensor(np.stack([a.first_mask for a in admissions]), dtype=torch.bool),
            "pos": torch.tensor([a.first_pos for a in admissions], dtype=torch.long),
            "temperature": torch.tensor([a.temperature for a in admissions], dtype=torch.float32),
            "top_k": torch.tensor([a.top_k for a in admissions], dtype=torch.long),
            "top_p": torch.tensor([a.top_p for a in admissions], dtype=torch.float32),
            "seed": torch.tensor([a.seed for a in admissions], dtype=torch.long),
        }
        if reset:
            host["frame"] = torch.zeros(len(admissions), dtype=torch.long)
        for name, value in host.items():
            getattr(s, name).index_copy_(0, slots, value.to(self.device, non_blocking=True))
        for a in admissions:
            self.host_pos[a.slot] = a.first_pos
        if reset and self.codec is not None:
            self.codec.reset(slots)

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> None:
        if not chunks:
            return
        key = None if self.prefill_graphs is None else self.prefill_graphs.bucket(chunks)
        if key is not None:  # a few short chunks: one graph replay instead of hundreds of launches
            self.prefill_graphs.run(chunks, key)
            return
        C, S = len(chunks), max(len(c.tokens) for c in chunks)
        W = self.cfg.frame_width
        tokens = np.zeros((C, S, W), dtype=np.int64)
        mask = np.zeros((C, S, W), dtype=bool)
        pos = np.zeros((C, S), dtype=np.int64)
        slot_tok = np.full((C, S), self.scratch, dtype=np.int64)
        for i, c in enumerate(chunks):
            n = len(c.tokens)
            tokens[i, :n], mask[i, :n] = c.tokens, c.mask
            pos[i, :n] = np.arange(c.start, c.start + n)
            slot_tok[i, :n] = c.slot
        bound = max(c.start + len(c.tokens) for c in chunks)
        dev = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        self.kv.set_prefill(dev(slot_tok), bound)
        self.model.forward_backbone(dev(tokens), dev(mask), dev(pos), self.kv)

    # ---- the frame step ----
    def frame_step(self, slot_ids: Tensor, kv_bound: int) -> tuple[Tensor, Tensor | None]:
        """slot_ids [B] (padding = scratch slot) -> codes [B, K], pcm [B, frame_size] | None."""
        s, m = self.state, self.model
        pos = s.pos[slot_ids]  # [B]
        x = m.embed_frames(s.next_tokens[slot_ids][:, None], s.next_mask[slot_ids][:, None])  # [B, 1, D]
        self.kv.set_decode(slot_ids, kv_bound)
        h = m.backbone(x, pos[:, None], self.kv)[:, 0]  # [B, D]
        temp, top_k, top_p = s.temperature[slot_ids], s.top_k[slot_ids], s.top_p[slot_ids]
        seed, frame = s.seed[slot_ids], s.frame[slot_ids]
        n = self.cfg.sampleable_codes

        def sampler(logits: Tensor, codebook: int) -> Tensor:
            return sample(logits[:, :n], temp, top_k, top_p, seed, frame, codebook)

        live = slot_ids != self.scratch
        if self.spec is not None:
            codes = self.spec.decode_frame(h, sampler, RowParams(temp, top_k, top_p, seed, frame), live)
        else:
            codes = m.decode_frame(h, sampler, self.depth_kv, self.depth_pos)  # [B, K]
        s.next_tokens[slot_ids] = torch.cat([codes, torch.zeros_like(codes[:, :1])], 1)
        s.next_mask[slot_ids] = self.audio_mask.expand(len(slot_ids), -1)
        s.pos[slot_ids] = torch.where(live, (pos + 1).clamp(max=self.max_seq_len - 1), 0)
        s.frame[slot_ids] = torch.where(live, frame + 1, 0)
        pcm = None if self.codec is None else self.codec.decode_step(codes[:, :, None], slot_ids)
        return codes, pcm

    @torch.inference_mode()
    def step(self, slots: list[int]) -> StepOutput | None:
        if not slots:
            return None
        bound = int(self.host_pos[slots].max()) + 1
        self.host_pos[slots] += 1
        if self.graphs is not None:
            return self.graphs.run(slots)
        codes, pcm = self.frame_step(torch.tensor(slots, device=self.device), bound)
        return StepOutput(slots, codes.cpu(), None if pcm is None else pcm.float().cpu(), None)


def default_buckets(num_slots: int) -> list[int]:
    out, b = [], 1
    while b < num_slots:
        out.append(b)
        b *= 2
    return out + [num_slots]
