"""Speculation's Triton kernels (kernels/speculate.py, kernels/heads.py) against the torch reference
(engine/speculate.py) on the CPU, through Triton's interpreter (TRITON_INTERPRET=1, numpy).

Skipped without triton (CI) and on CUDA machines (tests/engine/test_speculate_gpu.py covers the
compiled kernels there). Each kernel is compared on the same inputs, then a whole frame's depth
decoder with the Triton path (use_triton=True) against the torch path, on a tiny model whose
head_dim < 16 keeps the depth KV on the torch attention: the Triton path's KV positions must reach
it unclamped (it once wrote every position past K-1 at K-1, over the real position K-1's keys).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("CUDA: the GPU tests run the compiled kernels", allow_module_level=True)

from csmserve.engine.speculate import DRAW_DRAFT, RowParams, Speculator, _Frame, gumbel  # noqa: E402
from csmserve.models.sampler import GREEDY_BELOW, hash_uniform_at, sample_torch, sampling_logits  # noqa: E402

from test_speculate import tiny_model  # noqa: E402  (same folder: the CPU tests' tiny models)

# triton.language's own @jit helpers (tl.min, tl.argmax, ...) are interpreted only if TRITON_INTERPRET=1
# was set before triton was first imported: without it, this module's tests run in a fresh interpreter
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_under_the_interpreter's subprocess")


@pytest.mark.skipif(INTERPRETED, reason="already under the interpreter")
def test_kernels_under_the_interpreter():
    """This module again in a subprocess with TRITON_INTERPRET=1."""
    here = Path(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here)], env=env,
                       cwd=here.parents[2], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]


@pytest.fixture(scope="module")
def kernels():
    from csmserve.kernels import speculate

    return speculate


PARAMS = [(1.0, 0, 1.0), (0.8, 20, 0.9)]  # temperature, top_k, top_p (every 5th row greedy)


def params_for(B: int, prm: tuple, big_seed: bool = False) -> RowParams:
    t = torch.full((B,), prm[0])
    t[::5] = 0
    seed = torch.arange(B) * 31 + 7 + ((1 << 40) if big_seed else 0)  # big: the seed's high word matters
    return RowParams(t, torch.full((B,), prm[1]), torch.full((B,), prm[2]), seed, torch.full((B,), 5))


@interpreted
@pytest.mark.parametrize("prm", PARAMS)
def test_spec_probs_equals_reference(kernels, prm):
    """Drafts: q, the argmax and the draw-1 Gumbel sample of each row's own codebook."""
    torch.manual_seed(0)
    B, k, n, K = 12, 3, 40, 8
    params = params_for(B, prm, big_seed=True)
    logits = (torch.randn(B * k, n + 7) * 2)[:, :n]  # a row stride != n, as the head's padded logits
    cb = (torch.randint(1, K, (B,))[:, None] + 1 + torch.arange(k)).flatten()
    probs, top = torch.empty(B * k, n), torch.empty(B * k, dtype=torch.long)
    code = torch.empty(B * k, dtype=torch.long)
    kernels.spec_probs(logits, *params.fields(), per=k, probs=probs, top=top, codebook=cb, code=code,
                       draw=DRAW_DRAFT)
    rep = params.repeat(k)
    xq = sampling_logits(logits, *rep)
    noise = hash_uniform_at(params.seed, params.frame, cb.view(B, k), n, DRAW_DRAFT).view(B * k, n)
    ref_code = torch.where(rep[0] >= GREEDY_BELOW, (xq + gumbel(noise)).argmax(-1), logits.argmax(-1))
    torch.testing.assert_close(probs, xq.softmax(-1), rtol=0, atol=1e-6)
    assert torch.equal(top, logits.argmax(-1))
    assert torch.equal(code, ref_code)


