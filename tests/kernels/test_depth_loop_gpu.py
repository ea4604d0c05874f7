"""GPU (`pytest -m gpu`): kernels/depth_loop.py's persistent depth loop (codebooks 2..K-1 in one kernel) against the
plain depth steps (CSMModel.decode_frame over DepthKV): the same codes, logits and depth KV, one row and two,
greedy and sampled; teacher-forced logits; on CUDA the persistent kernel against its stepped launches (the same
bits) and no barrier stalls. Also runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1 with a triton
package on the path; CI has none), where only the stepped mode can run (the interpreter runs programs in turn)."""
import os

import pytest
import torch

from csmserve.engine.slots import DepthKV
from csmserve.models.csm import CSMConfig, CSMModel
from csmserve.models.llama import LlamaConfig
from csmserve.models.sampler import sample

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
run = pytest.mark.skipif(DEV != "cuda" and not INTERPRET, reason="needs CUDA (or TRITON_INTERPRET=1)")
cuda = pytest.mark.skipif(DEV != "cuda", reason="the persistent kernel needs CUDA")
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16


def _model(dtype, hd=32, layers=2, codebooks=6):
    n_heads = 128 // hd
    dec = LlamaConfig(dim=128, n_layers=layers, n_heads=n_heads, n_kv_heads=max(1, n_heads // 2), intermediate=256,
                      max_seq_len=max(16, codebooks))  # a depth position per codebook
    bb = LlamaConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, intermediate=256, max_seq_len=64)
    cfg = CSMConfig(backbone=bb, decoder=dec, num_codebooks=codebooks, audio_vocab_size=64, text_vocab_size=64)
    torch.manual_seed(0)
    model = CSMModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)  # logits of a few units: sampling is not near-uniform
            if p.dim() == 1:
                p.abs_()
    model = model.to(DEV, dtype).eval()
    model.prepare_heads()
    return model


def _params(M, temperature, seed0=0):
    t = torch.full((M,), temperature, device=DEV)
    k = torch.full((M,), 20, device=DEV)
    p = torch.ones(M, device=DEV)
    seed = torch.arange(seed0, seed0 + M, device=DEV) * 7919 + 11
    frame = torch.arange(M, device=DEV) + 3
    return t, k, p, seed, frame


def _plain(model, h, params, upto=None, force=None):
    """The plain depth steps: codes [M, upto or K], logits per codebook, the depth KV."""
    cfg = model.cfg
    M = h.shape[0]
    kv = DepthKV(cfg, M, h.dtype, h.device)
    logits = {}

    def sampler(lg, cb):
        logits[cb] = lg[:, :cfg.sampleable_codes].float()
        if force is not None:
            return force[:, cb]
        return sample(lg[:, :cfg.sampleable_codes], *params, cb)

    with torch.no_grad():
        codes = model.decode_frame(h, sampler, kv, torch.arange(cfg.num_codebooks, device=h.device), upto=upto)
    return codes, logits, kv


def _loop(model, kv, **kw):
    from csmserve.kernels.depth_loop import DepthLoop

    return DepthLoop(model, kv.k, kv.v, **({"persistent": False, "programs": 3} if DEV != "cuda" else {}), **kw)


@run
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_loop_equals_the_plain_depth_steps(dtype, M, temperature):
    model = _model(dtype)
    K = model.cfg.num_codebooks
    torch.manual_seed(5)
    h = torch.randn(M, model.cfg.backbone.dim, device=DEV).to(dtype)
    params = _params(M, temperature)
    ref, ref_logits, ref_kv = _plain(model, h, params)
    first, _, kv = _plain(model, h, params, upto=2)
    loop = _loop(model, kv)
    codes = loop(first, *params)
    assert torch.equal(codes[:, :2], ref[:, :2])
    # teacher forcing on the plain path's codes: every step's logits and the whole depth KV
    forced = loop(ref, *params, teach=True)
    assert torch.equal(forced, ref)
    got = torch.stack([loop.log[s, :M].float() for s in range(2, K)])
    want = torch.stack([ref_logits[s] for s in range(2, K)])
    if dtype == torch.float32:  # the GEMVs sum in another order: the last bits only, so the same codes
        assert torch.equal(codes, ref), (codes, ref)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv.k[:, :M], ref_kv.k[:, :M], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv.v[:, :M], ref_kv.v[:, :M], atol=1e-4, rtol=1e-4)
        return
    # half precision: the two paths round at other places (bf16 keeps 8 bits), so each is held to float32 on the
    # same (rounded) weights and the same codes: the loop no less accurate than the plain path
    m32 = _model(torch.float32)
    with torch.no_grad():
        for a, b in zip(m32.parameters(), model.parameters()):
            a.copy_(b.float())
    m32.prepare_heads()
    _, logits32, kv32 = _plain(m32, h.float(), params, force=ref)
    truth = torch.stack([logits32[s] for s in range(2, K)])
    err = lambda x, y: (x.float() - y.float()).abs().mean().item()  # noqa: E731
    assert err(got, truth) <= 1.5 * err(want, truth) + 1e-3, (err(got, truth), err(want, truth))
    for a, b, c in ((kv.k, ref_kv.k, kv32.k), (kv.v, ref_kv.v, kv32.v)):
        assert err(a[:, :M], c[:, :M]) <= 1.5 * err(b[:, :M], c[:, :M]) + 1e-3


