"""Checkpoints -> CSMModel: the HF layout, the original layout, and random `dummy` / `dummy-tiny` weights.

`--model` is `dummy`, `dummy-tiny`, a local directory (or checkpoint file), or a hub id. Every
real layout is first brought to HF names (spec §2.2; the original names of §2.1 are renamed with
§2.3 and their q/k rows permuted from interleaved to rotate-half RoPE), checked against the
config's expected names and shapes, then fused into our parameters (q,k,v -> qkv_proj,
gate,up -> gate_up_proj). No transformers import here.
"""
from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from csmserve.models.csm import CSMConfig, CSMModel, llama_100m, llama_1b
from csmserve.models.llama import LlamaConfig, rope_tables

DUMMY_MODELS = ("dummy", "dummy-tiny")
HF_IGNORED = (re.compile(r"^codec_model\."), re.compile(r"rotary_emb\.inv_freq$"))
# the audio table is tied; save_pretrained may keep only the depth decoder's copy
HF_AUDIO, HF_AUDIO_TIED = "backbone_model.embed_tokens.embed_audio_tokens.weight", "depth_decoder.model.embed_tokens.weight"
ORIG_IGNORED = (re.compile(r"causal_mask$"), re.compile(r"\.kv_cache\."), re.compile(r"\.pos_embeddings\."))

# original <-> HF names (spec §2.3): whole names, then a layer's prefix and its tensor's name within the layer
ORIG_HF_NAMES = {"text_embeddings.weight": "embed_text_tokens.weight", "codebook0_head.weight": "lm_head.weight",
                 "audio_embeddings.weight": "backbone_model.embed_tokens.embed_audio_tokens.weight",
                 "audio_head": "depth_decoder.codebooks_head.weight",
                 "projection.weight": "depth_decoder.model.inputs_embeds_projector.weight",
                 "decoder.norm.scale": "depth_decoder.model.norm.weight", "backbone.norm.scale": "backbone_model.norm.weight"}
ORIG_HF_LAYERS = (("backbone.layers.", "backbone_model.layers."), ("decoder.layers.", "depth_decoder.model.layers."))
ORIG_HF_IN_LAYER = (("attn.output_proj.", "self_attn.o_proj."), ("attn.", "self_attn."), ("mlp.w1.", "mlp.gate_proj."),
                    ("mlp.w2.", "mlp.down_proj."), ("mlp.w3.", "mlp.up_proj."), ("sa_norm.scale", "input_layernorm.weight"),
                    ("mlp_norm.scale", "post_attention_layernorm.weight"))
_LAYER_NAME = re.compile(r"^(.*layers\.)(\d+\.)(.*)$")  # (prefix, "N.", the tensor's name in layer N)


# ---------------------------------------------------------------------------------------------- configs

def tiny_config() -> CSMConfig:
    """`dummy-tiny`: real codebook count and audio vocab (codes are real Mimi ids), tiny transformers."""
    return CSMConfig(
        backbone=LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=128),
        decoder=LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64),
        text_vocab_size=258,  # ByteTokenizer
    )


def _rope_fields(c: dict[str, Any]) -> dict[str, Any]:
    # HF rope_parameters (v5) or legacy rope_theta + rope_scaling -> LlamaConfig rope fields
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", c.get("rope_theta", 500_000.0)))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=theta, rope_factor=None)
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r} (llama3 or default)")
    return dict(rope_theta=theta, rope_factor=float(rp["factor"]), rope_low_freq_factor=float(rp["low_freq_factor"]),
                rope_high_freq_factor=float(rp["high_freq_factor"]),
                rope_original_max_pos=int(rp["original_max_position_embeddings"]))


