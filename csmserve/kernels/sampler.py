"""The sampler of engine/sampler.py as one Triton kernel: a program per row, the vocab in registers."""
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
def _sample_kernel(LOGITS, TEMP, TOPK, TOPP, SEED, FRAME, OUT, stride, V, codebook, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    valid = i < V
    raw = tl.load(LOGITS + b * stride + i, mask=valid, other=float("-inf")).to(tl.float32)
    temp = tl.load(TEMP + b)
    top_k = tl.load(TOPK + b).to(tl.int32)
    top_p = tl.load(TOPP + b)
    x = raw / tl.where(temp > 0, temp, 1.0)
    s = tl.sort(x, descending=True)
    k = tl.where(top_k > 0, tl.minimum(top_k, V), V)
    sk = tl.where(i < k, s, float("-inf"))
    e = tl.exp(sk - tl.max(sk, 0))
    probs = e / tl.sum(e, 0)
    keep = ((tl.cumsum(probs, 0) - probs) <= top_p) & (i < k)
    n_keep = tl.sum(keep.to(tl.int32), 0)
    cut = tl.sum(tl.where(i == n_keep - 1, s, 0.0), 0)
    # counter-based noise, bit-identical to engine.sampler.hash_uniform
    seed = tl.load(SEED + b)
    frame = tl.load(FRAME + b)
    h = _mix32((i + codebook * V).to(tl.uint32))
    h = _mix32(h ^ (frame & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    score = tl.where(valid & (x >= cut), x - tl.log(-tl.log(u)), float("-inf"))
    choice = tl.argmax(score, 0)
    greedy = tl.argmax(raw, 0)
    tl.store(OUT + b, tl.where(temp > 0, choice, greedy).to(tl.int64))


def sample_triton(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, frame: Tensor,
                  codebook: int) -> Tensor:
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    _sample_kernel[(B,)](logits, temperature, top_k, top_p, seed, frame, out, logits.stride(0), V, codebook,
                         BLOCK=triton.next_power_of_2(V), num_warps=8)
    return out
