"""The engine against the reference generator (CPU, dummy-tiny, float32)."""
import numpy as np
import pytest
import torch

from csmserve.models import reference
from csmserve.config import EngineConfig
from csmserve.engine.engine import Engine
from csmserve.engine.request import Request
from csmserve.sampling import SamplingParams
from csmserve.engine.runner import ModelRunner
from csmserve.models.sampler import hash_uniform
from csmserve.models.loader import load_csm


@pytest.fixture(scope="module")
def model():
    return load_csm("dummy-tiny")[0]


def prompt(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, 33), np.int64)
    mask = np.zeros((n, 33), bool)
    tokens[:, 32] = rng.integers(1, 258, n)
    mask[:, 32] = True
    if n > 6:  # a context turn: audio frames and the all-zero EOS frame
        tokens[2:5, :32] = rng.integers(1, 2048, (3, 32))
        tokens[2:5, 32] = 0
        mask[2:6, :32], mask[2:6, 32] = True, False
        tokens[5] = 0
    return tokens, mask


class Collector:
    def __init__(self):
        self.chunks = {}

    def sink_for(self, rid):
        def sink(item):
            assert not isinstance(item, BaseException), item
            self.chunks.setdefault(rid, []).append(item)
        return sink

    def codes(self, rid):
        return np.concatenate([c.codes for c in self.chunks[rid]])

    def done(self, rid):
        return rid in self.chunks and self.chunks[rid][-1].final


def make_engine(model, **kw):
    cfg = EngineConfig(**{"max_slots": 4, "max_seq_len": 256, "prefill_token_budget": 16, **kw})
    return Engine(ModelRunner(model, cfg.max_slots, cfg.max_seq_len), cfg, start=False)


def drive(engine, col, arrivals, aborts=(), max_steps=400):
    """arrivals: {step: [request]}; aborts: {step: [request_id]}; steps the engine by hand."""
    pending = {r.request_id for rs in arrivals.values() for r in rs}
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            engine.submit(r, col.sink_for(r.request_id))
        for rid in dict(aborts).get(step, []):
            engine.abort(rid)
        engine.step()
        if all(col.done(rid) for rid in pending) and step > max(arrivals):
            return
    raise AssertionError("engine did not finish")


def test_greedy_engine_equals_reference_with_arrivals_and_aborts(model):
    greedy = SamplingParams(temperature=0.0, max_audio_length_ms=14 * 80)
    reqs = [Request(*prompt(n, i), params=greedy) for i, n in enumerate([3, 20, 9, 1, 40])]
    victims = [Request(*prompt(15, 99), params=greedy), Request(*prompt(30, 98), params=greedy)]
    arrivals = {0: reqs[:2], 3: [reqs[2], victims[0]], 5: [reqs[3]], 9: [reqs[4], victims[1]]}
    aborts = {6: [victims[0].request_id], 11: [victims[1].request_id]}
    engine, col = make_engine(model), Collector()
    drive(engine, col, arrivals, aborts)
    for r in reqs:
        ref = reference.generate(model, r.tokens, r.mask, greedy)
        np.testing.assert_array_equal(col.codes(r.request_id), ref.codes, err_msg=r.request_id)
    for v in victims:
        assert col.chunks[v.request_id][-1].finish_reason == "abort"
    assert engine.scheduler.num_free_slots == 4


def test_seeded_request_same_alone_and_in_batch_of_16(model):
    params = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_audio_length_ms=10 * 80)
    alone = Request(*prompt(11, 7), params=params)
    engine, col = make_engine(model, max_slots=16), Collector()
    drive(engine, col, {0: [alone]})
    others = [Request(*prompt(5 + i, 100 + i), params=SamplingParams(temperature=0.9, max_audio_length_ms=10 * 80))
              for i in range(15)]
    again = Request(*prompt(11, 7), params=params)
    engine2, col2 = make_engine(model, max_slots=16), Collector()
    drive(engine2, col2, {0: others[:7], 2: [again] + others[7:]})
    np.testing.assert_array_equal(col.codes(alone.request_id), col2.codes(again.request_id))
    ref = reference.generate(model, alone.tokens, alone.mask, params)
    np.testing.assert_array_equal(col.codes(alone.request_id), ref.codes)


