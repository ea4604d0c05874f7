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
