"""Draft/verify over codebooks (engine/speculate.py, EngineConfig.spec_depth), on the CPU in float32.

Speculation off is today's engine bit for bit; greedy codes with speculation equal greedy codes
without, for every k; sampled codes have the plain sampler's distribution (chi-square against the
exact distribution of a tiny model's frame, enumerated, and two wrong rules fail the same bound);
a seeded request gives the same codes alone and in a batch of 16.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from csmserve.config import EngineConfig
from csmserve.engine.engine import Engine
from csmserve.engine.request import Request
from csmserve.sampling import SamplingParams
from csmserve.engine.runner import ModelRunner
from csmserve.models.sampler import hash_uniform, hash_uniform_at, sample, sampling_logits
from csmserve.engine.speculate import RowParams, Speculator
from csmserve.models.csm import CSMConfig, CSMModel
from csmserve.models.llama import LlamaConfig
from csmserve.models.loader import load_csm


@pytest.fixture(scope="module")
def dummy_tiny():
    return load_csm("dummy-tiny")[0]


def tiny_model(K: int, V: int, agree: float | None = None, embed_noise: float = 0.2, seed: int = 0) -> CSMModel:
    """A small random CSM. agree=None: random heads (drafts accepted ~25% of the time); a float: every
    code embeds near one vector and the heads are one matrix plus `agree` noise, so the depth decoder's
    hidden states and heads barely differ between positions and most drafts are accepted."""
    torch.manual_seed(seed)
    bb = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=64)
    dd = LlamaConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, intermediate=32, max_seq_len=K)
    m = CSMModel(CSMConfig(backbone=bb, decoder=dd, text_vocab_size=16, audio_vocab_size=V, num_codebooks=K))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.5)
        base = torch.randn(16, V) * 0.8
        m.audio_head.copy_(base + (0.3 if agree is None else agree) * torch.randn(K - 1, 16, V))
        if agree is not None:
            w = m.audio_embeddings.weight
            w.copy_(w[:1] + embed_noise * torch.randn_like(w))
    return m.eval()


def row_params(B: int, temperature: float, top_k: int, top_p: float) -> RowParams:
    return RowParams(torch.full((B,), temperature), torch.full((B,), top_k, dtype=torch.long),
                     torch.full((B,), top_p), torch.arange(B, dtype=torch.long) * 7919 + 11,
                     torch.full((B,), 3, dtype=torch.long))


def plain_sampler(prm: RowParams):
    return lambda logits, cb: sample(logits, prm.temperature, prm.top_k, prm.top_p, prm.seed, prm.frame, cb)


# ---------------------------------------------------------------- speculation off: today's engine
def _hash_before_draws(seed, frame, codebook, vocab):  # models/sampler.py at a54a017, verbatim
    M32 = 0xFFFFFFFF

    def mix(x):
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & M32
        x = x ^ (x >> 15)
        x = (x * 0x5BD1E995) & M32
        return x ^ (x >> 16)

    tok = torch.arange(vocab, dtype=torch.int64)
    h = mix((tok + codebook * vocab) & M32)[None, :]
    h = mix(h ^ (frame[:, None] & M32))
    h = mix(h ^ (seed[:, None] & M32))
    h = mix(h ^ ((seed[:, None] >> 32) & M32))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def test_noise_draw_0_is_the_sampler_noise_of_before():
    seed = torch.tensor([0, 5, 2**40 + 3, 2**62 + 17])
    frame = torch.tensor([0, 7, 1000, 3])
    for cb in (0, 1, 31):
        old = _hash_before_draws(seed, frame, cb, 2051)
        assert torch.equal(hash_uniform(seed, frame, cb, 2051), old)
        assert torch.equal(hash_uniform_at(seed, frame, torch.full((4, 1), cb), 2051)[:, 0], old)
    draws = [hash_uniform_at(seed, frame, torch.full((4, 1), 5), 64, d)[:, 0] for d in range(4)]
    assert torch.equal(draws[0], _hash_before_draws(seed, frame, 5, 64))
    for a in range(4):
        for b in range(a + 1, 4):
            assert (draws[a] != draws[b]).float().mean() > 0.99  # independent streams
    mixed = hash_uniform_at(seed, frame, torch.full((4, 2), 5), 64, torch.tensor([[0, 3]] * 4))
    assert torch.equal(mixed[:, 0], draws[0]) and torch.equal(mixed[:, 1], draws[3])


# codes of three requests (top-k, top-p, greedy) on dummy-tiny at commit a54a017, before speculation existed
GOLDEN_A54A017 = "f7c2af2e28e39fb0"


@pytest.mark.parametrize("spec_depth", [None, 0])
def test_speculation_off_is_todays_engine_bit_for_bit(dummy_tiny, spec_depth):
    cfg = EngineConfig(max_slots=4, max_seq_len=128, spec_depth=spec_depth)
    runner = ModelRunner(dummy_tiny, 4, 128, spec_depth=cfg.spec_depth)
    assert runner.spec is None
    engine = Engine(runner, cfg, start=False)
    rng = np.random.default_rng
    reqs = []
    for i, (t, tk, tp) in enumerate([(0.9, 50, 1.0), (1.0, 0, 0.8), (0.0, 0, 1.0)]):
        tokens, mask = np.zeros((5 + i, 33), np.int64), np.zeros((5 + i, 33), bool)
        tokens[:, 32], mask[:, 32] = rng(i).integers(1, 258, 5 + i), True
        reqs.append(Request(tokens, mask, params=SamplingParams(temperature=t, top_k=tk, top_p=tp, seed=100 + i,
                                                                 max_audio_length_ms=6 * 80)))
    out = [[] for _ in reqs]
    for r, o in zip(reqs, out):
        engine.submit(r, o.append)
    while not all(o and o[-1].final for o in out):
        engine.step()
    codes = np.stack([np.concatenate([c.codes for c in o]) for o in out]).astype(np.int64)
    assert hashlib.sha256(codes.tobytes()).hexdigest()[:16] == GOLDEN_A54A017


# ---------------------------------------------------------------- greedy: the same codes, every k
def _run_runner(model, spec_depth, temperature, n_rows=3, frames=6, seeds=(100, 101, 102)):
    from csmserve.engine.request import Admission, PrefillChunk

    runner = ModelRunner(model, 4, 64, spec_depth=spec_depth)
    K = model.cfg.num_codebooks
    rng = np.random.default_rng(0)
    for slot in range(n_rows):
        P = 4 + 3 * slot
        tok, mask = np.zeros((P, K + 1), np.int64), np.zeros((P, K + 1), bool)
        tok[:, K], mask[:, K] = rng.integers(1, model.cfg.text_vocab_size, P), True
        runner.prefill([PrefillChunk(slot, 0, tok[: P - 1], mask[: P - 1])])
        runner.admit([Admission(slot, tok[-1], mask[-1], P - 1, temperature, 20, 1.0, seeds[slot])])
    codes = np.stack([runner.step(list(range(n_rows))).wait()[0].copy() for _ in range(frames)], 1)
    return codes, None if runner.spec is None else runner.spec.snapshot().read()


@pytest.mark.parametrize("which", ["dummy-tiny", "agreeing"])
def test_greedy_with_speculation_equals_greedy_without_every_k(dummy_tiny, which):
    model = dummy_tiny if which == "dummy-tiny" else tiny_model(12, 32, agree=0.05, embed_noise=0.05)
    with torch.inference_mode():
        plain, _ = _run_runner(model, None, 0.0)
        for k in range(2, 9):
            spec, stats = _run_runner(model, k, 0.0)
            np.testing.assert_array_equal(spec, plain, err_msg=f"k={k}")
            if which == "agreeing":  # drafts, bonus codes and the end of the frame all exercised
                assert stats["acceptance"] > 0.4 and stats["codes_per_pass"] > 1.4, stats


# ---------------------------------------------------------------- sampled: the plain sampler's distribution
K_STAT, V_STAT = 6, 8


@torch.no_grad()
def exact_frame_distribution(m: CSMModel, h: torch.Tensor, prm1: tuple) -> np.ndarray:
    """P(c_0 .. c_{K-1} | h) [V]*K under the sampler's distributions, by enumerating every prefix."""
    K, V = m.cfg.num_codebooks, m.cfg.audio_vocab_size

    def probs(logits):
        n = logits.shape[0]
        t, tk, tp = prm1
        return sampling_logits(logits, torch.full((n,), t), torch.full((n,), tk, dtype=torch.long),
                               torch.full((n,), tp)).softmax(-1)

    joint = probs(m.codebook0_head(h[None]))[0]
    prefixes = torch.arange(V)[:, None]  # [N, L]
    for L in range(1, K):
        N = prefixes.shape[0]
        x = torch.cat([h[None, None].expand(N, 1, -1), m.audio_embeddings(prefixes + torch.arange(L) * V)], 1)
        out = m.decoder(m.projection(x), torch.arange(L + 1).expand(N, L + 1),
                        m.decoder.new_kv(N, L + 1, torch.float32, "cpu"))[:, -1]
        joint = (joint.reshape(N, 1) * probs(m.codebook_logits(L, out))).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(N)[:, None]], 1)
    return joint.reshape([V] * K).double().numpy()