def test_noise_independent_of_batch_position():
    seeds = torch.tensor([5, 6, 7, 8])
    frames = torch.tensor([3, 0, 9, 3])
    a = hash_uniform(seeds, frames, codebook=4, vocab=2051)
    b = hash_uniform(seeds.flip(0), frames.flip(0), codebook=4, vocab=2051).flip(0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    single = hash_uniform(seeds[2:3], frames[2:3], codebook=4, vocab=2051)
    torch.testing.assert_close(a[2:3], single, rtol=0, atol=0)
    assert not torch.equal(a[0], a[3])  # different seeds, same frame
    assert 0 < float(a.min()) and float(a.max()) < 1


def test_chunking_first_chunk_is_one_frame(model):
    params = SamplingParams(temperature=0.0, max_audio_length_ms=12 * 80)
    r = Request(*prompt(4, 3), params=params)
    engine, col = make_engine(model, first_chunk_frames=1, chunk_frames=4), Collector()
    drive(engine, col, {0: [r]})
    sizes = [len(c.codes) for c in col.chunks[r.request_id]]
    assert sizes[0] == 1 and all(s <= 4 for s in sizes[1:])
    assert sum(sizes) == len(reference.generate(model, r.tokens, r.mask, params).codes)


def test_unused_ids_never_sampled(model):
    # ids 2048..2050 exist in the head but Mimi cannot decode them: even when they dominate, never sampled
    with torch.no_grad():
        saved = model.codebook0_head.weight[2048:].clone()
        model.codebook0_head.weight[2048:] = model.codebook0_head.weight[:3] * 50
    try:
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_audio_length_ms=3 * 80, seed=1)
            r = Request(*prompt(4, 1), params=params)
            engine, col = make_engine(model), Collector()
            drive(engine, col, {0: [r]})
            assert col.codes(r.request_id).max() < 2048
            assert reference.generate(model, r.tokens, r.mask, params).codes.max() < 2048
    finally:
        with torch.no_grad():
            model.codebook0_head.weight[2048:] = saved


def test_a_lost_device_fails_its_requests_and_refuses_later_ones_at_once(model):
    """A step error that leaves the device unusable (CUDA device-side assert): the running requests get
    the error, the engine sets `fatal`, and every later request is refused at once (never a hang); any
    other step error fails only that step's requests."""
    engine = make_engine(model)
    got = {}

    def sink(rid):
        return lambda item: got.setdefault(rid, []).append(item)

    step = engine.runner.step
    calls = {"n": 0}

    def failing(slots, *a):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")  # an ordinary error: this step's requests fail, the engine goes on
        if calls["n"] == 6:
            raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")
        return step(slots, *a)

    engine.runner.step = failing
    a = Request(*prompt(6, 1), params=SamplingParams(temperature=0.0, max_audio_length_ms=80 * 50))
    engine.submit(a, sink("a"))
    for _ in range(4):
        engine.run_once()
    assert isinstance(got["a"][-1], RuntimeError) and engine.fatal is None
    b = Request(*prompt(6, 2), params=SamplingParams(temperature=0.0, max_audio_length_ms=80 * 50))
    engine.submit(b, sink("b"))
    for _ in range(4):
        engine.run_once()
    assert isinstance(got["b"][-1], RuntimeError) and "device-side assert" in engine.fatal
    c = Request(*prompt(6, 3), params=SamplingParams(temperature=0.0))
    engine.submit(c, sink("c"))
    engine.run_once()
    assert len(got["c"]) == 1 and "restarted" in str(got["c"][0]) and "device-side assert" in str(got["c"][0])


def run_until_done(engine, requests, max_iters=400):
    """Submit all, then engine.run_once() (the real loop body: a failed step fails its requests) until each
    request's sink got a final chunk or an error. -> {request_id: [AudioChunk | BaseException]}"""
    got = {r.request_id: [] for r in requests}
    for r in requests:
        engine.submit(r, got[r.request_id].append)
    for _ in range(max_iters):
        engine.run_once()
        if all(v and (isinstance(v[-1], BaseException) or v[-1].final) for v in got.values()):
            return got
    raise AssertionError("engine did not finish")


def codes_of(items) -> np.ndarray:
    assert not any(isinstance(i, BaseException) for i in items), items
    assert items[-1].final and items[-1].finish_reason in ("eos", "length")
    return np.concatenate([c.codes for c in items])


@pytest.mark.parametrize("tiny", [1.175494351e-38, 1e-38, 1e-30])
def test_tiny_temperature_samples_greedy_and_leaves_a_seeded_neighbour_alone(model, tiny):
    """temperature 1.175494351e-38 (the schema admits 0..2) made `logits / t` overflow and the step raise,
    failing every request in it; now it is greedy (the limit), and a seeded request beside it is unchanged."""
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=77, max_audio_length_ms=8 * 80)
    alone = run_until_done(make_engine(model), [Request(*prompt(9, 4), params=seeded)])
    s, t = Request(*prompt(9, 4), params=seeded), Request(
        *prompt(7, 5), params=SamplingParams(temperature=tiny, top_p=1e-30, seed=3, max_audio_length_ms=8 * 80))
    got = run_until_done(make_engine(model), [s, t])
    np.testing.assert_array_equal(codes_of(got[s.request_id]), codes_of(next(iter(alone.values()))))
    greedy = reference.generate(model, t.tokens, t.mask, SamplingParams(temperature=0.0, max_audio_length_ms=8 * 80))
    np.testing.assert_array_equal(codes_of(got[t.request_id]), greedy.codes)


