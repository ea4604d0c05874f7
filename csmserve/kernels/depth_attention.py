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
# a static position (depth_attend_triton's pos_static) and its cos, sin read before the PDL wait (0: after)
POS_EARLY = os.environ.get("CSMSERVE_DEPTH_POS_EARLY", "1") != "0"


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
    c, s = rope_at(COS, SIN, p, out_row.dtype.element_ty, HD, HALF)
    attend_cached(src, p, c, s, k_base, v_base, out_row, s_kt, s_vt, h, n_kv, scale, n_q, kc1, kc2, vc, G, GP,
                  HD, HALF, BLOCK_N, IEEE)


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
    """attend_one on the cache as read by cached_kv (positions >= p masked here) and position p's cos, sin
    (rope_at)."""
    dt = out_row.dtype.element_ty
    out = attend_rows(src, p, c, s, k_base, v_base, s_kt, s_vt, h, n_kv, scale, n_q, kc1, kc2, vc, True, dt, G, GP, HD,
                      HALF, BLOCK_N, IEEE)
    g = tl.arange(0, GP)
    d = tl.arange(0, HD)
    tl.store(out_row + (h * G + g)[:, None] * HD + d[None, :], out.to(dt), mask=(g < G)[:, None])


@triton.jit
def attend_rows(src, p, c, s, k_base, v_base, s_kt, s_vt, h, n_kv, scale, n_q, kc1, kc2, vc, store, dt,
                G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                IEEE: tl.constexpr):
    """attend_cached's attention -> [GP, HD] fp32 (rows >= G: padding, not an output); store: write the new k and v
    at p (else only read them)."""
    i = tl.arange(0, HALF)
    d = tl.arange(0, HD)
    # this head's new key, rotated, and value -> the cache at position p
    kx1 = tl.load(src + (n_q + h) * HD + i).to(tl.float32)
    kx2 = tl.load(src + (n_q + h) * HD + HALF + i).to(tl.float32)
    k1 = (kx1 * c - kx2 * s).to(dt)  # [HALF]
    k2 = (kx2 * c + kx1 * s).to(dt)
    v_new = tl.load(src + (n_q + n_kv + h) * HD + d)  # [HD]
    if store:
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
    return acc / l_sum[:, None]


@triton.jit
def _depth_attend_kernel(QKV, POS, COS, SIN, KC, VC, OUT, stride_qkv, stride_pos, s_kn, s_kh, s_kt, s_vn, s_vh, s_vt,
                         scale, n_q, n_pos, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_N: tl.constexpr, IEEE: tl.constexpr, EARLY: tl.constexpr, POS_EARLY: tl.constexpr,
                         PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # kv head
    k_base = KC + b * s_kn + h * s_kh
    v_base = VC + b * s_vn + h * s_vh
    dt = OUT.dtype.element_ty
    if EARLY:  # before the wait: see cached_kv
        kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, n_pos, HD, HALF, BLOCK_N)
    if POS_EARLY:  # the position and its cos, sin before the wait: no kernel of the frame writes POS
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
                                    BLOCK_N=block_n, IEEE=qkv.dtype == torch.float32, EARLY=EARLY and B <= EARLY_ROWS,
                                    POS_EARLY=pos_static and POS_EARLY,
                                    num_warps=tuning.by_rows(WARPS, B), **pdl.opts())
    return out


# ---- the frame's first depth step: two queries, at positions 0 and 1 ----
# The depth decoder's first step takes two positions at once (the backbone's state and codebook 0's code). Unfused
# that is the torch path: per layer the cache stores as index_put, a mask, SDPA: ~8 plain launches between PDL
# kernels, ~36 a frame (docs/benchmarks.md, issue 16). Both positions are static (DepthKV.first_static: a view of
# depth_pos[:2]), so no earlier key exists: a program stores position 0's k and v, attends (one key: v0), then
# reads them back after a block barrier for position 1. CSMSERVE_DEPTH_FIRST=0 (read by DepthKV): the torch path.


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