@run
@pytest.mark.parametrize("ahead", ["0", "1"])
def test_head_dim_16_and_one_kv_head(ahead, monkeypatch):
    """The attention's broadcast-sum path (head_dim < 32) and a single KV head, 4 layers; with the next weight
    chunk's loads issued ahead (CSMSERVE_DEPTH_LOOP_AHEAD=1) and without (the default)."""
    monkeypatch.setenv("CSMSERVE_DEPTH_LOOP_AHEAD", ahead)
    model = _model(torch.float32, hd=16, layers=4, codebooks=5)
    torch.manual_seed(6)
    h = torch.randn(2, model.cfg.backbone.dim, device=DEV)
    params = _params(2, 0.8, seed0=4)
    ref, _, _ = _plain(model, h, params)
    first, _, kv = _plain(model, h, params, upto=2)
    assert torch.equal(_loop(model, kv)(first, *params), ref)


@run
def test_a_row_alone_and_in_a_pair_get_the_same_codes():
    model = _model(torch.float32)
    torch.manual_seed(7)
    h = torch.randn(2, model.cfg.backbone.dim, device=DEV)
    params = _params(2, 0.9, seed0=9)
    first, _, kv = _plain(model, h, params, upto=2)
    pair = _loop(model, kv)(first, *params)
    first1, _, kv1 = _plain(model, h[1:], tuple(t[1:] for t in params), upto=2)
    alone = _loop(model, kv1)(first1, *(t[1:] for t in params))
    assert torch.equal(pair[1:], alone)


@cuda
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("opt_in", ["0", "1"])
def test_persistent_equals_stepped_and_never_stalls(M, opt_in, monkeypatch):
    """The one-launch kernel (grid barriers) against the same kernel launched per phase: the same bits; every
    barrier met. With the L2 prefetch and the next-chunk loads (opted into) and without (the default)."""
    from csmserve.kernels.depth_loop import DepthLoop

    monkeypatch.setenv("CSMSERVE_DEPTH_LOOP_PREFETCH", opt_in)
    monkeypatch.setenv("CSMSERVE_DEPTH_LOOP_AHEAD", opt_in)

    model = _model(torch.bfloat16, layers=4, codebooks=32)
    torch.manual_seed(8)
    h = torch.randn(M, model.cfg.backbone.dim, device=DEV).bfloat16()
    params = _params(M, 0.9)
    outs = []
    for persistent in (False, True):
        first, _, kv = _plain(model, h, params, upto=2)
        loop = DepthLoop(model, kv.k, kv.v, persistent=persistent)
        outs.append((loop(first, *params), loop.log[:, :M].clone(), kv.k.clone()))
        assert loop.stalls() == 0
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@cuda
def test_persistent_in_a_cuda_graph():
    """Captured and replayed (as the runner's frame graphs do): the same codes as eager, and the barrier counter
    reset per replay."""
    from csmserve.kernels.depth_loop import DepthLoop

    model = _model(torch.bfloat16, layers=4, codebooks=32)
    torch.manual_seed(9)
    h = torch.randn(2, model.cfg.backbone.dim, device=DEV).bfloat16()
    params = _params(2, 0.9)
    first, _, kv = _plain(model, h, params, upto=2)
    loop = DepthLoop(model, kv.k, kv.v)
    eager = loop(first, *params)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        loop(first, *params)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = loop(first, *params)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert loop.stalls() == 0


@cuda
def test_timing_stamps_are_ordered_and_change_nothing():
    """DepthLoop(timing=True) (bench/depth_loop.py's per-phase table): the same codes as without, each program's
    phases in order, and its cycles and nanoseconds at an SM clock's ratio (0.5-3 GHz)."""
    from csmserve.kernels.depth_loop import DepthLoop

    model = _model(torch.bfloat16, layers=4, codebooks=32)
    torch.manual_seed(10)
    h = torch.randn(1, model.cfg.backbone.dim, device=DEV).bfloat16()
    params = _params(1, 0.9)
    outs = []
    for timing in (False, True):
        first, _, kv = _plain(model, h, params, upto=2)
        loop = DepthLoop(model, kv.k, kv.v, timing=timing)
        outs.append(loop(first, *params))
    assert torch.equal(*outs) and loop.stalls() == 0
    t = loop.times.cpu().double()  # [phases, P, 4]: start ns, end ns, start cycles, end cycles
    ns, cyc = t[:, :, 1] - t[:, :, 0], t[:, :, 3] - t[:, :, 2]
    assert (ns >= 0).all() and (cyc >= 0).all()
    assert (t[1:, :, 0] >= t[:-1, :, 1]).all()  # a program starts a phase after it ended the one before
    ghz = (t[-1, :, 3] - t[0, :, 2]) / (t[-1, :, 1] - t[0, :, 0])  # [P]
    assert ((ghz > 0.5) & (ghz < 3.0)).all(), ghz
