"""kernels/fp8.py's weight_only_mm (e4m3 weights, activations as they are, per-channel scales) against
models/fp8.py's weight_only_torch: rows that are and are not a multiple of the tile, N not a multiple of
BLOCK_N, split over K. Also under Triton's interpreter (fp16 there: it has no bfloat16)."""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
run = pytest.mark.skipif(DEV != "cuda" and not INTERPRET, reason="needs CUDA (or TRITON_INTERPRET=1)")


@run
@pytest.mark.parametrize("m", [3, 16, 33, 64, 100])
@pytest.mark.parametrize("n,k,cfg", [(1000, 256, (64, 128, 1, 4, 3)), (96, 512, (32, 128, 2, 4, 3)),
                                     (160, 1024, (64, 128, 4, 4, 2))])
def test_weight_only_mm_matches_torch(m, n, k, cfg):
    from csmserve.kernels.fp8 import weight_only_mm
    from csmserve.models.fp8 import quantize_rows_torch, weight_only_torch

    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[torch.randperm(n, generator=g)][:, None]
    w8, s = quantize_rows_torch(w)  # scales over two decades: a wrong or misplaced scale shows
    w8, s = w8.to(DEV), s.reshape(1, -1).contiguous().to(DEV)
    x = torch.randn(m, k, generator=g).to(dt).to(DEV)
    out = weight_only_mm(x, w8, s, *cfg)
    ref = weight_only_torch(x, w8, s)
    assert out.shape == (m, n) and out.dtype == dt
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    if cfg[2] > 1:  # split over K: the partial sums added in a fixed order, the same bits every call
        assert torch.equal(weight_only_mm(x, w8, s, *cfg), out)


@run
def test_the_few_rows_config_splits_k_until_the_gpu_is_covered():
    """weight_only_config (FP8Linear at up to 16 rows): N alone covers the GPU for the wide GEMMs; the K = 8192 down
    projections (N 1,024 / 2,048: 16 / 32 tiles) split 8 ways; every split divides K into whole chunks."""
    from csmserve.kernels.fp8 import weight_only_config

    assert weight_only_config(11, 16384, 2048)[2] == 1
    assert weight_only_config(11, 1024, 8192)[2] == 8
    assert weight_only_config(11, 2048, 8192)[2] == 4
    assert weight_only_config(11, 100, 100) is None
    for n, k in [(3072, 2048), (1536, 1024), (1024, 1024), (2048, 2048), (1024, 2048)]:
        bn, bk, split, _, _ = weight_only_config(16, n, k)
        assert k % (bk * split) == 0 and -(-n // bn) * split >= 64, (n, k, split)
