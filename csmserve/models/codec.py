"""Which Mimi goes with which model: weights beside the checkpoint, a separate path, or random for dummies."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from csmserve.models.mimi import Mimi, MimiConfig
from csmserve.models.mimi_loader import load_mimi

log = logging.getLogger("csmserve")
MOSHI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"  # what Sesame's own code loads


def tiny_codec_config() -> MimiConfig:
    """dummy-tiny's codec: the real frame (1920 samples, 32 codebooks of 2048) with tiny layers."""
    return MimiConfig(num_filters=8, hidden_size=32, codebook_dim=16, upsample_groups=32, num_hidden_layers=1,
                      num_attention_heads=2, head_dim=16, intermediate_size=64)


def load_codec(model: str, model_dir: Path | None, codec: str | Path | None, device: torch.device,
               dtype: torch.dtype) -> Mimi | None:
    if codec == "none":
        return None
    if codec is not None:
        return load_mimi(codec, dtype=dtype, device=device)
    if model == "dummy":
        return load_mimi("dummy", dtype=dtype, device=device)
    if model == "dummy-tiny":
        return load_mimi("dummy", cfg=tiny_codec_config(), dtype=dtype, device=device)
    if model_dir is not None:
        if (model_dir / MOSHI_FILE).exists():
            return load_mimi(model_dir / MOSHI_FILE, dtype=dtype, device=device)
        try:
            return load_mimi(model_dir, dtype=dtype, device=device)  # codec_model.* inside the checkpoint
        except (ValueError, FileNotFoundError, KeyError) as e:
            log.warning("no Mimi codec in %s (%s); audio disabled, pass codec=", model_dir, e)
    return None
