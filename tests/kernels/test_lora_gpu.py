"""GPU (`pytest -m gpu`): kernels/lora.py on CSM-1B's shapes (bf16) against the torch reference (models/lora.py): every
mode (the ticketed kernel in 16-row tiles, split by adapter or not; the shrink and expand apart), ragged and mixed
rows with rows without an adapter, ranks below the pool's; the same bits every run; inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODULES = ["backbone.layers.0.self_attn.qkv_proj", "backbone.layers.3.self_attn.o_proj",
           "backbone.layers.5.mlp.gate_up_proj", "backbone.layers.7.mlp.down_proj",
           "decoder.layers.1.self_attn.qkv_proj", "decoder.layers.2.mlp.gate_up_proj",
           "decoder.layers.3.mlp.down_proj", "projection"]


@pytest.fixture(scope="module")
def pool():
    yield from _pool([16, 64, 16, 8, 32, 16, 64, 16], seed=0)


def _pool(ranks: list[int], seed: int):
    """The dummy model with a pool of len(ranks) slots of random LoRA weights (max rank: the largest)."""
    from csmserve.models.loader import load_csm
    from csmserve.models.lora import LoraPool

    model, cfg, _ = load_csm("dummy", "cuda", torch.bfloat16)
    p = LoraPool(model, max_loras=len(ranks), max_rank=max(ranks))
    g = torch.Generator(device="cuda").manual_seed(seed)
    for slot, r in enumerate(ranks):
        p.weights[slot, :r] = (torch.randn(r, p.layout.width, generator=g, device="cuda") * 0.02).bfloat16()
        p.ranks[slot] = r
    yield model, p
    p.rows = None


def rows_of(m: int, kind: str) -> torch.Tensor:
    if kind == "sorted":  # ragged runs, rows without an adapter first (the scheduler's order)
        r = torch.sort(torch.randint(-1, 8, (m,), generator=torch.Generator().manual_seed(m))).values
    else:
        r = torch.randint(-1, 8, (m,), generator=torch.Generator().manual_seed(m + 1))
    return r.to(torch.int32).cuda()


def _half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half a bf16 step at each value of v (fp32): what rounding the sum y0 + delta to bf16 may move it by."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=1e-30))) - 8)


def _delta_err(got, y0, delta) -> float:
    """got (bf16) against y0 + delta (fp32, unrounded), relative to the delta's largest value: the error beyond
    the one rounding of the sum to bf16 (at |y| ~ 4 half a step is ~2% of these deltas' largest)."""
    want = y0.float() + delta.float()
    over = ((got.float() - want).abs() - _half_ulp(want)).clamp(min=0)
    return (over.max() / delta.float().abs().max().clamp(min=1e-6)).item()


def _apply(kl, module: str, layer, x, y0, delta) -> tuple[torch.Tensor, float]:
    """kernels/lora.py's y0 + the rows' deltas of x (gate_up: the GLU of it), and its error against the reference
    (delta: the torch path's, fp32)."""
    if "gate_up" in module:
        got = kl.lora_glu(y0, x, layer)
        a, b = (y0.float() + delta).bfloat16().float().chunk(2, -1)
        want = F.silu(a) * b
        return got, ((got.float() - want).abs().max() / want.abs().max()).item()
    got = kl.lora_add_(x, y0.clone(), layer)
    return got, _delta_err(got, y0, delta)


@cuda
@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("m, kind", [(1, "sorted"), (2, "mixed"), (7, "mixed"), (16, "sorted"), (40, "mixed"),
                                     (64, "sorted"), (200, "sorted"), (2048, "sorted"), (300, "mixed")])
def test_lora_matches_reference(pool, monkeypatch, module, m, kind):
    from csmserve.kernels import lora as kl
    from csmserve.models.lora import delta_torch

    model, p = pool
    layer = model.get_submodule(module).lora
    p.rows = rows_of(m, kind)
    t = layer.target
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, t.k, generator=g, device="cuda").bfloat16()
    y0 = torch.randn(m, t.n, generator=g, device="cuda").bfloat16()
    delta = delta_torch(x, layer).float()  # [m, n]
    # by adapter: ADAPTER_SPLIT 8; split: the shrink and expand apart (the path past TICKET_ROWS); the ticketed
    # kernel at every m here (its 16-row tiles at 2,048 too)
    bits = {}
    for mode in ["ticketed", "by adapter", "split"]:
        monkeypatch.setattr(kl, "TICKET_ROWS", 0 if mode == "split" else 2048)
        monkeypatch.setattr(kl, "ADAPTER_SPLIT", 8 if mode == "by adapter" else 1)
        got, err = _apply(kl, module, layer, x, y0, delta)
        if "gate_up" not in module:
            none = (p.rows < 0).repeat_interleave(m // len(p.rows))
            assert torch.equal(got[none], y0[none]), mode  # rows without an adapter untouched
        assert err < 2e-2, f"{mode}: relative error {err:.2e}"
        again = _apply(kl, module, layer, x, y0, delta)[0]
        assert torch.equal(again, got), f"{mode}: not the same bits twice"
        bits[mode] = got
    # each row's pieces summed in the same order, whichever program walks its adapter
    assert torch.equal(bits["by adapter"], bits["ticketed"])


@pytest.fixture(scope="module")
def many():
    """64 rank-16 slots (the pool above has 8: ADAPTER_SPLIT's programs past 8 a tile are run here)."""
    yield from _pool([16] * 64, seed=1)


@cuda
@pytest.mark.parametrize("module", MODULES[:4])
@pytest.mark.parametrize("m", [32, 64, 200])
def test_lora_many_adapters(many, monkeypatch, module, m):
    """m rows over 64 adapters in runs (~16 a tile at 64 rows): split by adapter (ADAPTER_SPLIT 32: 16
    programs a piece and column block at 32 rows, 8 at 64) == unsplit, same bits; against the reference."""
    from csmserve.kernels import lora as kl
    from csmserve.models.lora import delta_torch

    model, p = many
    layer = model.get_submodule(module).lora
    i = torch.arange(m, device="cuda")
    p.rows = torch.where(i % 9 == 0, -1, i * 64 // m).to(torch.int32)  # runs of each adapter, a few rows without one
    t = layer.target
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, t.k, generator=g, device="cuda").bfloat16()
    y0 = torch.randn(m, t.n, generator=g, device="cuda").bfloat16()
    delta = delta_torch(x, layer).float()
    bits = {}
    for split in (32, 1):
        monkeypatch.setattr(kl, "ADAPTER_SPLIT", split)
        bits[split], err = _apply(kl, module, layer, x, y0, delta)
        assert err < 2e-2, f"split {split}: relative error {err:.2e}"
    assert torch.equal(bits[32], bits[1])


@cuda
@pytest.mark.parametrize("block", ["backbone.layers.5", "decoder.layers.2"])
@pytest.mark.parametrize("m, kind", [(40, "mixed"), (200, "sorted"), (300, "mixed"), (512, "sorted"),
                                     (2048, "sorted")])
def test_glu_shrinks_the_down(pool, monkeypatch, block, m, kind):
    """The GLU makes the down's shrink of h (a piece a column block up to TICKET_ROWS, a column group past it): the
    down's lora_add_ of that h takes it and matches the reference, the same bits twice, close to the down's own
    shrink of a copy."""
    from csmserve.kernels import lora as kl
    from csmserve.models.lora import delta_torch

    model, p = pool
    gate_up, down = (model.get_submodule(f"{block}.mlp.{name}").lora for name in ("gate_up_proj", "down_proj"))
    p.rows = rows_of(m, kind)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, gate_up.target.k, generator=g, device="cuda").bfloat16()
    gu = torch.randn(m, gate_up.target.n, generator=g, device="cuda").bfloat16()
    y0 = torch.randn(m, down.target.n, generator=g, device="cuda").bfloat16()
    taken, shrunk = [], kl._shrunk
    monkeypatch.setattr(kl, "_shrunk", lambda x, lora: taken.append(shrunk(x, lora)) or taken[-1])
    h = kl.lora_glu(gu, x, gate_up)
    delta = delta_torch(h, down).float()
    got = kl.lora_add_(h, y0.clone(), down)
    assert taken[-1] is not None
    assert _delta_err(got, y0, delta) < 2e-2
    assert torch.equal(kl.lora_add_(kl.lora_glu(gu, x, gate_up), y0.clone(), down), got)
    own = kl.lora_add_(h.clone(), y0.clone(), down)
    assert taken[-1] is None
    assert _delta_err(own, y0, delta) < 2e-2
    if m in (200, 512):  # captured: the pieces made and taken inside the capture (the graph's pool), replayed
        y = y0.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kl.lora_add_(kl.lora_glu(gu, x, gate_up), y.copy_(y0), down)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, got) and down.shrunk is None


