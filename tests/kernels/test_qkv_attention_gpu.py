"""GPU (`pytest -m gpu`): kernels/qkv_attention.py's add + RMSNorm + qkv GEMV + depth attention in one kernel against
the two kernels it replaces (gemv.norm_gemv, then depth_attention.depth_attend_triton), bit for bit, a whole frame
of steps; and a depth decoder through fuse_gemv with it on and off. Also runs on the CPU under Triton's interpreter
(TRITON_INTERPRET=1 with a triton package on the path; CI has none)."""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
run = pytest.mark.skipif(DEV != "cuda" and not INTERPRET, reason="needs CUDA (or TRITON_INTERPRET=1)")
cuda = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter (numpy) takes fp16


def _weights(n, k, dtype, fp8, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    if not fp8:
        return w.to(dtype).to(DEV), None
    from csmserve.models.fp8 import quantize_rows_torch

    w8, s = quantize_rows_torch(w)
    return w8.to(DEV), s.reshape(-1).to(DEV)


def _frame(fused, dtype, B, n_q, n_kv, hd, P, K, fp8, with_delta, steps):
    """`steps` depth steps of one layer (positions 0..steps-1): (h, attention) per step and the caches after."""
    from csmserve.kernels import gemv
    from csmserve.kernels.depth_attention import depth_attend_triton
    from csmserve.kernels.qkv_attention import _COUNTERS, _config, norm_qkv_attend
    from csmserve.models.llama import LlamaConfig, rope_tables

    cfg = LlamaConfig(dim=n_q * hd, n_layers=1, n_heads=n_q, n_kv_heads=n_kv, intermediate=64, max_seq_len=64)
    cos, sin = (t.to(DEV) for t in rope_tables(cfg))
    N = (n_q + 2 * n_kv) * hd
    w, scale = _weights(N, K, dtype, fp8, 1)
    nw = (1 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(2))).to(dtype).to(DEV)
    shape = (B + 2, n_kv, P, hd)  # more cache rows than batch rows, as DepthKV allocates
    kc, vc = torch.zeros(shape, dtype=dtype, device=DEV), torch.zeros(shape, dtype=dtype, device=DEV)
    g = torch.Generator().manual_seed(3)
    outs = []
    for t in range(steps):
        x = torch.randn(B, K, generator=g).to(dtype).to(DEV)
        delta = torch.randn(B, K, generator=g).to(dtype).to(DEV) if with_delta else None
        pos = torch.full((B, 1), t, dtype=torch.long, device=DEV)[:, 0]  # a strided view, as DepthKV passes it
        if fused:
            h, a = norm_qkv_attend(x, delta, nw, 1e-5, w, scale, pos, cos, sin, kc, vc, n_q, n_kv)
            assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())  # every arrival counter back at 0
        else:
            # the fused kernel's GEMV blocks (CSMSERVE_QKV_ATTN_BLOCK_N may set them): the same sums
            h, qkv = gemv.norm_gemv(x, delta, nw, 1e-5, w, False, scale, cfg=_config(B, N, K, fp8))
            a = depth_attend_triton(qkv, pos, cos, sin, kc, vc, n_q, n_kv)
        outs.append((h, a))
    return outs, kc, vc