def test_values_that_cannot_sample_are_refused_at_add_not_in_the_step(model):
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -1.0},
                {"top_p": float("nan")}, {"top_p": 0.0}, {"top_k": 2**40}, {"seed": 2**64}, {"seed": -1},
                {"max_audio_length_ms": 79}, {"temperature": "0.5"}, {"top_p": None}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    broken = SamplingParams(temperature=0.9)
    object.__setattr__(broken, "temperature", float("nan"))  # built around the dataclass' own check
    good = Request(*prompt(6, 1), params=SamplingParams(temperature=0.0, max_audio_length_ms=4 * 80))
    bad = Request(*prompt(6, 2), params=broken)
    got = run_until_done(make_engine(model), [good, bad])
    assert len(got[bad.request_id]) == 1 and isinstance(got[bad.request_id][0], ValueError)
    assert "temperature" in str(got[bad.request_id][0])
    np.testing.assert_array_equal(codes_of(got[good.request_id]),
                                  reference.generate(model, good.tokens, good.mask, good.params).codes)


def test_a_failed_step_fails_its_requests_not_the_queued_ones(model):
    engine = make_engine(model, max_slots=1)
    step, calls = engine.runner.step, {"n": 0}

    def failing(slots, *a):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return step(slots, *a)

    engine.runner.step = failing
    params = SamplingParams(temperature=0.0, max_audio_length_ms=4 * 80)
    held, queued = Request(*prompt(6, 1), params=params), Request(*prompt(6, 2), params=params)
    got = run_until_done(engine, [held, queued])
    assert isinstance(got[held.request_id][-1], RuntimeError)
    np.testing.assert_array_equal(codes_of(got[queued.request_id]),
                                  reference.generate(model, queued.tokens, queued.mask, params).codes)
    assert engine.scheduler.num_free_slots == 1


def test_a_step_of_first_frames_is_done_before_the_next_launch(model):
    """After a frame step whose rows all make their first frame (an idle engine's new request), the next step
    launches only once that one is done (its decode alone on the GPU); every other step overlaps the next one's
    launch."""
    greedy = SamplingParams(temperature=0.0, max_audio_length_ms=6 * 80)
    engine, col = make_engine(model), Collector()
    log, firsts = [], {}
    launch = engine.runner.step

    def step(slots, step_id=-1, from_prefill=False):
        out = launch(slots, step_id, from_prefill)
        if out is not None:
            log.append(("launch", step_id))
            wait = out.wait

            def logged_wait():
                log.append(("wait", step_id))
                return wait()

            out.wait = logged_wait
        return out

    schedule = engine.scheduler.schedule

    def sched():
        b = schedule()
        firsts[b.step] = b.first_frames
        return b

    engine.runner.step, engine.scheduler.schedule = step, sched
    a = Request(*prompt(9, 1), params=greedy)
    b = Request(*prompt(5, 2), params=greedy)
    drive(engine, col, {0: [a], 3: [b]})
    launched = [s for kind, s in log if kind == "launch"]
    first = [s for s in launched if firsts[s]]
    assert first == [launched[0]]  # only the idle engine's first step: b's first frame joins a running a
    s0, s1 = launched[0], launched[1]
    assert log.index(("wait", s0)) < log.index(("launch", s1))  # the first frames' step read before the next launch
    for later, nxt in zip(launched[1:], launched[2:]):  # the rest overlap: launched before the previous is read
        assert log.index(("launch", nxt)) < log.index(("wait", later))
    for r in (a, b):
        np.testing.assert_array_equal(col.codes(r.request_id), reference.generate(model, r.tokens, r.mask, greedy).codes)


def test_a_failed_step_leaves_a_request_parked_for_its_adapter_queued(model, tmp_path):
    """One pool slot, held by a's adapter: b is parked for bob's slot (queued, in no step). A failed step fails a,
    not b, which then gets the slot and runs to its end."""
    from csmserve.models.loader import tiny_config
    from csmserve.models.lora import read_adapter, write_adapter

    cfg = EngineConfig(max_slots=4, max_seq_len=256, prefill_token_budget=16, max_loras=1, max_lora_rank=8)
    engine = Engine(ModelRunner(model, 4, 256, max_loras=1, max_lora_rank=8), cfg, start=False)
    engine.register_adapters({n: read_adapter(write_adapter(tmp_path / n, tiny_config(), rank=4, seed=i),
                                              tiny_config()) for i, n in enumerate(["ann", "bob"])})
    params = SamplingParams(temperature=0.0, max_audio_length_ms=200 * 80)
    a = Request(*prompt(4, 1), params=params, adapter="ann")
    b = Request(*prompt(4, 2), params=SamplingParams(temperature=0.0, max_audio_length_ms=4 * 80), adapter="bob")
    got: dict = {}
    engine.submit(a, sink=lambda item: got.setdefault("a", []).append(item))
    for _ in range(3):
        engine.run_once()
    engine.submit(b, sink=lambda item: got.setdefault("b", []).append(item))
    engine.run_once()
    assert engine.scheduler.num_parked == 1
    step = engine.runner.step

    def failing(*args):
        raise RuntimeError("boom")

    engine.runner.step = failing
    engine.run_once()
    engine.runner.step = step
    assert isinstance(got["a"][-1], RuntimeError)
    for _ in range(40):
        if got.get("b") and (isinstance(got["b"][-1], BaseException) or got["b"][-1].final):
            break
        engine.run_once()
    assert not any(isinstance(x, BaseException) for x in got["b"]) and got["b"][-1].final
