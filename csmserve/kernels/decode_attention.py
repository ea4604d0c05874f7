"""Decode attention over slot-indexed KV: one query per row, each row reading only its own context.

`decode_attention(q, k_cache, v_cache, slot_ids, lengths)`:
  q [B, Hq, hd]; k_cache/v_cache [N, Hkv, T, hd] (one layer of the slot pool); slot_ids/lengths [B] int
  (row b attends to keys 0..lengths[b]-1 of slot slot_ids[b]) -> [B, Hq, hd].

On CUDA a Triton split-K kernel (flash-decoding): grid (B, Hkv, splits), each program loops over
key blocks up to the row's length read on the device, so cost follows the real context and the
launch is CUDA-graph safe. Elsewhere a torch reference over the first `max_len` keys.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def decode_attention_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, lengths: Tensor,
                           max_len: int) -> Tensor:
    k = k_cache[slot_ids, :, :max_len]  # [B, Hkv, L, hd]
    v = v_cache[slot_ids, :, :max_len]
    mask = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None], enable_gqa=True)
    return out[:, :, 0]


_triton_kernels = None


def _kernels():  # lazy: triton is only present with CUDA builds of torch
    global _triton_kernels
    if _triton_kernels is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _split_kernel(Q, K, V, SLOT, LEN, O_PART, M_PART, L_PART, scale,
                          s_kn, s_kh, s_kt, s_vn, s_vh, s_vt,
                          G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                          SPLITS: tl.constexpr, IEEE: tl.constexpr):
            b = tl.program_id(0)
            h = tl.program_id(1)  # kv head
            sp = tl.program_id(2)
            slot = tl.load(SLOT + b).to(tl.int64)
            length = tl.load(LEN + b)
            per = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
            lo = sp * per
            hi = tl.minimum(lo + per, length)
            g = tl.arange(0, GP)  # the group's q heads, padded to the 16 rows tl.dot needs
            g_ok = g < G
            d = tl.arange(0, HD)
            n_q_heads = tl.num_programs(1) * G
            q_rows = b * n_q_heads + h * G + g  # [GP]
            q = tl.load(Q + q_rows[:, None] * HD + d[None, :], mask=g_ok[:, None], other=0.0)  # [GP, HD]
            m = tl.full([GP], float("-inf"), tl.float32)
            l = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, HD], tl.float32)
            k_base = K + slot * s_kn + h * s_kh
            v_base = V + slot * s_vn + h * s_vh
            for start in range(lo, hi, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                valid = n < hi
                k = tl.load(k_base + n[:, None] * s_kt + d[None, :], mask=valid[:, None], other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GP, BLOCK_N]
                else:
                    s = tl.dot(q, tl.trans(k)) * scale
                s = tl.where(valid[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                v = tl.load(v_base + n[:, None] * s_vt + d[None, :], mask=valid[:, None], other=0.0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                l = l * alpha + tl.sum(p, 1)
                m = m_new
            if SPLITS == 1:  # the whole row in one program: normalise and write the output directly
                out = acc / l[:, None]
                tl.store(O_PART + q_rows[:, None] * HD + d[None, :], out.to(O_PART.dtype.element_ty),
                         mask=g_ok[:, None])
            else:
                part = q_rows * SPLITS + sp  # [GP]
                tl.store(O_PART + part[:, None] * HD + d[None, :], acc, mask=g_ok[:, None])
                tl.store(M_PART + part, m, mask=g_ok)
                tl.store(L_PART + part, l, mask=g_ok)

        @triton.jit
        def _reduce_kernel(O_PART, M_PART, L_PART, OUT, HD: tl.constexpr, SPLITS: tl.constexpr):
            r = tl.program_id(0)  # b * Hq + head
            s = tl.arange(0, SPLITS)
            d = tl.arange(0, HD)
            m = tl.load(M_PART + r * SPLITS + s)
            l = tl.load(L_PART + r * SPLITS + s)
            m_max = tl.max(m, 0)
            w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
            o = tl.load(O_PART + (r * SPLITS + s)[:, None] * HD + d[None, :])
            out = tl.sum(o * w[:, None], 0) / tl.sum(l * w, 0)
            tl.store(OUT + r * HD + d, out.to(OUT.dtype.element_ty))

        _triton_kernels = (_split_kernel, _reduce_kernel)
    return _triton_kernels


def num_splits(batch: int, n_kv_heads: int, max_splits: int = 16) -> int:
    # enough programs to fill ~2 waves of 132 SMs at small batch; 1..max_splits, power of two
    want = max(1, math.ceil(264 / max(1, batch * n_kv_heads)))
    return min(max_splits, 1 << (want - 1).bit_length())


def decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, lengths: Tensor,
                            splits: int | None = None) -> Tensor:
    import triton

    split_kernel, reduce_kernel = _kernels()
    B, Hq, hd = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    splits = splits or num_splits(B, Hkv)
    q = q.contiguous()
    out = torch.empty_like(q)
    if splits == 1:
        o_part = m_part = l_part = out  # the kernel writes the output itself
    else:
        o_part = torch.empty(B * Hq * splits, hd, dtype=torch.float32, device=q.device)
        m_part = torch.empty(B * Hq * splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty(B * Hq * splits, dtype=torch.float32, device=q.device)
    block_n = max(16, min(64, triton.next_power_of_2(k_cache.shape[2])))  # tl.dot needs K >= 16
    split_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, slot_ids, lengths, o_part, m_part, l_part, 1.0 / math.sqrt(hd),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        G=G, GP=max(16, G), HD=hd, BLOCK_N=block_n, SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=4,
    )
    if splits > 1:
        reduce_kernel[(B * Hq,)](o_part, m_part, l_part, out, HD=hd, SPLITS=splits, num_warps=1)
    return out