@interpreted
@pytest.mark.parametrize("prm", PARAMS)
def test_spec_verify_equals_reference(kernels, prm):
    """Accept tests, residual / bonus resample, commit, counts and the next drafts' indices, rows at
    every m (finished ones included)."""
    K, V, k, B = 12, 64, 4, 16
    spec = Speculator(tiny_model(K, V), k, B)
    n = spec.n
    torch.manual_seed(1)
    params = params_for(B, prm)
    m = torch.randint(1, K, (B,))
    m[:2], m[2:4] = K - 1, K - 2
    codes, draft = torch.randint(0, n, (B, K + k + 1)), torch.randint(0, n, (B, k))
    q = torch.rand(B, k, n) ** 4
    q /= q.sum(-1, keepdim=True)
    logits = torch.randn(B, k + 1, n) * 1.5
    logits[:, :k].scatter_add_(-1, draft[..., None], 3.0 * (torch.rand(B, k, 1) < 0.6))  # accepts, often
    logits = logits.view(B * (k + 1), n)
    ref, got = (_Frame(codes.clone(), m.clone(), m >= K - 1, draft.clone(), q.clone()) for _ in range(2))
    pos = m[:, None] + torch.arange(k + 1) + 1
    j_ref = spec._verify_torch(ref, params, pos, logits)
    counts_ref = spec.counts.clone()
    spec.counts.zero_()
    p, top = torch.empty(B * (k + 1), n), torch.empty(B * (k + 1), dtype=torch.long)
    kernels.spec_probs(logits, *params.fields(), per=k + 1, probs=p, top=top)
    j, dheads, dcb = kernels.spec_verify(p.view(B, k + 1, n), top.view(B, k + 1), got.qprob, got.draft, got.m,
                                         got.done, got.codes, spec.counts, params.temperature, params.seed,
                                         params.frame, K)
    assert j_ref.sum() > 0 and (j_ref < k).any()  # both accepts and rejections
    assert torch.equal(j, j_ref)
    assert torch.equal(got.codes, ref.codes)
    assert torch.equal(got.m, ref.m) and torch.equal(got.done, ref.done)
    assert spec.counts.tolist() == counts_ref.tolist()
    cb = (ref.m[:, None] + 1 + torch.arange(k)).flatten()
    assert torch.equal(dcb, cb) and torch.equal(dheads, cb.clamp(max=K - 1) - 1)


@interpreted
def test_spec_prep_equals_reference(kernels):
    K, V, k, B = 12, 64, 3, 6
    m = torch.tensor([1, 4, K - 4, K - 2, K - 1, K - 1])
    codes, draft = torch.randint(0, V, (B, K + k + 1)), torch.randint(0, V, (B, k))
    emb, wpos, rpos, lengths, heads = kernels.spec_prep(m, codes, draft, K, V)
    cb_in = m[:, None] + torch.arange(k + 1)
    tok = torch.cat([codes.gather(1, m[:, None]), draft], 1)
    pos = cb_in + 1
    assert torch.equal(emb, tok + cb_in.clamp(max=K - 1) * V)
    assert torch.equal(wpos, pos) and torch.equal(rpos, pos.clamp(max=K - 1))
    assert torch.equal(lengths, (pos + 1).flatten().to(torch.int32))
    assert torch.equal(heads, pos.clamp(max=K - 1).flatten() - 1)


@interpreted
@pytest.mark.parametrize("prm", PARAMS[:1])  # the interpreter is slow: the cuts are the kernel tests' part
def test_spec_triton_frame_equals_torch_frame(kernels, prm):
    """A whole frame: the Triton path (prep, heads, probs, verify kernels; torch attention) == the torch
    path, every row, every code (the CPU form of the GPU test test_spec_triton_kernels_match_torch_reference)."""
    model = tiny_model(8, 64, agree=0.2, embed_noise=0.1)
    model.prepare_heads()
    B = 16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, model.cfg.backbone.dim, generator=g)
    params = params_for(B, prm)

    def sampler(logits, cb):
        return sample_torch(logits, params.temperature, params.top_k, params.top_p, params.seed, params.frame, cb)

    out = []
    for use_triton in (True, False):
        spec = Speculator(model, 4, B)
        assert not spec.kv.use_triton  # head_dim 8: the depth KV's torch attention
        spec.use_triton = use_triton
        with torch.inference_mode():
            out.append((spec.decode_frame(h, sampler, params).numpy(), spec.snapshot().read()))
    (a, sa), (b, sb) = out
    np.testing.assert_array_equal(a, b)
    assert sa == sb
    assert sa["accepted"] > 0