def chi2_z(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square of counts against probs, as a normal deviate (Wilson-Hilferty): ~N(0, 1)
    when the counts are drawn from probs; bins expecting < 5 are pooled; a count where probs is 0: inf."""
    if counts[probs <= 0].sum() > 0:
        return math.inf
    n = counts.sum()
    e = probs * n
    big = e >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(e[big], e[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    x, df = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    if df == 0:  # one outcome only
        return 0.0
    return ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def frame_z_scores(codes: np.ndarray, joint: np.ndarray) -> np.ndarray:
    """One z per codebook's marginal and per adjacent pair's joint: 2K-1 statistics."""
    K, V = joint.ndim, joint.shape[0]
    zs = []
    for i in range(K):
        marg = joint.sum(axis=tuple(a for a in range(K) if a != i))
        zs.append(chi2_z(np.bincount(codes[:, i], minlength=V), marg))
    for i in range(K - 1):
        pair = joint.sum(axis=tuple(a for a in range(K) if a not in (i, i + 1))).reshape(-1)
        zs.append(chi2_z(np.bincount(codes[:, i] * V + codes[:, i + 1], minlength=V * V), pair))
    return np.array(zs)


class AlwaysAccept(Speculator):  # wrong: the codes follow the drafts' q
    def accept(self, p_d, q_d, u, agree, greedy):
        return torch.ones_like(agree)


class NoResidual(Speculator):  # wrong: a rejected draft is resampled from p instead of max(0, p - q)
    def correct(self, p, q, bonus, codebook, params):
        return super().correct(p, q, torch.ones_like(bonus), codebook, params)


N_SAMPLES = 12_000  # rows of one batch, one seed each, all from the same backbone state
Z_OK, Z_WRONG = 4.0, 12.0  # |z| of the 11 statistics: the exact rule stays under 4, a wrong one is far above


@torch.no_grad()
def draw_frames(m, h, prm1, k=None, cls=Speculator):
    B = N_SAMPLES
    prm = row_params(B, *prm1)
    hh = h[None].expand(B, -1).contiguous()
    if k is None:
        K = m.cfg.num_codebooks
        return m.decode_frame(hh, plain_sampler(prm), m.decoder.new_kv(B, K, torch.float32, "cpu"),
                              torch.arange(K)).numpy()
    return cls(m, k, B).decode_frame(hh, plain_sampler(prm), prm).numpy()


@pytest.fixture(scope="module")
def stat_model():
    m = tiny_model(K_STAT, V_STAT)
    return m, torch.randn(32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("prm1", [(1.0, 0, 1.0), (0.8, 5, 0.9)], ids=["t1", "t0.8-topk5-topp0.9"])
def test_sampled_codes_follow_the_plain_samplers_distribution(stat_model, prm1):
    m, h = stat_model
    joint = exact_frame_distribution(m, h, prm1)
    z_plain = frame_z_scores(draw_frames(m, h, prm1), joint)
    assert np.abs(z_plain).max() < Z_OK, z_plain  # the harness passes the plain sampler
    for k in (2, 3):
        z = frame_z_scores(draw_frames(m, h, prm1, k), joint)
        assert np.abs(z).max() < Z_OK, (k, z)
    # the same harness fails a wrong acceptance rule
    for wrong in (AlwaysAccept, NoResidual):
        z = frame_z_scores(draw_frames(m, h, prm1, 2, wrong), joint)
        assert z.max() > Z_WRONG, (wrong.__name__, z)


def test_sampled_codes_distribution_when_most_drafts_are_accepted():
    """Bonus codes and passes that reach the last codebook are most of the work here."""
    m = tiny_model(K_STAT, V_STAT, agree=0.05, embed_noise=0.05)
    h = torch.randn(32, generator=torch.Generator().manual_seed(4))
    prm1 = (1.0, 0, 1.0)
    joint = exact_frame_distribution(m, h, prm1)
    B = N_SAMPLES
    spec = Speculator(m, 3, B)
    with torch.no_grad():
        codes = spec.decode_frame(h[None].expand(B, -1).contiguous(), plain_sampler(row_params(B, *prm1)),
                                  row_params(B, *prm1)).numpy()
    stats = spec.snapshot().read()
    assert stats["acceptance"] > 0.6, stats
    z = frame_z_scores(codes, joint)
    assert np.abs(z).max() < Z_OK, z


# ---------------------------------------------------------------- a seeded request: alone == in a batch of 16
def test_seeded_speculative_request_same_alone_and_in_batch_of_16():
    model = tiny_model(16, 32, agree=0.2)  # rows accept different numbers of drafts: ragged progress
    K = 16

    def prompt(n, seed):
        rng = np.random.default_rng(seed)
        tokens, mask = np.zeros((n, K + 1), np.int64), np.zeros((n, K + 1), bool)
        tokens[:, K], mask[:, K] = rng.integers(1, 16, n), True
        return tokens, mask

    params = SamplingParams(temperature=0.9, top_k=20, seed=1234, max_audio_length_ms=8 * 80)

    def run(requests):
        cfg = EngineConfig(max_slots=16, max_seq_len=128, spec_depth=4)
        runner = ModelRunner(model, 16, 128, spec_depth=cfg.spec_depth)
        engine = Engine(runner, cfg, start=False)
        out = [[] for _ in requests]
        for r, o in zip(requests, out):
            engine.submit(r, o.append)
        while not all(o and o[-1].final for o in out):
            engine.step()
        return np.concatenate([c.codes for c in out[0]]), runner.spec.snapshot().read()

    with torch.inference_mode():
        alone, _ = run([Request(*prompt(9, 7), params=params)])
        others = [Request(*prompt(4 + i, 100 + i), params=SamplingParams(temperature=0.9, seed=i,
                                                                         max_audio_length_ms=8 * 80))
                  for i in range(15)]
        batch, stats = run([Request(*prompt(9, 7), params=params)] + others)
    assert len(alone) == 8
    np.testing.assert_array_equal(alone, batch)
    assert 0.2 < stats["acceptance"] < 0.95, stats  # neither all nor none: rows progress raggedly


# ---------------------------------------------------------------- config
def test_spec_depth_and_weights_config():
    assert EngineConfig().spec_depth is None and EngineConfig().weights == "bf16"
    for k in (0, 2, 8):
        EngineConfig(spec_depth=k)
    for bad in (1, 9, -1):
        with pytest.raises(ValueError, match="spec_depth"):
            EngineConfig(spec_depth=bad)
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(weights="int4")
    with pytest.raises(ValueError, match="spec_depth"):
        Speculator(tiny_model(6, 8), 9, 4)
