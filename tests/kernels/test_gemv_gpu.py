"""GPU (`pytest -m gpu`): the skinny-GEMM kernel (kernels/gemv.py) against F.linear, and a Llama
forward with it (fuse_gemv) against the same forward through cuBLAS."""
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reference(x, w, glu, scale=None):
    """x @ w^T in float32 (glu: w is [gate; up], silu(gate) * up); scale: w is e4m3 with these per-channel scales,
    the weight-only numbers (models/fp8.py's weight_only_torch)."""
    if scale is not None:
        from csmserve.models.fp8 import weight_only_torch

        ref = weight_only_torch(x, w, scale)
    else:
        ref = F.linear(x.float(), w.float())
    if glu:
        a, b = ref.chunk(2, -1)
        ref = F.silu(a) * b
    return ref


@cuda
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k,glu", [(3072, 2048, False), (2048, 8192, False), (8192, 1024, True),
                                     (2051, 2048, False), (2112, 1024, False), (1536, 1024, False), (40, 256, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_linear(m, n, k, glu, dtype):
    from csmserve.kernels import gemv

    torch.manual_seed(0)
    w = torch.randn(2 * n if glu else n, k, device="cuda", dtype=dtype) * 0.05
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    assert gemv.applies(x, w, glu)
    ref = _reference(x, w, glu)
    out = gemv.gemv(x, w, glu)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # strided rows (the depth decoder's last position out[:, -1]) and a leading batch dim
    x3 = torch.randn(m, 2, k, device="cuda", dtype=dtype)
    torch.testing.assert_close(gemv.gemv(x3[:, -1], w, glu), gemv.gemv(x3[:, -1].contiguous(), w, glu))


@cuda
def test_gemv_does_not_apply_where_it_should_not():
    from csmserve.kernels import gemv

    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert gemv.applies(torch.randn(3, 256, device="cuda", dtype=torch.bfloat16), w)  # the tensor-core kernel
    assert not gemv.applies(torch.randn(gemv.MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16), w)
    assert gemv.mma_blocks(gemv.MMA_TILE + 1, 64, 256) is None  # past the tile
    assert not gemv.applies(torch.randn(2, 256, device="cuda"), w.float())  # float32: cuBLAS
    assert not gemv.applies(torch.randn(2, 256, dtype=torch.bfloat16), w.cpu())


@cuda
@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 1), (1, 2), (16, 1)])
def test_llama_forward_with_gemv_matches_cublas(batch, seq):
    from csmserve.models import llama
    from csmserve.models.csm import llama_100m

    torch.manual_seed(0)
    cfg = llama_100m()
    model = llama.Llama(cfg).to("cuda", torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(batch, seq, cfg.dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(seq, device="cuda").expand(batch, seq)
    outs = []
    for on in (False, True):
        llama.fuse_gemv(on)
        try:
            kv = model.new_kv(batch, 8, torch.bfloat16, "cuda")
            outs.append(model(x, pos, kv).float())
        finally:
            llama.fuse_gemv(False)
    torch.testing.assert_close(outs[1], outs[0], atol=5e-2, rtol=5e-2)
    assert (outs[1] - outs[0]).abs().mean() < 1e-2


@cuda
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k,glu", [(3072, 2048, False), (8192, 2048, True), (1536, 1024, False),
                                     (8192, 1024, True)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_norm_gemv_matches_add_rms_norm_then_linear(m, n, k, glu, with_delta):
    from csmserve.kernels import gemv
    from csmserve.kernels.elementwise import add_rms_norm_triton

    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dt)
    delta = torch.randn(m, k, device="cuda", dtype=dt) if with_delta else None
    nw = (torch.rand(k, device="cuda") + 0.5).to(dt)
    w = torch.randn(2 * n if glu else n, k, device="cuda", dtype=dt) * 0.05
    assert gemv.norm_applies(x, nw, w, glu)
    h_ref, y_ref = add_rms_norm_triton(x, delta, nw, 1e-5)
    ref = _reference(y_ref, w, glu)
    h, out = gemv.norm_gemv(x, delta, nw, 1e-5, w, glu)
    assert torch.equal(h, h_ref)  # the residual stream: bit for bit
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)


