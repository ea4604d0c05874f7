"""GPU (`pytest -m gpu`): kernels/depth_attention.py's one-kernel depth attention step against the unfused torch
pieces (RoPE, the cache store, attention over the frame so far), a whole frame of steps; and DepthKV's kernels
against its torch path (the CPU's). Also runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1 with a
triton package on the path; CI has none)."""
import os

import pytest
import torch
import torch.nn.functional as F

from csmserve.models.llama import LlamaConfig, _rope_qk, rope_tables

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
run = pytest.mark.skipif(DEV != "cuda" and not INTERPRET, reason="needs CUDA (or TRITON_INTERPRET=1)")
# bf16 on CUDA; the interpreter (numpy) takes fp16 for the half-precision case
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _reference_step(qkv, pos, cos, sin, kc, vc, n_q, n_kv):
    """The unfused path: rope (models/llama.py's torch reference), store, SDPA over positions 0..pos."""
    B = qkv.shape[0]
    hd = cos.shape[-1]
    q, k = _rope_qk(qkv[:, None], pos[:, None], cos, sin, n_q, n_kv)  # [B, 1, H, hd]
    v = qkv[:, (n_q + n_kv) * hd:].view(B, n_kv, hd)
    rows = torch.arange(B, device=qkv.device)
    kc[rows, :, pos] = k[:, 0]
    vc[rows, :, pos] = v
    mask = torch.arange(kc.shape[2], device=qkv.device)[None, :] <= pos[:, None]  # [B, P]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:B], vc[:B], attn_mask=mask[:, None, None],
                                         enable_gqa=True)  # [B, n_q, 1, hd]
    return out[:, :, 0].reshape(B, n_q * hd)


@run
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("B,n_q,n_kv,hd,P", [(1, 8, 2, 128, 32), (5, 8, 2, 128, 32), (3, 4, 4, 32, 20), (2, 4, 2, 16, 33)])
@pytest.mark.parametrize("pos_static", [False, True])
def test_a_frame_of_steps_equals_the_unfused_path(dtype, B, n_q, n_kv, hd, P, pos_static):
    from csmserve.kernels.depth_attention import depth_attend_triton

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=n_q * hd, n_layers=1, n_heads=n_q, n_kv_heads=n_kv, intermediate=64, max_seq_len=64)
    cos, sin = (t.to(DEV) for t in rope_tables(cfg))
    width = (n_q + 2 * n_kv) * hd
    shape = (B + 2, n_kv, P, hd)  # more cache rows than batch rows, as DepthKV allocates
    kc, vc = torch.zeros(shape, dtype=dtype, device=DEV), torch.zeros(shape, dtype=dtype, device=DEV)
    kr, vr = kc.clone(), vc.clone()
    for t in range(P):
        base = torch.randn(B, width + 7, dtype=dtype, device=DEV)
        qkv = base[:, 3:3 + width]  # strided rows, as a view into a wider projection
        pos = torch.full((B,), t, dtype=torch.long, device=DEV)
        out = depth_attend_triton(qkv, pos, cos, sin, kc, vc, n_q, n_kv, pos_static)
        ref = _reference_step(qkv, pos, cos, sin, kr, vr, n_q, n_kv)
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype], msg=f"step {t}")
    torch.testing.assert_close(kc, kr, atol=TOL[dtype], rtol=TOL[dtype])  # the same k, rounded as rope_qk does
    torch.testing.assert_close(vc, vr, atol=0, rtol=0)
    assert kc[B:].abs().sum() == 0  # rows past the batch untouched


