"""GPU (`pytest -m gpu`): the Triton decode attention against its torch reference."""
import pytest
import torch

from csmserve.kernels.decode_attention import decode_attention_torch, decode_attention_triton

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv,hd", [(1, 32, 8, 64), (7, 32, 8, 64), (64, 8, 2, 128)])
def test_decode_attention_matches_torch(dtype, B, Hq, Hkv, hd):
    torch.manual_seed(0)
    N, T = 9, 700
    k = torch.randn(N, Hkv, T, hd, device="cuda", dtype=dtype)
    v = torch.randn(N, Hkv, T, hd, device="cuda", dtype=dtype)
    q = torch.randn(B, Hq, hd, device="cuda", dtype=dtype)
    slots = torch.randint(0, N, (B,), device="cuda")
    lengths = torch.randint(1, T + 1, (B,), device="cuda", dtype=torch.int32)
    ref = decode_attention_torch(q.float(), k.float(), v.float(), slots, lengths, T)
    for splits in (1, 4, 16):
        out = decode_attention_triton(q, k, v, slots, lengths, splits)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
