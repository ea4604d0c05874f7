"""The sampler of models/sampler.py as one Triton kernel: a program per row, the vocab in registers.

No sort: the top-k cut-off is the k-th largest logit found by radix select over the logits'
order-preserving integer keys (histogram passes of 8 bits; a bisection took 33 counting passes): over the
logits as given, whose float32 form has 16 (bfloat16) or 13 (float16) low bits that carry nothing, so two
passes (three) find it where float32 takes four. Scaling by 1 / temperature keeps the order, so the k-th
largest scaled logit is the k-th largest logit, scaled (the same division as every x: the same bits);
and the top-p cut-off the smallest logit whose strictly-larger mass is <= top_p, by bisection. Ties at a cut-off are kept, as in the torch
reference; the two agree exactly whenever no two candidate logits are equal. As there, a temperature
below GREEDY_BELOW (or NaN) is greedy and a NaN logit is never chosen; x = +inf (a huge logit) makes
the top-p mass NaN, which keeps only the largest keys; the token is always < V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from csmserve import sampling as ref
from csmserve.kernels import pdl, tuning

MIX1: tl.constexpr = tl.constexpr(ref.MIX1)
MIX2: tl.constexpr = tl.constexpr(ref.MIX2)
GREEDY_BELOW: tl.constexpr = tl.constexpr(ref.GREEDY_BELOW)
WARPS = tuning.SAMPLER["warps"]  # [[rows_from, num_warps], ...] (kernels/tuning.py)


def radix_passes(dtype: torch.dtype) -> int:
    """The radix select's 8-bit passes for logits of `dtype`: those that can tell two of its values apart."""
    return {torch.bfloat16: 2, torch.float16: 3}.get(dtype, 4)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MIX1
    x = x ^ (x >> 15)
    x = x * MIX2
    return x ^ (x >> 16)


@triton.jit
def _key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32: float order as integer order


@triton.jit
def gumbel(seed, frame, V, codebook, BLOCK: tl.constexpr):
    """The row's Gumbel noise [BLOCK] fp32, -log(-log(u)) of counter-based uniforms bit-identical to
    models.sampler.hash_uniform: it reads no logit, so the kernel computes it before its PDL wait."""
    i = tl.arange(0, BLOCK)
    h = _mix32((i + codebook * V).to(tl.uint32))
    h = _mix32(h ^ (frame & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def sample_gumbel(ROW, temp, top_k, top_p, g, V, BLOCK: tl.constexpr, PASSES: tl.constexpr):
    """One row's token (int64 scalar, < V) from its logits ROW [V], sampling parameters (scalars) and noise g
    (gumbel). PASSES: radix_passes of ROW's dtype."""
    i = tl.arange(0, BLOCK)
    valid = i < V
    raw = tl.load(ROW + i, mask=valid, other=float("-inf")).to(tl.float32)
    raw = tl.where(raw == raw, raw, float("-inf"))  # NaN -> -inf: never chosen
    sampled = temp >= GREEDY_BELOW  # False for 0, tiny and NaN
    top_k = top_k.to(tl.int32)
    t = tl.where(sampled, temp, 1.0)
    x = raw / t
    key = _key(x)
    k = tl.where(top_k > 0, tl.minimum(top_k, V), V)
    # the k-th largest raw key (the largest t with count(key >= t) >= k) by radix select: PASSES passes over 8
    # bits each, top byte first, a histogram of the keys that match the bytes chosen so far; the chosen byte is
    # the largest whose count of keys at or above it still reaches the k left (k minus those above it)
    u = _key(raw).to(tl.uint32, bitcast=True) ^ 0x80000000  # unsigned order == key order
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    left = k
    for p in tl.static_range(PASSES):
        shift = 24 - 8 * p  # a constexpr (p is one): not annotated, as it is rebound each pass
        if p == 0:
            m = valid
        else:
            m = valid & ((u >> (shift + 8)) == prefix)
        digit = tl.where(m, (u >> shift) & 0xFF, 0).to(tl.int32)
        hist = tl.histogram(digit, 256, mask=m)  # [256]
        at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # [256]: matching keys with byte >= bin
        byte = tl.max(tl.where(at_or_above >= left, bins, -1), 0)  # >= 0: bin 0 counts them all, >= left
        left = left - tl.sum(tl.where(bins > byte, hist, 0), 0)
        prefix = (prefix << 8) | byte.to(tl.uint32)
    if PASSES < 4:  # the bits no pass read: the same in every key (a 16-bit float's), given by its sign
        REST: tl.constexpr = 32 - 8 * PASSES
        positive = (prefix >> (8 * PASSES - 1)) != 0  # u's top bit: a float >= +0
        prefix = (prefix << REST) | tl.where(positive, 0, (1 << REST) - 1).to(tl.uint32)
    kth_raw = (prefix ^ 0x80000000).to(tl.int32, bitcast=True)  # the k-th largest raw key
    kth_raw = tl.where(kth_raw >= 0, kth_raw, kth_raw ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    kth = _key(kth_raw / t).to(tl.int64)  # the k-th largest key of x: x's order is raw's
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
    score = tl.where(valid & (key >= cut.to(tl.int32)), x + g, float("-inf"))  # x - log(-log(u)), the same bits
    choice = tl.argmax(score, 0)
    greedy = tl.argmax(raw, 0)
    return tl.minimum(tl.where(sampled, choice, greedy), V - 1).to(tl.int64)  # never an index >= V


@triton.jit
def _sample_kernel(LOGITS, TEMP, TOPK, TOPP, SEED, FRAME, OUT, stride, V, codebook, BLOCK: tl.constexpr,
                   PASSES: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    # the parameters and the noise before the wait: no kernel of the frame step writes the parameters
    temp, top_k, top_p = tl.load(TEMP + b), tl.load(TOPK + b), tl.load(TOPP + b)
    g = gumbel(tl.load(SEED + b), tl.load(FRAME + b), V, codebook, BLOCK)
    if PDL:  # kernels/pdl.py
        gdc_wait()
        gdc_launch_dependents()
    tl.store(OUT + b, sample_gumbel(LOGITS + b * stride, temp, top_k, top_p, g, V, BLOCK, PASSES))


def sample_triton(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, frame: Tensor,
                  codebook: int) -> Tensor:
    """The parameters are read before the PDL wait, so the kernel launched just before this one must not write them
    (in the frame step they are gathered at its start, many kernels before)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    _sample_kernel[(B,)](logits, temperature, top_k, top_p, seed, frame, out, logits.stride(0), V, codebook,
                         BLOCK=triton.next_power_of_2(V), PASSES=radix_passes(logits.dtype),
                         num_warps=tuning.by_rows(WARPS, B), **pdl.opts())
    return out
