"""LoRA adapters (models/lora.py) against PEFT itself: adapters made by get_peft_model on the tiny transformers CSM
with random non-zero A and B, saved by save_pretrained, read onto our fused layout. Every projection's delta equals
PEFT's (scales: alpha / r, rsLoRA, rank_pattern / alpha_pattern); a merged fine-tune (unsloth's merged save) loads
as a model; what cannot be served right is refused in one line."""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tiny_csm import build_hf, hf_config  # noqa: E402
from tiny_lora import ALL, merged_checkpoint, peft_adapter  # noqa: E402

from csmserve.models.loader import load_csm  # noqa: E402
from csmserve.models.lora import (LoraError, LoraPool, delta_torch, detach, read_adapter,  # noqa: E402
                                  write_adapter)
from csmserve.models.reference import generate  # noqa: E402
from csmserve.prompt.tokenizer import load_tokenizer, prompt_frames  # noqa: E402
from csmserve.sampling import SamplingParams  # noqa: E402

WITH_PROJECTION = ALL + ["inputs_embeds_projector"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    hf = build_hf(d, seed=2)
    model, cfg, _ = load_csm(str(d))
    return d, hf, model, cfg


def _peft_modules(pm):
    """(transformers module name, its LoRA module) of every adapted projection outside Mimi."""
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and hasattr(mod, "base_layer") and "codec_model" not in name and len(mod.lora_A):
            yield name.removeprefix("base_model.model."), mod


def _check_deltas(model, cfg, pm, adapter, max_rank: int = 8) -> int:
    pool = LoraPool(model, max_loras=3, max_rank=max_rank)
    try:
        pool.write(2, adapter)
        g = torch.Generator().manual_seed(5)
        checked = 0
        for name, mod in _peft_modules(pm):
            t_i, s = pool.layout.hf[name]
            t = pool.layout.targets[t_i]
            x = torch.randn(3, t.k, generator=g)
            with torch.no_grad():
                want = mod(x) - mod.base_layer(x)  # [3, out] PEFT's delta
            pool.rows = torch.tensor([2, -1, 2], dtype=torch.int32)
            got = delta_torch(x, model.get_submodule(t.module).lora)
            col = sum(t.slices[:s])
            got = got[:, col:col + t.slices[s]]
            assert got[1].abs().max() == 0  # the row without an adapter
            err = (got[[0, 2]] - want[[0, 2]]).abs().max() / want.abs().max()
            assert err < 1e-5, f"{name}: relative error {err:.2e}"
            assert want.abs().max() > 0.1  # a real delta
            checked += 1
        return checked
    finally:
        detach(model)


@pytest.mark.parametrize("extra", [{}, {"use_rslora": True},
                                   {"rank_pattern": {"q_proj": 6, "depth_decoder.model.layers.1.mlp.down_proj": 2},
                                    "alpha_pattern": {"o_proj": 3.0}}],
                         ids=["alpha-over-r", "rslora", "patterns"])
def test_every_projection_equals_peft(base, tmp_path, extra):
    d, hf, model, cfg = base
    pm = peft_adapter(hf, tmp_path / "ad", targets=WITH_PROJECTION, **extra)
    adapter = read_adapter(tmp_path / "ad", cfg)
    assert adapter.rank == (6 if "rank_pattern" in extra else 4)
    n = _check_deltas(model, cfg, pm, adapter)
    layers = cfg.backbone.n_layers + cfg.decoder.n_layers
    assert n == adapter.modules == 7 * layers + 1  # q k v o gate up down per layer, and the projection


def test_write_adapter_writes_what_peft_reads(base, tmp_path):
    """models/lora.py's PEFT-free writer (the load benchmark's adapters): PEFT loads its directory onto transformers'
    model, and every projection's delta there equals ours read back from it."""
    from peft import PeftModel

    d, hf, model, cfg = base
    write_adapter(tmp_path / "w", cfg, rank=4, seed=3, std=0.3, dtype=torch.float32)
    import copy

    pm = PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "w")).eval()
    adapter = read_adapter(tmp_path / "w", cfg)
    layers = cfg.backbone.n_layers + cfg.decoder.n_layers
    assert adapter.rank == 4 and _check_deltas(model, cfg, pm, adapter) == adapter.modules == 7 * layers + 1