# ---- the attention and the o projection in one kernel (1-2 rows) ----
# A depth layer's attention output feeds only its o projection. At 1-2 rows the attention is a few thousand
# products, so each program of the o GEMV computes it itself (redundantly, from L2) for the output columns it owns:
# one launch and one store-then-load less per layer, and the o weights (read before the PDL wait, as kernels/gemv.py
# does) no longer wait behind a separate attention kernel. Off by default: measured slower (docs/benchmarks.md,
# issue 16: 3.92 against 3.52 ms a frame at batch 1, fp8-all; each program computes both KV heads' attention in
# turn, where the attention kernel runs them side by side). CSMSERVE_DEPTH_ATTN_O=1 turns it on.
ATTN_O = os.environ.get("CSMSERVE_DEPTH_ATTN_O", "0") == "1"
ATTN_O_BLOCK_N = 8  # o-projection outputs per program: 128 programs for the depth decoder's 1,024
ATTN_O_WARPS = 8


@triton.jit
def _head_o(src, p, c, s, k_base, v_base, w, s_kt, s_vt, h, n_q, n_kv, scale, store, dt, G: tl.constexpr,
            GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr, IEEE: tl.constexpr):
    """One (row, KV head): attend_rows' attention of its G query heads (rounded to the model dtype, as the unfused
    path stores it) times their o weights w [BN, G, HD] -> [BN] fp32. src the row's qkv, p its position, c/s its
    cos/sin (rope_at), k_base/v_base the head's cache [P, HD]; store: write the new k and v at p."""
    kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, p, HD, HALF, BLOCK_P)
    out = attend_rows(src, p, c, s, k_base, v_base, s_kt, s_vt, h, n_kv, scale, n_q, kc1, kc2, vc, store, dt, G, GP,
                      HD, HALF, BLOCK_P, IEEE)  # [GP, HD]
    r = tl.arange(0, GP)
    g = tl.arange(0, G)
    # the G output rows of the GP computed: [G, HD]
    sel = tl.sum(tl.where(r[None, :, None] == g[:, None, None], out.to(dt).to(tl.float32)[None, :, :], 0.0), 1)
    return tl.sum(tl.sum(w.to(tl.float32) * sel[None, :, :], 2), 1)  # [BN]


@triton.jit
def _row_o(QKV, KC, VC, p, c, s, w0, w1, s_kh, s_kt, s_vh, s_vt, n_q, scale, store, dt,
           NKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
           BLOCK_P: tl.constexpr, IEEE: tl.constexpr):
    """One row: the o projection of its attention [BN] fp32, summed over its (one or two) KV heads' query heads."""
    y = _head_o(QKV, p, c, s, KC, VC, w0, s_kt, s_vt, 0, n_q, NKV, scale, store, dt, G, GP, HD, HALF, BLOCK_P, IEEE)
    if NKV == 2:
        y += _head_o(QKV, p, c, s, KC + s_kh, VC + s_vh, w1, s_kt, s_vt, 1, n_q, NKV, scale, store, dt, G, GP, HD, HALF,
                     BLOCK_P, IEEE)
    return y


