"""The depth decoder's one-query attention step in one kernel: RoPE of q and k from the qkv projection, the new
K and V stored at the row's position, attention over the frame's earlier positions and the new one.

Unfused, a depth step's attention is three launches per layer (kernels/elementwise.py's RoPE and K+V store, then
kernels/decode_attention.py): 3 x 4 layers x 31 depth steps = 372 per frame, at ~1.5-2 us each mostly launch and
tail (docs/benchmarks.md, issue 16). Here it is one launch per layer (-248 per frame; predicted ~0.4 ms of the
6.6 ms frame step at batch 1, measured 0.12 ms).

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

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from csmserve.kernels import pdl, tuning

WARPS = tuning.DEPTH_ATTENTION["warps"]  # [[rows_from, num_warps], ...] (kernels/tuning.py)
# the cache is read before the PDL wait at up to this many rows: their GEMMs are ours, PDL-chained; at 3+ the chain
# is broken anyway, and the whole cache (not the row's positions) costs HBM time (2,048 rows: +0.7%)
EARLY_ROWS = 2


@triton.jit
def cached_kv(k_base, v_base, s_kt, s_vt, n_pos, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """The head's whole cache [BLOCK_N, HD] (positions past n_pos as 0), whatever the position: attend_cached masks
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
def rope_at(COS, SIN, p, dt, HD: tl.constexpr, HALF: tl.constexpr):
    """cos, sin [HALF] fp32 of position p: the fp32 tables rounded to the model dtype first, as rope_qk does
    (rotate-half layout)."""
    i = tl.arange(0, HALF)
    c = tl.load(COS + p * HD + i).to(dt).to(tl.float32)
    s = tl.load(SIN + p * HD + i).to(dt).to(tl.float32)
    return c, s


@triton.jit
def attend_cached(src, p, c, s, k_base, v_base, out_row, s_kt, s_vt, h, n_kv, scale, n_q, kc1, kc2, vc,
                  G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr):
    """One (row, KV head): src the row's qkv [(n_q + 2 n_kv) HD], p its position, c/s its cos, sin (rope_at),
    k_base/v_base the head's cache [P, HD] (position stride s_kt/s_vt) as read by cached_kv (positions >= p masked
    here), out_row the row's output [n_q HD]; the new k and v are stored at p."""
    dt = out_row.dtype.element_ty
    i = tl.arange(0, HALF)
    d = tl.arange(0, HD)
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
    out = acc / l_sum[:, None]  # [GP, HD]: rows >= G padding, not an output
    tl.store(out_row + (h * G + g)[:, None] * HD + d[None, :], out.to(dt), mask=g_ok[:, None])


@triton.jit
def _depth_attend_kernel(QKV, POS, COS, SIN, KC, VC, OUT, stride_qkv, stride_pos, s_kn, s_kh, s_kt, s_vn, s_vh, s_vt,
                         scale, n_q, n_pos, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_N: tl.constexpr, IEEE: tl.constexpr, EARLY: tl.constexpr, POS_EARLY: tl.constexpr,
                         PDL: tl.constexpr):
    # EARLY: the cache read before the PDL wait (see cached_kv); POS_EARLY: the position and its cos, sin too (a static
    # position: no kernel of the frame writes POS)
    b = tl.program_id(0)
    h = tl.program_id(1)  # kv head
    k_base = KC + b * s_kn + h * s_kh
    v_base = VC + b * s_vn + h * s_vh
    dt = OUT.dtype.element_ty
    if EARLY:
        kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, n_pos, HD, HALF, BLOCK_N)
    if POS_EARLY:
        p = tl.load(POS + b * stride_pos).to(tl.int64)
        c, s = rope_at(COS, SIN, p, dt, HD, HALF)
    if PDL:  # kernels/pdl.py: every read below depends on the kernels before
        gdc_wait()
        gdc_launch_dependents()
    if not EARLY:
        kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, n_pos, HD, HALF, BLOCK_N)
    if not POS_EARLY:
        p = tl.load(POS + b * stride_pos).to(tl.int64)
        c, s = rope_at(COS, SIN, p, dt, HD, HALF)
    attend_cached(QKV + b * stride_qkv, p, c, s, k_base, v_base, OUT + b * (n_q * HD), s_kt, s_vt, h,
                  tl.num_programs(1), scale, n_q, kc1, kc2, vc, G, GP, HD, HALF, BLOCK_N, IEEE)


