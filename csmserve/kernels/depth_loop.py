"""Codebooks 2..K-1 of a frame for 1-2 rows in one persistent kernel: 30 depth steps, each the projection of the
last code's embedding, the decoder's layers, the codebook head and the sampler, without a launch between them.

At batch 1 a depth step is ~25 kernels of 2-12 us whose launch, ramp and tail cost more than their weights take to
read (~130 us a step against ~60 at HBM speed; docs/benchmarks.md, issue 16). Here one grid of P programs, as
many as are resident at once (one per SM by default), walks the phases of every step; between two phases a grid
barrier (`_sync`: an arrival counter in global memory, released by each program and polled with acquire
semantics). A phase is the work the previous phase's results gate:

    per step s (codebook s, depth position s), 2 + 5 L phases:
      proj   c = sample(logits of step s-1) (every program, redundantly: no barrier after it); program 0 stores
             it; RES0 = embedding(codebook s-1, c) @ projection^T
      per layer l:
        A    h = RES(+ DEL); QKV = rms_norm(h) @ qkv^T           (program 0 writes h to RES0)
        B    attention of each (row, KV head) (kernels/depth_attention.attend_one): K/V stored at position s
        C    O = ATT @ o^T
        D    h = RES0 + O; HID = silu(gate) * up of rms_norm(h)   (program 0 writes h to RES1)
        E    DEL = HID @ down^T
      F      LOG[s] = rms_norm(RES1 + DEL) @ head_s^T (the sampleable columns only)
    then one phase samples codebook K-1.

The GEMV phases use kernels/gemv.py's chunk helpers (the same rounding: h and the normed row in the model dtype,
fp32 accumulation), a program taking tiles pid, pid + P, ... of the output columns. Opted into
(CSMSERVE_DEPTH_LOOP_PREFETCH=1), at the end of a phase a program asks L2 for its share of the next phase's
weights (`prefetch.global.L2`), so HBM streams across the barrier. Codebooks 0 and 1 (the backbone's head and
the depth step over positions 0 and 1) stay with the plain kernels.

Measured on the H200 (docs/benchmarks.md, issue 16): slower than the plain kernels chained by PDL, ~147 us a
depth step at one row against ~130, so it stays off by default. Each GEMV phase, one 8-warp program per SM,
streams its weights no faster than the standalone GEMV at ~4 programs per SM, and every phase adds its barrier
(~1 us) and its last program's lag (~1-3 us; the attention phase, two programs working, ~3).

Stepped mode (`persistent=False`: Triton's interpreter, which runs programs one after another, and the tests'
reference) launches the same kernel once per phase: no barrier, the same arithmetic. A barrier that waits
longer than MAX_SPINS polls gives up and counts a stall (`DepthLoop.stalls`), so a grid that is not all resident
returns wrong codes instead of hanging the GPU; the tests check the count is 0.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_wait

from csmserve.kernels import pdl
from csmserve.kernels.depth_attention import attend_one
from csmserve.kernels.gemv import _accumulate, _rstd, _store, l2_prefetch
from csmserve.kernels.sampler import radix_passes, sample_row

MAX_ROWS = 2
MAX_SPINS: tl.constexpr = tl.constexpr(1 << 20)  # ~0.5 s of polls: far past any phase (a few us), short of a hung GPU


@triton.jit
def _ld_acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _sync(BAR, STALL, target, ASM_POLL: tl.constexpr):
    """Grid barrier: returns once `target` arrivals are counted at BAR, every program's writes before its
    arrival visible to this program's reads after it; 1 if it gave up (a stall, counted at STALL), else 0."""
    tl.debug_barrier()  # the program's threads have issued this phase's writes
    tl.atomic_add(BAR, 1, sem="release", scope="gpu")
    spins = 0
    if ASM_POLL:
        seen = _ld_acquire(BAR)
        while (seen < target) & (spins < MAX_SPINS):
            seen = _ld_acquire(BAR)
            spins += 1
    else:
        seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
        while (seen < target) & (spins < MAX_SPINS):
            seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
            spins += 1
    stalled = 0
    if spins >= MAX_SPINS:
        tl.atomic_add(STALL, 1)
        stalled = 1
    tl.debug_barrier()
    return stalled


