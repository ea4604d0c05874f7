"""kernels/lora.py against the torch reference (models/lora.py) on the CPU, through Triton's interpreter
(TRITON_INTERPRET=1, numpy): ragged segments of rows per adapter (sorted, and not), rows without an adapter, ranks
below the pool's (padding), fused slices (q,k,v; gate,up through the GLU), two positions per row, every mode (one
launch; shrink and expand apart). Skipped without triton (CI) and on CUDA machines (test_lora_gpu.py there)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("CUDA: the GPU tests run the compiled kernels", allow_module_level=True)

from csmserve.models.loader import load_csm  # noqa: E402
from csmserve.models.lora import LoraPool, delta_torch  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_under_the_interpreter's subprocess")


@pytest.mark.skipif(INTERPRETED, reason="already under the interpreter")
def test_kernels_under_the_interpreter():
    """This module again in a subprocess with TRITON_INTERPRET=1 (set before triton is imported)."""
    here = Path(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here)], env=env,
                       cwd=here.parents[2], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]


@pytest.fixture(scope="module")
def pool():
    model, cfg, _ = load_csm("dummy-tiny")
    p = LoraPool(model, max_loras=5, max_rank=32)
    g = torch.Generator().manual_seed(0)
    ranks = [4, 32, 16, 8, 32]  # padding below the pool's 32
    for slot, r in enumerate(ranks):
        p.weights[slot, :r] = torch.randn(r, p.layout.width, generator=g) * 0.3
        p.ranks[slot] = r
    return model, p


ROWS = {  # each batch row's adapter slot
    "ragged-sorted": [-1, -1, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 4, 4, -1, -1],
    "unsorted": [3, -1, 1, 1, 0, -1, 4, 1, 2, 0, 3, 3, -1, 4, 2, 2, 1, 0],
    "none": [-1] * 5,
    "one": [2],
}


# the ticketed kernel (1-256 rows, 16-row tiles; split by adapter over ADAPTER_SPLIT // tiles, or not), and the
# shrink and expand apart (past 256; "wide": the shrink's row tiles of 2 x SHRINK_ROWS, as from SHRINK_WIDE_FROM, and
# its pieces capped at 2 a K: K = 128 in 2 of 64)
MODES = ["ticketed", "ticketed unsplit", "split", "split wide"]


def _mode(kl, monkeypatch, mode: str) -> None:
    monkeypatch.setattr(kl, "TICKET_ROWS", 256 if mode.startswith("ticketed") else 0)
    if mode == "ticketed unsplit":
        monkeypatch.setattr(kl, "ADAPTER_SPLIT", 1)
    monkeypatch.setattr(kl, "SHRINK_WIDE_FROM", 1 if mode == "split wide" else 1 << 30)
    monkeypatch.setattr(kl, "SHRINK_PIECE", 32)  # dummy-tiny's K of 64 and 128 in 2 and 4 pieces
    monkeypatch.setattr(kl, "SHRINK_PIECES", 2 if mode == "split wide" else 8)


def test_shrink_piece(monkeypatch):
    from csmserve.kernels import lora as kl

    monkeypatch.setattr(kl, "SHRINK_PIECE", 256)
    monkeypatch.setattr(kl, "SHRINK_PIECES", 8)
    assert [kl.shrink_piece(k) for k in (8192, 2048, 1024, 256, 100, 3072)] == [1024, 256, 256, 256, 100, 512]


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
    assert err < 1e-5, f"relative error {err:.2e}"


@interpreted
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("module", ["backbone.layers.0.self_attn.qkv_proj", "decoder.layers.1.self_attn.qkv_proj",
                                    "backbone.layers.1.mlp.down_proj", "projection"])
@pytest.mark.parametrize("per", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_lora_add(pool, monkeypatch, rows, module, per, mode):
    from csmserve.kernels import lora as kl

    model, p = pool
    layer = model.get_submodule(module).lora
    p.rows = torch.tensor(ROWS[rows], dtype=torch.int32)
    m = len(ROWS[rows]) * per
    x = _x(m, layer.target.k, 1)
    y0 = _x(m, layer.target.n, 2)
    want = y0 + delta_torch(x, layer)
    _mode(kl, monkeypatch, mode)
    got = kl.lora_add_(x, y0.clone(), layer)
    _close(got, want)
    untouched = torch.tensor(ROWS[rows]).repeat_interleave(per) < 0
    assert torch.equal(got[untouched], y0[untouched])  # rows without an adapter: not written


@interpreted
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("module", ["backbone.layers.0.mlp.gate_up_proj", "decoder.layers.0.mlp.gate_up_proj"])
@pytest.mark.parametrize("mode", MODES)
def test_lora_glu(pool, monkeypatch, rows, module, mode):
    from csmserve.kernels import lora as kl

    model, p = pool
    layer = model.get_submodule(module).lora
    p.rows = torch.tensor(ROWS[rows], dtype=torch.int32)
    m = len(ROWS[rows])
    x = _x(m, layer.target.k, 3)
    gu = _x(m, layer.target.n, 4)
    g, u = (gu + delta_torch(x, layer)).chunk(2, -1)
    _mode(kl, monkeypatch, mode)
    _close(kl.lora_glu(gu, x, layer), F.silu(g) * u)


@interpreted
@pytest.mark.parametrize("rows", ["ragged-sorted", "unsorted", "none"])
@pytest.mark.parametrize("block", ["backbone.layers.0", "decoder.layers.1"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bn", [None, 16])
def test_glu_shrinks_the_down(pool, monkeypatch, rows, block, mode, bn):
    """The GLU makes the down's shrink of its h (a piece a column group past TICKET_ROWS, a column block up to it;
    bn 16: several): the down's lora_add_ of that h takes those pieces and matches the reference; of another x
    (h's values, another tensor) it shrinks that x."""
    from csmserve.kernels import lora as kl

    model, p = pool
    gate_up, down = (model.get_submodule(f"{block}.mlp.{name}").lora for name in ("gate_up_proj", "down_proj"))
    assert gate_up.down is down
    p.rows = torch.tensor(ROWS[rows], dtype=torch.int32)
    m = len(ROWS[rows])
    x, gu, y0 = _x(m, gate_up.target.k, 5), _x(m, gate_up.target.n, 6), _x(m, down.target.n, 7)
    _mode(kl, monkeypatch, mode)
    if bn is not None:
        monkeypatch.setattr(kl, "col_block", lambda lora, n: bn)
    taken, shrunk = [], kl._shrunk
    monkeypatch.setattr(kl, "_shrunk", lambda x, lora: taken.append(shrunk(x, lora)) or taken[-1])
    h = kl.lora_glu(gu, x, gate_up)
    _close(kl.lora_add_(h, y0.clone(), down), y0 + delta_torch(h, down))
    assert taken[-1] is not None and down.shrunk is None
    other = h.clone()
    _close(kl.lora_add_(other, y0.clone(), down), y0 + delta_torch(other, down))
    assert taken[-1] is None


@interpreted
def test_shrink_rounds_like_the_reference(pool, monkeypatch):
    from csmserve.kernels import lora as kl
    from csmserve.models.lora import shrink_torch

    monkeypatch.setattr(kl, "SHRINK_PIECE", 32)  # K = 64: two pieces

    model, p = pool
    layer = model.get_submodule("backbone.layers.0.self_attn.qkv_proj").lora
    p.rows = torch.tensor(ROWS["ragged-sorted"], dtype=torch.int32)
    x = _x(len(ROWS["ragged-sorted"]), layer.target.k, 5)
    want = shrink_torch(x, layer)  # [M, S, R]
    pieces = kl.lora_shrink(x, layer)  # [KS, M, S, RB] float32
    assert pieces.shape[0] == layer.target.k // kl.shrink_piece(layer.target.k)
    got = pieces.sum(0).to(x.dtype)[:, :, :want.shape[2]]
    live = p.rows >= 0
    _close(got[live], want[live])


SMALL = {"ragged": [-1, 0, 0, 2, 2, 2, -1, 4], "mixed": [3, -1, 1, 0, 3, 1, 4, 2, 2, -1, 0, 1, 3, 4, 4, 0],
         "one": [1], "two": [-1, 4], "none": [-1, -1], "forty": [i % 6 - 1 for i in range(40)]}


@interpreted
@pytest.mark.parametrize("rows", list(SMALL))
@pytest.mark.parametrize("module", ["backbone.layers.0.self_attn.qkv_proj", "decoder.layers.0.mlp.gate_up_proj",
                                    "backbone.layers.1.mlp.down_proj", "projection"])
@pytest.mark.parametrize("piece_k", [512, 32])
@pytest.mark.parametrize("split", [1, 3])
def test_ticketed_pieces_split_over_k(pool, monkeypatch, rows, module, piece_k, split):
    """1-64 rows: shrink pieces (split over K: piece_k 32) then the column blocks that wait for them; run twice (the
    counters reset by the last program), with two positions per row where the rows allow; gate_up as the GLU. split:
    each piece and column block in 3 programs by adapter (ADAPTER_SPLIT; 5 slots: two programs walk two each)."""
    from csmserve.kernels import lora as kl

    model, p = pool
    layer = model.get_submodule(module).lora
    monkeypatch.setattr(kl, "PIECE_K", piece_k)
    monkeypatch.setattr(kl, "ADAPTER_SPLIT", split)
    _mode(kl, monkeypatch, "ticketed")
    layer._scratch = None
    for per in (1, 2) if len(SMALL[rows]) <= 8 else (1,):
        p.rows = torch.tensor(SMALL[rows], dtype=torch.int32)
        m = len(SMALL[rows]) * per
        x = _x(m, layer.target.k, 6)
        y0 = _x(m, layer.target.n, 7)
        want = y0 + delta_torch(x, layer)
        for _ in range(2):
            if "gate_up" in module:
                g, u = want.chunk(2, -1)
                _close(kl.lora_glu(y0, x, layer), F.silu(g) * u)
            else:
                _close(kl.lora_add_(x, y0.clone(), layer), want)
            assert layer._scratch[1].tolist() == [0, 0, 0, 0]


@pytest.fixture(scope="module")
def many():
    """A pool of 40 slots: a tile of 16 rows holds 16 adapters, so ADAPTER_SPLIT's programs each take one or two."""
    model, cfg, _ = load_csm("dummy-tiny")
    p = LoraPool(model, max_loras=40, max_rank=16)
    g = torch.Generator().manual_seed(2)
    for slot in range(40):
        r = (16, 4, 8)[slot % 3]
        p.weights[slot, :r] = torch.randn(r, p.layout.width, generator=g) * 0.3
        p.ranks[slot] = r
    return model, p


MANY = {"32 rows": [i - 1 for i in range(32)], "64 rows": sorted(i % 41 - 1 for i in range(64))}


@interpreted
@pytest.mark.parametrize("rows", list(MANY))
@pytest.mark.parametrize("module", ["backbone.layers.0.self_attn.qkv_proj", "decoder.layers.0.mlp.gate_up_proj"])
def test_ticketed_many_adapters(many, monkeypatch, rows, module):
    """32 and 64 rows over up to 40 adapters: split by adapter over ADAPTER_SPLIT 32 (16 programs a piece and column
    block at 2 tiles, 8 at 4) == unsplit == the reference."""
    from csmserve.kernels import lora as kl

    model, p = many
    layer = model.get_submodule(module).lora
    _mode(kl, monkeypatch, "ticketed")
    p.rows = torch.tensor(MANY[rows], dtype=torch.int32)
    m = len(MANY[rows])
    x, y0 = _x(m, layer.target.k, 8), _x(m, layer.target.n, 9)
    want = y0 + delta_torch(x, layer)
    got = {}
    for split in (32, 1):
        monkeypatch.setattr(kl, "ADAPTER_SPLIT", split)
        assert kl.adapter_programs(layer, m) == {32: {32: 16, 64: 8}[m], 1: 1}[split]  # 2 tiles: 16 programs, 4: 8
        if "gate_up" in module:
            g, u = want.chunk(2, -1)
            got[split] = kl.lora_glu(y0, x, layer)
            _close(got[split], F.silu(g) * u)
        else:
            got[split] = kl.lora_add_(x, y0.clone(), layer)
            _close(got[split], want)
    assert torch.equal(got[32], got[1])  # each row's pieces summed in one order, whichever program walks it


# ---- the LoRA inside kernels/gemv.py (1-16 rows): a model of dims >= 128 (the GEMV's smallest K)

@pytest.fixture(scope="module")
def wide():
    from csmserve.models.csm import CSMConfig
    from csmserve.models.llama import LlamaConfig
    from csmserve.models.loader import empty_model, init_dummy

    c = LlamaConfig(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, intermediate=256)
    model = empty_model(CSMConfig(backbone=c, decoder=c, text_vocab_size=258, audio_vocab_size=64, num_codebooks=4),
                        "cpu", torch.float32)
    init_dummy(model)
    p = LoraPool(model, max_loras=4, max_rank=16)
    g = torch.Generator().manual_seed(1)
    for slot, r in enumerate([16, 4, 8, 16]):
        p.weights[slot, :r] = torch.randn(r, p.layout.width, generator=g) * 0.2
        p.ranks[slot] = r
    return model, p


GEMV_ROWS = {1: [[2]], 2: [[-1, 1]], 3: [[1, -1, 1]], 16: [[i % 5 - 1 for i in range(16)]]}


def _gemv_cases():
    for m, rows_list in GEMV_ROWS.items():
        for rows in rows_list:
            yield m, rows, 1
    yield 4, [1, -1], 2  # the depth decoder's first step: two positions per row


@interpreted
@pytest.mark.parametrize("m, rows, per", list(_gemv_cases()))
@pytest.mark.parametrize("module, glu", [("backbone.layers.0.self_attn.qkv_proj", False),
                                         ("backbone.layers.0.mlp.gate_up_proj", True),
                                         ("decoder.layers.0.mlp.down_proj", False), ("projection", False)])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_with_lora(wide, monkeypatch, m, rows, per, module, glu, split):
    """gemv(x, w, lora=...) == F.linear + the torch delta (glu: silu(gate + dg) * (up + du)), the shrink pieces split
    over K (PIECE_K 64) and (split 3) over adapters, twice in a row (the counters reset)."""
    from csmserve.kernels import gemv
    from csmserve.kernels import lora as kl

    model, p = wide
    monkeypatch.setattr(kl, "PIECE_K", 64)
    monkeypatch.setattr(kl, "ADAPTER_SPLIT", split)
    mod = model.get_submodule(module)
    layer = mod.lora
    layer._scratch = None
    p.rows = torch.tensor(rows)
    x = _x(len(rows) * per, layer.target.k, 8)
    want = F.linear(x, mod.weight) + delta_torch(x, layer)
    if glu:
        g, u = want.chunk(2, -1)
        want = F.silu(g) * u
    for _ in range(2):
        _close(gemv.gemv(x, mod.weight, glu=glu, lora=layer), want)
    assert layer._scratch[1].tolist() == [0, 0, 0, 0]


@interpreted
@pytest.mark.parametrize("rows", [[1], [-1, 2], [3, 0]])
@pytest.mark.parametrize("module, glu", [("backbone.layers.0.self_attn.qkv_proj", False),
                                         ("decoder.layers.0.mlp.gate_up_proj", True)])
@pytest.mark.parametrize("split", [1, 2])
def test_norm_gemv_with_lora(wide, monkeypatch, rows, module, glu, split):
    """The block's residual add + RMSNorm and the GEMV in one kernel, the pieces normalising x + delta themselves
    (split 2: the pieces over adapters too, each normalising its own rows)."""
    from csmserve.kernels import gemv
    from csmserve.kernels import lora as kl
    from csmserve.models.llama import _add_rms_norm

    model, p = wide
    monkeypatch.setattr(kl, "PIECE_K", 64)
    monkeypatch.setattr(kl, "ADAPTER_SPLIT", split)
    mod = model.get_submodule(module)
    layer = mod.lora
    p.rows = torch.tensor(rows)
    x, d = _x(len(rows), 128, 9), _x(len(rows), 128, 10)
    nw = 1 + _x(1, 128, 11)[0] * 0.1
    h, y = _add_rms_norm(x, d, nw, 1e-5)
    want = F.linear(y, mod.weight) + delta_torch(y, layer)
    if glu:
        g, u = want.chunk(2, -1)
        want = F.silu(g) * u
    h2, got = gemv.norm_gemv(x, d, nw, 1e-5, mod.weight, glu, lora=layer)
    _close(h2, h)
    _close(got, want)


@interpreted
@pytest.mark.parametrize("idx, rows", [([5], [2]), ([7, 1], [1, -1]), ([3, 3, 9, 0, 2], [0, 1, 2, 3, -1])])
def test_gather_gemv_with_lora(wide, idx, rows):
    """The depth step's embedding gathered in the projection's GEMV, its LoRA's pieces gathering the same rows."""
    from csmserve.kernels import gemv

    model, p = wide
    mod = model.projection
    p.rows = torch.tensor(rows)
    table = _x(12, 128, 12)
    idx = torch.tensor(idx)
    x = table[idx]
    _close(gemv.gather_gemv(idx, table, mod.weight, lora=mod.lora), F.linear(x, mod.weight) + delta_torch(x, mod.lora))


@interpreted
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("glu", [False, True])
def test_gemv_without_lora_unchanged(wide, m, glu):
    """The GEMV kernels restructured around the LoRA (a program's columns in a helper, row 1's masks as vectors)
    still compute the plain GEMM, the norm and the GLU."""
    from csmserve.kernels import gemv
    from csmserve.models.llama import _add_rms_norm

    model, p = wide
    p.rows = None
    name = "backbone.layers.0.mlp.gate_up_proj" if glu else "backbone.layers.0.self_attn.qkv_proj"
    w = model.get_submodule(name).weight
    x = _x(m, 128, 13)
    want = F.linear(x, w)
    if glu:
        g, u = want.chunk(2, -1)
        want = F.silu(g) * u
    _close(gemv.gemv(x, w, glu), want)
    if m <= gemv.ELEMENTWISE_ROWS:
        d, nw = _x(m, 128, 14), 1 + _x(1, 128, 15)[0] * 0.1
        h, y = _add_rms_norm(x, d, nw, 1e-5)
        want = F.linear(y, w)
        if glu:
            g, u = want.chunk(2, -1)
            want = F.silu(g) * u
        h2, got = gemv.norm_gemv(x, d, nw, 1e-5, w, glu)
        _close(h2, h)
        _close(got, want)
