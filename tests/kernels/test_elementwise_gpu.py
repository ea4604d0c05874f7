"""GPU (`pytest -m gpu`): the fused Triton elementwise kernels against the torch pieces they replace."""
import pytest
import torch

from csmserve.models.llama import LlamaConfig, _add_rms_norm, _rope_qk, rope_tables

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 17, 1024), (64, 1, 64)])
def test_add_rms_norm(dtype, shape):
    from csmserve.kernels.elementwise import add_rms_norm_triton

    torch.manual_seed(0)
    x, d = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    for delta in (None, d):
        h, y = add_rms_norm_triton(x, delta, w, 1e-5)
        h_ref, y_ref = _add_rms_norm(x, delta, w, 1e-5)
        torch.testing.assert_close(h, h_ref, atol=0, rtol=0)  # the residual sum rounds exactly as x + delta
        torch.testing.assert_close(y, y_ref, atol=TOL[dtype], rtol=TOL[dtype])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,n_q,n_kv,dim", [(1, 1, 32, 8, 2048), (5, 13, 32, 8, 2048), (64, 2, 8, 2, 1024)])
def test_rope_qk(dtype, B, S, n_q, n_kv, dim):
    from csmserve.kernels.elementwise import rope_qk_triton

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=dim, n_layers=1, n_heads=n_q, n_kv_heads=n_kv, intermediate=64)
    cos, sin = (t.cuda() for t in rope_tables(cfg))
    hd = cfg.head_dim
    qkv = torch.randn(B, S, (n_q + 2 * n_kv) * hd, device="cuda", dtype=dtype)
    for pos in (torch.randint(0, cfg.max_seq_len, (B, S), device="cuda"),
                torch.arange(S, device="cuda")[None].expand(B, S)):  # the depth decoder's expanded positions
        q, k = rope_qk_triton(qkv, pos, cos, sin, n_q, n_kv)
        q_ref, k_ref = _rope_qk(qkv, pos, cos, sin, n_q, n_kv)
        torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])


@cuda
def test_store_kv():
    from csmserve.kernels.elementwise import store_kv_triton

    torch.manual_seed(0)
    N, H, T, hd, B = 9, 8, 100, 64, 5
    kc, vc = torch.randn(N, H, T, hd, device="cuda"), torch.randn(N, H, T, hd, device="cuda")
    kr, vr = kc.clone(), vc.clone()
    qkv = torch.randn(B, 1, (32 + 2 * H) * hd, device="cuda")
    k = torch.randn(B, H, hd, device="cuda")
    v = qkv[:, 0, (32 + H) * hd:].view(B, H, hd)  # a strided view, as the attention hands it over
    rows = torch.randperm(N, device="cuda")[:B]
    pos = torch.randint(0, T, (B,), device="cuda")
    store_kv_triton(kc, vc, rows, pos, k, v)
    kr[rows, :, pos] = k
    vr[rows, :, pos] = v
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@cuda
def test_silu_mul_kernel():
    from csmserve.kernels.elementwise import silu_mul_triton
    from csmserve.models.llama import _silu_mul

    x = torch.randn(37, 2 * 3000, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(silu_mul_triton(x), _silu_mul(x), atol=2e-2, rtol=2e-2)
    x = torch.randn(5, 1, 2 * 64, device="cuda")
    torch.testing.assert_close(silu_mul_triton(x), _silu_mul(x), atol=1e-5, rtol=1e-5)
