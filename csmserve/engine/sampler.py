"""Per-row temperature / top-k / top-p sampling with counter-based noise.

The noise for (seed, frame, codebook, token) is a hash of those four integers, so a seeded row
draws the same sample whatever else shares its batch, and nothing touches a global generator.
All ops are elementwise, sort or gather on static shapes: no host sync, CUDA-graph safe.
"""
from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    # x int64 in [0, 2^32); multipliers < 2^31 keep every product inside int64
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def hash_uniform(seed: Tensor, frame: Tensor, codebook: int, vocab: int) -> Tensor:
    """Uniform noise in (0, 1), float32 [B, vocab], a pure function of (seed, frame, codebook, token)."""
    tok = torch.arange(vocab, device=seed.device, dtype=torch.int64)  # [V]
    h = _mix32((tok + codebook * vocab) & _M32)[None, :]  # [1, V]
    h = _mix32(h ^ (frame[:, None] & _M32))
    h = _mix32(h ^ (seed[:, None] & _M32))
    h = _mix32(h ^ ((seed[:, None] >> 32) & _M32))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, frame: Tensor,
           codebook: int) -> Tensor:
    """logits [B, V]; temperature/top_p [B] float32; top_k/seed/frame [B] int64 -> tokens [B] int64.

    temperature 0 is greedy; top_k <= 0 disables top-k; top_p 1 disables top-p.
    """
    logits = logits.float()
    V = logits.shape[-1]
    greedy = logits.argmax(-1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    vals, idx = (logits / t[:, None]).sort(-1, descending=True)  # [B, V]
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    vals = vals.masked_fill(rank >= k[:, None], float("-inf"))
    probs = vals.softmax(-1)
    # drop tokens once the mass before them already exceeds top_p (the first token always stays)
    vals = vals.masked_fill((probs.cumsum(-1) - probs) > top_p[:, None], float("-inf"))
    u = hash_uniform(seed, frame, codebook, V).gather(1, idx)  # noise follows the token, not its rank
    gumbel = -torch.log(-torch.log(u))
    choice = idx.gather(1, (vals + gumbel).argmax(-1, keepdim=True))[:, 0]
    return torch.where(temperature > 0, choice, greedy)
