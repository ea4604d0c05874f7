"""Batched LoRA over a batch's rows, each row its own adapter (or none): y += B_a (A_a x) for row adapter a.

The pool (models/lora.py LoraPool) holds `L` adapters: per projection A [L, R, S, K] (S slices: q,k,v / gate,up /
one) and B [L, R, N] (scales folded in; column n belongs to slice s(n)); RANKS [L] each slot's rank (no row past it is
read); AD [B] int32 each batch row's slot, -1: none (data: the CUDA graphs hold one buffer). x has M = B * rows_per
rows, a batch row's positions consecutive. Rows are walked in tiles of BM; a tile takes the adapters of its rows one
at a time (the smallest index first, its rows masked in), so rows sorted by adapter (the scheduler orders a step's
rows so) read each adapter's A and B once per tile, not once per row; a tile of rows without adapters does nothing.

    shrink:  xa [M, S, R] = x A_a^T per slice (rounded to the model dtype, as PEFT's lora_A(x) is)
    expand:  y[:, slice s] += xa[:, s] B_a[:, slice s]   (in place)  | GLU: h = silu(g + dg) * (u + du)

Above the GEMV's rows (kernels/gemv.py, 1-16 rows, where the LoRA is fused into the GEMV itself) the base GEMM is
cuBLAS and this file runs after it: `lora_add_` (y += delta) and `lora_glu` (the MLP's SiLU*up with the gate and up
deltas added first: the LoRA replaces silu_mul's kernel, the expand costs no pass over the [M, 2I] output). Up to
TICKET_ROWS (256) rows one launch, the ticketed kernel (below: the shrink in pieces over K, the expand waiting on
them); past it two: the shrink in programs of SHRINK_ROWS rows x SHRINK_PIECE of K, their fp32 sums added in order
by the expand. lora_glu also makes the down projection's shrink of the adapter rows' h (a piece a column block, in
registers; past TICKET_ROWS a piece a column group, in a second pass over the group's blocks of h from L2), left on
the down's LoraLayer: the down's lora_add_ of that h runs no shrink (h [M, I] not read again from memory). A batch
whose every row has one adapter runs it merged into the weights instead (engine/runner.py, models/lora.py
LoraMerge): these kernels serve batches that mix adapters.

Cost (rank 16 on all 591 LoRA'd projections a frame, one H100; the history: docs/benchmarks.md "Issue 42"): a step
with no adapter row does not run these kernels (engine/graphs.py: the plain graphs replay) and a lone adapter runs
merged, both at the base's step. A mixed batch over 64 adapters (`c9fcc1f`'s kernels): 64 rows 22.1 ms against the
base's 8.4, 256 rows 25.2 (11.2), 512 rows 26.9 (15.9), 2,048 rows 59.9 against 51.6 (+16.0%; at `0a05861`, before
the down's shrink moved into the GLU: 128 rows 23.6 (9.4), 1,024 36.8 (27.7), and at 2,048 the GLU 51 us a call where
silu_mul's pass alone needs 36, the down's shrink 21 us, the expands ~13 us a layer, the other shrinks ~11, the rest
~1,000 short launches). At a few rows each call is ~20 us of chained latency (shrink, tickets, expand).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from csmserve.kernels import pdl

# past TICKET_ROWS the shrink's programs: row tiles of SHRINK_ROWS x K pieces of SHRINK_PIECE, at most SHRINK_PIECES
# a K (fp32 sums added in order by the expand, whose every column block re-reads them all): 2,048 rows of the K =
# 8,192 down projection are 512 programs of 16 chunks, not 64 of 128
SHRINK_ROWS = 16
SHRINK_WIDE_FROM = 2048  # from this many rows the shrink's row tiles are 2 x SHRINK_ROWS (adapters' runs are longer)
SHRINK_PIECE = 256
SHRINK_PIECES = 8  # K = 8,192 in pieces of 1,024 (32 of 256: 2,048 x 64 0.6 ms a frame slower)
GLU_ROWS = 16  # past TICKET_ROWS the GLU's row tile (1,024 programs at 2,048 rows: 32-row tiles left SMs idle)
# its column groups: at least GLU_GROUPS, raised until row tiles x groups reach GLU_PROGRAMS (512 rows: 32 groups;
# 8 there left the GPU half idle, 1.0 ms a frame)
GLU_GROUPS = 8
GLU_PROGRAMS = 1024
EXPAND_ROWS = 32  # past TICKET_ROWS the expand's row tile
_BIG = tl.constexpr(1 << 30)  # past any adapter index (a tile's next adapter is the smallest index left)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 operands: exact products, not TF32 (the CPU-parity dtype)
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def shrink_rows(x_rows, sel, a_base, stride_ar, rank, K, k_lo, k_hi, S: tl.constexpr, RB: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """xa [BM, RB] per slice (fp32) = x[sel rows, k_lo:k_hi] A[:, :, k_lo:k_hi]^T: x_rows [BM] row pointers, a_base
    the adapter's A [R, S, K] (slices K apart, rank rows stride_ar apart); rows outside sel, ranks >= rank: zero."""
    rr = tl.arange(0, RB)
    xa0 = tl.zeros([BM, RB], dtype=tl.float32)
    xa1 = tl.zeros([BM, RB], dtype=tl.float32)
    xa2 = tl.zeros([BM, RB], dtype=tl.float32)
    a_cols = a_base + rr.to(tl.int64)[None, :] * stride_ar  # [1, RB]
    ma = (rr < rank)[None, :]
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < k_hi
        x = tl.load(x_rows[:, None] + rk[None, :], mask=sel[:, None] & mk[None, :], other=0.0)  # [BM, BK]
        m = mk[:, None] & ma
        xa0 = _dot(x, tl.load(a_cols + rk[:, None], mask=m, other=0.0), xa0, IEEE)  # A^T tile [BK, RB]
        if S > 1:
            xa1 = _dot(x, tl.load(a_cols + K + rk[:, None], mask=m, other=0.0), xa1, IEEE)
        if S > 2:
            xa2 = _dot(x, tl.load(a_cols + 2 * K + rk[:, None], mask=m, other=0.0), xa2, IEEE)
    return xa0, xa1, xa2


