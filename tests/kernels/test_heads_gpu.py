"""GPU (`pytest -m gpu`): the gathered codebook-head GEMV (every row its own head) against einsum."""
import pytest
import torch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_head_kernel_matches_torch(dtype):
    from csmserve.kernels.heads import gathered_head_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    H, Vp, D, V = 31, 2112, 1024, 2051
    head_t = torch.randn(H, Vp, D, device="cuda", generator=g).to(dtype)
    x = torch.randn(40, D, device="cuda", generator=g).to(dtype)
    heads = torch.randint(0, H, (90,), device="cuda", generator=g)
    rows = torch.randint(0, 40, (90,), device="cuda", generator=g)
    out = gathered_head_logits(x, head_t, heads, rows, V)
    ref = torch.einsum("nd,nvd->nv", x[rows].float(), head_t[heads][:, :V].float())
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol * ref.abs().max().item(), rtol=tol)
