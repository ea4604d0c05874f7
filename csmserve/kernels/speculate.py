"""Speculation's sampling math and indices (engine/speculate.py) as three Triton kernels; the torch code
there is the reference and the CPU path.

`spec_probs`: a program per row of logits: the sampler's distribution (temperature, then the top-k /
top-p cut found by bisection exactly as kernels/sampler.py finds it) written out as probabilities, the
row's argmax, and optionally a Gumbel-max sample with the counter noise of a given draw (drafts).
`spec_verify`: a program per batch row: the accept tests in order, the residual / bonus resample, the
commit of the codes, the row's new position, the draft counters and the next drafts' indices.
`spec_prep`: a verify pass's input, position and head indices (a dozen torch ops in one launch).
They agree with the torch reference except where two candidate logits tie at a cut-off (as the
sampler kernel does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csmserve import sampling as ref

MIX1: tl.constexpr = tl.constexpr(ref.MIX1)
MIX2: tl.constexpr = tl.constexpr(ref.MIX2)
DRAW_MIX: tl.constexpr = tl.constexpr(ref.DRAW_MIX)

GREEDY_BELOW: tl.constexpr = tl.constexpr(ref.GREEDY_BELOW)

@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MIX1
    x = x ^ (x >> 15)
    x = x * MIX2
    return x ^ (x >> 16)


@triton.jit
def _uniform(tok, draw, frame, seed):
    """models.sampler.hash_uniform_at for token index `tok` (= token + codebook * vocab), bit for bit."""
    d = tl.zeros_like(frame) + draw  # an int64 tensor whether draw is a constant or not
    h = _mix32(tok.to(tl.uint32))
    h = tl.where(d != 0, _mix32(h ^ (d * DRAW_MIX).to(tl.uint32)), h)
    h = _mix32(h ^ (frame & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _probs_kernel(LOGITS, TEMP, TOPK, TOPP, SEED, FRAME, CODEBOOK, PROBS, CODE, TOP, stride_l, stride_p, V, PER,
                  DRAW, SAMPLE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = r // PER  # the batch row whose sampling parameters apply
    i = tl.arange(0, BLOCK)
    valid = i < V
    raw = tl.load(LOGITS + r * stride_l + i, mask=valid, other=float("-inf")).to(tl.float32)
    temp = tl.load(TEMP + b)
    top_k = tl.load(TOPK + b).to(tl.int32)
    top_p = tl.load(TOPP + b)
    x = raw / tl.where(temp >= GREEDY_BELOW, temp, 1.0)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32: float order as integer order
    k = tl.where(top_k > 0, tl.minimum(top_k, V), V)
    lo = tl.min(tl.where(valid, key, 2147483647), 0).to(tl.int64)
    hi = tl.max(key, 0).to(tl.int64)
    for _ in range(33):  # k-th largest key
        mid = lo + (hi - lo + 1) // 2
        ok = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), 0) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    kth = lo
    cut = kth
    if top_p < 1.0:  # the smallest t >= kth with mass(key > t) <= top_p
        cand = valid & (key >= kth.to(tl.int32))
        e = tl.where(cand, tl.exp(x - tl.max(x, 0)), 0.0)
        probs = e / tl.sum(e, 0)
        lo = kth
        hi = tl.max(key, 0).to(tl.int64)
        for _ in range(33):
            mid = lo + (hi - lo) // 2
            ok = tl.sum(tl.where(key > mid.to(tl.int32), probs, 0.0), 0) <= top_p
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        cut = lo
    kept = valid & (key >= cut.to(tl.int32))
    e = tl.where(kept, tl.exp(x - tl.max(x, 0)), 0.0)
    tl.store(PROBS + r * stride_p + i, e / tl.sum(e, 0), mask=valid)
    greedy = tl.argmax(raw, 0)
    tl.store(TOP + r, greedy.to(tl.int64))
    if SAMPLE:
        cb = tl.load(CODEBOOK + r)
        u = _uniform(i + cb * V, DRAW, tl.load(FRAME + b), tl.load(SEED + b))
        choice = tl.argmax(tl.where(kept, x - tl.log(-tl.log(u)), float("-inf")), 0)
        tl.store(CODE + r, tl.where(temp >= GREEDY_BELOW, choice, greedy).to(tl.int64))


def spec_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, frame: Tensor,
               per: int, probs: Tensor, top: Tensor, codebook: Tensor | None = None, code: Tensor | None = None,
               draw: int = 0) -> None:
    """logits [R, V] (row r uses batch row r // per's parameters) -> probs [R, V] float32 (written in place,
    rows contiguous), top [R] argmax; with `codebook` [R]: code [R], a sample (greedy rows: the argmax)."""
    R, V = logits.shape
    sample = codebook is not None
    _probs_kernel[(R,)](logits, temperature, top_k, top_p, seed, frame, codebook if sample else top, probs,
                        code if sample else top, top, logits.stride(0), probs.stride(0), V, per, draw,
                        SAMPLE=sample, BLOCK=triton.next_power_of_2(V), num_warps=4)


@triton.jit
def _prep_kernel(M, CODES, DRAFT, EMB, WPOS, RPOS, LEN, HEADS, stride_c, V, K, KD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    m = tl.load(M + b)
    for t in tl.static_range(KD + 1):
        if t == 0:
            code = tl.load(CODES + b * stride_c + m)
        else:
            code = tl.load(DRAFT + b * KD + t - 1)
        o = b * (KD + 1) + t
        tl.store(EMB + o, code + tl.minimum(m + t, K - 1) * V)  # codebook m+t's code -> its embedding row
        pos = m + 1 + t
        tl.store(WPOS + o, pos)
        tl.store(RPOS + o, tl.minimum(pos, K - 1))
        tl.store(LEN + o, (pos + 1).to(tl.int32))
        tl.store(HEADS + o, tl.minimum(pos, K - 1) - 1)


def spec_prep(m: Tensor, codes: Tensor, draft: Tensor, K: int, V: int) -> tuple[Tensor, ...]:
    """A verify pass's indices in one kernel: for each row's positions m+1..m+k+1 -> the input codes'
    embedding rows [B, k+1], KV positions [B, k+1], RoPE positions (clamped to K-1) [B, k+1], attention
    lengths [B (k+1)] int32, head index of each output [B (k+1)] (codebook - 1, clamped)."""
    B, k = draft.shape
    emb = torch.empty(B, k + 1, dtype=torch.long, device=m.device)
    wpos, rpos, heads = torch.empty_like(emb), torch.empty_like(emb), torch.empty_like(emb)
    lengths = torch.empty(B, k + 1, dtype=torch.int32, device=m.device)
    _prep_kernel[(B,)](m, codes, draft, emb, wpos, rpos, lengths, heads, codes.stride(0), V, K, KD=k, num_warps=1)
    return emb, wpos, rpos, lengths.view(-1), heads.view(-1)


@triton.jit
def _verify_kernel(P, TOP, Q, DRAFT, M, DONE, CODES, COUNTS, J, DHEADS, DCB, TEMP, SEED, FRAME, ALPHA,
                   stride_pb, stride_pt, stride_qb, stride_qt, stride_c, V, K, KD: tl.constexpr, FORCE: tl.constexpr,
                   BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    m = tl.load(M + b)
    done = tl.load(DONE + b).to(tl.int1)
    temp = tl.load(TEMP + b)
    seed = tl.load(SEED + b)
    frame = tl.load(FRAME + b)
    greedy = temp < GREEDY_BELOW  # 0, tiny and NaN: greedy, as the sampler
    j = m * 0  # drafts accepted in a row
    n_valid = m * 0
    still = m == m
    for t in tl.static_range(KD):
        c = m + 1 + t
        valid = c <= K - 1
        d = tl.load(DRAFT + b * KD + t)
        p_d = tl.load(P + b * stride_pb + t * stride_pt + d)
        q_d = tl.load(Q + b * stride_qb + t * stride_qt + d)
        u = _uniform(c, 2, frame, seed)  # DRAW_ACCEPT, one uniform per codebook (vocab 1, token 0)
        if FORCE:  # benchmarks: accept with a given probability (not exact)
            acc = u < tl.load(ALPHA)
        else:
            acc = tl.where(greedy, tl.load(TOP + b * (KD + 1) + t) == d, u * q_d < p_d)
        still = still & acc & valid
        j += still.to(tl.int64)
        n_valid += valid.to(tl.int64)
    c_new = m + j + 1
    bonus = j == KD
    i = tl.arange(0, BLOCK)
    vm = i < V
    p = tl.load(P + b * stride_pb + j * stride_pt + i, mask=vm, other=0.0)
    q = tl.load(Q + b * stride_qb + tl.minimum(j, KD - 1) * stride_qt + i, mask=vm, other=0.0)
    r = tl.where(bonus, p, tl.maximum(p - q, 0.0))
    r = tl.where(tl.sum(r, 0) > 0, r, p)
    u = _uniform(i + tl.minimum(c_new, K - 1) * V, tl.where(bonus, 0, 3), frame, seed)  # DRAW_PLAIN / RESIDUAL
    new = tl.argmax(tl.where(vm & (r > 0), tl.log(r) - tl.log(-tl.log(u)), float("-inf")), 0).to(tl.int64)
    new = tl.where(greedy, tl.load(TOP + b * (KD + 1) + j), new)
    for t in tl.static_range(KD):  # drafts (past j: overwritten by a later pass) and the new code, one store each
        d = tl.load(DRAFT + b * KD + t)
        tl.store(CODES + b * stride_c + m + 1 + t, tl.where(m + 1 + t == c_new, new, d))
    tl.store(CODES + b * stride_c + c_new, new, mask=bonus)
    live = done == 0
    tl.atomic_add(COUNTS + 0, j, mask=live)
    tl.atomic_add(COUNTS + 1, tl.minimum(j + 1, n_valid), mask=live)
    tl.atomic_add(COUNTS + 2, j + (c_new <= K - 1).to(tl.int64), mask=live)
    tl.atomic_add(COUNTS + 3, m * 0 + 1, mask=live)
    m_next = tl.minimum(c_new, K - 1)
    tl.store(M + b, m_next)
    tl.store(DONE + b, done | (m_next >= K - 1))
    tl.store(J + b, j)
    for t in tl.static_range(KD):  # the next drafts: codebooks m_next+1.. and their heads
        c = m_next + 1 + t
        tl.store(DCB + b * KD + t, c)
        tl.store(DHEADS + b * KD + t, tl.minimum(c, K - 1) - 1)


def spec_verify(p: Tensor, top: Tensor, q: Tensor, draft: Tensor, m: Tensor, done: Tensor, codes: Tensor,
                counts: Tensor, temperature: Tensor, seed: Tensor, frame: Tensor, K: int,
                alpha: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """p [B, k+1, V], top [B, k+1], q [B, k, V], draft [B, k] -> j [B] (drafts accepted), the next drafts'
    head indices and codebooks [B k]; updates codes [B, >= K+k+1], m, done [B] and counts [4] in place."""
    B, k1, V = p.shape
    j = torch.empty(B, dtype=torch.long, device=p.device)
    dheads, dcb = torch.empty(B * (k1 - 1), dtype=torch.long, device=p.device), torch.empty(
        B * (k1 - 1), dtype=torch.long, device=p.device)
    _verify_kernel[(B,)](p, top, q, draft, m, done, codes, counts, j, dheads, dcb, temperature, seed, frame,
                         alpha if alpha is not None else temperature, p.stride(0), p.stride(1), q.stride(0),
                         q.stride(1), codes.stride(0), V, K, KD=k1 - 1, FORCE=alpha is not None,
                         BLOCK=triton.next_power_of_2(V), num_warps=4)
    return j, dheads, dcb
