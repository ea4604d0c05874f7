"""MimiConfig: the codec's dimensions (field names follow HF `MimiConfig`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class MimiConfig:
    """Field names follow HF `MimiConfig`; defaults are the real model (`kyutai/mimi`)."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    upsample_groups: int = 512
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    head_dim: int = 64
    norm_eps: float = 1e-5
    sliding_window: int = 250
    rope_theta: float = 10000.0
    layer_scale_initial_scale: float = 0.01
    latent_stride: int = 2  # encoder frame rate / frame rate (25 Hz -> 12.5 Hz)

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsampling_ratios)

    @property
    def frame_size(self) -> int:
        return self.hop_length * self.latent_stride  # 1920 samples = 80 ms

    @property
    def frame_rate(self) -> float:
        return self.sampling_rate / self.frame_size

    @classmethod
    def tiny(cls, **kw: object) -> "MimiConfig":
        """The spec §4.4 tiny codec (frame_size 64), with a small FFN; override fields with kw."""
        base = dict(hidden_size=32, num_filters=8, upsampling_ratios=(8, 4), codebook_size=16,
                    codebook_dim=64, upsample_groups=32, num_hidden_layers=2, num_attention_heads=2,
                    head_dim=16, intermediate_size=64, sliding_window=4, num_quantizers=4)
        base.update(kw)
        return cls(**base)  # type: ignore[arg-type]

    @classmethod
    def from_hf(cls, d: dict) -> "MimiConfig":
        """From an HF `MimiConfig.to_dict()` / `codec_config` dict; rejects variants we do not implement."""
        fixed = dict(use_causal_conv=True, pad_mode="constant", use_conv_shortcut=False, trim_right_ratio=1.0,
                     audio_channels=1, attention_bias=False, hidden_act="gelu")
        for k, want in fixed.items():
            if d.get(k, want) != want:
                raise ValueError(f"unsupported Mimi config {k}={d[k]!r} (need {want!r})")
        heads = d.get("num_attention_heads", cls.num_attention_heads)
        if d.get("num_key_value_heads", heads) != heads:
            raise ValueError("Mimi with grouped-query attention is not supported")
        vq = d.get("vector_quantization_hidden_dimension")
        if vq is not None and vq != d.get("codebook_dim", cls.codebook_dim):
            raise ValueError("vector_quantization_hidden_dimension must equal codebook_dim")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "upsampling_ratios" in kw:
            kw["upsampling_ratios"] = tuple(kw["upsampling_ratios"])
        if "head_dim" not in kw or kw["head_dim"] is None:
            kw["head_dim"] = kw.get("hidden_size", cls.hidden_size) // heads
        rope = d.get("rope_parameters") or {}
        kw["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", cls.rope_theta)))
        return cls(**kw)

    def hf_kwargs(self) -> dict:
        """Kwargs for transformers' `MimiConfig` describing the same model (used by tests and the bench)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("rope_theta", "latent_stride"):
            kw.pop(k)
        kw["upsampling_ratios"] = list(self.upsampling_ratios)
        kw.update(vector_quantization_hidden_dimension=self.codebook_dim,
                  num_key_value_heads=self.num_attention_heads, use_cache=False,
                  rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        return kw