def test_codec_deltas_zero_dropped_nonzero_refused(base, tmp_path, caplog):
    d, hf, model, cfg = base
    peft_adapter(hf, tmp_path / "zero")  # Mimi's q/k/v/o wrapped too (plain names), left at B = 0
    with caplog.at_level(logging.INFO, logger="csmserve.lora"):
        a = read_adapter(tmp_path / "zero", cfg)
    assert a.dropped_codec == 16  # 2 encoder + 2 decoder layers x q, k, v, o
    assert any("zero LoRA deltas" in r.getMessage() and "codec_model" in r.getMessage() for r in caplog.records)
    peft_adapter(hf, tmp_path / "nonzero", codec_std=0.1)
    with pytest.raises(LoraError, match="non-zero LoRA on Mimi's transformer"):
        read_adapter(tmp_path / "nonzero", cfg)


def _greedy(model, d, tokens, mask) -> np.ndarray:
    return generate(model, tokens, mask, SamplingParams(temperature=0, max_audio_length_ms=16 * 80, seed=0)).codes


def test_merged_fine_tune_loads_as_model(base, tmp_path):
    """unsloth's merged save (merge_and_unload, save_pretrained) is a checkpoint in the HF layout: --model takes it,
    and its greedy codes are transformers + PEFT's (the unmerged adapter) on the same prompt."""
    d, hf, model, cfg = base
    pm = peft_adapter(hf, tmp_path / "ad", targets=WITH_PROJECTION)
    merged, mcfg, mdir = load_csm(str(merged_checkpoint(pm, tmp_path / "merged")))
    tokens, mask = prompt_frames(load_tokenizer(mdir), [], "A fine-tuned voice.", 0, cfg.num_codebooks)
    ours = _greedy(merged, mdir, tokens, mask)
    from test_csm_parity import _hf_inputs

    with torch.no_grad():
        ref = pm.generate(**_hf_inputs(tokens, mask), do_sample=False, depth_decoder_do_sample=False,
                          max_new_tokens=16)[0].numpy()
    assert len(ours) >= 12
    np.testing.assert_array_equal(ours, ref[:len(ours)])
    assert not np.array_equal(ours, _greedy(model, d, tokens, mask)[:len(ours)])  # the adapter changed the voice


