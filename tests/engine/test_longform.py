"""Long-form in one slot: segments carried over through the KV, one continuous stream (CPU, dummy-tiny)."""
import dataclasses
from collections import deque

import numpy as np
import pytest
import torch

from csmserve.models import reference
from csmserve.config import EngineConfig
from csmserve.engine.engine import Engine
from csmserve.engine.request import Request, RequestStatus
from csmserve.sampling import SamplingParams
from csmserve.engine.runner import ModelRunner
from csmserve.models.loader import load_csm

K = 32


def upd(sched, step, codes):
    """Scheduler.update as per-row records."""
    return sched.update(step, codes).outputs()


@pytest.fixture(scope="module")
def model():
    """dummy-tiny whose frame is the all-zero EOS frame whenever its greedy codebook 0 is 0 mod 5:
    the same rule in the engine and in the reference, so segments end on EOS as well as on length."""
    m = load_csm("dummy-tiny")[0]
    inner = m.decode_frame

    def decode_frame(*a, **kw):
        codes = inner(*a, **kw)
        return torch.where((codes[:, :1] % 7 == 0), torch.zeros_like(codes), codes)

    m.decode_frame = decode_frame
    return m


def text(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, K + 1), np.int64)
    mask = np.zeros((n, K + 1), bool)
    tokens[:, K] = rng.integers(1, 258, n)
    mask[:, K] = True
    return tokens, mask


