"""The torch sampler (the CPU path and the Triton kernel's reference) on every value the schema admits:
temperatures down to the smallest float32 are greedy, NaN / inf logits never give an index out of range."""
import pytest
import torch

from csmserve.models.sampler import GREEDY_BELOW, sample_torch

V = 2051
# the smallest normal float32 (what schemathesis sent), subnormal-adjacent values, and just under the threshold
TINY = [1.175494351e-38, 1e-38, 5e-38, 1e-30, 1e-12, GREEDY_BELOW / 2]


def rows(B: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    return logits, torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 500, (B,), generator=g)


@pytest.mark.parametrize("top_k", [0, 1, 50])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 1e-30])
def test_tiny_temperatures_are_greedy(top_k, top_p):
    B = len(TINY)
    logits, seed, frame = rows(B)
    t = torch.tensor(TINY, dtype=torch.float32)
    out = sample_torch(logits, t, torch.full((B,), top_k), torch.full((B,), top_p), seed, frame, 3)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_at_the_threshold_it_samples():
    logits, seed, frame = rows(64)
    flat = torch.zeros_like(logits)  # every token equally likely: the noise decides
    t = torch.full((64,), GREEDY_BELOW)
    out = sample_torch(flat, t, torch.zeros(64, dtype=torch.int64), torch.ones(64), seed, frame, 0)
    assert len(set(out.tolist())) > 32  # not all token 0


def test_non_finite_logits_and_temperatures_stay_in_range():
    logits, seed, frame = rows(8)
    logits[0] = float("nan")  # all NaN
    logits[1, :100] = float("nan")  # some NaN: one of the others is chosen
    logits[2, 7] = float("inf")
    logits[3, 9] = 3e38  # / 0.5 overflows to inf
    logits[4] = float("-inf")
    t = torch.tensor([0.9, 0.9, 0.9, 0.5, 0.9, float("nan"), 2.0, 1e-38])
    for top_p in (1.0, 0.9, 1e-30):
        for top_k in (0, 1, 50):
            out = sample_torch(logits, t, torch.full((8,), top_k), torch.full((8,), top_p), seed, frame, 0)
            assert ((out >= 0) & (out < V)).all(), out
            assert out[1] >= 100 and out[2] == 7 and out[3] == 9
            assert out[5] == logits[5].argmax() and out[7] == logits[7].argmax()  # NaN / tiny: greedy
