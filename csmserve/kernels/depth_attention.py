"""The depth decoder's one-query attention step in one kernel: RoPE of q and k from the qkv projection, the new
K and V stored at the row's position, attention over the frame's earlier positions and the new one.

Unfused, a depth step's attention is three launches per layer (kernels/elementwise.py's RoPE and K+V store, then
kernels/decode_attention.py): 3 x 4 layers x 31 depth steps = 372 per frame, at ~1.5-2 us each mostly launch and
tail (docs/benchmarks.md, issue 16). Here it is one launch per layer (-248 per frame; predicted ~0.4 ms of the
6.6 ms frame step at batch 1, measured 0.12 ms). On by default; CSMSERVE_DEPTH_FUSED=0 keeps the three.

grid (B, Hkv): a program ropes its KV head's k and its G query heads, stores k and v in the cache, then attends
over positions 0..pos-1 read from the cache (one block: the depth cache holds <= 64 positions) and the new
position from registers, merged in one softmax (no store-then-load within the program). The cache is read
before the PDL wait at 1-2 rows (the earlier positions' writers finished two kernels back), so that load
overlaps the qkv GEMV before it. Rounding follows the
unfused path: q and k rotated in fp32 and rounded to the model dtype, scores accumulated in fp32, the
probabilities rounded to the model dtype for the cached values' product (the new value's in fp32).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from csmserve.kernels import pdl, tuning

WARPS = tuning.DEPTH_ATTENTION["warps"]  # [[rows_from, num_warps], ...] (kernels/tuning.py)
EARLY = os.environ.get("CSMSERVE_DEPTH_ATTN_EARLY", "1") != "0"  # the cache read before the PDL wait (0: after)
# ... at up to this many rows: their GEMMs are ours, PDL-chained; at 3+ cuBLAS's break the chain, so there is no
# wait to hide the read behind, and the whole cache (not the row's positions) costs HBM time (2,048 rows: +0.7%)
EARLY_ROWS = 2


@triton.jit
def cached_kv(k_base, v_base, s_kt, s_vt, n_pos, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """The head's whole cache [BLOCK_N, HD] (positions past n_pos as 0), whatever the position: attend_one masks
    the positions from the row's on. Read before the PDL wait: earlier steps' kernels wrote the earlier
    positions, and they completed before the kernel before this one passed its own wait."""
    i = tl.arange(0, HALF)
    d = tl.arange(0, HD)
    n = tl.arange(0, BLOCK_N)
    ok = (n < n_pos)[:, None]
    kc1 = tl.load(k_base + n[:, None] * s_kt + i[None, :], mask=ok, other=0.0)  # [BLOCK_N, HALF]
    kc2 = tl.load(k_base + n[:, None] * s_kt + HALF + i[None, :], mask=ok, other=0.0)
    vc = tl.load(v_base + n[:, None] * s_vt + d[None, :], mask=ok, other=0.0)  # [BLOCK_N, HD]
    return kc1, kc2, vc


@triton.jit
def attend_one(src, p, COS, SIN, k_base, v_base, out_row, s_kt, s_vt, h, n_kv, scale, n_q, G: tl.constexpr,
               GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One (row, KV head): src the row's qkv [(n_q + 2 n_kv) HD], p its position, k_base/v_base the head's
    cache [P, HD] (position stride s_kt/s_vt), out_row the row's output [n_q HD]. Also called by
    kernels/depth_loop.py inside its persistent kernel."""
    kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, p, HD, HALF, BLOCK_N)
    attend_cached(src, p, COS, SIN, k_base, v_base, out_row, s_kt, s_vt, h, n_kv, scale, n_q, kc1, kc2, vc, G, GP,
                  HD, HALF, BLOCK_N, IEEE)


