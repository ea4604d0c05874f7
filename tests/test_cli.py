"""`python -m csmserve speak` and the public API on dummy-tiny weights."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "csmserve", *args], capture_output=True, text=True, env=e,
                          timeout=300)


def test_speak_writes_codes(tmp_path):
    out = tmp_path / "x.npy"
    r = _run("speak", "Hello there.", "--model", "dummy-tiny", "--seed", "3", "--temperature", "0.8", "--top-k",
             "20", "--max-audio-length-ms", "640", "--speaker", "1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    codes = np.load(out)
    assert codes.shape == (8, 32) and codes.dtype == np.int64
    assert "8 frames, 0.64 s of audio" in r.stdout


def test_bad_flags():
    r = _run("speak", "hi", "--model", "dummy-tiny", "--top-k", "many", "-o", "x.npy")
    assert r.returncode == 2 and "--top-k" in r.stderr
    r = _run("speak", "hi", "--model", "dummy-tiny")  # no -o
    assert r.returncode == 2 and "-o" in r.stderr
    r = _run("bench")  # later issues add serve / bench
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_offline_hub_id_names_dummy(tmp_path):
    r = _run("speak", "hi", "--model", "sesame/csm-1b", "-o", str(tmp_path / "x.npy"),
             env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert r.returncode == 2 and "--model dummy" in r.stderr


def test_api_prompt_and_generate():
    from csmserve import CSM, SamplingParams, Segment

    assert SamplingParams().temperature == 0.9
    csm = CSM("dummy-tiny", device="cpu", dtype="float32")
    codes = np.full((4, 32), 5, dtype=np.int64)
    tokens, mask = csm.prompt("Hello.", speaker=0, context=[Segment(speaker=1, text="Hi.", codes=codes)])
    assert tokens.shape == mask.shape and tokens.shape[1] == 33 and tokens.dtype == np.int64 and mask.dtype == bool
    a = csm.generate("Hello.", context=[Segment(1, "Hi.", codes=codes)], temperature=0.9, seed=11,
                     max_audio_length_ms=320)
    b = csm.generate("Hello.", context=[Segment(1, "Hi.", codes=codes)], temperature=0.9, seed=11,
                     max_audio_length_ms=320)
    assert a.codes.shape == (4, 32) and a.audio.shape == (4 * 1920,) and a.audio.dtype == np.float32
    np.testing.assert_array_equal(a.codes, b.codes)
    greedy = csm.generate("Hello.", temperature=0, max_audio_length_ms=240)
    assert greedy.codes.shape == (3, 32)
    # context audio is Mimi-encoded into audio frames (+ the EOS frame) between the turn's text frames
    t2, m2 = csm.prompt("x", context=[Segment(0, "y", audio=np.zeros(2 * 1920, dtype=np.float32))])
    audio_rows = m2[:, :32].all(1)
    assert audio_rows.sum() == 3 and not t2[audio_rows][-1].any()  # 2 frames + the all-zero EOS frame
    with pytest.raises(ValueError, match="prompt too long"):
        csm.generate("x" * 2100, max_audio_length_ms=800)
    csm.close()