@triton.jit
def expand_tile(xa, b_base, stride_br, rank, rn, N, RB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                IEEE: tl.constexpr):
    """xa [BM, RB] (model dtype) @ B[:, rn] [RB, BN] -> [BM, BN] fp32 (columns rn of the adapter's B [R, N])."""
    rr = tl.arange(0, RB)
    b = tl.load(b_base + rr.to(tl.int64)[:, None] * stride_br + rn[None, :],
                mask=(rr < rank)[:, None] & (rn < N)[None, :], other=0.0)
    return _dot(xa, b, tl.zeros([BM, BN], dtype=tl.float32), IEEE)


@triton.jit
def row_tile(pid_m, AD, M, rows_per, BM: tl.constexpr, PDL: tl.constexpr):
    """A program's rows rm [BM], their mask and adapters [BM] (-1: none), after the PDL wait (the rows' inputs and
    adapters are written by the kernels before)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rm = pid_m * BM + tl.arange(0, BM)
    mm = rm < M
    return rm, mm, tl.load(AD + rm // rows_per, mask=mm, other=-1)


@triton.jit
def glu_block(g_rows, y_rows, rn, m2, N, dg, du, DELTA: tl.constexpr):
    """y[:, rn] = silu(g + dg) * (u + du) for the rows in m2 [BM, BN]: g, u the gate_up's columns rn, N + rn."""
    dt = y_rows.dtype.element_ty
    g = tl.load(g_rows[:, None] + rn[None, :], mask=m2, other=0.0)
    u = tl.load(g_rows[:, None] + N + rn[None, :], mask=m2, other=0.0)
    if DELTA:
        g = (g.to(tl.float32) + dg.to(tl.float32)).to(dt)
        u = (u.to(tl.float32) + du.to(tl.float32)).to(dt)
    g = g.to(tl.float32)
    h = (g / (1.0 + tl.exp(-g)) * u.to(tl.float32)).to(dt)
    tl.store(y_rows[:, None] + rn[None, :], h, mask=m2)
    return h


