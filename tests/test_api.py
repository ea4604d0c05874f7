"""The Python API's engine life (csmserve/api.py, engine/client.py): close() ends what is being read, a list longer
than the engine's queue runs whole, a Request twice in one list is refused, the adapters served outlive close()."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from csmserve import CSM
from csmserve.config import EngineConfig
from csmserve.models.loader import tiny_config
from csmserve.models.lora import write_adapter


def test_close_ends_a_stream_another_thread_reads():
    csm = CSM("dummy-tiny", device="cpu", codec="none")
    seen, ended = [], []

    def read():
        try:
            for chunk in csm.stream("A long sentence that keeps going.", max_audio_length_ms=60_000, seed=1):
                seen.append(chunk)
        except RuntimeError as e:
            ended.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    csm.close()
    t.join(10)
    assert not t.is_alive() and ended and "shut down" in str(ended[0])


def test_a_list_longer_than_the_engine_takes_runs_whole_in_order():
    """2 slots and 1 place in the queue: 9 texts are fed as earlier ones end (not SchedulerBusy), in order."""
    csm = CSM("dummy-tiny", device="cpu", codec="none",
              engine_config=EngineConfig(max_slots=2, max_waiting=1, max_seq_len=256))
    try:
        texts = [f"Line number {i}." for i in range(9)]
        outs = csm.generate(texts, seed=1, max_audio_length_ms=160)
        assert len(outs) == 9
        for i in (0, 8):
            np.testing.assert_array_equal(outs[i].codes, csm.generate(texts[i], seed=1, max_audio_length_ms=160).codes)
    finally:
        csm.close()


def test_the_same_request_twice_in_a_list_is_refused():
    csm = CSM("dummy-tiny", device="cpu", codec="none")
    try:
        req = csm.request("Hello there.", seed=1, max_audio_length_ms=160)
        with pytest.raises(ValueError, match="twice"):
            csm.generate([req, req])
        assert len(csm.generate([req])[0].codes)  # not spent by the refusal
    finally:
        csm.close()


def test_the_adapters_served_outlive_close(tmp_path):
    """An adapter given at construction and one loaded later are served by the engine started after close(); one
    unloaded is not."""
    ann = write_adapter(tmp_path / "ann", tiny_config(), rank=4, seed=0)
    bob = write_adapter(tmp_path / "bob", tiny_config(), rank=4, seed=1)
    csm = CSM("dummy-tiny", device="cpu", codec="none", adapters={"ann": str(ann)},
              engine_config=EngineConfig(max_loras=2, max_lora_rank=8))
    try:
        first = csm.generate("Hello.", adapter="ann", seed=1, max_audio_length_ms=240).codes
        csm.load_adapter("bob", bob)
        with_bob = csm.generate("Hello.", adapter="bob", seed=1, max_audio_length_ms=240).codes
        csm.load_adapter("cat", bob)
        csm.unload_adapter("cat")
        csm.close()
        assert set(csm.adapters) == {"ann", "bob"}
        np.testing.assert_array_equal(csm.generate("Hello.", adapter="ann", seed=1, max_audio_length_ms=240).codes,
                                      first)
        np.testing.assert_array_equal(csm.generate("Hello.", adapter="bob", seed=1, max_audio_length_ms=240).codes,
                                      with_bob)
        assert set(csm.adapters) == {"ann", "bob"}
    finally:
        csm.close()


def test_a_segment_after_an_eos_starts_a_fresh_mimi_row():
    """Long-form: a segment that ended on EOS had its all-zero EOS frame and the step in flight behind it decoded
    into the slot's Mimi row (neither heard); the next segment's audio is the fresh decode of its own codes (it was
    a full-scale burst), and the first segment's the decode of its codes."""
    import torch

    csm = CSM("dummy-tiny", device="cpu", dtype="float32", engine_config=EngineConfig(max_slots=2, max_seq_len=512))
    inner = csm.model.decode_frame

    def decode_frame(*a, **kw):  # an EOS now and then (tests/engine/test_longform.py's rule)
        codes = inner(*a, **kw)
        return torch.where(codes[:, :1] % 13 == 0, torch.zeros_like(codes), codes)

    csm.model.decode_frame = decode_frame
    try:
        chunks = list(csm.speak("Hello there, friend. How are you doing today?", temperature=0.0,
                                max_segment_length_ms=12 * 80))
        ends = [c.segment_end for c in chunks if c.segment == 0 and c.segment_end]
        assert ends == ["eos"], ends  # the case under test (the rule and the seedless greedy run make it so)
        for seg in (0, 1):
            mine = [c for c in chunks if c.segment == seg]
            codes, audio = np.concatenate([c.codes for c in mine]), np.concatenate([c.audio for c in mine])
            assert len(codes) and np.abs(audio - csm.decode(codes)).max() < 1e-4, seg
    finally:
        csm.close()
