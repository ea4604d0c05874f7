"""Mimi weights: HF (`kyutai/mimi`, `codec_model.*` in `sesame/csm-1b`) and moshi layouts -> `Mimi`.

Both layouts go through HF flat names (spec §3.8): moshi -> HF flat -> ours. Missing,
unexpected or mis-shaped tensors raise ValueError naming them. Codebook vectors are
computed once here, in float32, from embed_sum / clamp(cluster_usage, 1e-5).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from csmserve.models.loader import Source, weight_files
from csmserve.models.mimi import Mimi, MimiConfig

# tf 5.x in-memory MimiModel names -> the flat hub names (tf conversion_mapping, reversed)
_HF_NESTED = [
    ("encoder.encoder_seanet.layers.", "encoder.layers."),
    ("encoder.encoder_transformer.", "encoder_transformer."),
    ("encoder.downsample.", "downsample."),
    ("decoder.upsample.", "upsample."),
    ("decoder.decoder_transformer.", "decoder_transformer."),
    ("decoder.decoder_seanet.layers.", "decoder.layers."),
]

# moshi -> HF flat, substring replacements in order (transformers convert_mimi_checkpoint_to_pytorch.py)
_MOSHI_TO_HF = [
    ("self_attn.in_projs.0.weight", "self_attn.in_proj_weight"), ("self_attn.out_projs.0.", "self_attn.out_proj."),
    ("conv.conv.conv", "conv"), ("convtr.convtr.convtr", "conv"), ("conv.conv", "conv"), ("convtr.convtr", "conv"),
    ("quantizer.rvq_first.vq", "quantizer.semantic_residual_vector_quantizer"),
    ("quantizer.rvq_first", "quantizer.semantic_residual_vector_quantizer"),
    ("quantizer.rvq_rest.vq", "quantizer.acoustic_residual_vector_quantizer"),
    ("quantizer.rvq_rest", "quantizer.acoustic_residual_vector_quantizer"),
    ("_codebook", "codebook"), ("_initialized", "initialized"), ("embedding_sum", "embed_sum"),
    ("encoder.model", "encoder.layers"), ("decoder.model", "decoder.layers"),
    ("encoder_transformer.transformer", "encoder_transformer"),
    ("decoder_transformer.transformer", "decoder_transformer"),
    ("linear1", "mlp.fc1"), ("linear2", "mlp.fc2"), ("self_attn.out_proj", "self_attn.o_proj"),
    ("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm"),
    ("layer_scale_1", "self_attn_layer_scale"), ("layer_scale_2", "mlp_layer_scale"),
]

# HF flat -> ours, regex rules applied to every non-attention-input, non-codebook key
_HF_TO_OURS = [
    (r"^(en|de)coder\.layers\.(\d+)\.conv\.(weight|bias)$", r"\1coder.\2.\3"),
    (r"^(en|de)coder\.layers\.(\d+)\.block\.1\.conv\.(weight|bias)$", r"\1coder.\2.conv1.\3"),
    (r"^(en|de)coder\.layers\.(\d+)\.block\.3\.conv\.(weight|bias)$", r"\1coder.\2.conv2.\3"),
    (r"^(.*_transformer\.layers\.\d+)\.input_layernorm\.", r"\1.norm1."),
    (r"^(.*_transformer\.layers\.\d+)\.post_attention_layernorm\.", r"\1.norm2."),
    (r"^(.*_transformer\.layers\.\d+)\.self_attn\.o_proj\.weight$", r"\1.out.weight"),
    (r"^(.*_transformer\.layers\.\d+)\.mlp\.(fc\d)\.weight$", r"\1.\2.weight"),
    (r"^(.*_transformer\.layers\.\d+)\.self_attn_layer_scale\.scale$", r"\1.ls1"),
    (r"^(.*_transformer\.layers\.\d+)\.mlp_layer_scale\.scale$", r"\1.ls2"),
    (r"^(down|up)sample\.conv\.weight$", r"\1sample.weight"),
    (r"^quantizer\.semantic_residual_vector_quantizer\.input_proj\.weight$", "quantizer.in_sem"),
    (r"^quantizer\.semantic_residual_vector_quantizer\.output_proj\.weight$", "quantizer.out_sem"),
    (r"^quantizer\.acoustic_residual_vector_quantizer\.input_proj\.weight$", "quantizer.in_ac"),
    (r"^quantizer\.acoustic_residual_vector_quantizer\.output_proj\.weight$", "quantizer.out_ac"),
]
_QKV = re.compile(r"^(.*_transformer\.layers\.\d+)\.self_attn\.([qkv])_proj\.weight$")
_BOOK = re.compile(r"^quantizer\.(semantic|acoustic)_residual_vector_quantizer\.layers\.(\d+)\.codebook\."
                   r"(embed_sum|cluster_usage|initialized)$")


def moshi_to_hf(sd: dict[str, Tensor], cfg: MimiConfig) -> dict[str, Tensor]:
    """moshi `MimiModel.state_dict()` names -> HF flat names; splits in_proj, permutes q/k to rotate-half."""
    out: dict[str, Tensor] = {}
    h, hd = cfg.num_attention_heads, cfg.head_dim
    for key, t in sd.items():
        for a, b in _MOSHI_TO_HF:
            key = key.replace(a, b)
        if key.endswith("self_attn.in_proj_weight"):
            base = key[: -len("in_proj_weight")]
            q, k, v = t.chunk(3, dim=0)
            for name, w in (("q", q), ("k", k)):  # interleaved pairs -> halves, per head
                w = w.reshape(h, hd // 2, 2, -1).transpose(1, 2).reshape(h * hd, -1)
                out[f"{base}{name}_proj.weight"] = w
            out[f"{base}v_proj.weight"] = v
        else:
            out[key] = t
    return out


def hf_to_ours(sd: dict[str, Tensor], cfg: MimiConfig, prefix: str = "") -> tuple[dict[str, Tensor], dict]:
    """HF names (flat hub or tf-5 nested; keys under `prefix`) -> (our params, codebook buffers)."""
    ours: dict[str, Tensor] = {}
    qkv: dict[str, dict[str, Tensor]] = {}
    books: dict[tuple[int, str], Tensor] = {}
    unexpected = []
    for key, t in sd.items():
        if not key.startswith(prefix):
            continue
        key = key[len(prefix):]
        for a, b in _HF_NESTED:
            key = b + key[len(a):] if key.startswith(a) else key
        if m := _QKV.match(key):
            qkv.setdefault(m[1], {})[m[2]] = t
        elif m := _BOOK.match(key):
            q = int(m[2]) + (0 if m[1] == "semantic" else cfg.num_semantic_quantizers)
            books[(q, m[3])] = t
        else:
            for pat, rep in _HF_TO_OURS:
                new, n = re.subn(pat, rep, key)
                if n:
                    ours[new] = t
                    break
            else:
                unexpected.append(prefix + key)
    for base, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"Mimi checkpoint: incomplete q/k/v projections under {prefix}{base}")
        ours[f"{base}.qkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    if unexpected:
        raise ValueError(f"Mimi checkpoint: unexpected tensors {unexpected}")
    return ours, books


def _stack_books(books: dict, cfg: MimiConfig) -> tuple[Tensor, Tensor]:
    # -> embed_sum [Q, bins, dim], cluster_usage [Q, bins]
    want = {(q, n) for q in range(cfg.num_quantizers) for n in ("embed_sum", "cluster_usage")}
    missing = sorted(want - set(books))
    extra = sorted(k for k in set(books) - want if k[1] != "initialized")
    if missing or extra:
        raise ValueError(f"Mimi checkpoint: codebook tensors missing {missing} / unexpected {extra}")
    es = torch.stack([books[(q, "embed_sum")].float() for q in range(cfg.num_quantizers)])
    us = torch.stack([books[(q, "cluster_usage")].float() for q in range(cfg.num_quantizers)])
    if es.shape != (cfg.num_quantizers, cfg.codebook_size, cfg.codebook_dim) or us.shape != es.shape[:2]:
        raise ValueError(f"Mimi checkpoint: codebook shapes {tuple(es.shape)}/{tuple(us.shape)} do not match config")
    return es, us


def load_state(mimi: Mimi, params: dict[str, Tensor], books: dict) -> None:
    """Copy converted params into `mimi` (strict: names and shapes) and compute the codebooks."""
    own = dict(mimi.named_parameters())
    missing = sorted(set(own) - set(params))
    unexpected = sorted(set(params) - set(own))
    shapes = [f"{k}: {tuple(params[k].shape)} != {tuple(own[k].shape)}"
              for k in set(own) & set(params) if params[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"Mimi checkpoint mismatch: missing {missing}, unexpected {unexpected}, shapes {shapes}")
    es, us = _stack_books(books, mimi.cfg)
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(params[k])
    mimi.quantizer.set_codebooks(es, us)


def load_hf_state_dict(mimi: Mimi, sd: dict[str, Tensor], prefix: str = "") -> None:
    """HF layout: `kyutai/mimi` (prefix "") or a CSM checkpoint (prefix "codec_model.")."""
    load_state(mimi, *hf_to_ours(sd, mimi.cfg, prefix))


def load_moshi_state_dict(mimi: Mimi, sd: dict[str, Tensor]) -> None:
    """moshi layout: `tokenizer-e351c8d8-checkpoint125.safetensors`."""
    load_state(mimi, *hf_to_ours(moshi_to_hf(sd, mimi.cfg), mimi.cfg))


def is_moshi_layout(sd: dict[str, Tensor]) -> bool:
    return any(".rvq_first." in k or k.startswith("encoder.model.") for k in sd)


def dummy_init(mimi: Mimi, seed: int = 0) -> Mimi:
    """Random weights of sane scale (benchmarks, offline demos); codebooks well spread."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mimi.named_parameters():
            if name.endswith((".ls1", ".ls2")):
                p.fill_(mimi.cfg.layer_scale_initial_scale)
            elif p.dim() == 1:
                p.copy_(torch.ones(p.shape) if "norm" in name and name.endswith("weight") else
                        0.02 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
    c = mimi.cfg
    es = torch.randn(c.num_quantizers, c.codebook_size, c.codebook_dim, generator=g)
    mimi.quantizer.set_codebooks(es, torch.ones(c.num_quantizers, c.codebook_size))
    return mimi


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a Mimi file (or directory: its checkpoint's files, as loader.py finds them); from a CSM
    checkpoint only its `codec_model.*` tensors."""
    files = [f for f in weight_files(path) if f.suffix == ".safetensors"]
    if not files:
        raise FileNotFoundError(f"no safetensors file in {path}")
    src = Source(files)
    names = [k for k in src.names() if k.startswith("codec_model.")] or src.names()
    return {k: src.get(k) for k in names}


def _config_from_dir(path: Path) -> MimiConfig:
    cfg_file = path / "config.json" if path.is_dir() else None
    if cfg_file is None or not cfg_file.exists():
        return MimiConfig()
    d = json.loads(cfg_file.read_text())
    return MimiConfig.from_hf(d.get("codec_config", d))


def load_mimi(source: str | Path, cfg: MimiConfig | None = None, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", prefix: str | None = None) -> Mimi:
    """source: "dummy", a safetensors file (HF or moshi layout), or a directory (kyutai/mimi or csm-1b)."""
    if source == "dummy":
        mimi = dummy_init(Mimi(cfg or MimiConfig()))
    else:
        path = Path(source)
        cfg = cfg or _config_from_dir(path)
        sd = _read_safetensors(path)
        mimi = Mimi(cfg)
        if is_moshi_layout(sd):
            load_moshi_state_dict(mimi, sd)
        else:
            if prefix is None:
                prefix = "codec_model." if any(k.startswith("codec_model.") for k in sd) else ""
            load_hf_state_dict(mimi, sd, prefix)
    return mimi.to(device=device, dtype=dtype).eval().requires_grad_(False)
