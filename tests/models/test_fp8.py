"""FP8 weights (models/fp8.py, EngineConfig.weights) on the CPU: the dequantized fallback runs the same
quantization as Hopper's FP8 GEMM, so these tests cover the numbers the GPU path computes."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from csmserve.models import reference
from csmserve.engine.request import Admission, PrefillChunk
from csmserve.sampling import SamplingParams
from csmserve.engine.runner import ModelRunner
from csmserve.models.fp8 import FP8, FP8Linear, quantize_rows_torch, quantize_weights
from csmserve.models.loader import load_csm


def test_rows_quantized_to_their_own_max():
    x = torch.randn(5, 300) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0])[:, None]
    q, s = quantize_rows_torch(x)
    assert q.dtype == FP8 and s.shape == (5, 1)
    assert torch.equal(q.float().abs().amax(1)[:4], torch.full((4,), 448.0))  # each row spans e4m3's range
    back = q.float() * s
    rel = (back - x).abs() / x.abs().amax(1, keepdim=True).clamp(min=1e-30)
    assert rel[:4].max() < 2 ** -4  # e4m3: 3 mantissa bits, half an ulp of the row's max at most
    assert torch.equal(back[4], torch.zeros(300))  # an all-zero row (padding) stays zero, no NaN
    single = quantize_rows_torch(x[2:3])  # a row's quantization never depends on the other rows
    assert torch.equal(single[0].float(), q[2:3].float()) and torch.equal(single[1], s[2:3])


def test_fp8_linear_close_to_the_bf16_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=False)
    f8 = FP8Linear(lin.weight)
    assert not f8.fast  # CPU: the dequantized fallback
    x = torch.randn(3, 7, 256)
    y, ref = f8(x), F.linear(x, lin.weight)
    assert y.shape == ref.shape
    rel = (y - ref).norm() / ref.norm()
    assert rel < 0.06, rel
    # exactly the quantized numbers: (x8 * sx) @ (w8 * sw).T
    x8, sx = quantize_rows_torch(x.reshape(-1, 256))
    exact = (x8.float() * sx) @ f8.dequantized().t()
    torch.testing.assert_close(y.reshape(-1, 128), exact, rtol=1e-5, atol=1e-5)


def test_weight_only_keeps_the_activations_and_is_closer():
    """FP8Linear.weight_only (the numbers of kernels/gemv.py's FP8 GEMV at 1-2 rows): the e4m3 weights times the
    activations as they are, exactly (x @ dequantized^T); closer to the bf16 linear than quantizing both."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=False)
    f8 = FP8Linear(lin.weight)
    x = torch.randn(3, 7, 256)
    w8a8 = f8(x)
    f8.weight_only = True
    y = f8(x)
    assert y.shape == (3, 7, 128)
    torch.testing.assert_close(y.reshape(-1, 128), x.reshape(-1, 256) @ f8.dequantized().t(), rtol=1e-5, atol=1e-5)
    ref = F.linear(x, lin.weight)
    assert (y - ref).norm() < (w8a8 - ref).norm()
    assert not torch.equal(y, w8a8)


def test_dense_copy_runs_between_weight_only_rows_and_dense_rows(monkeypatch):
    """The bf16 copy of the dequantized weight (made on Hopper only; set by hand here): used from WEIGHT_ONLY_ROWS + 1
    to DENSE_ROWS rows (F.linear on it, bit for bit), not below or past them, not for another dtype, never in the state
    dict; it equals the dequantized weight to within bf16's rounding. On the CPU none is made."""
    from csmserve.models import fp8

    monkeypatch.setattr(fp8, "WEIGHT_ONLY_ROWS", 4)
    monkeypatch.setattr(fp8, "DENSE_ROWS", 8)
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    f8 = FP8Linear(lin.weight)
    assert f8.dense is None and "dense" not in f8.state_dict()
    w8a8 = [f8(torch.randn(m, 64, generator=torch.Generator().manual_seed(m))) for m in (4, 5, 8, 9)]
    f8.dense = f8.dequantized().to(torch.bfloat16)
    torch.testing.assert_close(f8.dense.float(), f8.dequantized(), rtol=2 ** -8, atol=0)
    assert "dense" not in f8.state_dict()
    for m, before in zip((4, 5, 8, 9), w8a8):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        assert torch.equal(f8(x), before)  # float32 rows: not the copy's dtype
        xb = x.to(torch.bfloat16).reshape(1, m, 64)
        y = f8(xb)
        if 4 < m <= 8:
            assert torch.equal(y, F.linear(xb, f8.dense))
        else:
            assert not torch.equal(y, F.linear(xb, f8.dense))


def test_linear_dispatch_leaves_fp8_to_its_own_gemm_on_the_cpu():
    """models/llama.py's linear() with fuse_gemv on: the GEMV kernel needs CUDA, so an FP8Linear on the CPU runs its
    own (per-row quantized) GEMM, and an nn.Linear F.linear, both bit for bit as with fuse_gemv off."""
    from csmserve.models import llama

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=False)
    f8 = FP8Linear(lin.weight)
    x = torch.randn(1, 256)
    outs = []
    for on in (False, True):
        llama.fuse_gemv(on)
        try:
            outs.append((llama.linear(x, f8), llama.linear(x, lin), llama.glu(x, f8)))
        finally:
            llama.fuse_gemv(False)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(outs[0][0], f8(x))


