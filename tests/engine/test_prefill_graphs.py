"""CPU: the packed prefill layout and token buckets (the graphs themselves: test_runner_gpu.py), and a
packed prefill of several prompts at once == each prompt prefilled alone."""
import numpy as np
import torch

from csmserve.engine.buckets import bucket_sizes
from csmserve.engine.request import PrefillChunk
from csmserve.engine.runner import ModelRunner, pack_prefill
from csmserve.models.loader import load_csm


def test_token_buckets():
    assert bucket_sizes(512, smallest=16) == [16, 32, 64, 128, 256, 512]
    assert bucket_sizes(100, smallest=16) == [16, 32, 64, 100]
    assert bucket_sizes(8, smallest=16) == [8]
    assert bucket_sizes(2048, smallest=16) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert bucket_sizes(1000, smallest=16) == [16, 32, 64, 128, 256, 512, 768, 1000]


def test_frame_buckets():  # the frame graphs': every batch size from 1
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert bucket_sizes(2400)[-5:] == [1536, 1792, 2048, 2304, 2400]
    assert bucket_sizes(2400)[:9] == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_pack_layout_and_padding():
    W, scratch = 5, 9
    t1, m1 = np.arange(3 * W).reshape(3, W), np.ones((3, W), bool)
    t2, m2 = np.full((1, W), 7), np.eye(1, W, 4, dtype=bool)
    a = pack_prefill([PrefillChunk(2, 10, t1, m1), PrefillChunk(4, 0, t2, m2)], T=6, width=W, scratch=scratch)
    assert a.shape == (6, 2 * W + 4)
    assert (a[:, 2 * W] == 0).all()  # no head chunk: no hidden state kept
    np.testing.assert_array_equal(a[:3, :W], t1)
    np.testing.assert_array_equal(a[:3, W:2 * W], m1)
    np.testing.assert_array_equal(a[:3, -2], [10, 11, 12])
    np.testing.assert_array_equal(a[:3, -1], 2)
    np.testing.assert_array_equal(a[3, W:2 * W], m2[0])
    assert a[3, -1] == 4 and a[3, -2] == 0
    # padding rows write the scratch slot at position 0, with no LoRA adapter (-1)
    assert (a[4:, -1] == scratch).all() and (a[4:, :2 * W + 1] == 0).all() and (a[:, 2 * W + 1] == -1).all()
    # chunks with LoRA adapters: each row carries its chunk's pool slot, the chunks in order of it (a runner with a
    # pool); without one, the chunks as given and no adapter
    chunks = [PrefillChunk(2, 10, t1, m1, adapter=3), PrefillChunk(4, 0, t2, m2, adapter=-1)]
    a = pack_prefill(chunks, T=6, width=W, scratch=scratch, lora=True)
    np.testing.assert_array_equal(a[:, 2 * W + 1], [-1, 3, 3, 3, -1, -1])
    np.testing.assert_array_equal(a[:4, -1], [4, 2, 2, 2])
    a = pack_prefill(chunks, T=6, width=W, scratch=scratch)
    np.testing.assert_array_equal(a[:, 2 * W + 1], -1)
    np.testing.assert_array_equal(a[:4, -1], [2, 2, 2, 4])


def test_packed_prefill_of_many_prompts_equals_each_alone():
    model = load_csm("dummy-tiny")[0]
    rng = np.random.default_rng(0)
    prompts = []
    for P in (9, 4, 13):
        tok, mask = np.zeros((P, 33), np.int64), np.zeros((P, 33), bool)
        tok[:, 32], mask[:, 32] = rng.integers(1, 258, P), True
        tok[1:3, :32], mask[1:3, :32] = rng.integers(0, 2048, (2, 32)), True
        prompts.append((tok, mask))
    together = ModelRunner(model, num_slots=4, max_seq_len=64, max_prefill_tokens=64)
    alone = ModelRunner(model, num_slots=4, max_seq_len=64, max_prefill_tokens=64)
    # in two steps, the second continuing each prompt after its first 3 positions
    together.prefill([PrefillChunk(i, 0, t[:3], m[:3]) for i, (t, m) in enumerate(prompts)])
    together.prefill([PrefillChunk(i, 3, t[3:], m[3:]) for i, (t, m) in enumerate(prompts)])
    for i, (t, m) in enumerate(prompts):
        alone.prefill([PrefillChunk(i, 0, t, m)])
    for i, (t, _) in enumerate(prompts):
        n = len(t)
        torch.testing.assert_close(together.kv.k[:, i, :, :n], alone.kv.k[:, i, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(together.kv.v[:, i, :, :n], alone.kv.v[:, i, :, :n], atol=1e-5, rtol=1e-5)
        assert together.kv.k[:, i, :, n:].abs().sum() == 0  # nothing past the prompt