@triton.jit
def _depth_attend_o_kernel(QKV, POS, COS, SIN, KC, VC, W, S, Y, N, stride_qkv, stride_pos, s_kn, s_kh, s_kt, s_vn,
                           s_vh, s_vt, stride_wn, stride_ym, scale, n_q, NKV: tl.constexpr, G: tl.constexpr,
                           GP: tl.constexpr, IEEE: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                           TWO_ROWS: tl.constexpr, SCALED: tl.constexpr, POS_EARLY: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    mn = rn < N
    g = tl.arange(0, G)
    d = tl.arange(0, HD)
    dt = Y.dtype.element_ty
    # the o weights of KV head 0's query heads [BN, G, HD] (and head 1's): they depend on no kernel
    wp = W + rn.to(tl.int64)[:, None, None] * stride_wn + g[None, :, None] * HD + d[None, None, :]
    w0 = tl.load(wp, mask=mn[:, None, None], other=0.0)
    w1 = w0
    if NKV == 2:
        w1 = tl.load(wp + G * HD, mask=mn[:, None, None], other=0.0)
    sw = 1.0
    if SCALED:  # FP8 weights: a float32 scale per output channel
        sw = tl.load(S + rn, mask=mn, other=0.0)
    if POS_EARLY:  # static positions (depth_attend_triton's pos_static)
        p0 = tl.load(POS).to(tl.int64)
        c0, s0 = rope_at(COS, SIN, p0, dt, HD, HALF)
        p1, c1, s1 = p0, c0, s0
        if TWO_ROWS:
            p1 = tl.load(POS + stride_pos).to(tl.int64)
            c1, s1 = rope_at(COS, SIN, p1, dt, HD, HALF)
    if PDL:  # kernels/pdl.py
        gdc_wait()
        gdc_launch_dependents()
    if not POS_EARLY:
        p0 = tl.load(POS).to(tl.int64)
        c0, s0 = rope_at(COS, SIN, p0, dt, HD, HALF)
        p1, c1, s1 = p0, c0, s0
        if TWO_ROWS:
            p1 = tl.load(POS + stride_pos).to(tl.int64)
            c1, s1 = rope_at(COS, SIN, p1, dt, HD, HALF)
    store = pid == 0  # one program writes each row's new k and v
    y0 = _row_o(QKV, KC, VC, p0, c0, s0, w0, w1, s_kh, s_kt, s_vh, s_vt, n_q, scale, store, dt, NKV,
                G, GP, HD, HALF, BLOCK_P, IEEE)
    tl.store(Y + rn, (y0 * sw).to(dt), mask=mn)
    if TWO_ROWS:
        y1 = _row_o(QKV + stride_qkv, KC + s_kn, VC + s_vn, p1, c1, s1, w0, w1, s_kh, s_kt, s_vh, s_vt,
                    n_q, scale, store, dt, NKV, G, GP, HD, HALF, BLOCK_P, IEEE)
        tl.store(Y + stride_ym + rn, (y1 * sw).to(dt), mask=mn)


def attend_o_applies(qkv: Tensor, k_cache: Tensor, n_q: int, n_kv: int, weight: Tensor,
                     scale: Tensor | None) -> bool:
    """Where depth_attend_o_triton runs: CUDA, bf16/fp16, 1-2 rows, one or two KV heads, power-of-two group and head
    sizes, the o weight [N, n_q hd] (bf16 as the activations, or e4m3 with [N] float32 scales)."""
    B, hd, G = qkv.shape[0], k_cache.shape[-1], n_q // max(n_kv, 1)
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    wdt = qkv.dtype if scale is None else torch.float8_e4m3fn
    return (ATTN_O and qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16) and 1 <= B <= 2
            and n_kv in (1, 2) and n_q == G * n_kv and pow2(G) and pow2(hd) and hd >= 2 and k_cache.shape[2] <= 64
            and weight.dim() == 2 and weight.shape[1] == n_q * hd and weight.stride(-1) == 1 and weight.dtype == wdt
            and (scale is None or (scale.dtype == torch.float32 and scale.numel() == weight.shape[0]
                                   and scale.is_contiguous())))


def depth_attend_o_triton(qkv: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                          n_q: int, n_kv: int, weight: Tensor, scale: Tensor | None = None,
                          pos_static: bool = False) -> Tensor:
    """depth_attend_triton's attention, then its o projection (x @ weight^T, FP8 weights: times scale[n]), in one
    kernel: qkv [B <= 2, (n_q + 2 n_kv) hd] -> y [B, N]; the cache gets each row's rotated k and v at pos. The caller
    checks attend_o_applies (the interpreter's tests call it on the CPU)."""
    B, width = qkv.shape
    hd = cos.shape[-1]
    if qkv.stride(1) != 1 or width != (n_q + 2 * n_kv) * hd or B > 2:
        raise ValueError("depth_attend_o_triton: qkv must be [B <= 2, (n_q + 2 n_kv) hd] with contiguous rows")
    N = weight.shape[0]
    y = torch.empty(B, N, dtype=qkv.dtype, device=qkv.device)
    _depth_attend_o_kernel[(triton.cdiv(N, ATTN_O_BLOCK_N),)](
        qkv, pos, cos, sin, k_cache, v_cache, weight, weight if scale is None else scale, y, N, qkv.stride(0),
        pos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), weight.stride(0), y.stride(0), 1.0 / math.sqrt(hd), n_q, NKV=n_kv, G=n_q // n_kv,
        GP=max(16, triton.next_power_of_2(n_q // n_kv)), IEEE=qkv.dtype == torch.float32, HD=hd,
        HALF=hd // 2, BLOCK_P=max(16, triton.next_power_of_2(k_cache.shape[2])), BLOCK_N=ATTN_O_BLOCK_N,
        TWO_ROWS=B == 2, SCALED=scale is not None, POS_EARLY=pos_static and POS_EARLY, num_warps=ATTN_O_WARPS,
        **pdl.opts())
    return y
