import numpy as np
import pytest

from csmserve.audio import resample


@pytest.mark.parametrize("sr_in,sr_out", [(44_100, 24_000), (16_000, 24_000), (48_000, 24_000), (24_000, 48_000)])
def test_resample_length_and_phase(sr_in, sr_out):
    n = 2 * sr_in + 123
    x = (0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / sr_in)).astype(np.float32)
    y = resample(x, sr_in, sr_out)
    assert y.dtype == np.float32 and abs(y.size - n * sr_out / sr_in) <= 1
    ref = 0.5 * np.sin(2 * np.pi * 440 * np.arange(y.size) / sr_out)
    assert np.abs(y - ref)[200:-200].max() < 1e-3  # no delay, no aliasing at 440 Hz


def test_resample_identity_and_empty():
    x = np.arange(10, dtype=np.float32)
    assert np.array_equal(resample(x, 24_000, 24_000), x)
    assert resample(np.zeros(0, np.float32), 16_000, 24_000).size == 0