@triton.jit
def _lora_kernel(GU, Y, XA, B, RANKS, AD, DA, XD, M, N, rows_per, stride_gm, stride_ym, stride_bl, stride_br,
                 stride_dl, stride_dr, N0, N1, S: tl.constexpr, RB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 GLU: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, KS: tl.constexpr, DOWN: tl.constexpr):
    # program (row tile, column group g of G): xa from _shrink_kernel's KS pieces XA [KS, M, S, RB] (fp32), then y's
    # column blocks g, g + G, ... updated (not GLU: G = the column blocks, one a program, and only its slice's xa).
    # GLU: GU is the base gate_up [M, 2N] (cuBLAS'), Y = silu(gate + dg) * (up + du) [M, N] for EVERY row
    # (rows without an adapter too: this kernel is the MLP's silu_mul); slices 0 / 1 = gate / up (B columns N apart).
    # DOWN (GLU): also the down projection's shrink of the adapter rows' h, piece g = its column blocks' h A_down^T:
    # XD [G, M, 1, RB] (fp32), DA the down's A [L, R, 1, N] (h not read again: lora_add_ of the down expands these)
    pid_g = tl.program_id(1)
    G = tl.num_programs(1)
    rm, mm, ad = row_tile(tl.program_id(0), AD, M, rows_per, BM, PDL)
    if GLU:  # the rows without an adapter take the loop too (a = -1: no delta)
        todo = mm
    else:
        todo = ad >= 0
    rr = tl.arange(0, RB)
    g_rows = GU + rm.to(tl.int64) * stride_gm
    y_rows = Y + rm.to(tl.int64) * stride_ym
    xa_rows = XA + rm.to(tl.int64) * (S * RB)
    dt = Y.dtype.element_ty
    n_blocks = tl.cdiv(N, BN)
    rn1 = pid_g * BN + tl.arange(0, BN)  # not GLU: the program's one column block, in slice s0
    s0 = 0 if GLU else (pid_g * BN >= N0).to(tl.int32) + (pid_g * BN >= N1).to(tl.int32)
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        a = tl.min(tl.where(todo, ad, _BIG), axis=0)  # the tile's next adapter (rows sorted: usually one or two)
        sel = todo & (ad == a)
        todo = todo & (ad != a)
        has = a >= 0
        a_l = tl.maximum(a, 0).to(tl.int64)
        rank = tl.load(RANKS + a_l) * has.to(tl.int32)  # 0 for rows without an adapter: nothing read past it
        # the shrink's KS pieces added in order, rounded as PEFT's lora_A(x) is: the GLU's gate and up (slices 0, 1),
        # else the slice of this program's one column block (BN divides the slice bounds)
        mx = (sel & (ad >= 0))[:, None]  # not m2: the loop below makes its own [BM, BN] (a loop-carried name)
        xa0 = tl.zeros([BM, RB], dtype=tl.float32)
        xa1 = tl.zeros([BM, RB], dtype=tl.float32)
        for p in range(KS):
            piece = xa_rows[:, None] + p * M * (S * RB) + s0 * RB + rr[None, :]
            xa0 += tl.load(piece, mask=mx, other=0.0)
            if GLU:
                xa1 += tl.load(piece + RB, mask=mx, other=0.0)
        xa0, xa1 = xa0.to(dt), xa1.to(dt)
        b_base = B + a_l * stride_bl
        # GLU: two loops, not a branch in one (the deltas' layout, the dot's, never reaches the plain rows' loads),
        # each pipelined 3 deep: gate and up copied ahead into shared memory and read there in the dot's layout
        # (Triton's default pipelines only B's loads: 3 layout conversions a block, 115 registers, not 1 and 96)
        if GLU:
            if has:
                xd = tl.zeros([BM, RB], dtype=tl.float32)
                da_cols = DA + a_l * stride_dl + rr.to(tl.int64)[None, :] * stride_dr  # [1, RB]
                for nb in tl.range(pid_g, n_blocks, G, num_stages=3):
                    rn = nb * BN + tl.arange(0, BN)
                    # the deltas rounded to the model dtype before the add, as the torch path's
                    dg = expand_tile(xa0, b_base, stride_br, rank, rn, N, RB, BM, BN, IEEE).to(dt)
                    du = expand_tile(xa1, b_base + N, stride_br, rank, rn, N, RB, BM, BN, IEEE).to(dt)
                    glu_block(g_rows, y_rows, rn, sel[:, None] & (rn < N)[None, :], N, dg, du, True)
                # DOWN: a second pass over this program's blocks of h, from L2 (stored above: the barrier); the dot
                # inside the loop above held 168 registers, not 128 (docs/tried-and-dropped.md)
                if DOWN:
                    tl.debug_barrier()
                    for nb in tl.range(pid_g, n_blocks, G, num_stages=3):
                        rn = nb * BN + tl.arange(0, BN)
                        h = tl.load(y_rows[:, None] + rn[None, :], mask=sel[:, None] & (rn < N)[None, :], other=0.0)
                        w = tl.load(da_cols + rn[:, None], mask=(rn < N)[:, None] & (rr < rank)[None, :], other=0.0)
                        xd = _dot(h, w, xd, IEEE)
                    xd_ptr = XD + (pid_g * M + rm).to(tl.int64)[:, None] * RB + rr[None, :]
                    tl.store(xd_ptr, xd, mask=sel[:, None])
            else:
                for nb in tl.range(pid_g, n_blocks, G, num_stages=3):
                    rn = nb * BN + tl.arange(0, BN)
                    glu_block(g_rows, y_rows, rn, sel[:, None] & (rn < N)[None, :], N, 0.0, 0.0, False)
        else:
            m2 = sel[:, None] & (rn1 < N)[None, :]
            d = expand_tile(xa0, b_base, stride_br, rank, rn1, N, RB, BM, BN, IEEE).to(dt)
            y = tl.load(y_rows[:, None] + rn1[None, :], mask=m2, other=0.0)
            tl.store(y_rows[:, None] + rn1[None, :], (y.to(tl.float32) + d.to(tl.float32)).to(dt), mask=m2)


@triton.jit
def _shrink_kernel(X, XA, A, RANKS, AD, M, K, rows_per, stride_xm, stride_al, stride_ar, S: tl.constexpr,
                   RB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, KP: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr):
    # program (row tile, K piece p of KP): XA[p, rows] [BM, S, RB] (fp32) = x[rows, piece] A_a[:, s, piece]^T, each row
    # with its adapter (the tile's adapters one at a time; rows without one: zeros). Pieces of a fixed KP: a row's
    # sums, and their order, the same at every batch size
    p = tl.program_id(1)
    rm, mm, ad = row_tile(tl.program_id(0), AD, M, rows_per, BM, PDL)
    todo = ad >= 0
    x_rows = X + rm.to(tl.int64) * stride_xm
    acc0 = tl.zeros([BM, RB], dtype=tl.float32)
    acc1 = tl.zeros([BM, RB], dtype=tl.float32)
    acc2 = tl.zeros([BM, RB], dtype=tl.float32)
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        a = tl.min(tl.where(todo, ad, _BIG), axis=0)
        sel = todo & (ad == a)
        todo = todo & (ad != a)
        a_l = a.to(tl.int64)
        xa0, xa1, xa2 = shrink_rows(x_rows, sel, A + a_l * stride_al, stride_ar, tl.load(RANKS + a_l), K, p * KP,
                                    p * KP + KP, S, RB, BM, BK, IEEE)
        acc0 += xa0
        acc1 += xa1
        acc2 += xa2
    rr = tl.arange(0, RB)
    out = XA + (p * M + rm).to(tl.int64)[:, None] * (S * RB) + rr[None, :]  # [BM, RB]
    m2 = mm[:, None] & (rr < RB)[None, :]
    tl.store(out, acc0, mask=m2)
    if S > 1:
        tl.store(out + RB, acc1, mask=m2)
    if S > 2:
        tl.store(out + 2 * RB, acc2, mask=m2)