@run
def test_rows_at_different_positions():
    from csmserve.kernels.depth_attention import depth_attend_triton

    torch.manual_seed(1)
    n_q, n_kv, hd, P, B = 8, 2, 64, 32, 4
    cfg = LlamaConfig(dim=n_q * hd, n_layers=1, n_heads=n_q, n_kv_heads=n_kv, intermediate=64, max_seq_len=64)
    cos, sin = (t.to(DEV) for t in rope_tables(cfg))
    kc = torch.randn(B, n_kv, P, hd, device=DEV)  # earlier positions already filled
    vc = torch.randn(B, n_kv, P, hd, device=DEV)
    kr, vr = kc.clone(), vc.clone()
    qkv = torch.randn(B, (n_q + 2 * n_kv) * hd, device=DEV)
    pos = torch.tensor([0, 5, 31, 17], device=DEV)
    out = depth_attend_triton(qkv, pos, cos, sin, kc, vc, n_q, n_kv)
    ref = _reference_step(qkv, pos, cos, sin, kr, vr, n_q, n_kv)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc, kr, atol=2e-5, rtol=2e-5)


@run
def test_positions_past_the_row_are_never_read_into_the_output():
    """The kernel reads the whole cache (before its PDL wait) and masks from the row's position on: NaN there
    (another frame's values, or memory never written) changes nothing."""
    from csmserve.kernels.depth_attention import depth_attend_triton

    torch.manual_seed(2)
    n_q, n_kv, hd, P, B = 8, 2, 32, 20, 3
    cfg = LlamaConfig(dim=n_q * hd, n_layers=1, n_heads=n_q, n_kv_heads=n_kv, intermediate=64, max_seq_len=64)
    cos, sin = (t.to(DEV) for t in rope_tables(cfg))
    kc, vc = torch.randn(B, n_kv, P, hd, device=DEV), torch.randn(B, n_kv, P, hd, device=DEV)
    pos = torch.tensor([0, 7, 19], device=DEV)
    past = torch.arange(P, device=DEV)[None, :] >= pos[:, None]  # [B, P]
    kn, vn = kc.clone(), vc.clone()
    kn[past[:, None, :].expand(B, n_kv, P)] = float("nan")
    vn[past[:, None, :].expand(B, n_kv, P)] = float("nan")
    qkv = torch.randn(B, (n_q + 2 * n_kv) * hd, device=DEV)
    out = depth_attend_triton(qkv, pos, cos, sin, kn, vn, n_q, n_kv)
    ref = _reference_step(qkv, pos, cos, sin, kc, vc, n_q, n_kv)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@run
def test_depth_kv_fused_equals_unfused():
    """DepthKV's kernel (fused, CUDA's path) and its torch path (the CPU's) through a whole tiny depth decoder (4
    layers, hd 64): the same hidden states."""
    from csmserve.engine.slots import DepthKV
    from csmserve.models import llama
    from csmserve.models.csm import CSMConfig

    torch.manual_seed(0)
    dec = LlamaConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=512, max_seq_len=32)
    cfg = CSMConfig(backbone=dec, decoder=dec, num_codebooks=8, audio_vocab_size=64, text_vocab_size=64)
    model = llama.Llama(dec).to(DEV).eval()
    B = 3
    outs = {}
    for fused in (False, True):
        kv = DepthKV(cfg, B, torch.float32, torch.device(DEV))
        assert kv.fused == (DEV == "cuda")  # under the interpreter DepthKV keeps the torch path off CUDA
        kv.fused = fused
        torch.manual_seed(2)
        hs = []
        with torch.no_grad():
            for t in range(cfg.num_codebooks):
                x = torch.randn(B, 1, dec.dim, device=DEV)
                hs.append(model(x, torch.full((B, 1), t, device=DEV), kv))
        outs[fused] = torch.stack(hs)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-4, rtol=1e-4)