def depth_attend_triton(qkv: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                        n_q: int, n_kv: int, pos_static: bool = False) -> Tensor:
    """qkv [B, (n_q + 2 n_kv) hd] (rows may be strided; each row contiguous), pos [B] (< the cache's
    positions), cos/sin [T, hd] fp32, k_cache/v_cache [>= B, n_kv, P, hd] (one layer; row b is batch row b)
    -> out [B, n_q * hd]; the cache gets row b's rotated k and v at pos[b]. pos_static: no kernel of the
    graph writes pos (the depth steps' constant positions), so it is read before the PDL wait."""
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
                                    BLOCK_N=block_n, IEEE=qkv.dtype == torch.float32, EARLY=B <= EARLY_ROWS,
                                    POS_EARLY=pos_static,
                                    num_warps=tuning.by_rows(WARPS, B), **pdl.opts())
    return out


# ---- the frame's first depth step: two queries, at positions 0 and 1 ----
# The depth decoder's first step takes two positions at once (the backbone's state and codebook 0's code). Unfused
# that is the torch path: per layer the cache stores as index_put, a mask, SDPA: ~8 plain launches between PDL
# kernels, ~36 a frame (docs/benchmarks.md, issue 16). Both positions are static (DepthKV.first_static: a view of
# depth_pos[:2]), so no earlier key exists: a program stores position 0's k and v, attends (one key: v0), then
# reads them back after a block barrier for position 1.


@triton.jit
def _depth_attend_first_kernel(QKV, COS, SIN, KC, VC, OUT, stride_qb, stride_qs, s_kn, s_kh, s_kt, s_vn, s_vh, s_vt,
                               scale, n_q, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                               BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # kv head
    k_base = KC + b * s_kn + h * s_kh
    v_base = VC + b * s_vn + h * s_vh
    dt = OUT.dtype.element_ty
    c0, s0 = rope_at(COS, SIN, 0, dt, HD, HALF)  # constant positions: before the wait
    c1, s1 = rope_at(COS, SIN, 1, dt, HD, HALF)
    if PDL:  # kernels/pdl.py
        gdc_wait()
        gdc_launch_dependents()
    src = QKV + b * stride_qb
    out = OUT + b * 2 * (n_q * HD)
    kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, 0, HD, HALF, BLOCK_N)  # no earlier key: all masked
    attend_cached(src, 0, c0, s0, k_base, v_base, out, s_kt, s_vt, h, tl.num_programs(1), scale, n_q, kc1, kc2, vc,
                  G, GP, HD, HALF, BLOCK_N, IEEE)
    tl.debug_barrier()  # position 0's k and v, stored above by this program's threads, read back below
    kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, 1, HD, HALF, BLOCK_N)
    attend_cached(src + stride_qs, 1, c1, s1, k_base, v_base, out + n_q * HD, s_kt, s_vt, h, tl.num_programs(1), scale,
                  n_q, kc1, kc2, vc, G, GP, HD, HALF, BLOCK_N, IEEE)


def depth_attend_first_triton(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, n_q: int,
                              n_kv: int) -> Tensor:
    """The depth decoder's first step: qkv [B, 2, (n_q + 2 n_kv) hd] of positions 0 and 1 (rows contiguous) ->
    out [B, 2, n_q * hd]; the cache gets each row's rotated k and v at positions 0 and 1, as depth_attend_triton
    would in two steps."""
    B, S, width = qkv.shape
    hd = cos.shape[-1]
    if S != 2 or qkv.stride(2) != 1 or width != (n_q + 2 * n_kv) * hd:
        raise ValueError("depth_attend_first_triton: qkv must be [B, 2, (n_q + 2 n_kv) hd] with contiguous rows")
    for t in (k_cache, v_cache):
        if t.stride(3) != 1 or t.shape[2] < 2:
            raise ValueError("depth_attend_first_triton: the caches need >= 2 positions, the last dimension contiguous")
    G = n_q // n_kv
    out = torch.empty(B, 2, n_q * hd, dtype=qkv.dtype, device=qkv.device)
    _depth_attend_first_kernel[(B, n_kv)](
        qkv, cos, sin, k_cache, v_cache, out, qkv.stride(0), qkv.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), 1.0 / math.sqrt(hd), n_q, G=G,
        GP=max(16, triton.next_power_of_2(G)), HD=hd, HALF=hd // 2, BLOCK_N=max(16, triton.next_power_of_2(k_cache.shape[2])),
        IEEE=qkv.dtype == torch.float32, num_warps=tuning.by_rows(WARPS, B), **pdl.opts())
    return out
