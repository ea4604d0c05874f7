"""Parity with transformers' CsmForConditionalGeneration on a tiny random checkpoint (float32, CPU).

Our loader reads the checkpoint save_pretrained wrote; both models get the same frames (context
audio reaches transformers as waveform + <|AUDIO|>/<|audio_eos|> placeholders, whose codes its own
codec produces; we feed those codes as frames) and must produce identical greedy codes, with
codebook-0 and depth-head logits equal to 1e-4 relative.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tiny_csm import AUDIO, AUDIO_EOS, FRAME_SAMPLES, K, build_hf  # noqa: E402

from csmserve.sampling import SamplingParams
from csmserve.models.loader import load_csm  # noqa: E402
from csmserve.models.reference import generate  # noqa: E402
from csmserve.prompt.tokenizer import PromptSegment, load_tokenizer, prompt_frames  # noqa: E402

N_FRAMES = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf = build_hf(d)
    ours, cfg, model_dir = load_csm(str(d))
    return hf, ours, load_tokenizer(model_dir)


def _context_codes(hf, n: int) -> tuple[torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(1)
    audio = torch.randn(1, 1, n * FRAME_SAMPLES, generator=g) * 0.3
    with torch.no_grad():
        codes = hf.codec_model.encode(audio).audio_codes[0].T  # [n, K]
    assert codes.shape == (n, K)
    return audio, codes.numpy().astype(np.int64)


def _hf_inputs(tokens: np.ndarray, mask: np.ndarray) -> dict[str, torch.Tensor]:
    # our frames -> transformers' text ids: text column, <|AUDIO|> per audio frame, <|audio_eos|> per EOS frame
    ids = tokens[:, -1].copy()
    audio_rows = mask[:, :K].all(1)
    eos_rows = audio_rows & (tokens[:, :K] == 0).all(1)
    ids[audio_rows] = AUDIO
    ids[eos_rows] = AUDIO_EOS
    ids = torch.from_numpy(ids)[None]
    # explicit mask: generate() would otherwise treat pad_token_id (= <|end_of_text|> here) as padding
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _prompt(hf, tok, with_context: bool):
    if not with_context:
        tokens, mask = prompt_frames(tok, [], "Hello from the tiny model.", 0, K)
        return tokens, mask, {}
    audio, codes = _context_codes(hf, 6)
    segs = [PromptSegment(1, "Hi there.", codes)]
    tokens, mask = prompt_frames(tok, segs, "And hello back.", 0, K)
    return tokens, mask, {"input_values": audio, "input_values_cutoffs": torch.tensor([[audio.shape[-1]]])}


@pytest.mark.parametrize("with_context", [False, True], ids=["text-only", "audio-context"])
def test_greedy_codes_match_transformers(pair, with_context):
    hf, ours, tok = pair
    tokens, mask, extra = _prompt(hf, tok, with_context)
    with torch.no_grad():
        seq = hf.generate(**_hf_inputs(tokens, mask), do_sample=False, depth_decoder_do_sample=False,
                          max_new_tokens=N_FRAMES, **extra)[0].numpy()  # [n, K], stops after first-K-1-zero frame
    out = generate(ours, tokens, mask, SamplingParams(temperature=0, max_audio_length_ms=N_FRAMES * 80, seed=0))
    assert out.codes.shape[0] >= 30, "random weights hit EOS early; change the seed"
    assert not (seq[:, :-1] == 0).all(1).any(), "transformers stopped on its EOS rule"
    np.testing.assert_array_equal(out.codes, seq)
    assert len(np.unique(out.codes[:, 0])) > 3  # not a degenerate repetition


@pytest.mark.parametrize("with_context", [False, True], ids=["text-only", "audio-context"])
def test_logits_match_transformers(pair, with_context):
    hf, ours, tok = pair
    tokens, mask, extra = _prompt(hf, tok, with_context)
    with torch.no_grad():
        o = hf(**_hf_inputs(tokens, mask), output_hidden_states=True, **extra)
        h_hf = o.hidden_states[-1][:, -1]  # final-normed
        kv = ours.backbone.new_kv(1, tokens.shape[0], torch.float32, "cpu")
        t, m = torch.from_numpy(tokens)[None], torch.from_numpy(mask)[None]
        h = ours.forward_backbone(t, m, torch.arange(tokens.shape[0])[None], kv)[:, -1]
        _close(ours.codebook0_head(h), o.logits[:, -1])

        # depth decoder, teacher-forced on the greedy codes: HF logits at positions 1..K-1 = codebooks 1..K-1
        c0 = o.logits[:, -1].argmax(-1)
        seen: list[torch.Tensor] = []

        def record(logits: torch.Tensor, cb: int) -> torch.Tensor:
            seen.append(logits)
            return c0 if cb == 0 else logits.argmax(-1)

        codes = ours.decode_frame(h, record, ours.decoder.new_kv(1, K, torch.float32, "cpu"), torch.arange(K))
        hf_ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), codes[:, :-1]], dim=1)  # [0, c0 .. c_{K-2}]
        hf_codes = hf.depth_decoder(input_ids=hf_ids, backbone_last_hidden_state=h_hf).logits  # [1, K-1, V]
        _close(torch.stack(seen[1:], dim=1), hf_codes)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item() / b.abs().max().item()
    assert err < 1e-4, f"relative error {err:.2e}"