@run
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("B,n_q,n_kv,hd,P", [(1, 8, 2, 128, 32), (3, 8, 2, 128, 32), (2, 4, 4, 32, 20), (2, 4, 2, 16, 33)])
def test_the_first_step_equals_two_unfused_steps(dtype, B, n_q, n_kv, hd, P):
    """depth_attend_first_triton (positions 0 and 1 at once) == the unfused path at position 0, then at 1; the
    cache's positions 0 and 1 hold the same k and v, the rest stays as it was (another frame's values)."""
    from csmserve.kernels.depth_attention import depth_attend_first_triton

    torch.manual_seed(3)
    cfg = LlamaConfig(dim=n_q * hd, n_layers=1, n_heads=n_q, n_kv_heads=n_kv, intermediate=64, max_seq_len=64)
    cos, sin = (t.to(DEV) for t in rope_tables(cfg))
    width = (n_q + 2 * n_kv) * hd
    shape = (B + 1, n_kv, P, hd)
    kc, vc = torch.randn(shape, dtype=dtype, device=DEV), torch.randn(shape, dtype=dtype, device=DEV)  # stale
    kr, vr = kc.clone(), vc.clone()
    base = torch.randn(B, 2, width + 5, dtype=dtype, device=DEV)
    qkv = base[:, :, 2:2 + width]  # strided rows
    out = depth_attend_first_triton(qkv, cos, sin, kc, vc, n_q, n_kv)
    assert out.shape == (B, 2, n_q * hd)
    for t in (0, 1):
        pos = torch.full((B,), t, dtype=torch.long, device=DEV)
        ref = _reference_step(qkv[:, t], pos, cos, sin, kr, vr, n_q, n_kv)
        torch.testing.assert_close(out[:, t], ref, atol=TOL[dtype], rtol=TOL[dtype], msg=f"position {t}")
    torch.testing.assert_close(kc, kr, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(vc, vr, atol=0, rtol=0)
    # position 0 attends to itself alone: its output is its value, exactly
    v0 = qkv[:, 0, (n_q + n_kv) * hd:].reshape(B, n_kv, 1, hd).expand(B, n_kv, n_q // n_kv, hd).reshape(B, n_q * hd)
    assert torch.equal(out[:, 0], v0)


@run
def test_depth_kv_first_step_fused_equals_unfused():
    """A tiny depth decoder's frame as decode_frame runs it (positions 0-1 at once, then one at a time, all views of
    the static positions): DepthKV's kernels (the first step's, then the one-query one) give the hidden states of
    its torch path."""
    from csmserve.engine.slots import DepthKV
    from csmserve.models import llama
    from csmserve.models.csm import CSMConfig

    torch.manual_seed(0)
    dec = LlamaConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=512, max_seq_len=32)
    cfg = CSMConfig(backbone=dec, decoder=dec, num_codebooks=8, audio_vocab_size=64, text_vocab_size=64)
    model = llama.Llama(dec).to(DEV).eval()
    B = 2
    static = torch.arange(cfg.num_codebooks, device=DEV)
    outs = {}
    for fused in (False, True):
        kv = DepthKV(cfg, B, torch.float32, torch.device(DEV), static_pos=static)
        kv.fused = fused  # under the interpreter DepthKV keeps the torch path off CUDA
        torch.manual_seed(2)
        hs, flags = [], []
        with torch.no_grad():
            x = torch.randn(B, 2, dec.dim, device=DEV)
            hs.append(model(x, static[:2].expand(B, 2), kv)[:, -1])
            flags.append(kv.first_static)
            for t in range(2, cfg.num_codebooks):
                x = torch.randn(B, 1, dec.dim, device=DEV)
                hs.append(model(x, static[t:t + 1].expand(B, 1), kv)[:, -1])
        outs[fused] = torch.stack(hs)
        assert flags == [fused]
    torch.testing.assert_close(outs[True], outs[False], atol=1e-4, rtol=1e-4)
    # positions computed per row are never taken as the static first step
    kv = DepthKV(cfg, B, torch.float32, torch.device(DEV), static_pos=static)
    kv.fused = True
    kv.begin(torch.arange(2, device=DEV).expand(B, 2))
    assert not kv.first_static
    kv.begin(static[1:3].expand(B, 2))  # a view of the static positions, but not 0 and 1
    assert not kv.first_static