# --------------------------------------------------------------------------------- 1-256 rows: the ticketed kernel
# At a few rows the shrink is a reduction over K of a few rows: one program per column block (the expand) would each
# read all of A again, and one program per row reads A [R, K] alone (a latency of microseconds for K = 8,192). So
# the shrink is cut into pieces (slice s, a K range of PIECE_K), each a program of its own, and the programs that
# update y's column blocks wait for them. Programs take their role from a ticket (an atomic counter: the first NP
# tickets are the pieces), so a program that waits only waits for programs that are already running (the ordering
# CUB's decoupled look-back relies on): no deadlock whatever order the GPU starts them in. The pieces' partial sums
# [NP, 16, RB] (fp32) are added in a fixed order by every reader: the same bits every run. The last program to
# finish resets the counters for the next launch (the same call site runs again only kernels later). The GEMV
# (kernels/gemv.py) runs the same pieces and epilogue inside its own grid: no launch of its own at batch 1. Past 16
# rows the same launch runs row tiles of 16, pieces and column blocks per tile (tile-major), every column block
# waiting for every piece, each tile's programs split by adapter over ADAPTER_SPLIT // tiles (32- and 64-row tiles
# measured slower at 64-256 rows; past 256 rows the shrink and expand apart win: docs/tried-and-dropped.md).
TICKET_ROWS = 256  # lora_add_ / lora_glu run the ticketed kernel up to here; past it lora_shrink + _expand
TICKET_TILE = 16  # its row tile (the GEMV's rows)
PIECE_K = 512  # K per shrink piece ([16, 512] of x and [512, R] of A per adapter)
# up to TICKET_ROWS each piece and column block in ADAPTER_SPLIT // tiles programs, by pool slot % that (at 1-16 rows
# at most the rows' count: 32 and 16 alike there); 16: 5.0-5.5 ms a frame slower at 64-256 rows over 64 adapters
ADAPTER_SPLIT = 32


@triton.jit
def x_rows_of(X, IDX, rm, mm, stride_xm, GATHER: tl.constexpr):
    """Row pointers [BM] of x: X's rows, or (GATHER) the rows IDX[m] of the table X (the depth step's embedding)."""
    if GATHER:
        return X + tl.load(IDX + rm, mask=mm, other=0).to(tl.int64) * stride_xm
    return X + rm.to(tl.int64) * stride_xm


