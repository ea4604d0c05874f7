"""The loader: HF layout vs original layout (ckpt.pt and safetensors), bad checkpoints, hub offline, dummies."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from csmserve.sampling import SamplingParams
from csmserve.models.csm import CSMModel
from csmserve.models.loader import (ModelUnavailableError, config_from_original, load_csm, rope_permute,
                                    rope_unpermute)
from csmserve.models.reference import generate
from csmserve.prompt.tokenizer import load_tokenizer, prompt_frames

pytest.importorskip("transformers")
from tiny_csm import build_hf, write_original  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_audio_length_ms=12 * 80, seed=0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf")
    build_hf(d, seed=3)
    return d


def _codes(model_dir: Path | str) -> np.ndarray:
    model, cfg, d = load_csm(str(model_dir))
    tokens, mask = prompt_frames(load_tokenizer(d), [], "Loader parity.", 0, cfg.num_codebooks)
    return generate(model, tokens, mask, GREEDY).codes


def _copy_dir(src: Path, dst: Path, skip: str = "model.safetensors") -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != skip:
            shutil.copy(f, dst / f.name)
    return dst


def test_rope_permutation_round_trip():
    w = torch.randn(4 * 8, 5)
    assert torch.equal(rope_unpermute(rope_permute(w, 4), 4), w)
    # interleaved pair (2j, 2j+1) of head 0 becomes (j, j + hd/2)
    p = rope_permute(torch.arange(8.0)[:, None], 1)[:, 0]
    assert p.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_original_layout_matches_hf_layout(hf_dir, tmp_path, fmt):
    sd = load_file(str(hf_dir / "model.safetensors"))
    orig = _copy_dir(hf_dir, tmp_path / "orig")  # HF config.json + tokenizer, original-named weights
    write_original(sd, orig, fmt)
    ref = _codes(hf_dir)
    assert ref.shape[0] >= 10
    np.testing.assert_array_equal(_codes(orig), ref)


def test_sharded_hf_layout(hf_dir, tmp_path):
    sd = load_file(str(hf_dir / "model.safetensors"))
    d = _copy_dir(hf_dir, tmp_path / "sharded")
    names = sorted(sd)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: sd[n] for n in part}, str(d / shard))
        weight_map.update({n: shard for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    np.testing.assert_array_equal(_codes(d), _codes(hf_dir))


def _bad_checkpoint(hf_dir: Path, d: Path, edit) -> Path:
    sd = load_file(str(hf_dir / "model.safetensors"))
    edit(sd)
    _copy_dir(hf_dir, d)
    save_file(sd, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("kind,name", [
    ("missing", "backbone_model.layers.1.mlp.up_proj.weight"),
    ("unexpected", "backbone_model.layers.0.self_attn.q_proj.bias"),
    ("mis-shaped", "lm_head.weight"),
])
def test_bad_checkpoint_names_the_tensor(hf_dir, tmp_path, kind, name):
    def edit(sd):
        if kind == "missing":
            del sd[name]
        elif kind == "unexpected":
            sd[name] = torch.zeros(4)
        else:
            sd[name] = sd[name][:-1].contiguous()

    d = _bad_checkpoint(hf_dir, tmp_path / kind, edit)
    with pytest.raises(ValueError, match=f"{kind}: .*{name.replace('.', '[.]')}"):
        load_csm(str(d))


def test_untied_codebook_embeddings_are_refused_tied_copies_load(hf_dir, tmp_path):
    """A checkpoint holding the depth decoder's audio table beside the backbone's loads when it is a copy (a tied
    save that kept both) and is refused when it differs (tie_codebooks_embeddings=false): one table is served."""
    audio, tied = "backbone_model.embed_tokens.embed_audio_tokens.weight", "depth_decoder.model.embed_tokens.weight"

    def copy(sd):  # the tiny save keeps one of the two names: both, equal
        t = sd.get(audio, sd.get(tied))
        sd[audio], sd[tied] = t.clone(), t.clone()

    def untie(sd):
        copy(sd)
        sd[tied] = sd[tied] + 0.5

    load_csm(str(_bad_checkpoint(hf_dir, tmp_path / "copy", copy)))
    with pytest.raises(ValueError, match="untied codebook embeddings"):
        load_csm(str(_bad_checkpoint(hf_dir, tmp_path / "untied", untie)))


def test_bad_original_checkpoint_uses_original_names(hf_dir, tmp_path):
    sd = load_file(str(hf_dir / "model.safetensors"))
    d = _copy_dir(hf_dir, tmp_path / "orig")
    write_original(sd, d, "pt")
    ckpt = torch.load(d / "ckpt.pt", weights_only=True)
    del ckpt["decoder.layers.0.attn.k_proj.weight"]
    torch.save(ckpt, d / "ckpt.pt")
    with pytest.raises(ValueError, match=r"missing: decoder\.layers\.0\.attn\.k_proj\.weight"):
        load_csm(str(d))


def test_hub_id_offline_names_dummy(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelUnavailableError, match="--model dummy"):
        load_csm("sesame/csm-1b")


def test_missing_local_path_is_clear():
    with pytest.raises(ValueError, match="no such directory"):
        load_csm("./no/such/dir/")


def test_original_model_args_config():
    cfg = config_from_original({"backbone_flavor": "llama-1B", "decoder_flavor": "llama-100M",
                                "text_vocab_size": 128256, "audio_vocab_size": 2051, "audio_num_codebooks": 32})
    assert (cfg.backbone.dim, cfg.backbone.n_layers, cfg.backbone.n_kv_heads) == (2048, 16, 8)
    assert (cfg.decoder.dim, cfg.decoder.n_layers, cfg.decoder.n_heads) == (1024, 4, 8)
    assert (cfg.audio_vocab_size, cfg.num_codebooks, cfg.text_vocab_size) == (2051, 32, 128256)


def test_dummy_tiny_loads_and_generates():
    model, cfg, d = load_csm("dummy-tiny")
    assert d is None and cfg.num_codebooks == 32 and cfg.audio_vocab_size == 2051
    # buffers rebuilt after the meta-device construction equal a freshly built model's
    fresh = CSMModel(cfg)
    for (n, b), (_, f) in zip(model.named_buffers(), fresh.named_buffers()):
        assert b.dtype == f.dtype and torch.equal(b, f), n
    tokens, mask = prompt_frames(load_tokenizer(None), [], "Hi.", 0, 32)
    out = generate(model, tokens, mask, SamplingParams(temperature=0.9, top_k=50, max_audio_length_ms=400, seed=7))
    again = generate(load_csm("dummy-tiny")[0], tokens, mask,
                     SamplingParams(temperature=0.9, top_k=50, max_audio_length_ms=400, seed=7))
    assert out.codes.shape == (5, 32) and out.finish_reason == "length"
    np.testing.assert_array_equal(out.codes, again.codes)  # seeded weights and seeded sampling
    assert out.codes.max() < 2048 and len(np.unique(out.codes)) > 40


def test_dummy_bfloat16():
    model, _, _ = load_csm("dummy-tiny", dtype=torch.bfloat16)
    assert model.codebook0_head.weight.dtype == torch.bfloat16
    assert model.backbone.rope_cos.dtype == torch.float32
    tokens, mask = prompt_frames(load_tokenizer(None), [], "Hi.", 0, 32)
    assert generate(model, tokens, mask, GREEDY).codes.shape[1] == 32
