"""The plain reference generator: batch 1, dense KV caches, no graphs, obviously correct.

It is the golden path the engine is tested against: prefill the whole prompt, then one frame at a
time (backbone step -> codebook 0 -> depth decoder), sampled with the engine's counter-hash sampler,
until the all-zero EOS frame (not kept) or the frame limit.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from csmserve.sampling import SamplingParams
from csmserve.models.sampler import sample
from csmserve.models.csm import CSMModel, Sampler


@dataclass
class ReferenceOutput:
    codes: np.ndarray  # [frames, K] int64, EOS frame excluded
    finish_reason: str  # "eos" | "length"
    seed: int


def draw_seed() -> int:
    return secrets.randbits(63)


def frame_sampler(params: SamplingParams, seed: int, frame: int, device: torch.device,
                  n_codes: int | None = None) -> Sampler:
    """sample(logits [1, V], codebook) for one frame of one row, from the engine's sampler."""
    def one(x: float | int, dt: torch.dtype) -> Tensor:
        return torch.tensor([x], dtype=dt, device=device)

    t, p = one(params.temperature, torch.float32), one(params.top_p, torch.float32)
    k, s, f = one(params.top_k, torch.int64), one(seed, torch.int64), one(frame, torch.int64)
    return lambda logits, codebook: sample(logits[:, :n_codes], t, k, p, s, f, codebook)


@torch.inference_mode()
def generate(model: CSMModel, tokens: np.ndarray | Tensor, mask: np.ndarray | Tensor,
             params: SamplingParams) -> ReferenceOutput:
    """tokens/mask [T, K+1] prompt frames -> generated codes [frames, K]."""
    cfg = model.cfg
    device, dtype = model.codebook0_head.weight.device, model.codebook0_head.weight.dtype
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=device)
    mask = torch.as_tensor(mask, dtype=torch.bool, device=device)
    T, K, n_max = tokens.shape[0], cfg.num_codebooks, params.max_frames
    if params.max_audio_length_ms is None:  # no cap: until EOS or the model's context is full
        n_max = cfg.max_seq_len - T + 1
    if T + n_max > cfg.max_seq_len + 1:
        raise ValueError(f"prompt of {T} frames + {n_max} generated frames exceeds {cfg.max_seq_len} positions")
    seed = draw_seed() if params.seed is None else params.seed
    kv = model.backbone.new_kv(1, T + n_max, dtype, device)  # backbone positions 0 .. T+n_max-2
    dkv = model.decoder.new_kv(1, K, dtype, device)  # one frame; rewritten every frame
    dpos = torch.arange(K, device=device)
    h = model.forward_backbone(tokens[None], mask[None], torch.arange(T, device=device)[None], kv)[:, -1]  # [1, Db]
    frame_mask = torch.tensor([[[True] * K + [False]]], device=device)  # [1, 1, K+1]
    out: list[Tensor] = []
    for f in range(n_max):
        codes = model.decode_frame(h, frame_sampler(params, seed, f, device, cfg.sampleable_codes), dkv, dpos)  # [1, K]
        if bool((codes == 0).all()):
            return ReferenceOutput(_stack(out, K), "eos", seed)
        out.append(codes[0])
        if f + 1 < n_max:
            frame = torch.cat([codes, codes.new_zeros(1, 1)], dim=1)[None]  # [1, 1, K+1]
            pos = torch.tensor([[T + f]], device=device)
            h = model.forward_backbone(frame, frame_mask, pos, kv)[:, -1]
    return ReferenceOutput(_stack(out, K), "length", seed)


def _stack(frames: list[Tensor], K: int) -> np.ndarray:
    if not frames:
        return np.zeros((0, K), dtype=np.int64)
    return torch.stack(frames).cpu().numpy().astype(np.int64)