@triton.jit
def attend_cached(src, p, COS, SIN, k_base, v_base, out_row, s_kt, s_vt, h, n_kv, scale, n_q, kc1, kc2, vc,
                  G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr):
    """attend_one on the cache as read by cached_kv (positions >= p masked here)."""
    dt = out_row.dtype.element_ty
    i = tl.arange(0, HALF)
    d = tl.arange(0, HD)
    # the fp32 tables rounded to the model dtype first, as rope_qk does; rotate-half layout
    c = tl.load(COS + p * HD + i).to(dt).to(tl.float32)
    s = tl.load(SIN + p * HD + i).to(dt).to(tl.float32)
    # this head's new key, rotated, and value -> the cache at position p
    kx1 = tl.load(src + (n_q + h) * HD + i).to(tl.float32)
    kx2 = tl.load(src + (n_q + h) * HD + HALF + i).to(tl.float32)
    k1 = (kx1 * c - kx2 * s).to(dt)  # [HALF]
    k2 = (kx2 * c + kx1 * s).to(dt)
    v_new = tl.load(src + (n_q + n_kv + h) * HD + d)  # [HD]
    tl.store(k_base + p * s_kt + i, k1)
    tl.store(k_base + p * s_kt + HALF + i, k2)
    tl.store(v_base + p * s_vt + d, v_new)
    # the group's query heads, rotated (padded to the 16 rows tl.dot needs)
    g = tl.arange(0, GP)
    g_ok = g < G
    qh = h * G + g  # [GP]
    qx1 = tl.load(src + qh[:, None] * HD + i[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
    qx2 = tl.load(src + qh[:, None] * HD + HALF + i[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
    q1 = (qx1 * c[None, :] - qx2 * s[None, :]).to(dt)  # [GP, HALF]
    q2 = (qx2 * c[None, :] + qx1 * s[None, :]).to(dt)
    # earlier positions from the cache (written by earlier steps' programs), the new one from registers
    n = tl.arange(0, BLOCK_N)
    valid = n < p
    if HALF < 16:  # tl.dot needs K >= 16: head_dim 16 (the tests' tiny models) as a broadcast sum
        sc = (tl.sum(q1.to(tl.float32)[:, None, :] * kc1.to(tl.float32)[None, :, :], 2)
              + tl.sum(q2.to(tl.float32)[:, None, :] * kc2.to(tl.float32)[None, :, :], 2))
    elif IEEE:
        sc = tl.dot(q1, tl.trans(kc1), input_precision="ieee") + tl.dot(q2, tl.trans(kc2), input_precision="ieee")
    else:
        sc = tl.dot(q1, tl.trans(kc1)) + tl.dot(q2, tl.trans(kc2))
    sc = tl.where(valid[None, :], sc * scale, float("-inf"))  # [GP, BLOCK_N]
    s_new = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], 1)
             + tl.sum(q2.to(tl.float32) * k2.to(tl.float32)[None, :], 1)) * scale  # [GP]
    m = tl.maximum(tl.max(sc, 1), s_new)
    pc = tl.exp(sc - m[:, None])
    pn = tl.exp(s_new - m)
    l_sum = tl.sum(pc, 1) + pn
    vc = tl.where(valid[:, None], vc, 0.0)  # [BLOCK_N, HD]: positions >= p hold other frames' (or no) values
    if IEEE:
        acc = tl.dot(pc, vc, input_precision="ieee")
    else:
        acc = tl.dot(pc.to(dt), vc)
    acc = acc + pn[:, None] * v_new.to(tl.float32)[None, :]
    out = acc / l_sum[:, None]
    tl.store(out_row + qh[:, None] * HD + d[None, :], out.to(dt), mask=g_ok[:, None])


@triton.jit
def _depth_attend_kernel(QKV, POS, COS, SIN, KC, VC, OUT, stride_qkv, stride_pos, s_kn, s_kh, s_kt, s_vn, s_vh, s_vt,
                         scale, n_q, n_pos, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_N: tl.constexpr, IEEE: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # kv head
    k_base = KC + b * s_kn + h * s_kh
    v_base = VC + b * s_vn + h * s_vh
    if EARLY:  # before the wait: see cached_kv
        kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, n_pos, HD, HALF, BLOCK_N)
    if PDL:  # kernels/pdl.py: every read below depends on the kernels before
        gdc_wait()
        gdc_launch_dependents()
    if not EARLY:
        kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, n_pos, HD, HALF, BLOCK_N)
    p = tl.load(POS + b * stride_pos).to(tl.int64)
    attend_cached(QKV + b * stride_qkv, p, COS, SIN, k_base, v_base, OUT + b * (n_q * HD), s_kt, s_vt, h,
                  tl.num_programs(1), scale, n_q, kc1, kc2, vc, G, GP, HD, HALF, BLOCK_N, IEEE)


def depth_attend_triton(qkv: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                        n_q: int, n_kv: int) -> Tensor:
    """qkv [B, (n_q + 2 n_kv) hd] (rows may be strided; each row contiguous), pos [B] (< the cache's
    positions), cos/sin [T, hd] fp32, k_cache/v_cache [>= B, n_kv, P, hd] (one layer; row b is batch row b)
    -> out [B, n_q * hd]; the cache gets row b's rotated k and v at pos[b]."""
    B, width = qkv.shape
    hd = cos.shape[-1]
    if qkv.stride(1) != 1 or width != (n_q + 2 * n_kv) * hd:
        raise ValueError("depth_attend_triton: qkv must be [B, (n_q + 2 n_kv) hd] with contiguous rows")
    for t in (k_cache, v_cache):
        if t.stride(3) != 1:
            raise ValueError("depth_attend_triton: the caches' last dimension must be contiguous")
    G = n_q // n_kv
    out = torch.empty(B, n_q * hd, dtype=qkv.dtype, device=qkv.device)
    block_n = max(16, triton.next_power_of_2(k_cache.shape[2]))
    _depth_attend_kernel[(B, n_kv)](qkv, pos, cos, sin, k_cache, v_cache, out, qkv.stride(0), pos.stride(0),
                                    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                    v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), 1.0 / math.sqrt(hd), n_q,
                                    k_cache.shape[2], G=G, GP=max(16, triton.next_power_of_2(G)), HD=hd, HALF=hd // 2,
                                    BLOCK_N=block_n, IEEE=qkv.dtype == torch.float32, EARLY=EARLY and B <= EARLY_ROWS,
                                    num_warps=tuning.by_rows(WARPS, B), **pdl.opts())
    return out
