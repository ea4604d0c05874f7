"""CPU: the prefill graphs' packed input layout and length buckets (the graphs themselves: test_runner_gpu.py)."""
import numpy as np

from csmserve.engine.prefill_graphs import length_buckets, pack
from csmserve.engine.request import PrefillChunk


def test_length_buckets():
    assert length_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert length_buckets(100) == [16, 32, 64, 100]
    assert length_buckets(8) == [8]


def test_pack_layout_and_padding():
    W, scratch = 5, 9
    t1, m1 = np.arange(3 * W).reshape(3, W), np.ones((3, W), bool)
    t2, m2 = np.full((1, W), 7), np.eye(1, W, 4, dtype=bool)
    a = pack([PrefillChunk(2, 10, t1, m1), PrefillChunk(4, 0, t2, m2)], C=4, S=4, width=W, scratch=scratch)
    assert a.shape == (4, 4, 2 * W + 2)
    np.testing.assert_array_equal(a[0, :3, :W], t1)
    np.testing.assert_array_equal(a[0, :3, W:2 * W], m1)
    np.testing.assert_array_equal(a[0, :3, -2], [10, 11, 12])
    np.testing.assert_array_equal(a[0, :3, -1], 2)
    np.testing.assert_array_equal(a[1, 0, W:2 * W], m2[0])
    assert a[1, 0, -1] == 4 and a[1, 0, -2] == 0
    # padding: the rest of each chunk and the empty chunk rows write to the scratch slot at position 0
    assert (a[0, 3, -1] == scratch) and (a[1, 1:, -1] == scratch).all() and (a[2:, :, -1] == scratch).all()
    assert (a[0, 3, :-1] == 0).all() and (a[2:, :, :-1] == 0).all()