def _refused(path, cfg, match: str, **kw) -> None:
    with pytest.raises(LoraError, match=match) as e:
        read_adapter(path, cfg, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case, match", [
    ({"use_dora": True}, "DoRA"),
    ({"targets": ["q_proj", "lm_head"]}, "codebook-0 head"),
    ({"targets": ["embed_text_tokens"]}, "text embedding"),
    ({"targets": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias"),
    ({"targets": ["q_proj"], "init_lora_weights": "pissa"}, "init_lora_weights='pissa'.*rewrote"),
    ({"targets": ["q_proj"], "init_lora_weights": "olora"}, "init_lora_weights='olora'.*rewrote"),
])
def test_refused_configs(base, tmp_path, case, match):
    d, hf, model, cfg = base
    case = dict(case)
    if "bias" in case:  # PEFT refuses to build it on bias-free layers: the saved config says so
        peft_adapter(hf, tmp_path / "ad")
        c = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
        (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({**c, "bias": case["bias"]}))
    else:
        peft_adapter(hf, tmp_path / "ad", **case)
    _refused(tmp_path / "ad", cfg, match)


def test_refused_other_base_and_rank(base, tmp_path):
    d, hf, model, cfg = base
    from transformers import CsmForConditionalGeneration

    other = hf_config()
    other.intermediate_size = 96  # the backbone's MLP of another shape
    peft_adapter(CsmForConditionalGeneration(other).eval(), tmp_path / "other")
    _refused(tmp_path / "other", cfg, "different base model: backbone_model.layers.0.mlp.down_proj")
    peft_adapter(hf, tmp_path / "r8", r=8)
    _refused(tmp_path / "r8", cfg, "rank 8 is over the pool's max_lora_rank 4", max_rank=4)


def test_refused_files(base, tmp_path):
    d, hf, model, cfg = base
    _refused(tmp_path / "nowhere", cfg, "no such adapter directory")
    peft_adapter(hf, tmp_path / "ad")
    cfg_file, weights = tmp_path / "ad" / "adapter_config.json", tmp_path / "ad" / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _refused(tmp_path / "ad", cfg, "adapter_model.safetensors: cannot read it")
    weights.unlink()
    _refused(tmp_path / "ad", cfg, "no adapter_model.safetensors or adapter_model.bin")
    cfg_file.write_text("{not json")
    _refused(tmp_path / "ad", cfg, "not valid JSON")
    cfg_file.unlink()
    _refused(tmp_path / "ad", cfg, "no adapter_config.json")
    Path(tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "r": 4, "lora_alpha": 8}))
    _refused(tmp_path / "ad", cfg, "not LoRA")


def test_pissa_converted_equals_peft(base, tmp_path):
    """A PiSSA adapter saved with path_initial_model_for_weight_conversion (the way the refusal above names) is a plain
    LoRA against the original base (rank 2r, [A; A0] and [B, -B0]): read, it equals PEFT's change to the original
    base's output; its untouched Mimi layers' deltas are zero only to rounding, and are dropped as zero."""
    from peft import LoraConfig, get_peft_model

    d, hf, model, cfg = base
    pm = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"],
                                                      init_lora_weights="pissa"))
    pm.save_pretrained(str(tmp_path / "init"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # "training": Mimi's layers stay as they were
        for name, p in pm.named_parameters():
            if (".lora_A." in name or ".lora_B." in name) and "codec_model." not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(str(tmp_path / "ad"), path_initial_model_for_weight_conversion=str(tmp_path / "init"))
    adapter = read_adapter(tmp_path / "ad", cfg, max_rank=8)
    assert adapter.rank == 8 and adapter.dropped_codec > 0
    name = "backbone_model.layers.0.self_attn.q_proj"
    pool = LoraPool(model, max_loras=1, max_rank=8)
    try:
        pool.write(0, adapter)
        t_i, s = pool.layout.hf[name]
        t = pool.layout.targets[t_i]
        x = torch.randn(2, t.k, generator=g)
        with torch.no_grad():
            want = pm.get_submodule("base_model.model." + name)(x) - hf.get_submodule(name)(x)
        pool.rows = torch.tensor([0, 0], dtype=torch.int32)
        got = delta_torch(x, model.get_submodule(t.module).lora)[:, :t.slices[0]]
        assert want.abs().max() > 0.1
        assert (got - want).abs().max() / want.abs().max() < 1e-5
    finally:
        detach(model)


def test_refused_nonfinite(base, tmp_path):
    """A NaN or an infinity in the weights (a diverged fine-tune) is refused: in a mixed batch it would reach other
    requests' rows too."""
    from safetensors.torch import load_file, save_file

    d, hf, model, cfg = base
    for bad in (float("nan"), float("inf")):
        peft_adapter(hf, tmp_path / "ad", targets=["q_proj"])
        f = tmp_path / "ad" / "adapter_model.safetensors"
        sd = load_file(str(f))
        sd[next(k for k in sd if k.endswith("lora_B.weight") and "codec_model" not in k)][0, 0] = bad
        save_file(sd, str(f))
        _refused(tmp_path / "ad", cfg, "NaN or infinite")