@run
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("n_q,n_kv,hd,P,K", [(8, 2, 32, 20, 256), (4, 1, 16, 33, 128)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("with_delta", [False, True])
def test_one_kernel_equals_norm_gemv_then_the_attention(dtype, B, n_q, n_kv, hd, P, K, fp8, with_delta):
    """Each step's h and attention, and the caches, equal the two kernels' bit for bit (the same GEMV, the same
    attention on the stored qkv); the arrival counters are 0 after every call."""
    steps = min(P, 6)
    ref, kr, vr = _frame(False, dtype, B, n_q, n_kv, hd, P, K, fp8, with_delta, steps)
    out, kc, vc = _frame(True, dtype, B, n_q, n_kv, hd, P, K, fp8, with_delta, steps)
    for t, ((h, a), (hr, ar)) in enumerate(zip(out, ref)):
        torch.testing.assert_close(h, hr, atol=0, rtol=0, msg=f"h, step {t}")
        torch.testing.assert_close(a, ar, atol=0, rtol=0, msg=f"attention, step {t}")
    torch.testing.assert_close(kc, kr, atol=0, rtol=0)
    torch.testing.assert_close(vc, vr, atol=0, rtol=0)
    assert kc[B:].abs().sum() == 0  # rows past the batch untouched


@cuda
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_n", [0, 16])
def test_one_kernel_at_the_depth_decoders_shape(monkeypatch, B, fp8, block_n):
    """CSM-1B's depth decoder (D 1,024, 8 query and 2 KV heads of 128, 32 positions): a whole frame of steps, with
    gemv.config's column blocks and with CSMSERVE_QKV_ATTN_BLOCK_N=16."""
    from csmserve.kernels import qkv_attention as qa

    monkeypatch.setattr(qa, "BLOCK_N", block_n)
    ref, kr, vr = _frame(False, torch.bfloat16, B, 8, 2, 128, 32, 1024, fp8, True, 32)
    out, kc, vc = _frame(True, torch.bfloat16, B, 8, 2, 128, 32, 1024, fp8, True, 32)
    for t, ((h, a), (hr, ar)) in enumerate(zip(out, ref)):
        torch.testing.assert_close(h, hr, atol=0, rtol=0, msg=f"h, step {t}")
        torch.testing.assert_close(a, ar, atol=0, rtol=0, msg=f"attention, step {t}")
    torch.testing.assert_close(kc, kr, atol=0, rtol=0)


@cuda
def test_applies_only_where_it_should(monkeypatch):
    from csmserve.kernels import qkv_attention as qa

    monkeypatch.setattr(qa, "ON", True)

    x = torch.randn(1, 1, 1024, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 1024, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(4, 2, 32, 128, device="cuda", dtype=torch.bfloat16)
    assert qa.applies(x, nw, w, None, kc, 8, 2)
    assert qa.applies(x.expand(2, 1, 1024), nw, w, None, kc, 8, 2)
    assert not qa.applies(x.expand(3, 1, 1024), nw, w, None, kc, 8, 2)  # 3+ rows: the two kernels
    assert not qa.applies(x, nw, w[:1024], None, kc, 8, 2)  # not a [q; k; v] projection of these heads
    assert not qa.applies(x, nw, w, None, torch.zeros(4, 2, 65, 128, device="cuda", dtype=torch.bfloat16), 8, 2)
    monkeypatch.setattr(qa, "ON", False)  # CSMSERVE_DEPTH_QKV_ATTN unset: off
    assert not qa.applies(x, nw, w, None, kc, 8, 2)


@cuda
@pytest.mark.parametrize("B", [1, 2, 3])
@pytest.mark.parametrize("fp8", [False, True])
def test_depth_decoder_through_fuse_gemv_equals_the_two_kernels(monkeypatch, B, fp8):
    """A 4-layer depth decoder of CSM-1B's layer shape (DepthKV, fuse_gemv) over a frame of steps with
    CSMSERVE_DEPTH_QKV_ATTN on and off: the same hidden states bit for bit (3 rows: neither path, the same)."""
    from csmserve.engine.slots import DepthKV
    from csmserve.kernels import qkv_attention as qa
    from csmserve.models import llama
    from csmserve.models.csm import CSMConfig
    from csmserve.models.fp8 import GEMMS, FP8Linear

    torch.manual_seed(0)
    dec = llama.LlamaConfig(dim=1024, n_layers=4, n_heads=8, n_kv_heads=2, intermediate=2048, max_seq_len=64)
    cfg = CSMConfig(backbone=dec, decoder=dec, num_codebooks=8, audio_vocab_size=64, text_vocab_size=64)
    model = llama.Llama(dec).to("cuda", torch.bfloat16).eval()
    if fp8:  # as quantize_weights does
        for block in model.layers:
            for parent in (block.self_attn, block.mlp):
                for name in GEMMS:
                    if isinstance(getattr(parent, name, None), torch.nn.Linear):
                        setattr(parent, name, FP8Linear(getattr(parent, name).weight))
    calls = []
    real = qa.norm_qkv_attend
    monkeypatch.setattr(qa, "norm_qkv_attend", lambda *a: calls.append(1) or real(*a))
    outs = {}
    try:
        llama.fuse_gemv(True)
        for on in (False, True):
            monkeypatch.setattr(qa, "ON", on)
            kv = DepthKV(cfg, B, torch.bfloat16, torch.device("cuda"))
            g = torch.Generator(device="cuda").manual_seed(2)
            hs = []
            with torch.no_grad():
                for t in range(cfg.num_codebooks):
                    x = torch.randn(B, 1, dec.dim, device="cuda", generator=g).to(torch.bfloat16)
                    hs.append(model(x, torch.full((B, 1), t, device="cuda"), kv))
            outs[on] = torch.stack(hs)
    finally:
        llama.fuse_gemv(False)
    torch.testing.assert_close(outs[True], outs[False], atol=0, rtol=0)
    assert len(calls) == (cfg.num_codebooks * dec.n_layers if B <= 2 else 0)