@triton.jit
def norm_rstd(x_rows, d_rows, mm, K, eps, dt, HAS_DELTA: tl.constexpr, BK: tl.constexpr):
    """1 / rms [BM] of each row of h = x + delta (the sum rounded to dt, as `x + delta` rounds it)."""
    ss = tl.zeros([x_rows.shape[0], BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        m2 = mm[:, None] & (rk < K)[None, :]
        h = tl.load(x_rows[:, None] + rk[None, :], mask=m2, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(d_rows[:, None] + rk[None, :], mask=m2, other=0.0).to(tl.float32)).to(dt)
        ss += h.to(tl.float32) * h.to(tl.float32)
    return tl.rsqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def x_chunk(x_rows, d_rows, NW, rk, m2, rstd, dt, NORM: tl.constexpr, HAS_DELTA: tl.constexpr):
    """The rows' input chunk [BM, BK] in dt: x, or rms_norm(x + delta) * nw rounded as kernels/gemv.py's is."""
    x = tl.load(x_rows[:, None] + rk[None, :], mask=m2, other=0.0)
    if NORM:
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(d_rows[:, None] + rk[None, :], mask=m2, other=0.0).to(tl.float32)).to(dt)
        nw = tl.load(NW + rk).to(tl.float32)
        x = (nw[None, :] * (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)).to(dt)
    return x.to(dt)


@triton.jit
def lora_piece(t, X, DELTA, NW, IDX, AD, A, RANKS, WS, CTR, M, K, rows_per, stride_xm, stride_dm, stride_al,
               stride_ar, eps, dt, S: tl.constexpr, KSPLIT: tl.constexpr, RB: tl.constexpr, BM: tl.constexpr,
               BK: tl.constexpr, NORM: tl.constexpr, HAS_DELTA: tl.constexpr, GATHER: tl.constexpr,
               IEEE: tl.constexpr, PDL: tl.constexpr, AJ: tl.constexpr = 1):
    """Shrink piece p = t // AJ = (row tile, slice s, K range kp), tile-major: WS[p] [BM, RB] (fp32) = x[the tile's
    rows, kp's range] A_a[:, s, kp's range]^T, each row with its adapter (rows without one: zeros), then counted in
    CTR[1] for lora_wait. x as the GEMV sees it (NORM: normed x + delta; GATHER: rows of a table). PDL: x read after
    the kernel before (its program waits here). AJ > 1: the piece's rows split over AJ programs by adapter (pool
    slot % AJ == t % AJ; rows without one: the first's), so a tile of many adapters walks them side by side, not one
    after another."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    j = t % AJ
    t = t // AJ
    s = t // KSPLIT % S
    kp = t % KSPLIT
    rl = tl.arange(0, BM)
    rm = t // (S * KSPLIT) * BM + rl
    mm = rm < M
    rr = tl.arange(0, RB)
    ad = tl.load(AD + rm // rows_per, mask=mm, other=-1)
    x_rows = x_rows_of(X, IDX, rm, mm, stride_xm, GATHER)
    d_rows = DELTA + rm.to(tl.int64) * stride_dm
    rstd = tl.full([BM], 1.0, dtype=tl.float32)
    todo = (ad >= 0) & _owns(ad, j, AJ)
    if NORM:
        if tl.max(todo.to(tl.int32), axis=0) > 0:
            rstd = norm_rstd(x_rows, d_rows, mm & todo, K, eps, dt, HAS_DELTA, BK)
    acc = tl.zeros([BM, RB], dtype=tl.float32)
    k_per = K // KSPLIT
    # the piece's start a multiple of BK (piece_block divides K // KSPLIT), told to the compiler: unknown, x's and A's
    # chunks load 2 bytes at a time and unpipelined (K = 8,192 in 16 pieces: K // 16 has no known factor)
    k_lo = tl.multiple_of(kp * k_per, BK)
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        a = tl.min(tl.where(todo, ad, _BIG), axis=0)
        sel = todo & (ad == a)
        todo = todo & (ad != a)
        a_l = a.to(tl.int64)
        rank = tl.load(RANKS + a_l)
        a_cols = A + a_l * stride_al + rr.to(tl.int64)[None, :] * stride_ar + s * K  # [1, RB]
        for k0 in range(k_lo, k_lo + k_per, BK):
            rk = k0 + tl.arange(0, BK)
            x = x_chunk(x_rows, d_rows, NW, rk, sel[:, None] & (rk < K)[None, :], rstd, dt, NORM, HAS_DELTA)
            w = tl.load(a_cols + rk[:, None], mask=(rr < rank)[None, :] & (rk < K)[:, None], other=0.0)  # [BK, RB]
            acc = _dot(x, w.to(dt), acc, IEEE)
    if AJ > 1:  # this program's rows
        tl.store(WS + t * (BM * RB) + rl[:, None] * RB + rr[None, :], acc, mask=_owns(ad, j, AJ)[:, None])
    else:
        tl.store(WS + t * (BM * RB) + rl[:, None] * RB + rr[None, :], acc)
    tl.debug_barrier()  # every thread's sums stored before the count (release)
    tl.atomic_add(CTR + 1, 1, sem="release")


@triton.jit
def _owns(ad, j, AJ: tl.constexpr):
    """The rows [BM] program j of AJ writes: its adapters' (pool slot % AJ == j), and j = 0 the rows without one."""
    return tl.where(ad >= 0, ad % AJ, 0) == j


@triton.jit
def lora_wait(CTR, n):
    """Until the n shrink pieces have stored their sums (acquire: their stores are visible then)."""
    done = tl.atomic_add(CTR + 1, 0, sem="acquire")
    while done < n:
        done = tl.atomic_add(CTR + 1, 0, sem="acquire")


@triton.jit
def lora_arrive(CTR, total):
    """This program is done with the counters; the last of `total` resets them for the next launch."""
    if tl.atomic_add(CTR + 2, 1, sem="acq_rel") == total - 1:
        tl.atomic_xchg(CTR, 0)
        tl.atomic_xchg(CTR + 1, 0)
        tl.atomic_xchg(CTR + 2, 0)


@triton.jit
def lora_xa(WS, s, KSPLIT: tl.constexpr, RB: tl.constexpr, BM: tl.constexpr, P0=0):
    """Slice s's xa [BM, RB] (fp32): its KSPLIT pieces' sums added in order (P0: the row tile's first piece)."""
    rm = tl.arange(0, BM)
    rr = tl.arange(0, RB)
    xa = tl.zeros([BM, RB], dtype=tl.float32)
    for kp in range(KSPLIT):
        xa += tl.load(WS + (P0 + s * KSPLIT + kp) * (BM * RB) + rm[:, None] * RB + rr[None, :],
                      cache_modifier=".cg")
    return xa


@triton.jit
def lora_tile(WS, AD, B, RANKS, M, rows_per, n0, rn, N, N0, N1, stride_bl, stride_br, dt, KSPLIT: tl.constexpr,
              RB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, j=0, AJ: tl.constexpr = 1,
              R0=0, P0=0):
    """The delta [BM, BN] (fp32, rounded to dt as PEFT's is) of columns rn = n0 + [0, BN) (one slice), every row
    with its adapter's B (AJ > 1: only the rows of adapters with pool slot % AJ == j; the others zero); after
    lora_wait. R0, P0: the row tile's first row and first piece."""
    s = (n0 >= N0).to(tl.int32) + (n0 >= N1).to(tl.int32)
    xa = lora_xa(WS, s, KSPLIT, RB, BM, P0).to(dt)
    rm = R0 + tl.arange(0, BM)
    ad = tl.load(AD + rm // rows_per, mask=rm < M, other=-1)
    d = tl.zeros([BM, BN], dtype=tl.float32)
    todo = (ad >= 0) & _owns(ad, j, AJ)
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        a = tl.min(tl.where(todo, ad, _BIG), axis=0)
        sel = todo & (ad == a)
        todo = todo & (ad != a)
        a_l = a.to(tl.int64)
        b = expand_tile(tl.where(sel[:, None], xa, 0.0).to(dt), B + a_l * stride_bl, stride_br,
                        tl.load(RANKS + a_l), rn, N, RB, BM, BN, IEEE)
        d += b.to(dt).to(tl.float32)
    return d


@triton.jit
def lora_row(WS, AD, B, RANKS, m, M, rows_per, n0, rn, N, N0, N1, stride_bl, stride_br, dt, KSPLIT: tl.constexpr,
             RB: tl.constexpr, BM: tl.constexpr):
    """Row m's delta [BN] (fp32, rounded to dt) of columns rn (any BN: no tensor cores): the 1-2-row GEMV's (a row
    m >= M, or without an adapter: zeros)."""
    s = (n0 >= N0).to(tl.int32) + (n0 >= N1).to(tl.int32)
    rr = tl.arange(0, RB)
    a = tl.load(AD + m // rows_per, mask=m < M, other=-1)
    a_l = tl.maximum(a, 0).to(tl.int64)
    rank = tl.load(RANKS + a_l) * (a >= 0).to(tl.int32)
    xa = tl.zeros([RB], dtype=tl.float32)
    for kp in range(KSPLIT):
        xa += tl.load(WS + (s * KSPLIT + kp) * (BM * RB) + m * RB + rr, cache_modifier=".cg")
    b = tl.load(B + a_l * stride_bl + rr.to(tl.int64)[:, None] * stride_br + rn[None, :],
                mask=(rr < rank)[:, None] & (rn < N)[None, :], other=0.0)  # [RB, BN]
    return tl.sum(xa.to(dt).to(tl.float32)[:, None] * b.to(tl.float32), axis=0).to(dt).to(tl.float32)


@triton.jit
def _lora_small_kernel(X, GU, Y, AD, A, B, RANKS, WS, CTR, DA, XD, M, N, K, rows_per, stride_xm, stride_gm,
                       stride_ym, stride_al, stride_ar, stride_bl, stride_br, stride_dl, stride_dr, N0, N1,
                       S: tl.constexpr, KSPLIT: tl.constexpr, RB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                       BN: tl.constexpr, GLU: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                       AJ: tl.constexpr = 1, TILES=1, SHRINK: tl.constexpr = True, DOWN: tl.constexpr = False):
    # per row tile of BM rows (tile-major): S * KSPLIT shrink pieces, then cdiv(N, BN) column blocks, each in AJ
    # programs (lora_piece's split by adapter): y += delta (rows without an adapter untouched), or GLU: Y =
    # silu(gate + dg) * (up + du) [M, N] from the base GU [M, 2N], every row (the MLP's silu_mul). Not SHRINK: no
    # pieces, WS holds them already (the GLU's DOWN: [tiles, KSPLIT, BM, RB]). DOWN (GLU): the down projection's shrink
    # of the adapter rows' h too, a piece a column block: XD [tiles, cdiv(N, BN), BM, RB] (DA: the down's A)
    t = tl.atomic_add(CTR, 1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    NP = S * KSPLIT * AJ * TILES if SHRINK else 0
    dt = Y.dtype.element_ty
    if t < NP:
        lora_piece(t, X, X, X, X, AD, A, RANKS, WS, CTR, M, K, rows_per, stride_xm, 0, stride_al, stride_ar, 0.0,
                   dt, S, KSPLIT, RB, BM, BK, False, False, False, IEEE, False, AJ)  # PDL: every program waited above
    else:
        j = (t - NP) % AJ
        b = (t - NP) // AJ  # (row tile, column block), tile-major
        nb = tl.cdiv(N, BN)
        tile = b // nb
        rm = tile * BM + tl.arange(0, BM)
        ad = tl.load(AD + rm // rows_per, mask=rm < M, other=-1)
        own = _owns(ad, j, AJ) & (rm < M)
        live = own & (ad >= 0)
        any_live = tl.max(live.to(tl.int32), axis=0) > 0
        n0 = b % nb * BN
        rn = n0 + tl.arange(0, BN)
        if GLU:
            m2 = own[:, None] & (rn < N)[None, :]
            g_rows = GU + rm.to(tl.int64) * stride_gm
            y_rows = Y + rm.to(tl.int64) * stride_ym
            if any_live:  # (glu_block in both branches: the plain rows' loads stay in their own layout)
                lora_wait(CTR, NP)
                dg = lora_tile(WS, AD, B, RANKS, M, rows_per, n0, rn, 2 * N, N0, N1, stride_bl, stride_br, dt,
                               KSPLIT, RB, BM, BN, IEEE, j, AJ, tile * BM, tile * S * KSPLIT)
                du = lora_tile(WS, AD, B, RANKS, M, rows_per, n0 + N, rn + N, 2 * N, N0, N1, stride_bl, stride_br,
                               dt, KSPLIT, RB, BM, BN, IEEE, j, AJ, tile * BM, tile * S * KSPLIT)
                h = glu_block(g_rows, y_rows, rn, m2, N, dg, du, True)
                if DOWN:  # each adapter's rows of h [BM, BN] @ its A_down^T [BN, RB]
                    rr = tl.arange(0, RB)
                    xd = tl.zeros([BM, RB], dtype=tl.float32)
                    todo = live
                    while tl.max(todo.to(tl.int32), axis=0) > 0:
                        a = tl.min(tl.where(todo, ad, _BIG), axis=0)
                        sel = todo & (ad == a)
                        todo = todo & (ad != a)
                        a_l = a.to(tl.int64)
                        w = tl.load(DA + a_l * stride_dl + rr.to(tl.int64)[None, :] * stride_dr + rn[:, None],
                                    mask=(rn < N)[:, None] & (rr < tl.load(RANKS + a_l))[None, :], other=0.0)
                        xd = _dot(tl.where(sel[:, None], h, 0.0).to(dt), w, xd, IEEE)
                    rl = tl.arange(0, BM)
                    tl.store(XD + (b * BM + rl).to(tl.int64)[:, None] * RB + rr[None, :], xd, mask=own[:, None])
            else:
                glu_block(g_rows, y_rows, rn, m2, N, 0.0, 0.0, False)
        elif any_live:
            lora_wait(CTR, NP)
            d = lora_tile(WS, AD, B, RANKS, M, rows_per, n0, rn, N, N0, N1, stride_bl, stride_br, dt, KSPLIT, RB,
                          BM, BN, IEEE, j, AJ, tile * BM, tile * S * KSPLIT)
            y_ptr = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            m2 = live[:, None] & (rn < N)[None, :]
            y = tl.load(y_ptr, mask=m2, other=0.0)
            tl.store(y_ptr, (y.to(tl.float32) + d).to(dt), mask=m2)
    lora_arrive(CTR, tl.num_programs(0))


def piece_block(k: int) -> int:
    """The shrink pieces' K chunk: a power of two (<= 64) dividing each piece's range."""
    return _pow2_divisor(k // pieces(k), 64)


def rank_block(lora) -> int:
    """The rank tile: the pool's max rank, at least 16 (tl.dot's), a power of two."""
    return max(16, triton.next_power_of_2(lora.a.shape[1]))


def pieces(k: int) -> int:
    """K ranges per slice of the shrink pieces (K // PIECE_K where it divides, else 1)."""
    return k // PIECE_K if k % PIECE_K == 0 and k > PIECE_K else 1


def _small(x: Tensor, y: Tensor, lora, gu: Tensor | None, made: Tensor | None = None, down=None
           ) -> Tensor | None:
    """The ticketed kernel. made: the shrink's pieces [tiles, KSPLIT, TICKET_TILE, RB] already (the GLU's of the
    down): no pieces run. down (GLU): the down's LoraLayer, whose shrink of y this returns so."""
    m, n = y.shape
    t = lora.target
    bn, rb = col_block(lora, n), rank_block(lora)
    ksplit = pieces(t.k) if made is None else made.shape[1]
    bk = piece_block(t.k)  # divides each piece's K range
    ws, ctr = lora.scratch(rb)
    gu = y if gu is None else gu
    bm = TICKET_TILE
    tiles = triton.cdiv(m, bm)  # tiles * bm <= the scratch's rows: TICKET_ROWS in whole tiles (LoraLayer.scratch)
    aj = adapter_programs(lora, m)
    shrink = len(t.slices) * ksplit if made is None else 0
    grid = ((shrink + triton.cdiv(n, bn)) * aj * tiles,)
    xd = None if down is None else torch.empty(tiles, triton.cdiv(n, bn), bm, rb, dtype=torch.float32,
                                               device=y.device)
    da = lora.a if down is None else down.a
    _lora_small_kernel[grid](x, gu, y, lora.rows, lora.a, lora.b, lora.pool.ranks, ws if made is None else made, ctr,
                             da, ws if xd is None else xd, m, n, t.k, m // lora.rows.shape[0], x.stride(0),
                             gu.stride(0), y.stride(0), lora.a.stride(0), lora.a.stride(1), lora.b.stride(0),
                             lora.b.stride(1), da.stride(0), da.stride(1), *t.bounds, S=len(t.slices),
                             KSPLIT=ksplit, RB=rb, BM=bm, BK=bk, BN=bn, GLU=gu is not y,
                             IEEE=x.dtype == torch.float32, AJ=aj, TILES=tiles, SHRINK=made is None,
                             DOWN=xd is not None, num_warps=4, **pdl.opts())
    return xd


def adapter_programs(lora, m: int) -> int:
    """The ticketed kernel's programs per piece and column block at m rows: adapter_split's, divided over the row
    tiles (programs ~ one tile's at any number of tiles)."""
    return max(1, adapter_split(lora) // triton.cdiv(m, TICKET_TILE))


def adapter_split(lora) -> int:
    """The ticketed kernels' programs per piece and column block (AJ): ADAPTER_SPLIT, at most the pool's slots and
    the batch's rows (the most adapters a tile can hold)."""
    return max(1, min(ADAPTER_SPLIT, lora.a.shape[0], lora.rows.shape[0]))


def _pow2_divisor(n: int, most: int) -> int:
    d = 1
    while d < most and n % (d * 2) == 0:
        d *= 2
    return d


def col_block(lora, n: int) -> int:
    """The column block of a projection's n output columns: <= 128, dividing its slice bounds."""
    t = lora.target
    return min(128, max(16, triton.next_power_of_2(n)), *(_pow2_divisor(b, 128) for b in t.bounds if b < t.n))


def applies(x: Tensor, lora) -> bool:
    """x in the pool's dtype, column blocks of >= 16 that never straddle two slices (CSM's are 128), shrink
    chunks of >= 16 (tl.dot's least)."""
    t = lora.target
    return (x.dtype == lora.a.dtype and all(_pow2_divisor(b, 16) == 16 for b in t.bounds if b < t.n)
            and piece_block(t.k) >= 16 and t.k % 16 == 0)


def _expand(xa: Tensor, y: Tensor, lora, n: int, gu: Tensor | None = None, down=None) -> Tensor | None:
    """y's deltas from lora_shrink's pieces xa; gu: the GLU's (GLU_GROUPS column groups), else every column block
    its own program. down (GLU): the down projection's LoraLayer, whose shrink of y this returns, in pieces
    [G, M, 1, RB] (one a column group)."""
    m, glu = y.shape[0], gu is not None
    gu = gu if glu else y
    bm, bn, rb = GLU_ROWS if glu else EXPAND_ROWS, col_block(lora, n), rank_block(lora)
    rows = lora.rows
    t = lora.target
    tiles, cols = triton.cdiv(m, bm), triton.cdiv(n, bn)
    if glu:  # column groups
        cols = min(max(GLU_GROUPS, triton.next_power_of_2(triton.cdiv(GLU_PROGRAMS, tiles))), cols)
    xd = None if down is None else torch.empty(cols, m, 1, rb, dtype=torch.float32, device=y.device)
    da = lora.a if down is None else down.a
    _lora_kernel[(tiles, cols)](
        gu, y, xa, lora.b, lora.pool.ranks, rows, da, xa if xd is None else xd, m, n, m // rows.shape[0],
        gu.stride(0), y.stride(0), lora.b.stride(0), lora.b.stride(1), da.stride(0), da.stride(1), *t.bounds,
        S=len(t.slices), RB=rb, BM=bm, BN=bn, GLU=glu, IEEE=y.dtype == torch.float32, KS=xa.shape[0],
        DOWN=xd is not None, num_warps=4, **pdl.opts())
    return xd


def shrink_piece(k: int) -> int:
    """The K piece of one shrink program past TICKET_ROWS: SHRINK_PIECE where it divides K (else K), doubled while K
    has more than SHRINK_PIECES of them (K's alone: a row's sums the same at every batch size)."""
    kp = SHRINK_PIECE if k % SHRINK_PIECE == 0 else k
    while k // kp > SHRINK_PIECES and k % (2 * kp) == 0:
        kp *= 2
    return kp


def lora_shrink(x: Tensor, lora) -> Tensor:
    """The shrink of x [M, K] in K pieces: [KS, M, S, RB] float32 (rows without an adapter zero); xa is their sum
    in order, rounded to the model dtype (the expand's)."""
    t = lora.target
    m = x.shape[0]
    rb = rank_block(lora)
    kp = shrink_piece(t.k)
    xa = torch.empty(t.k // kp, m, len(t.slices), rb, dtype=torch.float32, device=x.device)
    bm = SHRINK_ROWS * (2 if m >= SHRINK_WIDE_FROM else 1)
    grid = (triton.cdiv(m, bm), t.k // kp)
    _shrink_kernel[grid](x, xa, lora.a, lora.pool.ranks, lora.rows, m, t.k, m // lora.rows.shape[0], x.stride(0),
                         lora.a.stride(0), lora.a.stride(1), S=len(t.slices), RB=rb, BM=bm,
                         BK=min(64, kp), KP=kp, IEEE=x.dtype == torch.float32, num_warps=4, **pdl.opts())
    return xa


def lora_add_(x: Tensor, y: Tensor, lora) -> Tensor:
    """y [M, N] += the rows' LoRA deltas of x [M, K] (each row its adapter; none: untouched). Returns y."""
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    m, n = x2.shape[0], y2.shape[1]
    made = _shrunk(x2, lora)
    if m <= TICKET_ROWS:
        _small(x2, y2, lora, None, made)
    else:
        _expand(lora_shrink(x2, lora) if made is None else made, y2, lora, n)
    return y


def _shrunk(x: Tensor, lora) -> Tensor | None:
    """The shrink's pieces lora_glu made of this very x (the down's input: its h) as it wrote it, or None (the
    stash holds h: no other tensor can have its address meanwhile)."""
    made, lora.shrunk = lora.shrunk, None
    if made is not None and made[0].data_ptr() == x.data_ptr() and made[0].shape == x.shape:
        return made[1]
    return None


def lora_glu(gate_up: Tensor, x: Tensor, lora) -> Tensor:
    """silu(gate + dg) * (up + du) [M, I] from the base gate_up [M, 2I] (cuBLAS') and its input x [M, K]: the MLP's
    SiLU*up with each row's LoRA deltas of gate and up added first (every row written)."""
    x2, gu = x.reshape(-1, x.shape[-1]), gate_up.reshape(-1, gate_up.shape[-1])
    m, i = gu.shape[0], gu.shape[1] // 2
    h = torch.empty(m, i, dtype=gu.dtype, device=gu.device)
    # the down's shrink of h here too, while h is in registers (lora_add_ of the down takes it: _shrunk)
    down = lora.down if lora.down is not None and applies(h, lora.down) else None
    if m <= TICKET_ROWS:
        xd = _small(x2, h, lora, gu, down=down)
    else:
        xd = _expand(lora_shrink(x2, lora), h, lora, i, gu, down)
    if down is not None:
        down.shrunk = (h, xd)
    return h.reshape(*gate_up.shape[:-1], i)
