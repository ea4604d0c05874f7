"""LoRA adapters through the engine (CSM API) against transformers + PEFT on the same weights (CPU, float32, tiny):
our greedy codes with an adapter are PEFT's with it, and our run on PEFT's merged weights (unsloth's merged save)
gives the same codes; with rsLoRA and per-module ranks too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_csm_parity import _hf_inputs  # noqa: E402
from tiny_csm import build_hf  # noqa: E402
from tiny_lora import ALL, merged_checkpoint, peft_adapter  # noqa: E402

from csmserve import CSM  # noqa: E402
from csmserve.config import EngineConfig  # noqa: E402

N_FRAMES = 20
TEXT = "A fine-tuned voice, in its own words."
CONFIG = EngineConfig(max_slots=4, max_seq_len=256, max_loras=2, max_lora_rank=8)
ADAPTERS = {  # name -> (PEFT config, seed)
    "ann": (dict(targets=ALL + ["inputs_embeds_projector"]), 1),
    "rs": (dict(use_rslora=True, r=8, alpha=4.0, rank_pattern={"down_proj": 2}), 2),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    hf = build_hf(d / "base", seed=2)
    peft = {name: peft_adapter(hf, d / name, seed=seed, **kw) for name, (kw, seed) in ADAPTERS.items()}
    csm = CSM(str(d / "base"), device="cpu", dtype="float32", engine_config=CONFIG,
              adapters={name: str(d / name) for name in ADAPTERS})
    yield d, hf, peft, csm
    csm.close()


def _reference(pm, csm) -> np.ndarray:
    tokens, mask = csm.prompt(TEXT, 0)
    with torch.no_grad():
        return pm.generate(**_hf_inputs(tokens, mask), do_sample=False, depth_decoder_do_sample=False,
                           max_new_tokens=N_FRAMES)[0].numpy()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_codes_equal_transformers_with_peft(served, name):
    d, hf, peft, csm = served
    ours = csm.generate(TEXT, temperature=0, adapter=name, max_audio_length_ms=N_FRAMES * 80).codes
    ref = _reference(peft[name], csm)
    assert len(ours) >= N_FRAMES - 2, "random weights hit EOS early; change the seed"
    np.testing.assert_array_equal(ours, ref[:len(ours)])
    base = csm.generate(TEXT, temperature=0, max_audio_length_ms=N_FRAMES * 80).codes
    assert not np.array_equal(ours[:len(base)], base[:len(ours)])  # the adapter changed the codes


def test_adapter_equals_peft_merged_weights(served, tmp_path):
    """Our run with the adapter == our run on PEFT's merged weights (merge_and_unload, save_pretrained)."""
    d, hf, peft, csm = served
    ours = csm.generate(TEXT, temperature=0, adapter="ann", max_audio_length_ms=N_FRAMES * 80).codes
    merged = CSM(str(merged_checkpoint(peft["ann"], tmp_path / "merged")), device="cpu", dtype="float32",
                 engine_config=EngineConfig(max_slots=4, max_seq_len=256))
    try:
        np.testing.assert_array_equal(merged.generate(TEXT, temperature=0, max_audio_length_ms=N_FRAMES * 80).codes,
                                      ours)
    finally:
        merged.close()
