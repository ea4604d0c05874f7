"""Skinny GEMMs (M <= 16 rows): y [M, N] = x [M, K] @ w [N, K]^T, each weight read once for all M rows.

At batch 1 a frame is ~560 of these (31 depth steps x (4 layers x 4 + projection + head) + the
backbone's 64): 2-32 MB each, where cuBLAS' GEMV kernels (+ a split-K reduction) run at ~40% of HBM
bandwidth (docs/benchmarks.md, the batch-1 profile). Here a program owns BLOCK_N output columns for
both rows and walks K in BLOCK_K chunks (fp32 accumulation); BLOCK_N is chosen so that ~512 programs
cover N (every SM several, so enough loads are in flight), BLOCK_K so that a program's fp32 accumulator tiles
(one per row, and per gate/up) hold ~8K products (~64 registers a thread at 4 warps). No split-K at 1-2 rows, so
no second kernel and no workspace.

glu=True: w is [gate; up] [2I, K] and y = silu(x @ gate^T) * (x @ up^T) [M, I]: the MLP's first GEMM
and its SiLU*up in one kernel (the gate and up tiles of a column block read together).

FP8 weights (scale given: models/fp8.py's FP8Linear): w is e4m3 [N, K] with a float32 scale per output channel
(per [gate; up] row for glu), y = scale[n] * sum_k x[k] w[n, k]: weight-only, the activations stay in the model
dtype (no quantization kernel before the GEMM), half the bytes of a bf16 weight for the same products.

3..MAX_ROWS (16) rows (a prompt's short prefill, a few streams' frame step): `_gemv_mma_kernel`, the same fusions
(glu, FP8 scales, the gather, PDL; not the norm) with the rows as one 16-row tile through tl.dot: a program owns
BLOCK_N >= 16 columns and walks K with [BLOCK_K, BLOCK_N] weight tiles (~8K weights a chunk, so the few programs of
an N = 1,024 GEMM still keep ~64 KB of loads in flight each). Rows past M are masked.
A GEMM with too few column blocks (the K = 8,192 down projections) is split over K (at most MMA_SPLIT = 8 splits),
the partial sums added by the column block's last program in a fixed order (no second kernel, the same bits every
run): the frame step at 4 / 16 rows 8.08 / 8.10 -> 6.90 / 7.24 ms (bf16), 8.47 / 10.06 -> 6.89 / 7.61 (FP8).
Measured (docs/benchmarks.md, issue 16): per GEMM faster than cuBLAS on most shapes at 4-16 rows; in the frame step
level with cuBLAS for bf16 and 6-18% faster for FP8 weights. The add + RMSNorm stays a kernel of its own at 3+ rows
(fused, each program normalised all 16 rows of every chunk again: up to 22% slower; docs/tried-and-dropped.md).

norm_gemv: the residual add + RMSNorm before a block's qkv / gate_up GEMM fused into it (1-2 rows): h = x + delta,
y = gemv(rms_norm(h) * norm_weight), with the rounding of kernels/elementwise.py's add_rms_norm (h and
the normed row in the model dtype). Every program reads the row (K <= 8192: from L2) once for its sum of
squares and again per chunk; program 0 writes h, the residual stream. Two launches less per layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from csmserve.kernels import pdl, tuning
from csmserve.kernels.lora import lora_arrive, lora_piece, lora_row, lora_tile, lora_wait

ELEMENTWISE_ROWS = 2  # 1-2 rows: _gemv_kernel; 3..MAX_ROWS: _gemv_mma_kernel (bench/gemv.py: the elementwise
# tiles lose to cuBLAS from 4 rows, the 16-row tensor-core tiles do not)
# the tensor-core kernel's row tile and its most rows, bf16/fp16 and e4m3 weights alike (past it cuBLAS, or FP8Linear's
# own GEMM; 32- and 64-row tiles lost to both: docs/tried-and-dropped.md)
MMA_TILE = 16
_LORA_TILE = tl.constexpr(16)  # the LoRA shrink pieces' row tile inside these kernels (kernels/lora.py)
MAX_ROWS = MMA_TILE
_PROGRAMS = 512  # the grid to aim at: ~4 programs per SM on an H100/H200 (132 SMs)
_ELEMS = 8192  # weights per program per chunk (16 KB bf16)
NUM_WARPS = 4


@triton.jit
def _chunk(X, DELTA, nw, rk, mask, rstd, dt, NORM: tl.constexpr, HAS_DELTA: tl.constexpr):
    """One row's input chunk [BK] in fp32: x, or rms_norm(x + delta) * nw rounded as add_rms_norm does."""
    x = tl.load(X + rk, mask=mask, other=0.0)
    if NORM:
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(DELTA + rk, mask=mask, other=0.0).to(tl.float32)).to(dt)
        x = (nw * (x.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
    return x.to(tl.float32)


@triton.jit
def _rstd(X, DELTA, H, K, mask_row, write_h, eps, dt, HAS_DELTA: tl.constexpr, PRE_K: tl.constexpr):
    """1 / rms of one row of h = x + delta (rounded to the model dtype, as `x + delta` is); h stored if write_h.
    In chunks of PRE_K >= BLOCK_K: this pass stands between the launch and the first weight load."""
    ss = tl.zeros([PRE_K], dtype=tl.float32)
    for k0 in range(0, K, PRE_K):
        rk = k0 + tl.arange(0, PRE_K)
        m = (rk < K) & mask_row
        h = tl.load(X + rk, mask=m, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(DELTA + rk, mask=m, other=0.0).to(tl.float32)).to(dt)
            if write_h:
                tl.store(H + rk, h, mask=m)
        ss += h.to(tl.float32) * h.to(tl.float32)
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _store(Y, rn, mask, g, u, sg, su, GLU: tl.constexpr, dg, du, LORA: tl.constexpr):
    y = tl.sum(g, axis=1) * sg  # [BN]
    if LORA:  # the row's LoRA deltas (fp32), gate's and up's before the SiLU
        y += dg
        if GLU:
            y = y / (1.0 + tl.exp(-y)) * (tl.sum(u, axis=1) * su + du)
    elif GLU:
        y = y / (1.0 + tl.exp(-y)) * (tl.sum(u, axis=1) * su)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _accumulate(X, X1, DELTA, NW, stride_dm, w, u, rk, K, two, rstd0, rstd1, g0, g1, u0, u1, dt,
                NORM: tl.constexpr, HAS_DELTA: tl.constexpr, TWO_ROWS: tl.constexpr, GLU: tl.constexpr):
    """One chunk: the rows' inputs (X, X1: rows 0 and 1) at columns rk [BK] times the chunk's weights w (and up u)
    [BN, BK]."""
    nw = 1.0
    if NORM:
        nw = tl.load(NW + rk).to(tl.float32)
    x0 = _chunk(X, DELTA, nw, rk, rk < K, rstd0, dt, NORM, HAS_DELTA)[None, :]
    g0 += w.to(tl.float32) * x0
    if TWO_ROWS:
        x1 = _chunk(X1, DELTA + stride_dm, nw, rk, (rk < K) & two, rstd1, dt, NORM, HAS_DELTA)[None, :]
        g1 += w.to(tl.float32) * x1
    if GLU:
        u0 += u.to(tl.float32) * x0
        if TWO_ROWS:
            u1 += u.to(tl.float32) * x1
    return g0, g1, u0, u1


@triton.jit
def _gemv_kernel(X, DELTA, H, NW, W, S, Y, M, N, K, stride_xm, stride_dm, stride_hm, stride_wn, stride_ym, UP_OFF, eps,
                 NORM: tl.constexpr, HAS_DELTA: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GLU: tl.constexpr, PRE_K: tl.constexpr, PDL: tl.constexpr,
                 SCALED: tl.constexpr = False, IDX=None, GATHER: tl.constexpr = False):
    """1-2 rows: program pid's outputs at columns pid * BLOCK_N + [0, BLOCK_N), stored to Y."""
    _gemv_columns(tl.program_id(0), X, DELTA, H, NW, W, S, Y, M, N, K, stride_xm, stride_dm, stride_hm, stride_wn,
                  stride_ym, UP_OFF, eps, NORM, HAS_DELTA, TWO_ROWS, BLOCK_N, BLOCK_K, GLU, PRE_K, PDL, SCALED, IDX,
                  GATHER, False, None, None, None, None, None, None, None, None, None, None, 0, 1, 16)


@triton.jit
def _gemv_lora_kernel(X, DELTA, H, NW, W, S, Y, M, N, K, stride_xm, stride_dm, stride_hm, stride_wn, stride_ym, UP_OFF,
                      eps, AD, LA, LB, LRANKS, LWS, LCTR, l_per, l_sal, l_sar, l_sbl, l_sbr, L_N0, L_N1,
                      NORM: tl.constexpr, HAS_DELTA: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GLU: tl.constexpr, PRE_K: tl.constexpr, PDL: tl.constexpr,
                      LS: tl.constexpr, LKSPLIT: tl.constexpr, LRB: tl.constexpr, LBK: tl.constexpr,
                      SCALED: tl.constexpr = False, IDX=None, GATHER: tl.constexpr = False, LAJ: tl.constexpr = 1):
    """_gemv_kernel with each row's LoRA delta added before the store (and the GLU), its shrink in LS * LKSPLIT * LAJ
    programs of the same grid (kernels/lora.py: the ticketed pieces; a program's role and column block come from its
    ticket). A kernel of its own: the plain GEMV's parameters and PTX stay as they were (bench/ptx_diff.py)."""
    t = tl.atomic_add(LCTR, 1)
    n_pieces = LS * LKSPLIT * LAJ
    if t < n_pieces:
        lora_piece(t, X, DELTA, NW, IDX, AD, LA, LRANKS, LWS, LCTR, M, K, l_per, stride_xm, stride_dm, l_sal, l_sar,
                   eps, X.dtype.element_ty, LS, LKSPLIT, LRB, _LORA_TILE, LBK, NORM, HAS_DELTA, GATHER, False, PDL,
                   LAJ)
    else:
        _gemv_columns(t - n_pieces, X, DELTA, H, NW, W, S, Y, M, N, K, stride_xm, stride_dm, stride_hm, stride_wn,
                      stride_ym, UP_OFF, eps, NORM, HAS_DELTA, TWO_ROWS, BLOCK_N, BLOCK_K, GLU, PRE_K, PDL,
                      SCALED, IDX, GATHER, True, AD, LB, LRANKS, LWS, LCTR, l_per, l_sbl, l_sbr, L_N0, L_N1,
                      n_pieces, LKSPLIT, LRB)
    lora_arrive(LCTR, tl.num_programs(0))


@triton.jit
def _gemv_columns(pid, X, DELTA, H, NW, W, S, Y, M, N, K, stride_xm, stride_dm, stride_hm, stride_wn, stride_ym,
                  UP_OFF, eps, NORM: tl.constexpr, HAS_DELTA: tl.constexpr, TWO_ROWS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr, PRE_K: tl.constexpr,
                  PDL: tl.constexpr, SCALED: tl.constexpr, IDX, GATHER: tl.constexpr, LORA: tl.constexpr, AD, LB,
                  LRANKS, LWS, LCTR, l_per, l_sbl, l_sbr, L_N0, L_N1, n_pieces, LKSPLIT: tl.constexpr,
                  LRB: tl.constexpr):
    # products accumulate elementwise in [BN, BK] fp32 tiles (one per row, and per gate/up), reduced once at the end
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    mn = rn < N
    rk0 = tl.arange(0, BLOCK_K)
    dt = X.dtype.element_ty
    # row 1 exists: M > 1 as vectors (Triton's interpreter fails on a scalar mask broadcast into a vector's); the
    # same PTX for sm_90 as the scalar (bench/ptx_diff.py)
    two = (rk0 * 0 + 1) < M  # [BK]
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    # the first chunk of weights depends on no kernel: read while the kernel before still runs (kernels/pdl.py)
    w = tl.load(w_rows + rk0[None, :], mask=mn[:, None], other=0.0)  # [BN, BK]
    u = w
    if GLU:
        u = tl.load(w_rows + UP_OFF * stride_wn + rk0[None, :], mask=mn[:, None], other=0.0)
    sg = 1.0
    su = 1.0
    if SCALED:  # FP8 weights: a float32 scale per output channel (gate's, then up's at UP_OFF)
        sg = tl.load(S + rn, mask=mn, other=0.0)
        if GLU:
            su = tl.load(S + UP_OFF + rn, mask=mn, other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    X1 = X + stride_xm
    if GATHER:  # the rows are X's (a table [R, K]) rows IDX [M], written by the kernel before: read after the wait
        X1 = X + tl.load(IDX + 1, mask=M > 1, other=0) * stride_xm
        X = X + tl.load(IDX) * stride_xm
    rstd0 = 1.0
    rstd1 = 1.0
    if NORM:  # program 0 writes h, the residual stream
        rstd0 = _rstd(X, DELTA, H, K, True, pid == 0, eps, dt, HAS_DELTA, PRE_K)
        if TWO_ROWS:
            rstd1 = _rstd(X1, DELTA + stride_dm, H + stride_hm, K, (tl.arange(0, PRE_K) * 0 + 1) < M, pid == 0, eps,
                          dt, HAS_DELTA, PRE_K)
    g0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    g1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    u0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    u1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    g0, g1, u0, u1 = _accumulate(X, X1, DELTA, NW, stride_dm, w, u, rk0, K, two, rstd0, rstd1, g0, g1, u0, u1,
                                 dt, NORM, HAS_DELTA, TWO_ROWS, GLU)
    for k0 in range(BLOCK_K, K, BLOCK_K):  # K % BLOCK_K == 0 (blocks() checks)
        rk = k0 + rk0
        w = tl.load(w_rows + rk[None, :], mask=mn[:, None], other=0.0)
        u = w
        if GLU:
            u = tl.load(w_rows + UP_OFF * stride_wn + rk[None, :], mask=mn[:, None], other=0.0)
        g0, g1, u0, u1 = _accumulate(X, X1, DELTA, NW, stride_dm, w, u, rk, K, two, rstd0, rstd1, g0, g1, u0,
                                     u1, dt, NORM, HAS_DELTA, TWO_ROWS, GLU)
    dg0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    dg1 = dg0
    du0 = dg0
    du1 = dg0
    if LORA:  # the rows' deltas of these columns (gate's and up's), once the shrink pieces are in
        rm = tl.arange(0, _LORA_TILE)
        ad = tl.load(AD + rm // l_per, mask=rm < M, other=-1)
        if tl.max(ad, axis=0) >= 0:
            lora_wait(LCTR, n_pieces)
            n0 = pid * BLOCK_N
            n_all = N * (2 if GLU else 1)  # B's columns: [gate; up] for the GLU
            dg0 = lora_row(LWS, AD, LB, LRANKS, 0, M, l_per, n0, rn, n_all, L_N0, L_N1, l_sbl, l_sbr, dt, LKSPLIT,
                           LRB, _LORA_TILE)
            if GLU:
                du0 = lora_row(LWS, AD, LB, LRANKS, 0, M, l_per, n0 + UP_OFF, rn + UP_OFF, n_all, L_N0, L_N1, l_sbl,
                               l_sbr, dt, LKSPLIT, LRB, _LORA_TILE)
            if TWO_ROWS:
                dg1 = lora_row(LWS, AD, LB, LRANKS, 1, M, l_per, n0, rn, n_all, L_N0, L_N1, l_sbl, l_sbr, dt,
                               LKSPLIT, LRB, _LORA_TILE)
                if GLU:
                    du1 = lora_row(LWS, AD, LB, LRANKS, 1, M, l_per, n0 + UP_OFF, rn + UP_OFF, n_all, L_N0, L_N1,
                                   l_sbl, l_sbr, dt, LKSPLIT, LRB, _LORA_TILE)
    _store(Y, rn, mn, g0, u0, sg, su, GLU, dg0, du0, LORA)
    if TWO_ROWS:
        _store(Y + stride_ym, rn, mn & ((rn * 0 + 1) < M), g1, u1, sg, su, GLU, dg1, du1, LORA)


@triton.jit
def _gemv_mma_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, UP_OFF, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr,
                     SCALED: tl.constexpr = False, IDX=None, GATHER: tl.constexpr = False,
                     WS=None, CTR=None, SPLIT: tl.constexpr = 1):
    # 3-16 rows: acc [BM, BN] += x [BM, BK] @ w^T [BK, BN] on the tensor cores (fp32 accumulation). SPLIT > 1: the
    # program (pid, s) takes K's s-th 1/SPLIT; its partial sums go to WS [SPLIT, BM, 2N] (fp32, up's at column N), and
    # the last of the column block's SPLIT programs to arrive (CTR [tiles]: arrivals) adds them in the order s = 0,
    # 1, ... (the same bits every run, whichever arrives last), resets the counter and writes y
    _mma_columns(tl.program_id(0), tl.program_id(1), X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, UP_OFF,
                 BLOCK_M, BLOCK_N, BLOCK_K, GLU, PDL, SCALED, IDX, GATHER, WS, CTR, SPLIT, False, None, None, None,
                 None, None, None, None, None, None, None, 0, 1, 16)


@triton.jit
def _gemv_mma_lora_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, UP_OFF, AD, LA, LB, LRANKS, LWS, LCTR,
                          l_per, l_sal, l_sar, l_sbl, l_sbr, L_N0, L_N1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr, LS: tl.constexpr,
                          LKSPLIT: tl.constexpr, LRB: tl.constexpr, LBK: tl.constexpr, SCALED: tl.constexpr = False,
                          IDX=None, GATHER: tl.constexpr = False, WS=None, CTR=None, SPLIT: tl.constexpr = 1,
                          LAJ: tl.constexpr = 1):
    # _gemv_mma_kernel with the rows' LoRA deltas: a 1-D grid, the LS * LKSPLIT * LAJ shrink pieces first (tickets),
    # then (pid, s) = divmod(ticket - pieces, SPLIT); the storing program adds the rows' deltas
    t = tl.atomic_add(LCTR, 1)
    n_pieces = LS * LKSPLIT * LAJ
    if t < n_pieces:
        lora_piece(t, X, X, X, IDX, AD, LA, LRANKS, LWS, LCTR, M, K, l_per, stride_xm, 0, l_sal, l_sar, 0.0,
                   X.dtype.element_ty, LS, LKSPLIT, LRB, BLOCK_M, LBK, False, False, GATHER, False, PDL, LAJ)
    else:
        b = t - n_pieces
        _mma_columns(b // SPLIT, b % SPLIT, X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, UP_OFF,
                     BLOCK_M, BLOCK_N, BLOCK_K, GLU, PDL, SCALED, IDX, GATHER, WS, CTR, SPLIT, True, AD, LB,
                     LRANKS, LWS, LCTR, l_per, l_sbl, l_sbr, L_N0, L_N1, n_pieces, LKSPLIT, LRB)
    lora_arrive(LCTR, tl.num_programs(0))


@triton.jit
def _mma_columns(pid, pid_k, X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, UP_OFF, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr,
                 SCALED: tl.constexpr, IDX, GATHER: tl.constexpr, WS, CTR, SPLIT: tl.constexpr, LORA: tl.constexpr,
                 AD, LB, LRANKS, LWS, LCTR, l_per, l_sbl, l_sbr, L_N0, L_N1, n_pieces, LKSPLIT: tl.constexpr,
                 LRB: tl.constexpr):
    k_per = K // SPLIT  # a multiple of BLOCK_K (mma_split() checks)
    # told to the compiler: K // SPLIT has no known factor past 16 // SPLIT, so the weights' chunks would load 8 bytes
    # at a time at 4 splits, 4 at 8 (sm_90 PTX, Triton 3.6), not 16
    k_lo = tl.multiple_of(pid_k * k_per, BLOCK_K)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    mn = rn < N
    rm = tl.arange(0, BLOCK_M)  # [BM] rows, >= M masked
    mm = rm < M
    rk0 = k_lo + tl.arange(0, BLOCK_K)
    dt = X.dtype.element_ty
    w_cols = W + rn.to(tl.int64)[None, :] * stride_wn  # [1, BN]: weight row n is the tile's column n
    # the first chunk of weights depends on no kernel: read while the kernel before still runs (kernels/pdl.py)
    w = tl.load(w_cols + rk0[:, None], mask=mn[None, :], other=0.0)  # [BK, BN]
    u = w
    if GLU:
        u = tl.load(w_cols + UP_OFF * stride_wn + rk0[:, None], mask=mn[None, :], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if GATHER:  # the rows are X's (a table [R, K]) rows IDX [M], written by the kernel before: read after the wait
        x_rows = X + tl.load(IDX + rm, mask=mm, other=0).to(tl.int64) * stride_xm
    else:
        x_rows = X + rm.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x = tl.load(x_rows[:, None] + rk0[None, :], mask=mm[:, None], other=0.0).to(dt)  # [BM, BK]
    acc = tl.dot(x, w.to(dt), acc)
    if GLU:
        acc_u = tl.dot(x, u.to(dt), acc_u)
    for k0 in range(BLOCK_K, k_per, BLOCK_K):  # K % BLOCK_K == 0 (mma_blocks() checks)
        rk = k0 + rk0
        w = tl.load(w_cols + rk[:, None], mask=mn[None, :], other=0.0)
        x = tl.load(x_rows[:, None] + rk[None, :], mask=mm[:, None], other=0.0).to(dt)
        acc = tl.dot(x, w.to(dt), acc)
        if GLU:
            u = tl.load(w_cols + UP_OFF * stride_wn + rk[:, None], mask=mn[None, :], other=0.0)
            acc_u = tl.dot(x, u.to(dt), acc_u)
    if SPLIT == 1:
        _mma_store(S, Y, acc, acc_u, rm, rn, mm, mn, M, stride_ym, UP_OFF, SCALED, GLU, LORA, AD, LB, LRANKS, LWS,
                   LCTR, l_per, l_sbl, l_sbr, L_N0, L_N1, n_pieces, LKSPLIT, LRB, BLOCK_M, BLOCK_N, pid * BLOCK_N, N)
    else:
        ws_rows = WS + (pid_k * BLOCK_M + rm).to(tl.int64)[:, None] * (2 * N) + rn[None, :]  # [BM, BN]
        tl.store(ws_rows, acc, mask=mn[None, :])
        if GLU:
            tl.store(ws_rows + N, acc_u, mask=mn[None, :])
        tl.debug_barrier()  # every thread's partial sums stored before the arrival (release: visible with it)
        arrived = tl.atomic_add(CTR + pid, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last: every other split's sums are visible (acquire)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for sk in range(SPLIT):
                part = WS + (sk * BLOCK_M + rm).to(tl.int64)[:, None] * (2 * N) + rn[None, :]
                acc += tl.load(part, mask=mn[None, :], other=0.0, cache_modifier=".cg")
                if GLU:
                    acc_u += tl.load(part + N, mask=mn[None, :], other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(CTR + pid, 0)  # for the next call (which reads it only after its PDL wait)
            _mma_store(S, Y, acc, acc_u, rm, rn, mm, mn, M, stride_ym, UP_OFF, SCALED, GLU, LORA, AD, LB, LRANKS,
                       LWS, LCTR, l_per, l_sbl, l_sbr, L_N0, L_N1, n_pieces, LKSPLIT, LRB, BLOCK_M, BLOCK_N,
                       pid * BLOCK_N, N)


@triton.jit
def _mma_store(S, Y, acc, acc_u, rm, rn, mm, mn, M, stride_ym, UP_OFF, SCALED: tl.constexpr, GLU: tl.constexpr,
               LORA: tl.constexpr, AD, LB, LRANKS, LWS, LCTR, l_per, l_sbl, l_sbr, L_N0, L_N1, n_pieces,
               LKSPLIT: tl.constexpr, LRB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, n0, N):
    y = acc
    if SCALED:  # FP8 weights: a float32 scale per output channel (gate's, then up's at UP_OFF)
        y = y * tl.load(S + rn, mask=mn, other=0.0)[None, :]
    yu = acc_u
    if GLU:
        if SCALED:
            yu = yu * tl.load(S + UP_OFF + rn, mask=mn, other=0.0)[None, :]
    if LORA:  # the rows' LoRA deltas of these columns (gate's and up's), once the shrink pieces are in
        ad = tl.load(AD + rm // l_per, mask=mm, other=-1)
        if tl.max(ad, axis=0) >= 0:
            lora_wait(LCTR, n_pieces)
            n_all = N * (2 if GLU else 1)
            y += lora_tile(LWS, AD, LB, LRANKS, M, l_per, n0, rn, n_all, L_N0, L_N1, l_sbl, l_sbr,
                           Y.dtype.element_ty, LKSPLIT, LRB, BLOCK_M, BLOCK_N, False)
            if GLU:
                yu += lora_tile(LWS, AD, LB, LRANKS, M, l_per, n0 + UP_OFF, rn + UP_OFF, n_all, L_N0, L_N1, l_sbl,
                                l_sbr, Y.dtype.element_ty, LKSPLIT, LRB, BLOCK_M, BLOCK_N, False)
    if GLU:
        y = y / (1.0 + tl.exp(-y)) * yu
    tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


# (m, n, k, glu, norm) -> (BLOCK_N, BLOCK_K, num_warps, num_stages): CSM-1B's shapes at 1-2 rows (kernels/tuning.py);
# any other shape takes blocks()' rule with NUM_WARPS and Triton's default stages (3+ rows: mma_blocks())
TUNED: dict[tuple[int, int, int, bool, bool], tuple[int, int, int, int]] = dict(tuning.GEMV)
TUNED_FP8: dict[tuple[int, int, int, bool, bool], tuple[int, int, int, int]] = dict(tuning.GEMV_FP8)  # e4m3 weights
_MMA_ELEMS = 8192  # weights per program per chunk, per gate/up tile (4,096: slower at 16 rows)
_MMA_PROGRAMS = 256
MMA_WARPS, MMA_STAGES = 4, 4
# the most splits over K of the tensor-core kernel: mma_split() splits a GEMM whose column blocks alone give
# < _MMA_PROGRAMS programs (the K = 8,192 down projections: 64-128) while each split keeps >= 2 chunks
MMA_SPLIT = 8


def config(m: int, n: int, k: int, glu: bool = False, norm: bool = False, fp8: bool = False
           ) -> tuple[int, int, int, int | None]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages or None) for an [m, k] @ [n, k]^T; the caller checks `applies`.
    FP8 weights take their own table (TUNED_FP8), else the rule."""
    tuned = (TUNED_FP8 if fp8 else TUNED).get((m, n, k, glu, norm))
    if tuned is not None:
        return tuned
    bn, bk = blocks(m, n, k, glu)
    return (bn, bk, MMA_WARPS, MMA_STAGES) if m > ELEMENTWISE_ROWS else (bn, bk, NUM_WARPS, None)


def _launch_opts(warps: int, stages: int | None) -> dict:
    return {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}


def blocks(m: int, n: int, k: int, glu: bool = False) -> tuple[int, int] | None:
    """(BLOCK_N, BLOCK_K) for an [m, k] @ [n, k]^T, or None where this kernel does not apply. The same for e4m3
    weights: the fp32 accumulator tiles, not the weight bytes, set the chunk (16K for e4m3 measured slower)."""
    if m > ELEMENTWISE_ROWS:
        return mma_blocks(m, n, k, glu)
    if not 1 <= m or k < 128:
        return None
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < _PROGRAMS:
        block_n //= 2
    tiles = m * (2 if glu else 1)  # fp32 accumulator tiles: ~64 registers a thread in all
    block_k = min(triton.next_power_of_2(k), max(128, _ELEMS // tiles // block_n))
    if k % block_k:
        return None
    return block_n, block_k


def mma_blocks(m: int, n: int, k: int, glu: bool = False) -> tuple[int, int] | None:
    """(BLOCK_N, BLOCK_K) of the tensor-core kernel at 3..MAX_ROWS rows, or None: the widest
    BLOCK_N (16-64) that still gives ~256 programs, BLOCK_K so that a chunk is ~8K weights (per gate/up tile) and its
    input tile [16, BLOCK_K] at most 8K elements."""
    if not ELEMENTWISE_ROWS < m <= MAX_ROWS or k < 128:
        return None
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < _MMA_PROGRAMS:
        block_n //= 2
    block_k = min(triton.next_power_of_2(k), max(64, min(_MMA_ELEMS // block_n, 8192 // MMA_TILE)))
    if k % block_k:
        return None
    return block_n, block_k


def mma_split(n: int, k: int, block_n: int, block_k: int, most: int | None = None) -> int:
    """Splits over K for the tensor-core kernel (a power of two <= most, MMA_SPLIT by default)."""
    most = MMA_SPLIT if most is None else most
    split, tiles = 1, triton.cdiv(n, block_n)
    while split * 2 <= most and tiles * split < _MMA_PROGRAMS and k % (block_k * split * 2) == 0 \
            and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


# (device, splits, N, column blocks) -> (WS [splits, MMA_TILE, 2N] fp32, CTR [blocks] int32 zeros): one pair per
# shape, shared by its GEMMs (they run one after the other on the stream; a PDL kernel touches them after its wait)
_SPLIT_BUFS: dict[tuple, tuple[Tensor, Tensor]] = {}


def _split_bufs(device: torch.device, split: int, n: int, tiles: int) -> tuple[Tensor, Tensor] | None:
    key = (device, split, n, tiles)
    bufs = _SPLIT_BUFS.get(key)
    if bufs is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # never made inside a capture (it would live in the graph's pool): no split this time
        bufs = _SPLIT_BUFS[key] = (torch.empty(split, MMA_TILE, 2 * n, dtype=torch.float32, device=device),
                                   torch.zeros(tiles, dtype=torch.int32, device=device))
    return bufs


def applies(x: Tensor, weight: Tensor, glu: bool = False, scale: Tensor | None = None, lora=None) -> bool:
    """scale: FP8 weights' [N] (or [1, N]) float32 per-channel scales; then weight is e4m3. lora: the layer's LoRA
    weights in this forward (models/lora.py LoraLayer): fused into the kernel (its column blocks never straddle two
    of the projection's slices)."""
    m = x.numel() // x.shape[-1]
    n = weight.shape[0] // (2 if glu else 1)
    wdt = x.dtype if scale is None else torch.float8_e4m3fn
    k = x.shape[-1]
    bk = blocks(m, n, k, glu)
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == wdt
            and (scale is None or (scale.dtype == torch.float32 and scale.is_contiguous()
                                   and scale.numel() == weight.shape[0]))
            and weight.stride(-1) == 1 and bk is not None
            and (lora is None or _lora_applies(x, lora, {bk[0]} | {config(m, n, k, glu, norm, scale is not None)[0]
                                                                    for norm in (False, True)})))


def _lora_applies(x: Tensor, lora, block_ns: set[int]) -> bool:
    """The LoRA fits the kernel: its dtype, column blocks (the rule's and the tuned ones) inside one slice each."""
    from csmserve.kernels import lora as kl

    t = lora.target
    return kl.applies(x, lora) and all(b % bn == 0 for b in t.bounds if b < t.n for bn in block_ns) and \
        kl.piece_block(t.k) >= 16


def _lora_args(lora, m: int) -> tuple[dict, int]:
    """The kernels' LoRA arguments for a LoraLayer at m rows, and its shrink pieces (programs before the others)."""
    from csmserve.kernels import lora as kl

    t = lora.target
    ksplit = kl.pieces(t.k)
    rb = kl.rank_block(lora)
    ws, ctr = lora.scratch(rb)
    a, b = lora.a, lora.b
    kw = dict(AD=lora.rows, LA=a, LB=b, LRANKS=lora.pool.ranks, LWS=ws, LCTR=ctr,
              l_per=m // lora.rows.shape[0], l_sal=a.stride(0), l_sar=a.stride(1), l_sbl=b.stride(0),
              l_sbr=b.stride(1), L_N0=t.bounds[0], L_N1=t.bounds[1], LS=len(t.slices), LKSPLIT=ksplit, LRB=rb,
              LBK=kl.piece_block(t.k), LAJ=kl.adapter_split(lora))
    return kw, len(t.slices) * ksplit * kw["LAJ"]


def _launch(x, delta, h, nw, weight, scale, y, M, N, K, strides, eps, *, glu, norm, has_delta=False, pre_k=0,
            idx=None, cfg=None, lora=None) -> None:
    """One launch of the kernel for M rows: _gemv_kernel at 1-2, _gemv_mma_kernel at 3..MAX_ROWS (no norm
    there). strides: (x, delta, h) row strides; cfg: (BLOCK_N, BLOCK_K, warps, stages[, splits]) in place of
    config()'s (and mma_split()'s)."""
    cfg = cfg or config(M, N, K, glu, norm, fp8=scale is not None)
    bn, bk, warps, stages = cfg[:4]
    sx, sd, sh = strides
    s = weight if scale is None else scale
    kw = dict(BLOCK_N=bn, BLOCK_K=bk, GLU=glu, SCALED=scale is not None, **_launch_opts(warps, stages), **pdl.opts())
    if idx is not None:
        kw.update(IDX=idx, GATHER=True)
    grid = (triton.cdiv(N, bn),)
    pieces = 0
    if lora is not None:  # one 1-D grid: the shrink pieces' tickets first, then the column blocks' (and splits')
        lkw, pieces = _lora_args(lora, M)
        kw.update(lkw)
    if M > ELEMENTWISE_ROWS:
        split = cfg[4] if len(cfg) > 4 else mma_split(N, K, bn, bk)
        bufs = _split_bufs(x.device, split, N, grid[0]) if split > 1 else None
        if bufs is not None:
            kw.update(WS=bufs[0], CTR=bufs[1], SPLIT=split)
            grid = (grid[0], split)
        if lora is not None:
            grid = (pieces + grid[0] * (split if bufs is not None else 1),)
        kernel = _gemv_mma_kernel if lora is None else _gemv_mma_lora_kernel
        kernel[grid](x, weight, s, y, M, N, K, sx, weight.stride(0), y.stride(0), N, BLOCK_M=MMA_TILE, **kw)
    else:
        grid = (pieces + grid[0],)
        kernel = _gemv_kernel if lora is None else _gemv_lora_kernel
        kernel[grid](x, delta, h, nw, weight, s, y, M, N, K, sx, sd, sh, weight.stride(0), y.stride(0), N, eps,
                     NORM=norm, HAS_DELTA=has_delta, PRE_K=pre_k if pre_k else bk, TWO_ROWS=M > 1, **kw)


def gemv(x: Tensor, weight: Tensor, glu: bool = False, scale: Tensor | None = None, cfg=None, lora=None) -> Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] (glu: weight [2I, K] -> silu(gate) * up [..., I]); scale: FP8
    weights (e4m3 weight, [N] float32 scales). The caller checks `applies` (else F.linear / FP8Linear).
    cfg: a launch configuration to try (bench/gemv.py)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    N = weight.shape[0] // (2 if glu else 1)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _launch(x2, x2, x2, x2, weight, scale, y, M, N, K, (x2.stride(0), 0, 0), 0.0, glu=glu, norm=False, cfg=cfg,
            lora=lora)
    return y.reshape(*x.shape[:-1], N)


def gather_applies(idx: Tensor, table: Tensor, weight: Tensor, scale: Tensor | None = None, lora=None) -> bool:
    return lora is None and (idx.dim() == 1 and idx.dtype == torch.int64 and idx.is_cuda and table.dim() == 2
            and table.stride(-1) == 1 and len(idx) <= len(table) and applies(table[:len(idx)], weight, False, scale))


def gather_gemv(idx: Tensor, table: Tensor, weight: Tensor, scale: Tensor | None = None, lora=None) -> Tensor:
    """table[idx] @ weight^T without the gathered rows in memory: idx [M] int64 (rows of table [R, K]) -> [M, N].
    The embedding before the depth decoder's projection, in the projection's kernel: one launch less per depth
    step, and none of torch's between two PDL kernels. The caller checks `gather_applies`."""
    M, K = len(idx), table.shape[1]
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=table.dtype, device=table.device)
    _launch(table, table, table, table, weight, scale, y, M, N, K, (table.stride(0), 0, 0), 0.0, glu=False,
            norm=False, idx=idx, lora=lora)
    return y


def norm_applies(x: Tensor, norm_weight: Tensor, weight: Tensor, glu: bool = False,
                 scale: Tensor | None = None, lora=None) -> bool:
    return (applies(x, weight, glu, scale, lora) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
            and x.numel() // x.shape[-1] <= ELEMENTWISE_ROWS)


def pre_k(m: int, k: int, block_k: int) -> int:
    """The fused norm's sum-of-squares chunk (1-2 rows): a power of two >= BLOCK_K dividing K, up to 4,096 products a
    row."""
    per_row = 4096 // m
    pre = block_k
    while pre * 2 <= per_row and k % (pre * 2) == 0:
        pre *= 2
    return pre


def norm_gemv(x: Tensor, delta: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
              glu: bool = False, scale: Tensor | None = None, cfg=None, lora=None) -> tuple[Tensor, Tensor]:
    """(h, gemv(rms_norm(h) * norm_weight, weight)) with h = x + delta (or x): add_rms_norm and the GEMM
    after it in one kernel at 1-2 rows. x/delta [..., K]; the caller checks `norm_applies`."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    d2 = x2 if delta is None else delta.reshape(-1, K).contiguous()
    h = x2 if delta is None else torch.empty_like(x2)
    M = x2.shape[0]
    if M > ELEMENTWISE_ROWS:
        raise ValueError(f"norm_gemv runs at 1-{ELEMENTWISE_ROWS} rows, got {M}")
    N = weight.shape[0] // (2 if glu else 1)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cfg = cfg or config(M, N, K, glu, True, fp8=scale is not None)
    _launch(x2, d2, h, norm_weight, weight, scale, y, M, N, K, (x2.stride(0), d2.stride(0), h.stride(0)), eps,
            glu=glu, norm=True, has_delta=delta is not None, pre_k=pre_k(M, K, cfg[1]), cfg=cfg, lora=lora)
    return h.reshape(x.shape), y.reshape(*x.shape[:-1], N)
