"""GPU (`pytest -m gpu`): FP8 weights on Hopper: the row-quantization kernel against torch, torch._scaled_mm
against the dequantized fallback on the real GEMM shapes (the frame graphs with FP8 weights:
tests/engine/test_runner_gpu.py)."""
import pytest
import torch

from csmserve.models.fp8 import FP8Linear, hopper_fp8, quantize_rows_torch

pytestmark = pytest.mark.gpu
hopper = pytest.mark.skipif(not torch.cuda.is_available() or not hopper_fp8(torch.device("cuda")),
                            reason="needs a Hopper GPU")


@hopper
@pytest.mark.parametrize("K", [16, 1024, 2048, 8192])
def test_quantize_rows_kernel_matches_torch(K):
    from csmserve.kernels.fp8 import quantize_rows_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(300, K, device="cuda", generator=g) * 5).to(torch.bfloat16)
    x[7] = 0
    q, s = quantize_rows_triton(x)
    q2, s2 = quantize_rows_torch(x)
    torch.testing.assert_close(s, s2, rtol=0, atol=0)
    same = (q.float() == q2.float()).float().mean().item()
    assert same > 0.999, same  # division rounding may move a value across a rounding boundary, rarely
    ulp = (q2.float().abs() * 2 ** -3).clamp(min=2 ** -9)
    assert ((q.float() - q2.float()).abs() <= ulp).all()


@hopper
@pytest.mark.parametrize("K,N", [(1024, 1536), (1024, 1024), (1024, 16384), (8192, 1024), (2048, 1024),
                                 (2048, 3072), (2048, 16384)])
@pytest.mark.parametrize("M", [1, 3, 9, 16, 17, 64, 512, 513, 2048])
def test_scaled_mm_matches_the_dequantized_fallback(M, K, N):
    """Up to 16 rows (WEIGHT_ONLY_ROWS; outside fuse_gemv) weight_only_mm == weight_only_torch, closer to it
    than w8a8 is: the activations are not quantized. From 17 to 512 rows (DENSE_ROWS) the bf16 copy of the dequantized
    weight through cuBLAS: F.linear on that copy exactly, and the weight-only numbers to within bf16's rounding. Past
    512 the w8a8 GEMM == its float32 fallback."""
    from csmserve.models import fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    lin = FP8Linear(w)
    assert lin.fast
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    y = lin(x)
    dense = fp8.WEIGHT_ONLY_ROWS < M <= fp8.DENSE_ROWS
    weight_only = M <= fp8.WEIGHT_ONLY_ROWS or dense
    if dense:
        assert lin.dense is not None and lin.dense.dtype == torch.bfloat16
        assert torch.equal(y, torch.nn.functional.linear(x, lin.dense))
        assert "dense" not in lin.state_dict()
    if weight_only:
        lin.weight_only = True  # the torch weight-only numbers
    else:
        lin.fast = False
    ref = lin(x)
    if weight_only:  # the w8a8 numbers are further from weight-only's: e4m3's error on the activations
        lin.weight_only, lin.fast, lin.dense = False, False, None
        w8a8 = lin(x)
        assert ((w8a8.float() - ref.float()).norm() / ref.float().norm()).item() > 3 * (
            (y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, err
    exact = torch.nn.functional.linear(x.float(), w.float())
    err = ((y.float() - exact).norm() / exact.norm()).item()
    assert err < 0.06, err  # FP8 against bf16 weights: e4m3's 3 mantissa bits


@hopper
def test_no_dense_copy_at_dense_rows_0(monkeypatch):
    """CSMSERVE_FP8_DENSE_ROWS=0: no bf16 copy (the e4m3 weights' memory only); 17+ rows take the w8a8 GEMM."""
    from csmserve.models import fp8

    monkeypatch.setattr(fp8, "DENSE_ROWS", 0)
    g = torch.Generator(device="cuda").manual_seed(0)
    lin = FP8Linear((torch.randn(1024, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16))
    assert lin.dense is None
    x = torch.randn(64, 2048, device="cuda", generator=g).to(torch.bfloat16)
    x8, sx = fp8.quantize_rows(x)
    ref = torch._scaled_mm(x8, lin.weight8.t(), scale_a=sx, scale_b=lin.scale, out_dtype=torch.bfloat16)
    assert torch.equal(lin(x), ref)