@triton.jit
def _clocks(x):
    """(%globaltimer ns, %clock64 cycles) now; x: any value (the asm needs an operand)."""
    t, c = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;\n\tmov.u64 $1, %clock64;", "=l,=l,r", [x],
                                     dtype=(tl.int64, tl.int64), is_pure=False, pack=1)
    return t, c


@triton.jit
def _stamp(TIMES, slot, t0, c0):
    """TIMES[slot] = (start ns, end ns, start cycles, end cycles) of a program's phase (bench/depth_loop.py)."""
    t1, c1 = _clocks(slot)
    tl.store(TIMES + slot * 4, t0)
    tl.store(TIMES + slot * 4 + 1, t1)
    tl.store(TIMES + slot * 4 + 2, c0)
    tl.store(TIMES + slot * 4 + 3, c1)


@triton.jit
def _prefetch(W, N, K, stride_wn, UP_OFF, pid, P, BLOCK_N: tl.constexpr, GLU: tl.constexpr, LINES: tl.constexpr,
              LINE: tl.constexpr):
    """This program's tiles of W [N, K] (and the up rows UP_OFF further), every 128-byte line, into L2."""
    cols = tl.minimum(tl.arange(0, LINES) * LINE, K - 1)
    for t in range(pid, tl.cdiv(N, BLOCK_N), P):
        rn = tl.minimum(t * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
        ptrs = W + rn.to(tl.int64)[:, None] * stride_wn + cols[None, :]
        l2_prefetch(ptrs)
        if GLU:
            l2_prefetch(ptrs + UP_OFF * stride_wn)


@triton.jit
def _gemv(X, DELTA, H, NW, W, Y, N, K, stride_xm, stride_dm, stride_hm, stride_wn, stride_ym, UP_OFF, eps, pid, P,
          NORM: tl.constexpr, HAS_DELTA: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, GLU: tl.constexpr, PRE_K: tl.constexpr, AHEAD: tl.constexpr):
    """This program's tiles of Y [M, N] = (rms_norm(X + DELTA) * NW if NORM else X) @ W^T (GLU: silu(gate) * up
    with up UP_OFF rows below gate); program 0 writes h = X + DELTA to H (NORM and HAS_DELTA)."""
    dt = X.dtype.element_ty
    two = pid >= 0  # both rows valid whenever TWO_ROWS
    rstd0 = 1.0
    rstd1 = 1.0
    if NORM:
        rstd0 = _rstd(X, DELTA, H, K, two, pid == 0, eps, dt, HAS_DELTA, PRE_K)
        if TWO_ROWS:
            rstd1 = _rstd(X + stride_xm, DELTA + stride_dm, H + stride_hm, K, two, pid == 0, eps, dt, HAS_DELTA,
                          PRE_K)
    rk0 = tl.arange(0, BLOCK_K)
    for t in range(pid, tl.cdiv(N, BLOCK_N), P):
        rn = t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
        mn = rn < N
        w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
        g0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        g1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        u0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        u1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if AHEAD:  # the next chunk's loads issued before this one's products: two chunks in flight
            rk = rk0
            w = tl.load(w_rows + rk[None, :], mask=mn[:, None], other=0.0)
            u = w
            if GLU:
                u = tl.load(w_rows + UP_OFF * stride_wn + rk[None, :], mask=mn[:, None], other=0.0)
            for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (DepthLoop checks)
                rk_n = rk + BLOCK_K
                m_n = mn[:, None] & (rk_n < K)[None, :]  # past K: masked, no traffic
                w_n = tl.load(w_rows + rk_n[None, :], mask=m_n, other=0.0)
                u_n = w_n
                if GLU:
                    u_n = tl.load(w_rows + UP_OFF * stride_wn + rk_n[None, :], mask=m_n, other=0.0)
                g0, g1, u0, u1 = _accumulate(X, X + stride_xm, DELTA, NW, stride_dm, w, u, rk, K, two, rstd0, rstd1, g0,
                                             g1, u0, u1, dt, NORM, HAS_DELTA, TWO_ROWS, GLU)
                w, u, rk = w_n, u_n, rk_n
        else:
            for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (DepthLoop checks)
                rk = k0 + rk0
                w = tl.load(w_rows + rk[None, :], mask=mn[:, None], other=0.0)
                u = w
                if GLU:
                    u = tl.load(w_rows + UP_OFF * stride_wn + rk[None, :], mask=mn[:, None], other=0.0)
                g0, g1, u0, u1 = _accumulate(X, X + stride_xm, DELTA, NW, stride_dm, w, u, rk, K, two, rstd0, rstd1, g0,
                                             g1, u0, u1, dt, NORM, HAS_DELTA, TWO_ROWS, GLU)
        _store(Y, rn, mn, g0, u0, 1.0, 1.0, GLU)
        if TWO_ROWS:
            _store(Y + stride_ym, rn, mn, g1, u1, 1.0, 1.0, GLU)


@triton.jit
def _depth_loop_kernel(
        CODES_IN, CODES, EMB, PROJ, WQKV, WO, WGU, WDN, NRM1, NRM2, NRMF, HEAD, COS, SIN, KC, VC,
        RES, DEL, QKV, ATT, OBUF, HID, LOG, TEMP, TOPK, TOPP, SEED, FRAME, BAR, STALL, TIMES,
        ph_lo, ph_hi, eps, scale,
        s_cin, s_emb, s_ql, s_ol, s_gl, s_dl, s_hcb, s_kl, s_kn, s_kh, s_kt,
        V, NS, K_CB, L,
        D: tl.constexpr, DB: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, I: tl.constexpr,
        TWO_ROWS: tl.constexpr, PERSISTENT: tl.constexpr, TEACH: tl.constexpr, PREFETCH: tl.constexpr,
        ASM_POLL: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr, TIMING: tl.constexpr,
        BN_PJ: tl.constexpr, BK_PJ: tl.constexpr, BN_QKV: tl.constexpr, BK_QKV: tl.constexpr,
        BN_O: tl.constexpr, BK_O: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
        BN_DN: tl.constexpr, BK_DN: tl.constexpr, BN_HD: tl.constexpr, BK_HD: tl.constexpr,
        PRE_D: tl.constexpr, BLOCK_V: tl.constexpr, RADIX: tl.constexpr, BLOCK_P: tl.constexpr, GP: tl.constexpr,
        LINES_D: tl.constexpr, LINES_DB: tl.constexpr, LINES_I: tl.constexpr, LINE: tl.constexpr,
        IEEE: tl.constexpr):
    # activations [2, width] (row 1 unused at one row), RES [2 buffers, 2, D]; LOG [K_CB, 2, NS];
    # KC/VC [L, rows, NKV, P, HD]
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    W3: tl.constexpr = (NQ + 2 * NKV) * HD
    G: tl.constexpr = NQ // NKV
    per = 2 + 5 * L  # phases per step
    last = (K_CB - 2) * per  # the phase that samples codebook K-1 (r == 0, s == K_CB)
    if PREFETCH:  # the first step's projection weights depend on no kernel: asked for while the one before runs
        _prefetch(PROJ, D, DB, DB, 0, pid, P, BN_PJ, False, LINES_DB, LINE)
    if PDL:  # kernels/pdl.py: every activation read waits for the kernel before
        gdc_wait()
    stalled = 0  # after one stall this program waits at no further barrier (wrong codes, not minutes of polls)
    for ph in range(ph_lo, ph_hi):
        if TIMING:  # each program's phase start and end (before the barrier): bench/depth_loop.py
            tm0, cy0 = _clocks(ph)
        s = 2 + ph // per  # the step's codebook
        r = ph % per
        l = (r - 1) // 5
        j = (r - 1) % 5
        if r == 0:
            # the codes of codebook s-1: given (s == 2, or teacher forcing), else sampled from step s-1's logits
            # (r == 0 at the last phase too: s == K there, so it samples codebook K-1 and projects nothing)
            prev = s - 1
            given = s == 2
            if TEACH:
                given = s >= 2
            if given:
                c0 = tl.load(CODES_IN + prev)
                c1 = c0
                if TWO_ROWS:
                    c1 = tl.load(CODES_IN + s_cin + prev)
            else:
                c0 = sample_row(LOG + prev * 2 * NS, tl.load(TEMP), tl.load(TOPK), tl.load(TOPP), tl.load(SEED),
                                tl.load(FRAME), NS, prev, BLOCK_V, RADIX)
                c1 = c0
                if TWO_ROWS:
                    c1 = sample_row(LOG + (prev * 2 + 1) * NS, tl.load(TEMP + 1), tl.load(TOPK + 1),
                                    tl.load(TOPP + 1), tl.load(SEED + 1), tl.load(FRAME + 1), NS, prev, BLOCK_V, RADIX)
            if pid == 0:
                if s == 2:  # codebooks 0 and 1 come through
                    tl.store(CODES, tl.load(CODES_IN))
                    if TWO_ROWS:
                        tl.store(CODES + K_CB, tl.load(CODES_IN + s_cin))
                tl.store(CODES + prev, c0)
                if TWO_ROWS:
                    tl.store(CODES + K_CB + prev, c1)
            if ph != last:
                x = EMB + ((prev * V).to(tl.int64) + c0) * s_emb  # the code's row of the table [DB]
                _gemv(x, x, x, x, PROJ, RES, D, DB, (c1 - c0) * s_emb, 0, 0, DB, D, 0, eps, pid, P,
                      False, False, TWO_ROWS, BN_PJ, BK_PJ, False, PRE_D, AHEAD)
                if PREFETCH:
                    _prefetch(WQKV, W3, D, D, 0, pid, P, BN_QKV, False, LINES_D, LINE)
        elif r == per - 1:  # F: the codebook head of step s over the sampleable columns
            # (h is not kept: program 0 writes it over RES0, which the next step's projection overwrites)
            _gemv(RES + 2 * D, DEL, RES, NRMF, HEAD + (s - 1).to(tl.int64) * s_hcb, LOG + s * 2 * NS, NS, D, D, D, D,
                  D, NS, 0, eps, pid, P, True, True, TWO_ROWS, BN_HD, BK_HD, False, PRE_D, AHEAD)
            if PREFETCH:
                _prefetch(PROJ, D, DB, DB, 0, pid, P, BN_PJ, False, LINES_DB, LINE)
        elif j == 0:  # A
            wq = WQKV + l.to(tl.int64) * s_ql
            if l == 0:
                _gemv(RES, RES, RES, NRM1, wq, QKV, W3, D, D, D, D, D, W3, 0, eps, pid, P,
                      True, False, TWO_ROWS, BN_QKV, BK_QKV, False, PRE_D, AHEAD)
            else:
                _gemv(RES + 2 * D, DEL, RES, NRM1 + l * D, wq, QKV, W3, D, D, D, D, D, W3, 0, eps, pid, P,
                      True, True, TWO_ROWS, BN_QKV, BK_QKV, False, PRE_D, AHEAD)
            if PREFETCH:
                _prefetch(WO + l.to(tl.int64) * s_ol, D, NQ * HD, NQ * HD, 0, pid, P, BN_O, False, LINES_D, LINE)
        elif j == 1:  # B: a program per (row, KV head)
            n_att = NKV
            if TWO_ROWS:
                n_att = 2 * NKV
            for item in range(pid, n_att, P):
                b = item // NKV
                h = item % NKV
                kb = l.to(tl.int64) * s_kl + b * s_kn + h * s_kh
                attend_one(QKV + b * W3, s.to(tl.int64), COS, SIN, KC + kb, VC + kb, ATT + b * (NQ * HD), s_kt,
                           s_kt, h, NKV, scale, NQ, G, GP, HD, HD // 2, BLOCK_P, IEEE)
        elif j == 2:  # C
            _gemv(ATT, ATT, ATT, ATT, WO + l.to(tl.int64) * s_ol, OBUF, D, NQ * HD, NQ * HD, 0, 0, NQ * HD, D, 0,
                  eps, pid, P, False, False, TWO_ROWS, BN_O, BK_O, False, PRE_D, AHEAD)
            if PREFETCH:
                _prefetch(WGU + l.to(tl.int64) * s_gl, I, D, D, I, pid, P, BN_GU, True, LINES_D, LINE)
        elif j == 3:  # D
            _gemv(RES, OBUF, RES + 2 * D, NRM2 + l * D, WGU + l.to(tl.int64) * s_gl, HID, I, D, D, D, D, D, I, I, eps,
                  pid, P, True, True, TWO_ROWS, BN_GU, BK_GU, True, PRE_D, AHEAD)
            if PREFETCH:
                _prefetch(WDN + l.to(tl.int64) * s_dl, D, I, I, 0, pid, P, BN_DN, False, LINES_I, LINE)
        else:  # E
            _gemv(HID, HID, HID, HID, WDN + l.to(tl.int64) * s_dl, DEL, D, I, I, 0, 0, I, D, 0, eps, pid, P,
                  False, False, TWO_ROWS, BN_DN, BK_DN, False, PRE_D, AHEAD)
            if PREFETCH:
                if l + 1 < L:
                    _prefetch(WQKV + (l + 1).to(tl.int64) * s_ql, W3, D, D, 0, pid, P, BN_QKV, False, LINES_D, LINE)
                else:
                    _prefetch(HEAD + (s - 1).to(tl.int64) * s_hcb, NS, D, D, 0, pid, P, BN_HD, False, LINES_D,
                              LINE)
        if TIMING:
            _stamp(TIMES, ph * P + pid, tm0, cy0)
        if PERSISTENT:
            if (ph + 1 < ph_hi) & (stalled == 0):
                stalled = _sync(BAR, STALL, (ph + 1 - ph_lo) * P, ASM_POLL)


def _tiles(m: int, n: int, k: int, programs: int, elems: int, glu: bool = False) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a GEMV phase. A program's tiles (pid, pid + P, ...) run one after another, each a
    memory latency (~1 us) before its weights stream (~30 KB/us per SM at HBM speed): the BLOCK_N of least
    rounds x 1 us + the busiest program's bytes / 30 KB/us, with the fp32 accumulators (m rows, gate and up)
    at most `elems` products of BLOCK_K >= 128 (or all of K)."""
    tiles = m * (2 if glu else 1)
    best = None
    for bn in (64, 32, 16, 8, 4, 2, 1):
        bk = min(triton.next_power_of_2(k), max(128, elems // tiles // bn))
        if bn * bk * tiles > elems and bn > 1:
            continue
        rounds = triton.cdiv(triton.cdiv(n, bn), programs)
        cost = rounds + rounds * bn * k * 2 * (2 if glu else 1) / 30_000
        if best is None or cost < best[0] - 1e-9:
            best = (cost, bn, bk)
    _, bn, bk = best
    if k % bk:
        raise ValueError(f"depth loop: K = {k} is not a multiple of its chunk {bk}")
    return bn, bk


class DepthLoop:
    """Codebooks 2..K-1 by the persistent kernel for one model, the runner's depth KV and up to MAX_ROWS rows.

    Holds the decoder's weights stacked per layer ([L, N, K], a copy: ~230 MB at CSM-1B's shapes) and the
    activation buffers, all allocated once; `__call__` launches (graph-safe: no sync, no allocation but the
    output codes, which come from the graph's pool when captured). CSMSERVE_DEPTH_LOOP=1 turns it on in the
    runner; CSMSERVE_DEPTH_LOOP_PROGRAMS sets programs per SM (default 1: at 8 warps and ~255 registers a thread
    no second one fits; a grid that is not all resident stalls, see above), CSMSERVE_DEPTH_LOOP_ELEMS the fp32
    products of a GEMV chunk (16,384), CSMSERVE_DEPTH_LOOP_PREFETCH=1 asks L2 for the next phase's weights,
    CSMSERVE_DEPTH_LOOP_POLL=atomic polls the barrier with atomics instead of ld.acquire,
    CSMSERVE_DEPTH_LOOP_AHEAD=1 loads the next weight chunk before this one's products (both off: measured
    slower on the H200, docs/benchmarks.md).
    """

    max_rows = MAX_ROWS

    def __init__(self, model, k_cache: Tensor, v_cache: Tensor, persistent: bool | None = None,
                 programs: int | None = None, warps: int = 8, timing: bool = False) -> None:
        cfg = model.cfg
        dec = model.decoder
        d = cfg.decoder
        dev = k_cache.device
        self.cfg, self.d = cfg, d
        self.persistent = (dev.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
                           if persistent is None else persistent)
        layers = dec.layers
        stack = lambda f: torch.stack([f(b).detach() for b in layers]).contiguous()  # noqa: E731
        self.wqkv = stack(lambda b: b.self_attn.qkv_proj.weight)  # [L, W3, D]
        self.wo = stack(lambda b: b.self_attn.o_proj.weight)  # [L, D, NQ HD]
        self.wgu = stack(lambda b: b.mlp.gate_up_proj.weight)  # [L, 2I, D]
        self.wdn = stack(lambda b: b.mlp.down_proj.weight)  # [L, D, I]
        self.nrm1 = stack(lambda b: b.input_layernorm.weight)  # [L, D]
        self.nrm2 = stack(lambda b: b.post_attention_layernorm.weight)
        self.nrmf = dec.norm.weight.detach()
        self.eps = dec.norm.eps
        self.emb = model.audio_embeddings.weight.detach()  # [V K, DB]
        self.proj = model.projection.weight.detach()  # [D, DB]
        model.prepare_heads()
        self.head = model.head_t  # [K-1, Vp, D]
        self.cos, self.sin = dec.rope_cos, dec.rope_sin
        self.k_cache, self.v_cache = k_cache, v_cache  # [L, rows, NKV, P, HD]
        dt = self.wqkv.dtype
        D, DB, I = d.dim, cfg.backbone.dim, d.intermediate
        self.ns = cfg.sampleable_codes
        K = cfg.num_codebooks
        z = lambda *shape, dtype=dt: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        w3 = (d.n_heads + 2 * d.n_kv_heads) * d.head_dim
        self.res, self.dl, self.qkv = z(2, 2, D), z(2, D), z(2, w3)
        self.att, self.obuf, self.hid = z(2, d.n_heads * d.head_dim), z(2, D), z(2, I)
        self.log = z(K, 2, self.ns)
        self.bar = z(1, dtype=torch.int32)
        self.stall = z(1, dtype=torch.int32)
        if programs is None:
            per_sm = int(os.environ.get("CSMSERVE_DEPTH_LOOP_PROGRAMS", "1"))
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 3
            programs = per_sm * sms
        self.programs, self.warps = programs, warps
        self.prefetch = self.persistent and os.environ.get("CSMSERVE_DEPTH_LOOP_PREFETCH", "0") == "1"
        self.asm_poll = os.environ.get("CSMSERVE_DEPTH_LOOP_POLL", "acquire") != "atomic"
        self.ahead = os.environ.get("CSMSERVE_DEPTH_LOOP_AHEAD", "0") == "1"
        self.phases = (K - 2) * (2 + 5 * d.n_layers) + 1
        self.timing = timing  # [phases, programs, 4] int64: bench/depth_loop.py's per-phase times
        self.times = z(self.phases, programs, 4, dtype=torch.int64) if timing else self.bar
        if v_cache.stride() != k_cache.stride():
            raise ValueError("depth loop: the K and V caches must share a layout")
        # the launch's arguments that do not change between calls (the kernel's order)
        self._buffers = (self.emb, self.proj, self.wqkv, self.wo, self.wgu, self.wdn, self.nrm1, self.nrm2, self.nrmf,
                         self.head, self.cos, self.sin, k_cache, v_cache, self.res, self.dl, self.qkv, self.att,
                         self.obuf, self.hid, self.log)
        self._scalars = (self.eps, 1.0 / math.sqrt(d.head_dim))
        self._strides = (self.emb.stride(0), self.wqkv.stride(0), self.wo.stride(0), self.wgu.stride(0),
                         self.wdn.stride(0), self.head.stride(0), *k_cache.stride()[:4])  # [L, rows, NKV, P]
        self._dims = (cfg.audio_vocab_size, self.ns, K, d.n_layers)
        line = 128 // self.emb.element_size()  # elements per 128-byte line (the L2 prefetch's step)
        lines = lambda n: triton.next_power_of_2(triton.cdiv(n, line))  # noqa: E731
        self._meta = dict(D=D, DB=DB, NQ=d.n_heads, NKV=d.n_kv_heads, HD=d.head_dim, I=I, PERSISTENT=self.persistent,
                          PREFETCH=self.prefetch, ASM_POLL=self.asm_poll, AHEAD=self.ahead,
                          BLOCK_V=triton.next_power_of_2(self.ns), RADIX=radix_passes(self.log.dtype),
                          BLOCK_P=max(16, triton.next_power_of_2(k_cache.shape[3])),
                          GP=max(16, triton.next_power_of_2(d.n_heads // d.n_kv_heads)),
                          LINES_D=lines(D), LINES_DB=lines(DB), LINES_I=lines(I), LINE=line,
                          IEEE=self.emb.dtype == torch.float32, TIMING=timing,
                          num_warps=warps)
        elems = int(os.environ.get("CSMSERVE_DEPTH_LOOP_ELEMS", 16384))  # fp32 products per chunk (64 a thread)
        self._blocks = {}
        for m in (1, 2):
            pj = _tiles(m, D, DB, programs, elems)
            qkv = _tiles(m, w3, D, programs, elems)
            o = _tiles(m, D, d.n_heads * d.head_dim, programs, elems)
            gu = _tiles(m, I, D, programs, elems, glu=True)
            dn = _tiles(m, D, I, programs, elems)
            hd = _tiles(m, self.ns, D, programs, elems)
            pre = min(bk for _, bk in (qkv, gu, hd))  # the norm's sum-of-squares chunk (K = D)
            while pre * 2 <= 4096 // m and D % (pre * 2) == 0:
                pre *= 2
            self._blocks[m] = dict(BN_PJ=pj[0], BK_PJ=pj[1], BN_QKV=qkv[0], BK_QKV=qkv[1], BN_O=o[0], BK_O=o[1],
                                   BN_GU=gu[0], BK_GU=gu[1], BN_DN=dn[0], BK_DN=dn[1], BN_HD=hd[0], BK_HD=hd[1],
                                   PRE_D=pre)

    def stalls(self) -> int:
        """Barriers that gave up waiting (a sync: tests and diagnostics only)."""
        return int(self.stall.item())

    def __call__(self, codes: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
                 frame: Tensor, teach: bool = False) -> Tensor:
        """codes [M, >= 2] int64 (codebooks 0 and 1; teach: [M, K], every codebook given and none sampled, for the
        tests' teacher forcing), sampling parameters [M] -> codes [M, K]; self.log[s, :M] holds step s's logits.
        The depth KV's positions 0 and 1 must hold the frame's first depth step."""
        M = codes.shape[0]
        out = torch.empty(M, self.cfg.num_codebooks, dtype=torch.int64, device=codes.device)
        self.bar.zero_()
        head = (codes, out, *self._buffers, temperature, top_k, top_p, seed, frame, self.bar, self.stall, self.times)
        tail = (*self._scalars, codes.stride(0), *self._strides, *self._dims)
        meta = dict(self._meta, TWO_ROWS=M == 2, TEACH=teach, **self._blocks[M])
        grid = (self.programs,)
        if self.persistent:
            _depth_loop_kernel[grid](*head, 0, self.phases, *tail, **meta, **pdl.opts())
        else:
            for ph in range(self.phases):
                _depth_loop_kernel[grid](*head, ph, ph + 1, *tail, **meta, PDL=False)
        return out
