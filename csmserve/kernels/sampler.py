"""The sampler of models/sampler.py as one Triton kernel: a program per row, the vocab in registers.

No sort: the top-k cut-off is the k-th largest logit found by an ARITY-way search over the logits'
order-preserving integer keys (~32 / log2(ARITY) counting passes), and the top-p cut-off the smallest logit whose
strictly-larger mass is <= top_p, found the same way. Ties at a cut-off are kept, as in the torch
reference; the two agree exactly whenever no two candidate logits are equal. As there, a temperature
below GREEDY_BELOW (or NaN) is greedy and a NaN logit is never chosen; x = +inf (a huge logit) makes
the top-p mass NaN, which keeps only the largest keys; the token is always < V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csmserve import sampling as ref
from csmserve.kernels import tuning

MIX1: tl.constexpr = tl.constexpr(ref.MIX1)
MIX2: tl.constexpr = tl.constexpr(ref.MIX2)
GREEDY_BELOW: tl.constexpr = tl.constexpr(ref.GREEDY_BELOW)
ARITY = tuning.SAMPLER["arity"]  # thresholds per pass of the top-k search (kernels/tuning.py)
NUM_WARPS = tuning.SAMPLER["warps"]


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MIX1
    x = x ^ (x >> 15)
    x = x * MIX2
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(LOGITS, TEMP, TOPK, TOPP, SEED, FRAME, OUT, stride, V, codebook, BLOCK: tl.constexpr,
                   ARITY: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    valid = i < V
    raw = tl.load(LOGITS + b * stride + i, mask=valid, other=float("-inf")).to(tl.float32)
    raw = tl.where(raw == raw, raw, float("-inf"))  # NaN -> -inf: never chosen
    temp = tl.load(TEMP + b)
    sampled = temp >= GREEDY_BELOW  # False for 0, tiny and NaN
    top_k = tl.load(TOPK + b).to(tl.int32)
    top_p = tl.load(TOPP + b)
    x = raw / tl.where(sampled, temp, 1.0)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32: float order as integer order
    k = tl.where(top_k > 0, tl.minimum(top_k, V), V)
    # k-th largest key: the largest t with count(key >= t) >= k, in [lo, hi]. Each pass counts at ARITY
    # thresholds in one reduction (t_0 = lo, where the count is >= k) and keeps the sub-range after the last
    # threshold that still counts >= k: ~32 / log2(ARITY) passes, each one block-wide reduction.
    lo = tl.min(tl.where(valid, key, 2147483647), 0).to(tl.int64)  # scalars in int64: no overflow
    hi = tl.max(key, 0).to(tl.int64)
    j = tl.arange(0, ARITY).to(tl.int64)
    while lo < hi:
        w = hi - lo + 1
        t = lo + (w * j) // ARITY  # [ARITY] ascending, t[0] = lo
        cnt = tl.sum((key[None, :] >= t[:, None].to(tl.int32)).to(tl.int32), 1)  # [ARITY]
        last = tl.sum((cnt >= k).to(tl.int32), 0) - 1  # counts fall with t: the ok ones are a prefix
        nxt = last + 1
        hi = tl.where(nxt < ARITY, lo + (w * nxt) // ARITY - 1, hi)  # t[nxt] counts < k, and t[nxt] > t[last]
        lo = lo + (w * last) // ARITY
    kth = lo
    cut = kth
    if top_p < 1.0:  # top-p: the smallest t >= kth with mass(key > t) <= top_p
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
    # counter-based noise, bit-identical to models.sampler.hash_uniform
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
    tl.store(OUT + b, tl.minimum(tl.where(sampled, choice, greedy), V - 1).to(tl.int64))  # never an index >= V


def sample_triton(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, frame: Tensor,
                  codebook: int) -> Tensor:
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    _sample_kernel[(B,)](logits, temperature, top_k, top_p, seed, frame, out, logits.stride(0), V, codebook,
                         BLOCK=triton.next_power_of_2(V), ARITY=ARITY, num_warps=NUM_WARPS)
    return out
