"""engine/paced.py: the stand-in engine paced at the GPU's measured frame-step times (`--model paced`)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from csmserve.api import CSM
from csmserve.config import EngineConfig
from csmserve.engine.paced import PREFILL_MS, STEP_MS, frame_step_s, prefill_s, stand_in_codes


def test_step_times_are_the_table_s_at_its_graph_bucket():
    for rows, ms in STEP_MS:
        assert frame_step_s(rows) == pytest.approx(ms / 1e3)
    assert frame_step_s(3) == pytest.approx(6.88e-3)  # runs as the 4-row graph
    assert frame_step_s(300) == pytest.approx(19.07e-3)  # 300 rows pad to 512 (then every 256)
    assert frame_step_s(768) == pytest.approx((19.07 + 33.96) / 2e3)  # between 512 and 1,024
    assert frame_step_s(100, max_rows=100) < frame_step_s(128)  # the largest bucket is max_slots itself
    assert frame_step_s(4096) > frame_step_s(2048)  # past the table: on its last slope
    steps = [frame_step_s(r) for r in range(1, 2049)]
    assert all(b >= a for a, b in zip(steps, steps[1:]))
    assert prefill_s(0) == 0 and prefill_s(12) == pytest.approx(PREFILL_MS[1][1] / 1e3)
    assert prefill_s(8192) > prefill_s(1000) > prefill_s(166)


def test_stand_in_codes_are_a_clip_s_frames():
    a = np.random.default_rng(0).standard_normal(24_000).astype(np.float32)
    c = stand_in_codes(a)
    assert c.shape == (13, 32) and c.dtype == np.int64 and 0 <= c.min() and c.max() < 2048
    assert np.array_equal(c, stand_in_codes(a.copy()))
    with pytest.raises(ValueError):
        stand_in_codes(np.zeros(0, np.float32))


def test_requests_run_to_their_length_no_faster_than_the_gpu():
    csm = CSM("paced", engine_config=EngineConfig(max_slots=16, max_seq_len=512))
    try:
        assert csm.paced and csm.model is None and csm.has_codec
        reqs = [csm.request("Hello there.", max_audio_length_ms=40 * 80) for _ in range(8)]
        t = time.perf_counter()
        outs = csm.generate(reqs)
        took = time.perf_counter() - t
        for o in outs:  # random codes never end early: every request stops at its length, with its audio
            assert o.finish_reason == "length" and o.codes.shape == (40, 32) and o.audio.shape == (40 * 1920,)
            assert o.codes.any(axis=1).all()
        assert took >= 40 * frame_step_s(8)  # 40 frame steps of 8 rows: never faster than the H200
        assert csm.engine.runner.steps >= 40
        assert csm.encode_audio(np.ones(3840, np.float32)).shape == (2, 32)
    finally:
        csm.close()


def test_buckets_are_the_engine_s():
    from csmserve.engine.buckets import bucket_sizes
    from csmserve.engine.paced import _bucket

    for limit in (1, 7, 100, 256, 300, 2048, 2400):
        sizes = bucket_sizes(limit)
        for rows in range(1, limit + 1):
            assert _bucket(rows, limit) == next(b for b in sizes if b >= rows), (limit, rows)