def _llama_from_hf(c: dict[str, Any], max_seq_len: int) -> LlamaConfig:
    heads, dim = c["num_attention_heads"], c["hidden_size"]
    if c.get("head_dim") not in (None, dim // heads):
        raise ValueError(f"head_dim {c['head_dim']} != hidden_size / num_attention_heads is not supported")
    if c.get("hidden_act", "silu") != "silu" or c.get("attention_bias") or c.get("mlp_bias"):
        raise ValueError("only silu MLPs without biases are supported")
    return LlamaConfig(dim=dim, n_layers=c["num_hidden_layers"], n_heads=heads, n_kv_heads=c["num_key_value_heads"],
                       intermediate=c["intermediate_size"], norm_eps=float(c.get("rms_norm_eps", 1e-5)),
                       max_seq_len=max_seq_len, **_rope_fields(c))


def config_from_hf(c: dict[str, Any]) -> CSMConfig:
    """transformers' CsmConfig dict (config.json of the HF layout) -> CSMConfig."""
    d = c["depth_decoder_config"]
    K, V = c.get("num_codebooks", 32), c.get("vocab_size", 2051)
    if d.get("num_codebooks", K) != K or d.get("vocab_size", V) != V or d.get("backbone_hidden_size",
                                                                            c["hidden_size"]) != c["hidden_size"]:
        raise ValueError("depth_decoder_config disagrees with the backbone on num_codebooks/vocab_size/hidden_size")
    max_pos = c.get("max_position_embeddings", 2048)
    return CSMConfig(backbone=_llama_from_hf(c, max_pos), decoder=_llama_from_hf(d, max(K, 2)),
                     text_vocab_size=c.get("text_vocab_size", 128_256), audio_vocab_size=V, num_codebooks=K,
                     max_seq_len=max_pos)


FLAVORS: dict[str, Callable[[], LlamaConfig]] = {"llama-1B": llama_1b, "llama-100M": llama_100m}


def config_from_original(c: dict[str, Any]) -> CSMConfig:
    """The original ModelArgs fields (backbone_flavor, decoder_flavor, vocab sizes, codebooks) -> CSMConfig."""
    for key in ("backbone_flavor", "decoder_flavor"):
        if c[key] not in FLAVORS:
            raise ValueError(f"unknown {key} {c[key]!r}; known: {sorted(FLAVORS)}")
    K = c.get("audio_num_codebooks", 32)
    dec = FLAVORS[c["decoder_flavor"]]()
    return CSMConfig(backbone=FLAVORS[c["backbone_flavor"]](),
                     decoder=LlamaConfig(**{**dec.__dict__, "max_seq_len": K}),
                     text_vocab_size=c.get("text_vocab_size", 128_256),
                     audio_vocab_size=c.get("audio_vocab_size", 2051), num_codebooks=K)


def read_config(model_dir: Path) -> CSMConfig:
    """config.json (HF CsmConfig or original ModelArgs); without one, the real CSM-1B shape."""
    path = model_dir / "config.json"
    if not path.is_file():
        return CSMConfig(decoder=LlamaConfig(**{**llama_100m().__dict__, "max_seq_len": 32}))
    c = json.loads(path.read_text())
    if "depth_decoder_config" in c:
        return config_from_hf(c)
    if "backbone_flavor" in c:
        return config_from_original(c)
    raise ValueError(f"{path}: neither a transformers CsmConfig nor the original ModelArgs")


# ------------------------------------------------------------------------------- names and shapes (HF)

def _layer_shapes(prefix: str, c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    hd, D, I = c.head_dim, c.dim, c.intermediate
    out = {}
    for i in range(c.n_layers):
        p = f"{prefix}.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (c.n_heads * hd, D), p + "self_attn.k_proj.weight": (c.n_kv_heads * hd, D),
            p + "self_attn.v_proj.weight": (c.n_kv_heads * hd, D), p + "self_attn.o_proj.weight": (D, c.n_heads * hd),
            p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D), p + "mlp.down_proj.weight": (D, I),
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
        })
    out[f"{prefix}.norm.weight"] = (D,)
    return out


