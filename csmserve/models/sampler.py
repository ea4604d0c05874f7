"""Per-row temperature / top-k / top-p sampling with counter-based noise.

The noise for (seed, frame, codebook, token) is a hash of those four integers, so a seeded row
draws the same sample whatever else shares its batch, and nothing touches a global generator.
Top-k and top-p keep every token whose scaled logit reaches the cut-off value (ties kept, as the
reference `sample_topk` does), then Gumbel-max picks one. A temperature below GREEDY_BELOW (or NaN)
is greedy: the limit t -> 0, where `logits / t` would overflow. Whatever the logits hold (inf, NaN),
the token is an index into them: the top token is always kept, a NaN logit is never chosen.
No host sync; CUDA-graph safe. On CUDA the whole of it is one Triton kernel per call
(kernels/sampler.py); the torch code here is the reference it is tested against, and the CPU path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from csmserve.sampling import GREEDY_BELOW, MIX1, MIX2  # noqa: F401 (re-exported: the reference's names)

_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    # x int64 in [0, 2^32)
    x = x ^ (x >> 16)
    x = (x * MIX1) & _M32
    x = x ^ (x >> 15)
    x = (x * MIX2) & _M32
    return x ^ (x >> 16)


def hash_uniform(seed: Tensor, frame: Tensor, codebook: int, vocab: int) -> Tensor:
    """Uniform noise in (0, 1), float32 [B, vocab], a pure function of (seed, frame, codebook, token)."""
    tok = torch.arange(vocab, device=seed.device, dtype=torch.int64)  # [V]
    h = _mix32((tok + codebook * vocab) & _M32)[None, :]  # [1, V]
    h = _mix32(h ^ (frame[:, None] & _M32))  # [B, V]
    h = _mix32(h ^ (seed[:, None] & _M32))
    h = _mix32(h ^ ((seed[:, None] >> 32) & _M32))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def scaled_and_cut(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """logits [B, V] -> x = logits / temperature [B, V] float32 and cut [B, 1]: the sampler draws from
    softmax(x) over the tokens with x >= cut (top-k, then top-p; ties at the cut-off kept)."""
    logits = logits.float()
    logits = logits.masked_fill(logits.isnan(), float("-inf"))  # a NaN logit is never chosen
    V = logits.shape[-1]
    sampled = temperature >= GREEDY_BELOW  # [B]; False for 0, tiny and NaN temperatures
    t = torch.where(sampled, temperature, torch.ones_like(temperature))
    x = logits / t[:, None]  # [B, V]
    s = x.sort(-1, descending=True).values
    rank = torch.arange(V, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))[:, None]  # [B, 1]
    sk = s.masked_fill(rank >= k, float("-inf"))
    probs = sk.softmax(-1)
    keep = ((probs.cumsum(-1) - probs) <= top_p[:, None]) & (rank < k)  # mass before a token <= top_p
    # the top token always (its mass before is 0; NaN probs, from x = +inf, keep only the largest)
    cut = s.gather(1, keep.sum(-1, keepdim=True).clamp(min=1) - 1)  # [B, 1] smallest kept value
    return x, cut


def sample_torch(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, frame: Tensor,
                 codebook: int) -> Tensor:
    x, cut = scaled_and_cut(logits, temperature, top_k, top_p)
    gumbel = -torch.log(-torch.log(hash_uniform(seed, frame, codebook, x.shape[-1])))
    sampled = temperature >= GREEDY_BELOW  # [B]; False for 0, tiny and NaN temperatures
    greedy = logits.float().masked_fill(logits.isnan(), float("-inf")).argmax(-1)
    choice = (x + gumbel).masked_fill(x < cut, float("-inf")).argmax(-1)
    return torch.where(sampled, choice, greedy)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, frame: Tensor,
           codebook: int) -> Tensor:
    """logits [B, V]; temperature/top_p [B] float32; top_k/seed/frame [B] int64 -> tokens [B] int64.

    temperature < GREEDY_BELOW (0 included) is greedy; top_k <= 0 disables top-k; top_p 1 disables top-p.
    """
    if logits.is_cuda:
        from csmserve.kernels.sampler import sample_triton

        return sample_triton(logits, temperature, top_k, top_p, seed, frame, codebook)
    return sample_torch(logits, temperature, top_k, top_p, seed, frame, codebook)
