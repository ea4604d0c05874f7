"""The public API on the engine, against transformers on a tiny checkpoint that includes its codec."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tiny_csm import FRAME_SAMPLES, K, build_hf  # noqa: E402

from csmserve import CSM, Segment  # noqa: E402
from csmserve.config import EngineConfig  # noqa: E402

N_FRAMES = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf = build_hf(d)
    csm = CSM(str(d), device="cpu", dtype="float32", engine_config=EngineConfig(max_slots=4, max_seq_len=256))
    yield hf, csm
    csm.close()


def test_generate_with_context_audio_equals_transformers(pair):
    hf, csm = pair
    g = torch.Generator().manual_seed(3)
    wav = torch.randn(5 * FRAME_SAMPLES, generator=g) * 0.3  # 5 codec frames of context audio
    ours = csm.generate("And hello back.", speaker=0, context=[Segment(1, "Hi there.", audio=wav.numpy())],
                        temperature=0, max_audio_length_ms=N_FRAMES * 80)
    tokens, mask = csm.prompt("And hello back.", 0, [Segment(1, "Hi there.", audio=wav.numpy())])
    audio_rows = mask[:, :K].all(1)
    ids = tokens[:, -1].copy()
    ids[audio_rows] = 258  # <|AUDIO|>
    ids[audio_rows & (tokens[:, :K] == 0).all(1)] = 259  # <|audio_eos|>
    ids = torch.from_numpy(ids)[None]
    with torch.no_grad():
        ref_codes = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), input_values=wav[None, None],
                                input_values_cutoffs=torch.tensor([[wav.numel()]]), do_sample=False,
                                depth_decoder_do_sample=False, max_new_tokens=N_FRAMES)[0].numpy()
        ref_audio = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), input_values=wav[None, None],
                                input_values_cutoffs=torch.tensor([[wav.numel()]]), do_sample=False,
                                depth_decoder_do_sample=False, max_new_tokens=N_FRAMES,
                                output_audio=True)[0].numpy()
    assert ours.codes.shape[0] >= N_FRAMES - 2
    np.testing.assert_array_equal(ours.codes, ref_codes[: len(ours.codes)])
    assert ours.audio.shape == (len(ours.codes) * FRAME_SAMPLES,)
    np.testing.assert_allclose(ours.audio, ref_audio[: ours.audio.shape[0]], atol=1e-5)


def test_batch_of_texts_and_stream(pair):
    _, csm = pair
    texts = ["One.", "Two, two.", "Three, three, three."]
    batch = csm.generate(texts, temperature=0, max_audio_length_ms=8 * 80)
    for t, r in zip(texts, batch):
        alone = csm.generate(t, temperature=0, max_audio_length_ms=8 * 80)
        np.testing.assert_array_equal(r.codes, alone.codes)
    chunks = list(csm.stream("Streaming, please.", temperature=0, max_audio_length_ms=8 * 80))
    assert len(chunks[0].codes) == 1 and chunks[-1].final
    whole = csm.generate("Streaming, please.", temperature=0, max_audio_length_ms=8 * 80)
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), whole.codes)
    np.testing.assert_allclose(np.concatenate([c.audio for c in chunks]), whole.audio, atol=1e-6)