def test_quantize_weights_scopes():
    for weights, backbone_too in (("fp8", False), ("fp8-all", True)):
        m = load_csm("dummy-tiny")[0]
        quantize_weights(m, weights)
        dec = [mod for mod in m.decoder.modules() if isinstance(mod, FP8Linear)]
        bb = [mod for mod in m.backbone.modules() if isinstance(mod, FP8Linear)]
        assert len(dec) == 4 * m.cfg.decoder.n_layers and isinstance(m.projection, FP8Linear)
        assert len(bb) == (4 * m.cfg.backbone.n_layers if backbone_too else 0)
        assert isinstance(m.codebook0_head, torch.nn.Linear)  # heads and embeddings stay in the model's dtype
        quantize_weights(m, weights)  # idempotent
        assert len([mod for mod in m.modules() if isinstance(mod, FP8Linear)]) == len(dec) + len(bb) + 1
    m = load_csm("dummy-tiny")[0]
    quantize_weights(m, "bf16")
    assert not any(isinstance(mod, FP8Linear) for mod in m.modules())
    with pytest.raises(ValueError):
        quantize_weights(m, "int4")


def _prompts():
    rng = np.random.default_rng(0)
    out = []
    for slot in range(2):
        P = 6 + slot
        tok, mask = np.zeros((P, 33), np.int64), np.zeros((P, 33), bool)
        tok[:, 32], mask[:, 32] = rng.integers(1, 258, P), True
        out.append((tok, mask))
    return out


def _codes(runner, frames=5):
    for slot, (tok, mask) in enumerate(_prompts()):
        P = len(tok)
        runner.prefill([PrefillChunk(slot, 0, tok[: P - 1], mask[: P - 1])])
        runner.admit([Admission(slot, tok[-1], mask[-1], P - 1, 0.0, 0, 1.0, slot)])
    return np.stack([runner.step([0, 1]).wait()[0].copy() for _ in range(frames)], 1)


@pytest.mark.parametrize("weights", ["fp8", "fp8-all"])
def test_engine_runs_fp8_weights(weights):
    """The runner quantizes the model it is given (EngineConfig.weights) and steps frames with it; the
    codes follow the quantized model (its own reference, not the bf16 one)."""
    m = load_csm("dummy-tiny")[0]
    with torch.inference_mode():
        bf16 = _codes(ModelRunner(load_csm("dummy-tiny")[0], 4, 64))
        runner = ModelRunner(m, 4, 64, weights=weights)
        assert isinstance(m.projection, FP8Linear)
        fp8 = _codes(runner)
        again = _codes(ModelRunner(m, 4, 64, weights=weights))
    np.testing.assert_array_equal(fp8, again)
    assert fp8.shape == bf16.shape and fp8.max() < 2048
    tok, mask = _prompts()[0]
    ref = reference.generate(m, tok, mask, SamplingParams(temperature=0.0, max_audio_length_ms=5 * 80, seed=0))
    np.testing.assert_array_equal(fp8[0], ref.codes)
