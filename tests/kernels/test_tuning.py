"""CPU: kernels/tuning.py, the launch configurations' tables and CSMSERVE_KERNEL_TUNING (unset, off, a file)."""
import importlib
import json

import pytest

from csmserve.kernels import tuning


def test_by_rows_takes_the_entry_with_the_most_rows_at_or_below_the_batch():
    table = [[1, 8], [256, 2], [2048, 1]]
    assert [tuning.by_rows(table, b) for b in (1, 2, 255, 256, 2047, 2048, 4096)] == [8, 8, 8, 2, 2, 1, 1]
    assert tuning.by_rows([[1, 4]], 10_000) == 4


@pytest.fixture
def reload(monkeypatch):
    def load(value):
        if value is None:
            monkeypatch.delenv("CSMSERVE_KERNEL_TUNING", raising=False)
        else:
            monkeypatch.setenv("CSMSERVE_KERNEL_TUNING", value)
        return importlib.reload(tuning)

    yield load
    monkeypatch.delenv("CSMSERVE_KERNEL_TUNING", raising=False)
    importlib.reload(tuning)


def test_unset_off_and_a_file(reload, tmp_path):
    t = reload(None)
    assert t.GEMV == t.H200_GEMV and t.SAMPLER == t.H200_SAMPLER and t.DEPTH_ATTENTION == t.H200_DEPTH_ATTENTION
    assert t.GEMV_FP8 == t.H200_GEMV_FP8
    assert all(len(v) == 4 and k[0] in (1, 2) for k, v in {**t.GEMV, **t.GEMV_FP8}.items())  # (m, n, k, glu, norm)
    t = reload("off")
    assert t.GEMV == {} and t.GEMV_FP8 == {}
    assert t.SAMPLER == t.OFF_SAMPLER and t.DEPTH_ATTENTION == t.OFF_DEPTH_ATTENTION
    f = tmp_path / "t.json"  # as bench/kernel_sweep.py writes it
    f.write_text(json.dumps({"gpu": "X", "gemv": [[1, 1024, 2048, False, False, 2, 512, 8, 2]],
                             "gemv_fp8": [[2, 8192, 1024, True, True, 4, 1024, 4, 3]],
                             "sampler": {"warps": [[1, 16], [64, 2]]}}))
    t = reload(str(f))
    assert t.GEMV == {(1, 1024, 2048, False, False): (2, 512, 8, 2)}
    assert t.GEMV_FP8 == {(2, 8192, 1024, True, True): (4, 1024, 4, 3)}
    assert t.SAMPLER == {"warps": [[1, 16], [64, 2]]}
    assert t.DEPTH_ATTENTION == t.OFF_DEPTH_ATTENTION  # what the file leaves out: the kernels' own rule
    with pytest.raises(FileNotFoundError):
        reload(str(tmp_path / "missing.json"))