def hf_shapes(cfg: CSMConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the HF layout must hold (codec and tied copies excluded), with its shape."""
    K, V, Db, Dd = cfg.num_codebooks, cfg.audio_vocab_size, cfg.backbone.dim, cfg.decoder.dim
    return {
        "embed_text_tokens.weight": (cfg.text_vocab_size, Db),
        "lm_head.weight": (V, Db),
        "backbone_model.embed_tokens.embed_audio_tokens.weight": (V * K, Db),
        **_layer_shapes("backbone_model", cfg.backbone),
        **_layer_shapes("depth_decoder.model", cfg.decoder),
        "depth_decoder.model.inputs_embeds_projector.weight": (Dd, Db),
        "depth_decoder.codebooks_head.weight": (K - 1, Dd, V),
    }


_WHOLE = (ORIG_HF_NAMES, {hf: orig for orig, hf in ORIG_HF_NAMES.items()})  # by the source side: orig, HF


def _rename(name: str, to_hf: bool) -> str:
    src, dst = (0, 1) if to_hf else (1, 0)
    whole = _WHOLE[src]
    if name in whole:
        return whole[name]
    m = _LAYER_NAME.match(name)
    if m is None:
        return name
    prefix, layer, rest = m.groups()
    prefix = next((p[dst] for p in ORIG_HF_LAYERS if p[src] == prefix), prefix)
    for pair in ORIG_HF_IN_LAYER:
        if rest.startswith(pair[src]):
            return prefix + layer + pair[dst] + rest[len(pair[src]):]
    return prefix + layer + rest


def orig_to_hf_name(name: str) -> str:
    return _rename(name, to_hf=True)


def hf_to_orig_name(name: str) -> str:
    """HF name -> original name (spec §2.3 reversed)."""
    return _rename(name, to_hf=False)


def rope_permute(w: Tensor, n_heads: int) -> Tensor:
    """q/k rows, interleaved RoPE pairs -> rotate-half halves (spec §2.3)."""
    d1, d2 = w.shape
    return w.view(n_heads, d1 // n_heads // 2, 2, d2).transpose(1, 2).reshape(d1, d2)


def rope_unpermute(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of `rope_permute` (rotate-half -> interleaved), for writing the original layout."""
    d1, d2 = w.shape
    return w.view(n_heads, 2, d1 // n_heads // 2, d2).transpose(1, 2).reshape(d1, d2)


def _rope_heads(hf_name: str, cfg: CSMConfig) -> int | None:
    # how many heads a q/k tensor holds, or None for every other tensor
    m = re.search(r"self_attn\.([qk])_proj\.weight$", hf_name)
    if m is None:
        return None
    c = cfg.backbone if hf_name.startswith("backbone_model.") else cfg.decoder
    return c.n_heads if m.group(1) == "q" else c.n_kv_heads


# --------------------------------------------------------------------------------------- reading files

class Source:
    """Lazy name -> tensor access over safetensors files or a torch.load'ed dict (CPU)."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, Any] = {}
        for f in files:
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                h = safe_open(str(f), framework="pt", device="cpu")
                self._where.update({k: h for k in h.keys()})
            else:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                sd = sd.get("model", sd.get("state_dict", sd)) if isinstance(sd, dict) else sd
                if not isinstance(sd, dict):
                    raise ValueError(f"{f}: expected a state dict, got {type(sd).__name__}")
                self._where.update({k: sd for k in sd})

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        h = self._where[name]
        return tuple(h[name].shape) if isinstance(h, dict) else tuple(h.get_slice(name).get_shape())

    def get(self, name: str) -> Tensor:
        h = self._where[name]
        return h[name] if isinstance(h, dict) else h.get_tensor(name)


def weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    for name in ("model.safetensors", "ckpt.pt"):
        if (path / name).is_file():
            return [path / name]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise ValueError(f"{path}: no model.safetensors(.index.json), ckpt.pt or single *.safetensors file")


def _is_original(names: list[str]) -> bool:
    return any(n.startswith(("backbone.", "decoder.", "text_embeddings.")) for n in names)


def hf_view(src: Source, cfg: CSMConfig) -> dict[str, Callable[[], Tensor]]:
    """Check `src` against the config; return HF name -> loader of that tensor in HF layout (CPU).

    Raises one ValueError naming every missing, unexpected and mis-shaped tensor (in the file's names).
    """
    expected = hf_shapes(cfg)
    original = _is_original(src.names())
    names = src.names()
    tied_only = not original and HF_AUDIO_TIED in names and HF_AUDIO not in names
    rename = orig_to_hf_name if original else (lambda n: HF_AUDIO if tied_only and n == HF_AUDIO_TIED else n)
    ignored = ORIG_IGNORED if original else HF_IGNORED
    view: dict[str, Callable[[], Tensor]] = {}
    unexpected, misshaped, seen = [], [], {}
    for name in names:
        if any(p.search(name) for p in ignored) or (not original and not tied_only and name == HF_AUDIO_TIED):
            continue
        hf = rename(name)
        seen[hf] = name
        if hf not in expected:
            unexpected.append(name)
        elif src.shape(name) != expected[hf]:
            misshaped.append(f"{name} {list(src.shape(name))} (expected {list(expected[hf])})")
        else:
            view[hf] = _loader(src, name, _rope_heads(hf, cfg) if original else None)
    missing = [hf_to_orig_name(n) if original else n for n in expected if n not in seen]
    problems = [f"{what}: {', '.join(items)}" for what, items in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if items]
    if (not original and not tied_only and HF_AUDIO_TIED in names and HF_AUDIO in view
            and (src.shape(HF_AUDIO_TIED) != src.shape(HF_AUDIO) or not torch.equal(src.get(HF_AUDIO_TIED),
                                                                                    src.get(HF_AUDIO)))):
        problems.append(f"untied codebook embeddings: {HF_AUDIO_TIED} is not {HF_AUDIO} (a model saved with "
                        f"tie_codebooks_embeddings=false; CSM's depth decoder reads the backbone's table)")
    if problems:
        raise ValueError("checkpoint does not match the model config; " + "; ".join(problems))
    return view


def _loader(src: Source, name: str, rope_heads: int | None) -> Callable[[], Tensor]:
    if rope_heads is None:
        return lambda: src.get(name)
    return lambda: rope_permute(src.get(name), rope_heads)


# ---------------------------------------------------------------------------------- building the model

def empty_model(cfg: CSMConfig, device: torch.device | str, dtype: torch.dtype) -> CSMModel:
    """CSMModel with uninitialised parameters allocated once, directly on `device` in `dtype`."""
    with torch.device("meta"):
        model = CSMModel(cfg)
    for mod in model.modules():  # not Module.to_empty: its empty_like on meta imports sympy (~1 s a process)
        for name, p in mod.named_parameters(recurse=False):
            mod._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), p.requires_grad)
    _reset_buffers(model, device)
    return model.eval().requires_grad_(False)


def _reset_buffers(model: CSMModel, device: torch.device | str) -> None:
    # the non-persistent buffers were on meta: recompute them (rope tables stay float32)
    cfg = model.cfg
    for llama, c in ((model.backbone, cfg.backbone), (model.decoder, cfg.decoder)):
        cos, sin = rope_tables(c)
        llama.rope_cos, llama.rope_sin = cos.to(device), sin.to(device)
    model.codebook_offsets = torch.arange(cfg.num_codebooks, device=device) * cfg.audio_vocab_size


def fuse_hf(view: dict[str, Callable[[], Tensor]], cfg: CSMConfig) -> Iterator[tuple[str, Tensor]]:
    """HF-named tensors -> our parameter names, fusing q,k,v and gate,up. Yields one tensor at a time."""
    yield "text_embeddings.weight", view["embed_text_tokens.weight"]()
    yield "audio_embeddings.weight", view["backbone_model.embed_tokens.embed_audio_tokens.weight"]()
    yield "codebook0_head.weight", view["lm_head.weight"]()
    yield "projection.weight", view["depth_decoder.model.inputs_embeds_projector.weight"]()
    yield "audio_head", view["depth_decoder.codebooks_head.weight"]()
    for ours, theirs, c in (("backbone", "backbone_model", cfg.backbone), ("decoder", "depth_decoder.model",
                                                                           cfg.decoder)):
        yield f"{ours}.norm.weight", view[f"{theirs}.norm.weight"]()
        for i in range(c.n_layers):
            p, q = f"{ours}.layers.{i}.", f"{theirs}.layers.{i}."
            att, mlp = q + "self_attn.", q + "mlp."
            yield p + "self_attn.qkv_proj.weight", torch.cat([view[att + f"{x}_proj.weight"]() for x in "qkv"])
            yield p + "self_attn.o_proj.weight", view[att + "o_proj.weight"]()
            yield p + "mlp.gate_up_proj.weight", torch.cat([view[mlp + "gate_proj.weight"](),
                                                            view[mlp + "up_proj.weight"]()])
            yield p + "mlp.down_proj.weight", view[mlp + "down_proj.weight"]()
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                yield p + n, view[q + n]()


@torch.no_grad()
def load_weights(model: CSMModel, view: dict[str, Callable[[], Tensor]]) -> None:
    params = dict(model.named_parameters())
    done = set()
    for name, t in fuse_hf(view, model.cfg):
        params[name].copy_(t)
        done.add(name)
    assert done == set(params), f"parameters left unloaded: {sorted(set(params) - done)}"


@torch.no_grad()
def init_dummy(model: CSMModel, seed: int = 0) -> None:
    """Seeded random weights with a non-degenerate output: linear weights N(0, 1/fan_in), embeddings N(0, 1).

    Logit rows of ids past the 2048 real Mimi codes are zeroed so sampled codes stay decodable.
    """
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif "embeddings" in name:
            p.normal_(0.0, 1.0, generator=g)
        else:
            fan_in = p.shape[-2] if name == "audio_head" else p.shape[-1]
            p.normal_(0.0, fan_in ** -0.5, generator=g)
    if model.cfg.audio_vocab_size > 2048:
        model.codebook0_head.weight[2048:] = 0
        model.audio_head[..., 2048:] = 0


# ---------------------------------------------------------------------------------- resolving --model

class ModelUnavailableError(RuntimeError):
    """A hub id that cannot be fetched (offline, gated, not found, disk full): one line, why and what to do."""


NO_WEIGHTS_HINT = "or a local directory, or `--model dummy-tiny` (random weights) to run without weights"


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return env in ("1", "true", "yes", "on") or bool(constants.HF_HUB_OFFLINE)


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split("\n")[0].split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _has_token() -> bool:
    try:
        from huggingface_hub import get_token

        return bool(get_token())
    except Exception:  # noqa: BLE001 - an unreadable token file is no token
        return False


def hub_error_message(model: str, e: BaseException, offline: bool) -> str:
    """Why `model` could not be fetched from the hub, and what to do: one line."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    cache = constants.HF_HUB_CACHE
    url = f"https://huggingface.co/{model}"
    for err in _chain(e):
        if isinstance(err, OSError) and (err.errno == errno.ENOSPC or "No space left" in str(err)):
            return (f"no space left on the disk while downloading {model!r} into {cache}: free some space, "
                    f"or point HF_HOME (or HF_HUB_CACHE) at a larger disk ({NO_WEIGHTS_HINT})")
    if isinstance(e, GatedRepoError):
        if _has_token():
            return (f"{model!r} is a gated model and your Hugging Face token has no access to it: accept its "
                    f"terms at {url} with the account of that token, then retry")
        return (f"{model!r} is a gated model and no Hugging Face token is set: accept its terms at {url}, then "
                f"`export HF_TOKEN=hf_...` (a token from https://huggingface.co/settings/tokens) or run "
                f"`huggingface-cli login`, and retry")
    if isinstance(e, RevisionNotFoundError):
        return f"{model!r} has no such revision on the Hugging Face hub ({_first_line(e)})"
    if isinstance(e, RepositoryNotFoundError) or _status(e) == 404:
        private = "" if _has_token() else "; a private model needs `export HF_TOKEN=hf_...` or `huggingface-cli login`"
        return (f"no model {model!r} on the Hugging Face hub: check the id (e.g. sesame/csm-1b){private}; "
                f"{NO_WEIGHTS_HINT}")
    if _status(e) == 401:
        return (f"the Hugging Face hub refused the token for {model!r} (HTTP 401): set a valid one with "
                f"`export HF_TOKEN=hf_...` or `huggingface-cli login`")
    if offline:
        return (f"{model!r} is not in the Hugging Face cache ({cache}) and downloads are off (HF_HUB_OFFLINE): "
                f"unset HF_HUB_OFFLINE and connect once to download it, {NO_WEIGHTS_HINT}")
    if isinstance(e, LocalEntryNotFoundError):  # the hub was unreachable and nothing is cached
        cause = next((c for c in _chain(e) if c is not e), None)
        why = _first_line(cause) if cause is not None else _first_line(e).split(" An error happened")[0]
        return (f"cannot reach the Hugging Face hub to download {model!r} ({why}) and it is not in the cache "
                f"({cache}): connect to the internet and retry (set HTTPS_PROXY behind a proxy), {NO_WEIGHTS_HINT}")
    status = _status(e)
    if status is not None and status >= 500:
        return f"the Hugging Face hub failed (HTTP {status}) for {model!r}: retry later, {NO_WEIGHTS_HINT}"
    return f"cannot get {model!r} from the Hugging Face hub ({_first_line(e)}): retry, {NO_WEIGHTS_HINT}"


def resolve_model_dir(model: str) -> Path:
    """A local directory or checkpoint file as given; a hub id downloaded (or found in the cache)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise ValueError(f"--model {model!r}: no such directory or file, and not a hub id (owner/name); "
                         f"use a hub id like sesame/csm-1b, a local directory, or dummy / dummy-tiny")
    from huggingface_hub import snapshot_download

    offline = _offline()
    try:
        # the weights in one layout only: the repo may hold both model.safetensors and the original ckpt.pt
        d = Path(snapshot_download(model, local_files_only=offline,
                                   allow_patterns=["*.json", "tokenizer*", "*.safetensors"]))
        if not any(d.glob("*.safetensors")):
            d = Path(snapshot_download(model, local_files_only=offline, allow_patterns=["*.json", "tokenizer*", "*.pt"]))
        return d
    except Exception as e:  # connection errors, gated repos, missing cache entries, a full disk
        raise ModelUnavailableError(hub_error_message(model, e, offline)) from e


def load_csm(model: str, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> tuple[CSMModel, CSMConfig, Path | None]:
    """`--model` -> (model in eval mode on `device`/`dtype`, its config, the directory holding tokenizer.json or None)."""
    if model in DUMMY_MODELS:
        cfg = tiny_config() if model == "dummy-tiny" else CSMConfig(
            decoder=LlamaConfig(**{**llama_100m().__dict__, "max_seq_len": 32}))
        m = empty_model(cfg, device, dtype)
        init_dummy(m)
        return m, cfg, None
    path = resolve_model_dir(model)
    model_dir = path if path.is_dir() else path.parent
    cfg = read_config(model_dir)
    view = hf_view(Source(weight_files(path)), cfg)
    m = empty_model(cfg, device, dtype)
    load_weights(m, view)
    return m, cfg, model_dir