@cuda
@pytest.mark.parametrize("m", [1, 16, 64, 200, 512])  # 200: the ticketed kernel in 13 row tiles
def test_lora_in_a_cuda_graph(pool, m):
    """Captured once, replayed with other rows' adapters written into the same buffer: equal to eager each time (the
    ticketed kernel's counters reset by its last program)."""
    from csmserve.kernels import lora as kl

    model, p = pool
    layer = model.get_submodule("backbone.layers.2.self_attn.qkv_proj").lora
    rows = rows_of(m, "mixed")
    p.rows = rows
    x = torch.randn(m, layer.target.k, device="cuda").bfloat16()
    y = torch.zeros(m, layer.target.n, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        kl.lora_add_(x, y.zero_(), layer)  # warm up: compiled, scratch made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kl.lora_add_(x, y.zero_(), layer)
    for seed in range(3):
        rows.copy_(rows_of(m, "sorted" if seed % 2 else "mixed").roll(seed))
        graph.replay()
        eager = kl.lora_add_(x, torch.zeros_like(y), layer)
        torch.cuda.synchronize()
        assert torch.equal(y, eager)


@cuda
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("module, kind", [("backbone.layers.0.self_attn.qkv_proj", "norm"),
                                          ("backbone.layers.1.self_attn.o_proj", "plain"),
                                          ("backbone.layers.2.mlp.gate_up_proj", "norm-glu"),
                                          ("backbone.layers.3.mlp.down_proj", "plain"),
                                          ("decoder.layers.0.self_attn.qkv_proj", "norm"),
                                          ("decoder.layers.3.mlp.gate_up_proj", "glu"),
                                          ("decoder.layers.1.mlp.down_proj", "plain"),
                                          ("projection", "gather")])
def test_gemv_with_lora_matches_reference(pool, m, kind, module):
    """The LoRA inside kernels/gemv.py (1-16 rows: its shrink pieces in the GEMV's grid, the deltas before the store
    and the GLU) == F.linear + the torch delta, with the norm (1-2 rows) and the gather; twice the same bits."""
    from csmserve.kernels import gemv
    from csmserve.models.llama import _add_rms_norm
    from csmserve.models.lora import delta_torch

    model, p = pool
    mod = model.get_submodule(module)
    layer, w = mod.lora, mod.weight
    glu = "glu" in kind
    norm = kind.startswith("norm") and m <= gemv.ELEMENTWISE_ROWS
    p.rows = rows_of(m, "mixed")
    g = torch.Generator(device="cuda").manual_seed(m)
    k = layer.target.k
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    assert gemv.applies(x, w, glu, None, layer)
    if kind == "gather":
        table = torch.randn(64, k, generator=g, device="cuda").bfloat16()
        idx = torch.randint(0, 64, (m,), generator=g, device="cuda")
        x = table[idx]
        run = lambda: gemv.gather_gemv(idx, table, w, lora=layer)  # noqa: E731
    elif norm:
        d = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        nw = (1 + 0.1 * torch.randn(k, generator=g, device="cuda")).bfloat16()
        run = lambda x=x: gemv.norm_gemv(x, d, nw, 1e-5, w, glu, lora=layer)[1]  # noqa: E731 (x: the un-normed)
        x = _add_rms_norm(x, d, nw, 1e-5)[1]
    else:
        run = lambda: gemv.gemv(x, w, glu, lora=layer)  # noqa: E731
    ref = F.linear(x.float(), w.float()) + delta_torch(x, layer).float()
    if glu:
        a, b = ref.chunk(2, -1)
        ref = F.silu(a) * b
    got = run()
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, f"relative error {err:.2e}"
    assert torch.equal(run(), got)
    assert layer.scratch(layer._scratch[0].shape[2])[1].tolist() == [0, 0, 0, 0]  # counters reset