def _tuned():
    from csmserve.kernels import tuning

    return [(k, False) for k in sorted(tuning.GEMV)] + [(k, True) for k in sorted(tuning.GEMV_FP8)]


@cuda
@pytest.mark.parametrize("key,fp8", _tuned())
def test_every_tuned_config_matches_linear(key, fp8):
    """Each launch configuration of kernels/tuning.py's tables (or CSMSERVE_KERNEL_TUNING's file) on its shape, bf16
    and e4m3 weights: the same result as F.linear / weight_only_torch (after the fused norm where the frame step
    fuses one)."""
    from csmserve.kernels import gemv
    from csmserve.kernels.elementwise import add_rms_norm_triton

    m, n, k, glu, norm = key
    assert gemv.config(*key, fp8=fp8) == (gemv.TUNED_FP8 if fp8 else gemv.TUNED)[key]
    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dt)
    if fp8:
        w, scale = _fp8(2 * n if glu else n, k, seed=n + k)
    else:
        w, scale = torch.randn(2 * n if glu else n, k, device="cuda", dtype=dt) * 0.05, None
    delta = torch.randn(m, k, device="cuda", dtype=dt)
    nw = (torch.rand(k, device="cuda") + 0.5).to(dt)
    if norm:
        h_ref, y = add_rms_norm_triton(x, delta, nw, 1e-5)
        h, out = gemv.norm_gemv(x, delta, nw, 1e-5, w, glu, scale)
        assert torch.equal(h, h_ref)
    else:
        y, out = x, gemv.gemv(x, w, glu, scale)
    ref = _reference(y, w, glu, scale)
    tol = 3e-2 * max(1.0, ref.abs().max().item()) if fp8 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=2e-2)


@cuda
def test_a_pdl_chain_in_a_graph_equals_plain_launches(monkeypatch):
    """kernels/pdl.py: a chain of dependent kernels (norm + GEMV, GEMV, add + norm, sampler-free) launched with
    programmatic dependent launch and replayed as a CUDA graph gives the same bits as plain launches: a kernel
    that read its input before the one before had written it would differ."""
    from csmserve.kernels import gemv, pdl
    from csmserve.kernels.elementwise import add_rms_norm_triton

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm90")
    torch.manual_seed(0)
    dt = torch.bfloat16
    ws = [torch.randn(1024, 1024, device="cuda", dtype=dt) * 0.05 for _ in range(8)]
    up = torch.randn(2 * 4096, 1024, device="cuda", dtype=dt) * 0.05
    down = torch.randn(1024, 4096, device="cuda", dtype=dt) * 0.02
    nw = (torch.rand(1024, device="cuda") + 0.5).to(dt)
    x0 = torch.randn(2, 1024, device="cuda", dtype=dt)

    def chain():
        x, delta = x0, None
        for w in ws:
            x, y = gemv.norm_gemv(x, delta, nw, 1e-5, w)
            x, h = gemv.norm_gemv(x, gemv.gemv(y, w), nw, 1e-5, up, glu=True)
            delta = gemv.gemv(h, down)
        return add_rms_norm_triton(x, delta, nw, 1e-5)[1]

    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "enabled", lambda on=on: on)  # opts() asks it at every launch
        assert pdl.opts()["PDL"] is on
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            chain()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain()
        reps = []
        for _ in range(20):
            g.replay()
            reps.append(out.clone())
        torch.cuda.synchronize()
        outs[on] = reps
    for r in outs[False] + outs[True]:
        assert torch.equal(r, outs[False][0])


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
run = pytest.mark.skipif(DEV != "cuda" and not INTERPRET, reason="needs CUDA (or TRITON_INTERPRET=1)")


def _fp8(n_out, k, seed):
    """An e4m3 weight [n_out, K] with per-row scales spread over two decades (so a wrong scale shows)."""
    from csmserve.models.fp8 import quantize_rows_torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, k, generator=g) * torch.logspace(-2, 0, n_out)[torch.randperm(n_out, generator=g)][:, None]
    w8, s = quantize_rows_torch(w)
    return w8.to(DEV), s.reshape(-1).to(DEV)


