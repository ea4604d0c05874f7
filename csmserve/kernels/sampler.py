"""The sampler of engine/sampler.py as one Triton kernel: a program per row, the vocab in registers.

No sort: the top-k cut-off is the k-th largest logit found by an M-ary search over the logits'
order-preserving integer keys (M counts per pass: 33 passes of 1 for large batches, 9 of 16 for small
ones, where each pass's block-wide reduction is latency), and the top-p cut-off the smallest logit
whose strictly-larger mass is <= top_p, found the same way. Ties at a cut-off are kept, as in the torch
reference; the two agree exactly whenever no two candidate logits are equal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..engine import sampler as ref

MIX1: tl.constexpr = tl.constexpr(ref.MIX1)
MIX2: tl.constexpr = tl.constexpr(ref.MIX2)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MIX1
    x = x ^ (x >> 15)
    x = x * MIX2
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(LOGITS, TEMP, TOPK, TOPP, SEED, FRAME, OUT, stride, V, codebook, BLOCK: tl.constexpr,
                   M: tl.constexpr, PASSES: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    valid = i < V
    raw = tl.load(LOGITS + b * stride + i, mask=valid, other=float("-inf")).to(tl.float32)
    temp = tl.load(TEMP + b)
    top_k = tl.load(TOPK + b).to(tl.int32)
    top_p = tl.load(TOPP + b)
    x = raw / tl.where(temp > 0, temp, 1.0)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32: float order as integer order
    k = tl.where(top_k > 0, tl.minimum(top_k, V), V)
    j = (tl.arange(0, M) + 1).to(tl.int64)  # M thresholds per pass: the interval shrinks (M+1)-fold
    # k-th largest key: the largest t with count(key >= t) >= k (true at lo, kept so)
    lo = tl.min(tl.where(valid, key, 2147483647), 0).to(tl.int64)  # scalars in int64: no overflow
    hi = tl.max(key, 0).to(tl.int64)
    for _ in range(PASSES):
        t = lo + (hi - lo + 1 + M) // (M + 1) * j  # [M]
        inside = t <= hi
        tc = tl.minimum(t, hi).to(tl.int32)
        cnt = tl.sum((key[None, :] >= tc[:, None]).to(tl.int32), 1)  # [M]
        ok = inside & (cnt >= k)
        new_lo = tl.max(tl.where(ok, t, lo), 0)
        hi = tl.min(tl.where(inside & ~ok, t - 1, hi), 0)
        lo = new_lo
    kth = lo
    cut = kth
    if top_p < 1.0:  # top-p: the smallest t >= kth with mass(key > t) <= top_p (true at hi, kept so)
        cand = valid & (key >= kth.to(tl.int32))
        e = tl.where(cand, tl.exp(x - tl.max(x, 0)), 0.0)
        probs = e / tl.sum(e, 0)
        lo = kth
        hi = tl.max(key, 0).to(tl.int64)
        for _ in range(PASSES):
            t = hi - (hi - lo + 1 + M) // (M + 1) * j  # [M], down from hi
            inside = t >= lo
            tc = tl.maximum(t, lo)
            mass = tl.sum(tl.where(key[None, :] > tc.to(tl.int32)[:, None], probs[None, :], 0.0), 1)  # [M]
            ok = inside & (mass <= top_p)
            new_hi = tl.min(tl.where(ok, tc, hi), 0)
            lo = tl.max(tl.where(inside & ~ok, tc + 1, lo), 0)
            hi = new_hi
        cut = hi
    # counter-based noise, bit-identical to engine.sampler.hash_uniform
    seed = tl.load(SEED + b)
    frame = tl.load(FRAME + b)
    h = _mix32((i + codebook * V).to(tl.uint32))
    h = _mix32(h ^ (frame & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    score = tl.where(valid & (key >= cut.to(tl.int32)), x - tl.log(-tl.log(u)), float("-inf"))
    choice = tl.argmax(score, 0)
    greedy = tl.argmax(raw, 0)
    tl.store(OUT + b, tl.where(temp > 0, choice, greedy).to(tl.int64))


def sample_triton(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, frame: Tensor,
                  codebook: int) -> Tensor:
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    # small batches are latency-bound: 15 thresholds per pass, 9 passes; large ones keep the ALU work
    # low with plain bisection (1 threshold, 33 passes)
    M, passes = (16, 9) if B <= 64 else (1, 33)  # 17-fold per pass: 17^8 > 2^32
    _sample_kernel[(B,)](logits, temperature, top_k, top_p, seed, frame, out, logits.stride(0), V, codebook,
                         BLOCK=triton.next_power_of_2(V), M=M, PASSES=passes, num_warps=8 if M > 1 else 4)
    return out
