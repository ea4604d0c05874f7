"""GPU (`pytest -m gpu`): the Triton sampler on the values the schema admits that the torch reference
guards: temperatures down to the smallest float32 (greedy), top_p tiny, top_k 1, NaN / inf logits;
always an index < V, the same token as the reference, and through a graphed frame step."""
import os

import numpy as np
import pytest
import torch

from csmserve.models.sampler import GREEDY_BELOW, sample_torch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the Triton kernels on the CPU (a triton on the path)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = [1.175494351e-38, 1e-38, 5e-38, 1e-30, 1e-12, GREEDY_BELOW / 2]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [2048, 2051])
def test_tiny_temperatures_are_greedy(dtype, V):
    from csmserve.kernels.sampler import sample_triton

    torch.manual_seed(0)
    B = 64
    logits = (torch.randn(B, V, device="cuda") * 3).to(dtype)
    t = torch.tensor(TINY * (B // len(TINY)) + TINY[:B % len(TINY)], device="cuda")
    seed = torch.randint(0, 2**62, (B,), device="cuda")
    frame = torch.randint(0, 500, (B,), device="cuda")
    greedy = logits.float().argmax(-1)
    for top_k in (0, 1, 50):
        for top_p in (1.0, 0.5, 1e-30):
            k, p = torch.full((B,), top_k, device="cuda"), torch.full((B,), top_p, device="cuda")
            a = sample_triton(logits, t, k, p, seed, frame, 5)
            assert torch.equal(a, greedy), (top_k, top_p)
            assert torch.equal(a, sample_torch(logits, t, k, p, seed, frame, 5))


@cuda
def test_non_finite_logits_stay_in_range_and_match_torch():
    from csmserve.kernels.sampler import sample_triton

    torch.manual_seed(1)
    B, V = 16, 2051
    logits = torch.randn(B, V, device="cuda") * 3
    logits[0] = float("nan")
    logits[1, :100] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, 9] = 3e38  # / 0.5 overflows
    logits[4] = float("-inf")
    t = torch.full((B,), 0.9, device="cuda")
    t[3], t[5], t[6], t[7] = 0.5, float("nan"), 2.0, 1e-38
    seed = torch.randint(0, 2**62, (B,), device="cuda")
    frame = torch.randint(0, 500, (B,), device="cuda")
    for top_k in (0, 1, 50):
        for top_p in (1.0, 0.9, 1e-30):
            k, p = torch.full((B,), top_k, device="cuda"), torch.full((B,), top_p, device="cuda")
            a = sample_triton(logits, t, k, p, seed, frame, 0)
            assert ((a >= 0) & (a < V)).all(), a
            assert a[1] >= 100 and a[2] == 7 and a[3] == 9
            assert torch.equal(a, sample_torch(logits, t, k, p, seed, frame, 0)), (top_k, top_p)


@cuda
def test_graphed_step_with_a_tiny_temperature_row():
    """A batch holding a tiny-temperature row: its codes are the greedy row's, its neighbours' unchanged."""
    from csmserve.engine.request import Admission
    from csmserve.engine.runner import ModelRunner
    from csmserve.models.loader import load_csm

    model = load_csm("dummy-tiny", "cuda", torch.float32)[0]

    def codes(temps: list[float], frames: int = 8) -> np.ndarray:
        runner = ModelRunner(model, num_slots=4, max_seq_len=64, use_graphs=True)
        first = np.zeros(33, np.int64)
        mask = np.zeros(33, bool)
        first[32], mask[32] = 7, True
        runner.admit([Admission(i, first, mask, 0, t, 50, 0.9, 100 + i) for i, t in enumerate(temps)])
        out = []
        for _ in range(frames):
            out.append(runner.step(list(range(len(temps)))).wait()[0].copy())
        return np.stack(out)  # [frames, B, 32]

    with torch.inference_mode():
        mixed = codes([0.9, 1.175494351e-38, 1e-30])
        ref = codes([0.9, 0.0, 0.0])
    np.testing.assert_array_equal(mixed, ref)


@cuda
@pytest.mark.parametrize("V", [64, 2051])
@pytest.mark.parametrize("B", [64, 200])
def test_triton_sampler_matches_torch(V, B):
    from csmserve.models.sampler import sample_torch
    from csmserve.kernels.sampler import sample_triton

    torch.manual_seed(0)
    logits = (torch.randn(B, V, device="cuda") * 3).to(torch.bfloat16)
    temperature = torch.rand(B, device="cuda") + 0.3
    temperature[:8] = 0
    top_k = torch.randint(-1, 80, (B,), device="cuda")
    seed = torch.randint(0, 2**62, (B,), device="cuda")
    frame = torch.randint(0, 500, (B,), device="cuda")
    for top_p in (1.0, 0.8):
        tp = torch.full((B,), top_p, device="cuda")
        for cb in (0, 17):
            a = sample_triton(logits, temperature, top_k, tp, seed, frame, cb)
            b = sample_torch(logits, temperature, top_k, tp, seed, frame, cb)
            agree = (a == b).float().mean().item()
            assert agree >= (1.0 if top_p == 1.0 else 0.95), agree


@pytest.mark.skipif(DEV != "cuda" and not INTERPRET, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("V", [2048, 2051])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_topk_radix_select_matches_torch(V, dtype):
    """The k-th largest key by radix select: the same tokens as the torch reference, ties at the cut-off
    included (integer logits: many equal keys), k from 1 past V, keys at both ends of the range, -inf logits
    next to the padding lanes of a vocab that is not a power of two. In 16-bit logits (2 or 3 passes, the
    rest of the key from its sign) and float32 (4)."""
    from csmserve.kernels import sampler

    assert sampler.radix_passes(dtype) == {torch.float32: 4, torch.bfloat16: 2, torch.float16: 3}[dtype]
    torch.manual_seed(V)
    B = 12
    logits = torch.randn(B, V, device=DEV) * 3
    logits[:4] = torch.randint(-5, 6, (4, V), device=DEV).float()  # ties everywhere
    logits[4, :5] = torch.tensor([3e38, -3e38, 1e-38, -1e-38, 0.0])  # keys at both ends of the int32 range
    logits[5] = -logits[5].abs() - 1  # every logit negative: the k-th too
    logits[9, : V // 2] = float("-inf")
    logits = logits.to(dtype)
    t = torch.full((B,), 0.9, device=DEV)
    t[1] = 1.0
    seed = torch.randint(0, 2**62, (B,), device=DEV)
    frame = torch.randint(0, 500, (B,), device=DEV)
    k = torch.tensor([1, 2, 50, 3, 1, 50, 400, V - 1, V, V + 5, 0, -1], device=DEV)
    p = torch.ones(B, device=DEV)
    a = sampler.sample_triton(logits, t, k, p, seed, frame, 3)
    assert torch.equal(a, sample_torch(logits, t, k, p, seed, frame, 3))
    assert ((a >= 0) & (a < V)).all()
    # hot and flat: tokens just past the cut-off would be drawn often if the search kept them
    B = 256
    logits = torch.randn(B, V, device=DEV).to(dtype)
    t = torch.full((B,), 4.0, device=DEV)
    k = torch.randint(1, 12, (B,), device=DEV)
    seed = torch.randint(0, 2**62, (B,), device=DEV)
    frame = torch.randint(0, 500, (B,), device=DEV)
    p = torch.ones(B, device=DEV)
    assert torch.equal(sampler.sample_triton(logits, t, k, p, seed, frame, 3),
                       sample_torch(logits, t, k, p, seed, frame, 3))