def _run(x, w, glu, scale, norm):
    """(the GEMM's input, our output, the norm weight): gemv(x), or norm_gemv(x, delta) with a random delta and norm
    weight, its h checked bit for bit against llama._add_rms_norm's (whose normed rows are the GEMM's input)."""
    from csmserve.kernels import gemv
    from csmserve.models import llama

    m, k = x.shape
    delta = torch.randn(m, k, dtype=x.dtype).to(DEV)
    nw = (torch.rand(k) + 0.5).to(x.dtype).to(DEV)
    if not norm:
        return x, gemv.gemv(x, w, glu, scale), nw
    h_ref, y = llama._add_rms_norm(x, delta, nw, 1e-5)
    h, out = gemv.norm_gemv(x, delta, nw, 1e-5, w, glu, scale)
    assert torch.equal(h, h_ref)
    return y, out, nw


@run
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k,glu", [(1536, 1024, False), (1024, 8192, False), (4096, 1024, True), (40, 256, True)])
@pytest.mark.parametrize("norm", [False, True])
def test_fp8_weight_only_gemv_matches_torch(m, n, k, glu, norm):
    """FP8 weights (kernels/gemv.py with scale): scale[o] * x @ w8[o]^T, the activations as they are, gate and up
    each with its own scales; with the fused residual add + RMSNorm too; against models/fp8.py's weight_only_torch."""
    from csmserve.kernels import gemv

    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    torch.manual_seed(0)
    w8, scale = _fp8(2 * n if glu else n, k, seed=n + k)
    x = torch.randn(m, k, dtype=dt).to(DEV)
    if DEV == "cuda":
        assert gemv.applies(x, w8, glu, scale) and not gemv.applies(x, w8, glu)
        assert not gemv.applies(x, w8.to(dt), glu, scale)  # scales with bf16 weights: not this kernel
    y, out, _ = _run(x, w8, glu, scale, norm)
    ref = _reference(y, w8, glu, scale)
    assert out.shape == (m, n) and out.dtype == dt
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@cuda
@pytest.mark.parametrize("batch", [1, 2, 5, 16, 17, 33, 64, 65])
def test_llama_forward_with_fp8_gemv_matches_weight_only_torch(batch):
    """A Llama with FP8 weights (quantize_weights' FP8Linear): through fuse_gemv at 1..gemv.MAX_ROWS rows (the
    weight-only kernels) == the same numbers in torch (FP8Linear.weight_only); past it fuse_gemv leaves FP8Linear's
    own GEMM."""
    from csmserve.kernels import gemv
    from csmserve.models import llama
    from csmserve.models.csm import llama_100m
    from csmserve.models.fp8 import FP8Linear, GEMMS

    torch.manual_seed(0)
    cfg = llama_100m()
    model = llama.Llama(cfg).to("cuda", torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    fp8 = []
    for block in model.layers:
        for parent in (block.self_attn, block.mlp):
            for name in GEMMS:
                if isinstance(getattr(parent, name, None), torch.nn.Linear):
                    setattr(parent, name, FP8Linear(getattr(parent, name).weight))
                    fp8.append(getattr(parent, name))
    x = torch.randn(batch, 1, cfg.dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    outs = {}
    for mode in ("torch", "plain", "gemv"):
        for m in fp8:
            m.weight_only = mode == "torch"
        llama.fuse_gemv(mode == "gemv")
        try:
            outs[mode] = model(x, pos, model.new_kv(batch, 8, torch.bfloat16, "cuda")).float()
        finally:
            llama.fuse_gemv(False)
    for m in fp8:
        m.weight_only = False
    if batch <= gemv.MAX_ROWS:
        torch.testing.assert_close(outs["gemv"], outs["torch"], atol=5e-2, rtol=5e-2)
        assert (outs["gemv"] - outs["torch"]).abs().mean() < 1e-2
        assert not torch.equal(outs["gemv"], outs["plain"])  # not the per-row quantized GEMM
    else:
        assert torch.equal(outs["gemv"], outs["plain"])


@run
@pytest.mark.parametrize("m", [1, 2, 3, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_gather_gemv_equals_the_embedding_then_the_gemv(m, fp8):
    """gather_gemv (the depth step's embedding gathered in the projection's kernel): the same bits as F.embedding
    then gemv, from a codebook's rows of a larger table (a row view, as CSMModel.audio_table gives), the first and
    last rows among them; with FP8 weights too. A wrong row (an index read as another, row 1's offset) fails."""
    from csmserve.kernels import gemv

    if DEV == "cuda":  # past the tensor-core kernel's rows: cuBLAS after the embedding, as before
        assert not gemv.gather_applies(torch.zeros(gemv.MAX_ROWS + 1, dtype=torch.int64, device=DEV),
                                       torch.zeros(128, 2048, dtype=torch.bfloat16, device=DEV), *_gather_w(fp8))
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    torch.manual_seed(m)
    V, K, N = 64, 2048, 1024
    big = torch.randn(3 * V, K, dtype=dt).to(DEV)
    table = big[V:2 * V]  # codebook 1's rows
    w, scale = _gather_w(fp8)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(3)).tolist()
    cases = {1: ([0], [V - 1]), 2: ([5, V - 1], [17, 17]), 3: ([V - 1, 0, 9],), 16: (perm[:15] + [perm[0]],)}[m]
    for idx in cases:
        idx = torch.tensor(idx, dtype=torch.int64).to(DEV)
        if DEV == "cuda":
            assert gemv.gather_applies(idx, table, w, scale)
        out = gemv.gather_gemv(idx, table, w, scale)
        ref = gemv.gemv(F.embedding(idx, table), w, scale=scale)
        assert out.shape == (m, N) and torch.equal(out, ref), idx


def _gather_w(fp8):
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    return _fp8(1024, 2048, seed=7) if fp8 else ((torch.randn(1024, 2048, dtype=dt) * 0.05).to(DEV), None)


@run
@pytest.mark.parametrize("m", [3, 5, 12, 16])
@pytest.mark.parametrize("n,k,glu", [(1536, 1024, False), (1024, 8192, False), (4096, 1024, True), (40, 256, True)])
@pytest.mark.parametrize("fp8", [False, True])
def test_mma_gemv_matches_the_reference(m, n, k, glu, fp8):
    """3-16 rows (_gemv_mma_kernel: the rows as one 16-row tensor-core tile): against F.linear in float32 (bf16
    weights) or weight_only_torch (FP8 weights), with the glu, and rows of a strided view. A row read from the wrong
    place, a mask that let the padding rows in, a scale misapplied or the up tile read as the gate fails; also N = 40
    (a partial column tile). norm_gemv (the fused add + RMSNorm) runs at 1-2 rows only: 3+ rows are refused."""
    from csmserve.kernels import gemv

    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    torch.manual_seed(m + n)
    if fp8:
        w, scale = _fp8(2 * n if glu else n, k, seed=n + k + m)
    else:
        w, scale = (torch.randn(2 * n if glu else n, k, dtype=dt) * 0.05).to(DEV), None
    big = torch.randn(m, 3, k, dtype=dt).to(DEV)
    x = big[:, 1]  # strided rows
    if DEV == "cuda":
        assert gemv.applies(x, w, glu, scale)
    y, out, nw = _run(x, w, glu, scale, False)
    ref = _reference(y, w, glu, scale)
    assert out.shape == (m, n) and out.dtype == dt
    tol = 1e-2 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=1e-2)
    assert not gemv.norm_applies(x, nw, w, glu, scale)
    with pytest.raises(ValueError, match="1-2 rows"):
        gemv.norm_gemv(x, None, nw, 1e-5, w, glu, scale)


@run
@pytest.mark.parametrize("lo,hi", [(3, 16), (5, 12)])
def test_mma_gemv_rows_are_independent_of_the_padding(lo, hi):
    """A row's result does not depend on the rows beside it or their count within the row tile: the tile's products
    for row r read only row r (the same bits for row 0 of 3 rows and of 16)."""
    from csmserve.kernels import gemv

    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    torch.manual_seed(0)
    w = (torch.randn(1024, 2048, dtype=dt) * 0.05).to(DEV)
    x = torch.randn(hi, 2048, dtype=dt).to(DEV)
    a = gemv.gemv(x[:lo], w)
    b = gemv.gemv(x, w)
    assert torch.equal(a, b[:lo])


@run
def test_mma_split_rule():
    """mma_split: split K only where the column blocks alone give < 256 programs, each split >= 2 chunks."""
    from csmserve.kernels import gemv

    assert gemv.mma_split(1024, 8192, 16, 512, most=8) == 4  # depth down: 64 blocks -> 256 programs
    assert gemv.mma_split(2048, 8192, 16, 512, most=8) == 2  # backbone down: 128 -> 256
    assert gemv.mma_split(8192, 1024, 32, 256, most=8) == 1  # gate_up: 256 blocks already
    assert gemv.mma_split(1024, 1024, 16, 512, most=8) == 1  # depth o: a split would hold one chunk
    assert gemv.mma_split(1024, 8192, 16, 512, most=2) == 2
    assert gemv.mma_split(1024, 8192, 16, 512, most=1) == 1


@run
def test_mma_blocks_rule():
    """mma_blocks: the 16-row tile narrows BLOCK_N (64 -> 16) for programs; none past MAX_ROWS, bf16 or e4m3."""
    from csmserve.kernels import gemv

    assert gemv.mma_blocks(16, 1024, 8192) == (16, 512)  # depth down: 64 column blocks, then split 4
    assert gemv.mma_blocks(16, 8192, 2048, glu=True) == (32, 256)  # backbone gate_up: 256 blocks at BLOCK_N 32
    assert gemv.mma_blocks(3, 16384, 2048) == (64, 128)  # 256 blocks at BLOCK_N 64
    assert gemv.mma_blocks(gemv.MAX_ROWS + 1, 1024, 8192) is None
    assert gemv.config(16, 1024, 8192)[2:] == (gemv.MMA_WARPS, gemv.MMA_STAGES)


@run
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("n,k,glu", [(1024, 8192, False), (40, 2048, True)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m", [5, 16])
def test_mma_gemv_split_over_k(split, n, k, glu, fp8, m):
    """The tensor-core kernel split over K (each split's partial sums in a workspace, the column block's last program
    to arrive adds them in a fixed order): == the reference; the same bits on every call, whichever program arrives
    last; the arrival counters back at 0 after each call (a counter left behind would make the next call's sum early
    or never). A sum that took one split twice or dropped one fails the reference check."""
    from csmserve.kernels import gemv

    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    torch.manual_seed(split + n)
    if fp8:
        w, scale = _fp8(2 * n if glu else n, k, seed=n + k + split)
    else:
        w, scale = (torch.randn(2 * n if glu else n, k, dtype=dt) * 0.05).to(DEV), None
    x = torch.randn(m, k, dtype=dt).to(DEV)
    cfg = (16, 256, 4, gemv.MMA_STAGES, split)

    def call(c):
        return gemv.gemv(x, w, glu, scale, cfg=c)

    outs = [call(cfg) for _ in range(3)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    for ws, ctr in gemv._SPLIT_BUFS.values():
        assert int(ctr.abs().sum()) == 0
    assert any(ws.shape == (split, gemv.MMA_TILE, 2 * n) for ws, _ in gemv._SPLIT_BUFS.values())
    ref = _reference(x, w, glu, scale)
    tol = 1e-2 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(outs[0].float(), ref, atol=tol, rtol=1e-2)
    torch.testing.assert_close(outs[0].float(), call(cfg[:4] + (1,)).float(), atol=tol, rtol=1e-2)
    if DEV == "cuda":  # replayed as a graph (the workspace made before the capture): the same bits every replay
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call(cfg)
            with torch.cuda.graph(g, stream=s):
                out = call(cfg)
        torch.cuda.synchronize()
        for _ in range(5):
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, outs[0])
