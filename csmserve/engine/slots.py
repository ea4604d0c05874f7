"""The slot pool: every per-stream tensor the frame step reads or writes, indexed by slot.

Slot `num_slots` (one past the last) is scratch: padding rows of a batch bucket point at it, so a
padded graph replay never touches a live stream. Everything is allocated once.
"""
from __future__ import annotations

import torch
from torch import Tensor

from csmserve.kernels.decode_attention import decode_attention_torch, decode_attention_triton
from csmserve.models.csm import CSMConfig
from csmserve.models.llama import KVView


def store_kv_triton(k_cache: Tensor, v_cache: Tensor, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
    from csmserve.kernels.elementwise import store_kv_triton as store  # lazy: triton comes with CUDA builds only

    store(k_cache, v_cache, rows, pos, k, v)


class SlotKV(KVView):
    """Backbone KV k, v [L, N+1, Hkv, T, hd]; the KVView of frame steps and of packed prefills: each row
    (a slot's next frame, or one prompt token) writes its K/V at (slot, position), then attends to its
    slot's keys up to that position (so a prompt's tokens see each other, written in the same layer)."""

    def __init__(self, cfg: CSMConfig, num_slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        c = cfg.backbone
        shape = (c.n_layers, num_slots + 1, c.n_kv_heads, max_seq_len, c.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.use_triton = device.type == "cuda" and c.head_dim >= 16  # the kernel's tl.dot needs hd >= 16
        self.slot_tok = self.pos = self.lengths = self.given_lengths = None
        self.kv_bound = max_seq_len  # torch path: keys read per row (host-known upper bound)

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def bytes_per_position(self) -> int:
        """k and v of one position of one slot, all layers (a prefix-cache entry's size per position)."""
        return 2 * self.k[:, 0, :, 0].numel() * self.k.element_size()

    def set_decode(self, slot_ids: Tensor, kv_bound: int, lengths: Tensor | None = None) -> None:
        # slot_ids [B]: each row's slot; the rows' positions come through begin(); lengths [B] int32: their
        # positions + 1 where the caller has them (the frame step's prologue kernel), else begin() computes them
        self.slot_tok, self.kv_bound, self.given_lengths = slot_ids, kv_bound, lengths

    def begin(self, pos: Tensor) -> None:
        self.pos = pos  # [B, 1]
        given, self.given_lengths = self.given_lengths, None
        self.lengths = given if given is not None else (pos[:, 0] + 1).to(torch.int32)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kc, vc = self.k[layer], self.v[layer]  # q [B, 1, Hq, hd]
        if self.use_triton:
            store_kv_triton(kc, vc, self.slot_tok, self.pos[:, 0], k[:, 0], v[:, 0])
            out = decode_attention_triton(q[:, 0], kc, vc, self.slot_tok, self.lengths)
        else:
            kc[self.slot_tok, :, self.pos[:, 0]] = k[:, 0]
            vc[self.slot_tok, :, self.pos[:, 0]] = v[:, 0]
            out = decode_attention_torch(q[:, 0], kc, vc, self.slot_tok, self.lengths, self.kv_bound)
        return out[:, None]


class DepthKV(KVView):
    """The depth decoder's one-frame cache k, v [L, B, Hkv, K, hd], rewritten every frame (batch-local:
    nothing crosses a frame boundary, so no slot indexing). On CUDA (head_dim >= 16) a one-query step is
    kernels/depth_attention.py's one kernel (RoPE + K/V store + attention), and so is the frame's first step
    (positions 0 and 1, static); elsewhere torch (SDPA)."""

    def __init__(self, cfg: CSMConfig, batch: int, dtype: torch.dtype, device: torch.device,
                 static_pos: Tensor | None = None) -> None:
        d = cfg.decoder
        # static_pos: the depth steps' positions, written by no kernel of a frame: a step whose pos is a view of it
        # reads it before the fused kernel's PDL wait (kernels/depth_attention.py, pos_static)
        self.static_pos = static_pos
        self.pos_static = False
        shape = (d.n_layers, batch, d.n_kv_heads, cfg.num_codebooks, d.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.rows = torch.arange(batch, device=device)
        self.fused = device.type == "cuda" and d.head_dim >= 16  # the kernels' tl.dot needs hd >= 16
        self.first_static = False
        self.pos = self.mask = None

    def begin(self, pos: Tensor) -> None:
        self.pos = pos  # [B, S]
        self.pos_static = self.static_pos is not None and (pos._base if pos._base is not None else pos) is self.static_pos
        # the frame's first step, positions 0 and 1 (a view of static_pos[:2]): kernels/depth_attention.py's
        # depth_attend_first_triton, no mask
        self.first_static = (self.fused and self.pos_static and pos.shape[1] == 2 and pos.storage_offset() == 0
                             and pos.stride(1) == self.static_pos.stride(0))
        if not (self.first_static or (self.fused and pos.shape[1] == 1)):
            keys = torch.arange(self.k.shape[3], device=pos.device)
            self.mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, S, K]

    def attend_qkv(self, layer: int, qkv: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int) -> Tensor | None:
        """KVView.attend_qkv: kernels/depth_attention.py when fused and S == 1, or S == 2 at positions 0 and 1."""
        if self.first_static and qkv.shape[1] == 2:
            from csmserve.kernels.depth_attention import depth_attend_first_triton

            return depth_attend_first_triton(qkv, cos, sin, self.k[layer], self.v[layer], n_q, n_kv)
        if not self.fused or qkv.shape[1] != 1:
            return None
        from csmserve.kernels.depth_attention import depth_attend_triton

        out = depth_attend_triton(qkv[:, 0], self.pos[:, 0], cos, sin, self.k[layer], self.v[layer], n_q, n_kv,
                                  self.pos_static)
        return out[:, None]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # the torch path: the CPU, head_dim < 16, or two positions that are not the frame's static first two
        B, S = q.shape[:2]
        rows = self.rows[:B]
        kc, vc = self.k[layer], self.v[layer]
        kc[rows[:, None], :, self.pos] = k
        vc[rows[:, None], :, self.pos] = v
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kc[:B], vc[:B], attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2)


class SlotState:
    """Per-slot inputs of the next frame step and sampling parameters, all [N+1, ...] on the device."""

    def __init__(self, cfg: CSMConfig, num_slots: int, device: torch.device) -> None:
        n, w = num_slots + 1, cfg.frame_width
        self.next_tokens = torch.zeros(n, w, dtype=torch.long, device=device)  # [N+1, 33]
        self.next_mask = torch.zeros(n, w, dtype=torch.bool, device=device)
        self.pos = torch.zeros(n, dtype=torch.long, device=device)  # position of next_tokens
        self.frame = torch.zeros(n, dtype=torch.long, device=device)  # frames generated (sampling counter)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.long, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.seed = torch.zeros(n, dtype=torch.long, device=device)
        self.adapter = torch.full((n,), -1, dtype=torch.long, device=device)  # LoRA pool slot (-1: none)


def size_slots(model: torch.nn.Module, mimi: torch.nn.Module | None, max_seq_len: int,
               memory_fraction: float = 0.85, cap: int = 4096, reserve_bytes: int = 0,
               free_bytes: int | None = None) -> int:
    """Slots that fit in free device memory (CUDA; `free_bytes` if given: a share of the GPU), leaving room
    for graphs' activations and `reserve_bytes` (the prefix cache); 8 on the CPU."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return 8
    cfg = model.cfg
    c = cfg.backbone
    kv = 2 * c.n_layers * c.n_kv_heads * max_seq_len * c.head_dim * p.element_size()
    codec = 0
    if mimi is not None:
        from csmserve.models.mimi import MimiStream

        codec = sum(b[0].numel() * b.element_size() for b in MimiStream(mimi, 1, "decode", 1).bufs.values())
    free = torch.cuda.mem_get_info(p.device)[0] if free_bytes is None else free_bytes
    free = max(0, free - reserve_bytes)
    return max(1, min(cap, int(free * memory_fraction) // (kv + codec + 64 * 1024)))