def audio(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Context audio frames + the all-zero EOS frame (tokenizer.assemble)."""
    n = len(codes)
    tokens = np.zeros((n + 1, K + 1), np.int64)
    tokens[:n, :K] = codes
    mask = np.zeros((n + 1, K + 1), bool)
    mask[:, :K] = True
    return tokens, mask


def cat(parts):
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def run(engine, req, appends=(), max_steps=2000):
    """Drive the engine by hand; appends: {step: [(tokens, mask) | "close"]}. -> chunks."""
    chunks = []
    engine.submit(req, lambda c: chunks.append(c) if not isinstance(c, BaseException) else pytest.fail(str(c)))
    for step in range(max_steps):
        for item in dict(appends).get(step, []):
            if item == "close":
                engine.close(req.request_id)
            else:
                engine.append(req.request_id, *item)
        engine.step()
        if chunks and chunks[-1].final:
            return chunks
    raise AssertionError("engine did not finish")


def per_segment(chunks, n):
    out = [np.zeros((0, K), np.int64) for _ in range(n)]
    for c in chunks:
        out[c.segment] = np.concatenate([out[c.segment], c.codes])
    return out


def expected_segments(model, texts, params, max_seq_len):
    """The reference generator on each segment's prompt: the earlier segments still in the slot as
    context turns (text + generated codes + EOS), the oldest dropped when the next would not fit."""
    kept, used, out, rebuilds = [], 0, [], 0
    for t in texts:
        need = len(t[0]) - 1 + params.segment_frames
        if kept and used + need > max_seq_len:
            while kept and sum(len(k[0][0]) + len(k[1][0]) for k in kept) + need > max_seq_len:
                kept.pop(0)
            rebuilds += 1
        parts = [p for k in kept for p in k] + [t]
        one = dataclasses.replace(params, max_audio_length_ms=params.max_segment_length_ms)
        codes = reference.generate(model, *cat(parts), one).codes
        out.append(codes)
        kept.append((t, audio(codes)))
        used = sum(len(k[0][0]) + len(k[1][0]) for k in kept)
    return out, rebuilds


def make_engine(model, max_seq_len=256, **kw):
    cfg = EngineConfig(max_slots=2, max_seq_len=max_seq_len, prefill_token_budget=16, **kw)
    return Engine(ModelRunner(model, cfg.max_slots, cfg.max_seq_len), cfg, start=False)


def test_segments_carry_over_equals_reference_on_the_concatenated_prompt(model):
    params = SamplingParams(temperature=0.0, max_audio_length_ms=None, max_segment_length_ms=8 * 80)
    texts = [text(n, i) for i, n in enumerate([7, 5, 9, 4, 6, 8])]
    want, _ = expected_segments(model, texts, params, 256)
    lens = [len(w) for w in want]
    assert any(n < 8 for n in lens) and any(n == 8 for n in lens), lens  # ends on EOS and on length
    req = Request(*texts[0], params=params, segments=deque(texts[1:]))
    chunks = run(make_engine(model), req)
    got = per_segment(chunks, len(texts))
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"segment {i}")
    assert chunks[-1].final and req.status.finished
    starts = [c.frame_start for c in chunks]
    assert starts == list(np.cumsum([0] + [len(c.codes) for c in chunks[:-1]]))  # one contiguous stream


def test_context_limit_drops_oldest_segments_and_prefills_again(model):
    params = SamplingParams(temperature=0.0, max_audio_length_ms=None, max_segment_length_ms=8 * 80)
    texts = [text(n, 10 + i) for i, n in enumerate([6, 5, 7, 6, 5, 6, 7, 5])]
    want, rebuilds = expected_segments(model, texts, params, 48)
    assert rebuilds >= 2
    req = Request(*texts[0], params=params, segments=deque(texts[1:]))
    got = per_segment(run(make_engine(model, max_seq_len=48), req), len(texts))
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"segment {i}")


def test_text_appended_later_gives_the_same_codes_and_the_slot_idles_meanwhile(model):
    params = SamplingParams(temperature=0.0, max_audio_length_ms=None, max_segment_length_ms=6 * 80)
    texts = [text(n, 20 + i) for i, n in enumerate([5, 6, 4])]
    whole = per_segment(run(make_engine(model), Request(*texts[0], params=params, segments=deque(texts[1:]))), 3)
    engine = make_engine(model)
    req = Request(*texts[0], params=params, open=True)
    chunks = run(engine, req, {40: [texts[1]], 41: [texts[2]], 90: ["close"]})
    for i in range(3):
        np.testing.assert_array_equal(per_segment(chunks, 3)[i], whole[i], err_msg=f"segment {i}")
    assert engine.scheduler.num_free_slots == 2


def test_idle_request_is_not_stepped_and_close_ends_it(model):
    params = SamplingParams(temperature=0.0, max_audio_length_ms=None, max_segment_length_ms=3 * 80)
    engine = make_engine(model)
    req = Request(*text(5, 1), params=params, open=True)
    chunks = []
    engine.submit(req, chunks.append)
    for _ in range(10):
        engine.step()
    assert req.status is RequestStatus.IDLE and engine.waiting_for_input
    frames = engine.stats["frames"]
    engine.step()
    assert engine.stats["frames"] == frames and not any(c.final for c in chunks)
    engine.close(req.request_id)
    engine.step()
    assert chunks[-1].final and chunks[-1].finish_reason in ("eos", "length")
    assert engine.scheduler.num_free_slots == 2


def test_abort_while_idle_frees_the_slot(model):
    engine = make_engine(model)
    req = Request(*text(5, 2), params=SamplingParams(temperature=0.0, max_audio_length_ms=None, max_segment_length_ms=160), open=True)
    chunks = []
    engine.submit(req, chunks.append)
    for _ in range(8):
        engine.step()
    engine.abort(req.request_id)
    engine.step()
    assert chunks[-1].finish_reason == "abort" and engine.scheduler.num_free_slots == 2


def _sched(max_frames):
    from csmserve.engine.scheduler import Scheduler
    # the plain layout (the last prompt frame through the frame step); first_frame_from_prefill: test_scheduler.py
    s = Scheduler(EngineConfig(max_slots=1, max_seq_len=64, prefill_token_budget=64, first_frame_from_prefill=False))
    req = Request(*text(4, 0), params=SamplingParams(temperature=0.0, max_audio_length_ms=None, max_segment_length_ms=max_frames * 80),
                  segments=deque([text(4, 1)]))
    s.add(req)
    return s, req


def frame(v):
    return np.full((1, K), v, np.int64)


def test_eos_consumed_by_the_step_in_flight_is_context_and_its_junk_frame_is_dropped():
    s, req = _sched(8)
    b1 = s.schedule()  # admission + prefill of positions 0..2; frame 0 at position 3
    b2 = s.schedule()  # frame 1 at position 4: consumes frame 0
    assert upd(s, b1.step, np.zeros((1, K)))[0].segment_end == "eos"  # frame 0 is EOS: in KV at 4
    b3 = s.schedule()
    assert [(c.start, len(c.tokens)) for c in b3.prefills] == [(5, 3)]  # the text right after it
    assert b3.resumes[0].first_pos == 8 and b3.decode_slots.tolist() == [0]
    assert upd(s, b2.step, frame(7)) == []  # the junk frame of the step that consumed EOS
    out = upd(s, b3.step, frame(9))
    assert out[0].segment == 1 and out[0].frame_start == 0


def test_eos_as_last_allowed_frame_and_length_end_prefill_their_tail():
    s, req = _sched(2)
    b1, b2 = s.schedule(), s.schedule()  # frames 0, 1 (the limit): no third step
    upd(s, b1.step, frame(5))
    assert s.schedule().decode_slots.tolist() == []
    upd(s, b2.step, np.zeros((1, K)))  # EOS as the last allowed frame: nobody consumed it
    b = s.schedule()
    assert b.prefills[0].start == 3 + 2 and b.prefills[0].tokens[0].tolist() == [0] * (K + 1)
    assert b.prefills[0].mask[0, :K].all() and not b.prefills[0].mask[0, K]  # the EOS frame
    s2, _ = _sched(2)
    c1, c2 = s2.schedule(), s2.schedule()
    upd(s2, c1.step, frame(5))
    s2.schedule()
    upd(s2, c2.step, frame(6))  # ends on length: [last frame, EOS] then the text
    b = s2.schedule()
    assert b.prefills[0].start == 5 and b.prefills[0].tokens[0, :K].tolist() == [6] * K
    assert b.prefills[0].tokens[1].tolist() == [0] * (K + 1) and b.resumes[0].first_pos == 5 + 2 + 4 - 1
