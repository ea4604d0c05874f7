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


MODES = ["ticketed", "fused", "split"]  # the 1-64-row kernel; row tiles with the shrink per program, or apart


def _mode(kl, monkeypatch, mode: str) -> None:
    monkeypatch.setattr(kl, "TICKET_ROWS", 64 if mode == "ticketed" else 0)
    monkeypatch.setattr(kl, "FUSED_ROWS", 1 << 20 if mode == "fused" else 0)


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
def test_shrink_rounds_like_the_reference(pool):
    from csmserve.kernels import lora as kl
    from csmserve.models.lora import shrink_torch

    model, p = pool
    layer = model.get_submodule("backbone.layers.0.self_attn.qkv_proj").lora
    p.rows = torch.tensor(ROWS["ragged-sorted"], dtype=torch.int32)
    x = _x(len(ROWS["ragged-sorted"]), layer.target.k, 5)
    want = shrink_torch(x, layer)  # [M, S, R]
    got = kl.lora_shrink(x, layer)[:, :, :want.shape[2]]
    live = p.rows >= 0
    _close(got[live], want[live])


SMALL = {"ragged": [-1, 0, 0, 2, 2, 2, -1, 4], "mixed": [3, -1, 1, 0, 3, 1, 4, 2, 2, -1, 0, 1, 3, 4, 4, 0],
         "one": [1], "two": [-1, 4], "none": [-1, -1], "forty": [i % 6 - 1 for i in range(40)]}


@interpreted
@pytest.mark.parametrize("rows", list(SMALL))
@pytest.mark.parametrize("module", ["backbone.layers.0.self_attn.qkv_proj", "decoder.layers.0.mlp.gate_up_proj",
                                    "backbone.layers.1.mlp.down_proj", "projection"])
@pytest.mark.parametrize("piece_k", [512, 32])
def test_ticketed_pieces_split_over_k(pool, monkeypatch, rows, module, piece_k):
    """1-64 rows: shrink pieces (split over K: piece_k 32) then the column blocks that wait for them; run twice (the
    counters reset by the last program), with two positions per row where the rows allow; gate_up as the GLU."""
    from csmserve.kernels import lora as kl

    model, p = pool
    layer = model.get_submodule(module).lora
    monkeypatch.setattr(kl, "PIECE_K", piece_k)
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
