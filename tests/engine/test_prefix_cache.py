"""The prompt-prefix cache: the index (LRU by bytes), the scheduler's policy, and the engine (CPU, dummy-tiny):
a cache hit gives the same greedy codes as a miss and as the reference generator, and skips the prefix's prefill."""
import numpy as np
import pytest

from csmserve.models import reference
from csmserve.config import EngineConfig
from csmserve.engine.engine import Engine
from csmserve.engine.prefix_cache import PrefixCache, prefix_key, prefix_keys
from csmserve.engine.request import Request, RequestStatus
from csmserve.sampling import SamplingParams
from csmserve.engine.runner import ModelRunner
from csmserve.engine.scheduler import Scheduler
from csmserve.models.loader import load_csm

K = 32


# ---- frames
def text(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, K + 1), np.int64)
    mask = np.zeros((n, K + 1), bool)
    tokens[:, K] = rng.integers(1, 258, n)
    mask[:, K] = True
    return tokens, mask


def audio(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n context audio frames + the all-zero EOS frame."""
    tokens = np.zeros((n + 1, K + 1), np.int64)
    tokens[:n, :K] = np.random.default_rng(seed).integers(1, 2048, (n, K))
    mask = np.zeros((n + 1, K + 1), bool)
    mask[:, :K] = True
    return tokens, mask


def cat(*parts):
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def context(seed: int, n_text: int = 5, n_audio: int = 6):
    """A context turn: its text, then its audio codes (as a voice's reference turn)."""
    return cat(text(n_text, seed), audio(n_audio, seed + 1000))


def request(ctx, target_seed: int, max_frames: int = 6, **kw) -> Request:
    tokens, mask = cat(ctx, text(4, target_seed))
    return Request(tokens, mask, params=SamplingParams(temperature=0.0, max_audio_length_ms=max_frames * 80),
                   prefix_len=len(ctx[0]), **kw)


# ---- the index
def test_index_lru_by_bytes_and_never_above_the_bound():
    c = PrefixCache(max_bytes=100, bytes_per_position=10)
    assert c.reserve(b"a", 4) and c.reserve(b"b", 4) and c.used_bytes == 80
    assert not c.reserve(b"a", 4)  # already there
    assert not c.reserve(b"huge", 11)  # larger than the whole cache: not stored, nothing evicted
    assert c.lookup(b"a") == 4  # a is now the most recently used
    assert c.reserve(b"c", 3) and c.keys() == [b"a", b"c"] and c.take_evicted() == [b"b"]
    assert c.used_bytes == 70 <= c.max_bytes
    assert c.lookup(b"b") is None
    assert c.reserve(b"d", 10) and c.keys() == [b"d"] and c.take_evicted() == [b"a", b"c"]
    assert c.used_bytes == 100 and c.take_evicted() == []
    assert c.stats["hits"] == 1 and c.stats["misses"] == 1 and c.stats["evictions"] == 3


def test_key_covers_tokens_mask_and_length():
    t, m = context(1)
    k = prefix_key(t, m, 8)
    assert k == prefix_key(t.copy(), m.copy(), 8) and k != prefix_key(t, m, 7)
    t2, m2 = t.copy(), m.copy()
    t2[3, 5] += 1
    m2[0, 0] = True
    assert prefix_key(t2, m, 8) != k and prefix_key(t, m2, 8) != k


# ---- the scheduler's policy
def sched(budget: int = 4, cache_bytes: int = 1000) -> Scheduler:
    cfg = EngineConfig(max_slots=2, max_seq_len=64, prefill_token_budget=budget, max_prefill_chunk=budget)
    return Scheduler(cfg, K, PrefixCache(cache_bytes, 1))


def test_miss_stores_once_the_prefix_is_prefilled_and_a_hit_skips_its_prefill():
    s, ctx = sched(), context(3)  # prefix of 12 positions, prefill 4 per step
    r1 = request(ctx, 1)
    s.add(r1)
    batches = [s.schedule() for _ in range(4)]
    assert batches[0].admissions[0].prefix_hit is None
    assert [len(b.prefix_stores) for b in batches] == [0, 0, 1, 0]  # after the chunk reaching position 12
    st = batches[2].prefix_stores[0]
    assert (st.slot, st.n, st.evict) == (r1.slot, 12, ())
    assert st.key == prefix_key(r1.tokens, r1.mask, 12)
    r2 = request(ctx, 2)  # another target text after the same context
    s.add(r2)
    b = s.schedule()
    assert b.admissions[0].prefix_hit == st.key
    assert [(c.slot, c.start, len(c.tokens)) for c in b.prefills if c.slot == r2.slot] == [(r2.slot, 12, 3)]
    assert s.prefix_cache.stats["hits"] == 1 and not b.prefix_stores


def test_abort_before_the_prefix_is_prefilled_stores_nothing_and_bad_prefix_len_is_refused():
    s, ctx = sched(), context(4)
    r = request(ctx, 1)
    s.add(r)
    s.schedule()
    s.abort(r.request_id)
    assert not any(b.prefix_stores for b in (s.schedule() for _ in range(4)))
    assert len(s.prefix_cache) == 0
    bad = request(ctx, 1)
    bad.prefix_len = bad.prompt_len  # a prefix never covers the last position
    with pytest.raises(ValueError, match="prefix_len"):
        s.add(bad)


def test_evictions_travel_with_the_store_that_needed_the_room():
    s = sched(budget=64, cache_bytes=25)  # room for two prefixes of 11 positions
    keys = []
    for i in range(3):
        r = request(context(10 * i, 5, 5), 1)
        s.add(r)
        b = s.schedule()
        keys.append(b.prefix_stores[0].key)
        assert b.prefix_stores[0].evict == (() if i < 2 else (keys[0],))
        s.abort(r.request_id)
    assert s.prefix_cache.keys() == keys[1:] and s.prefix_cache.used_bytes == 22


# ---- the engine
@pytest.fixture(scope="module")
def model():
    return load_csm("dummy-tiny")[0]


def make_engine(model, cache_bytes=None, **kw):
    cfg = EngineConfig(max_slots=2, max_seq_len=128, prefill_token_budget=8, prefix_cache_bytes=cache_bytes, **kw)
    engine = Engine(ModelRunner(model, cfg.max_slots, cfg.max_seq_len), cfg, start=False)
    engine.prefilled = 0  # prompt positions prefilled (hits skip their prefix)
    prefill = engine.runner.prefill

    def counting(chunks):
        # positions before the prompt's last frame (a head chunk also takes that frame: first_frame_from_prefill)
        engine.prefilled += sum(len(c.tokens) - c.head for c in chunks)
        prefill(chunks)

    engine.runner.prefill = counting
    return engine


def run(engine, reqs, max_steps=300):
    chunks = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.submit(r, lambda c, rid=r.request_id: chunks[rid].append(c) if not isinstance(c, BaseException)
                      else pytest.fail(str(c)))
    for _ in range(max_steps):
        engine.step()
        if all(cs and cs[-1].final for cs in chunks.values()):
            return [np.concatenate([c.codes for c in chunks[r.request_id]]) for r in reqs]
    raise AssertionError("engine did not finish")


def expected(model, req):
    return reference.generate(model, req.tokens, req.mask, req.params).codes


def test_cache_hit_equals_cache_miss_and_reference_and_skips_the_prefill(model):
    engine, ctx = make_engine(model), context(7, 6, 14)  # 21 positions of prefix
    cache, runner = engine.prefix_cache, engine.runner
    first = request(ctx, 1)
    [miss] = run(engine, [first])
    assert engine.prefilled == first.prompt_len - 1 and cache.stats == {**cache.stats, "misses": 1, "stores": 1}
    assert len(runner.prefix_kv) == 1 and runner.prefix_kv_bytes == cache.used_bytes == 21 * cache.bytes_per_position
    np.testing.assert_array_equal(miss, expected(model, first))
    assert len(miss) >= 2

    again, other = request(ctx, 1), request(ctx, 2)  # the same request, and another text after the same context
    engine.prefilled = 0
    [hit] = run(engine, [again])
    assert cache.stats["hits"] == 1 and engine.prefilled == again.prompt_len - 1 - 21
    np.testing.assert_array_equal(hit, miss)
    engine.prefilled = 0
    [hit2] = run(engine, [other])
    assert cache.stats["hits"] == 2 and engine.prefilled == other.prompt_len - 1 - 21
    np.testing.assert_array_equal(hit2, expected(model, other))

    # the same prefix in two requests at once: both miss (nothing stored yet), stored once
    engine2, ctx2 = make_engine(model), context(8, 4, 9)
    a, b = request(ctx2, 3), request(ctx2, 4)
    got = run(engine2, [a, b])
    assert engine2.prefix_cache.stats["stores"] == 1 and len(engine2.runner.prefix_kv) == 1
    for req, codes in zip((a, b), got):
        np.testing.assert_array_equal(codes, expected(model, req))


def test_eviction_under_memory_pressure_lru_and_evicted_prefixes_miss_with_correct_output(model):
    bpp = make_engine(model, cache_bytes=0).runner.kv.bytes_per_position
    engine = make_engine(model, cache_bytes=25 * bpp)  # two prefixes of 11 positions, not three
    cache, runner = engine.prefix_cache, engine.runner
    ctxs = [context(20 + i, 4, 6) for i in range(3)]  # 11 positions each
    key = [prefix_key(*c, 11) for c in ctxs]
    step = engine.step

    def checked_step(*a, **kw):  # the bound holds after every step, on the host and on the device
        step(*a, **kw)
        assert cache.used_bytes <= cache.max_bytes and runner.prefix_kv_bytes <= cache.max_bytes
        assert set(runner.prefix_kv) == set(cache.keys())

    engine.step = checked_step

    def check(ctx_i: int, target: int, hit: bool) -> None:
        req = request(ctxs[ctx_i], target, max_frames=4)
        hits = cache.stats["hits"]
        [codes] = run(engine, [req])
        assert cache.stats["hits"] == hits + hit, (ctx_i, hit)
        np.testing.assert_array_equal(codes, expected(model, req))
        assert req.status in (RequestStatus.FINISHED_EOS, RequestStatus.FINISHED_LENGTH)

    check(0, 1, False)
    check(1, 1, False)
    assert cache.keys() == [key[0], key[1]]
    check(0, 2, True)  # 0 is now the most recently used
    check(2, 1, False)  # evicts 1, the least recently used
    assert cache.keys() == [key[0], key[2]] and cache.stats["evictions"] == 1
    check(1, 3, False)  # evicted: a miss again, same output as the reference; evicts 0
    assert cache.keys() == [key[2], key[1]] and cache.stats["evictions"] == 2
    check(2, 2, True)
    check(1, 4, True)


# ---- growing conversations: the longest cached turn boundary
def test_prefix_keys_in_one_pass_equal_one_key_each():
    t, m = cat(context(1), context(2))
    keys = prefix_keys(t, m, [3, 11, 22])
    assert keys == {n: prefix_key(t, m, n) for n in (3, 11, 22)}
    assert len(set(keys.values())) == 3


def test_longest_cached_boundary_is_used_and_the_whole_prefix_stored():
    s = sched(budget=64)
    a, b = context(1), context(2)  # 12 positions each
    r1 = request(a, 1)
    s.add(r1)
    key_a = s.schedule().prefix_stores[0].key
    s.abort(r1.request_id)
    r2 = request(cat(a, b), 2, prefix_boundaries=(12,))  # the conversation grew by a turn
    s.add(r2)
    batch = s.schedule()
    assert batch.admissions[0].prefix_hit == key_a
    # from position 12 to the prompt's end (the last frame too, head: an idle engine's first frame from the prefill)
    assert [(c.start, len(c.tokens), c.head) for c in batch.prefills] == [(12, 24 + 4 - 12, True)]
    assert batch.prefix_stores[0].n == 24 and s.prefix_cache.stats["hits"] == 1
    assert s.prefix_cache.stats["misses"] == 1  # r1's; r2 counts one hit, not a miss and a hit


def test_growing_conversation_hits_the_previous_turns_and_equals_the_reference(model):
    engine = make_engine(model)
    cache = engine.prefix_cache
    turns = [context(30 + i, 4, 5) for i in range(3)]  # 10 positions each
    for k in range(1, 4):  # request k: k turns of context, then its text
        ctx = cat(*turns[:k])
        req = request(ctx, k, prefix_boundaries=tuple(10 * j for j in range(1, k)))
        engine.prefilled, hits = 0, cache.stats["hits"]
        [codes] = run(engine, [req])
        np.testing.assert_array_equal(codes, expected(model, req))
        if k == 1:
            assert engine.prefilled == req.prompt_len - 1 and hits == cache.stats["hits"]
        else:  # the previous request's context (k-1 turns) was cached: only the newest turn and the text
            assert cache.stats["hits"] == hits + 1 and engine.prefilled == req.prompt_len - 1 - 10 * (k - 1)
    assert len(cache) == 3  # each request stored its whole context


def test_a_failed_step_leaves_no_entry_it_never_stored():
    """The prefill of a step that reserved a prefix entry raises (an out-of-memory, say): the request fails, the
    index drops the key the runner never stored, and the next request with that voice / context is a miss that
    runs as the reference (it was a hit whose copy failed every step that took it)."""
    model = load_csm("dummy-tiny")[0]
    cfg = EngineConfig(max_slots=2, max_seq_len=128, prefill_token_budget=64, prefix_cache_bytes=None)
    engine = Engine(ModelRunner(model, cfg.max_slots, cfg.max_seq_len), cfg, start=False)
    prefill, calls = engine.runner.prefill, []

    def fails_once(chunks):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (a stand-in)")
        return prefill(chunks)

    engine.runner.prefill = fails_once
    ctx, got = context(7, 6, 14), {}

    def run(r):
        got[r.request_id] = []
        engine.submit(r, got[r.request_id].append)
        for _ in range(200):
            engine.run_once()
            if got[r.request_id] and (isinstance(got[r.request_id][-1], BaseException) or got[r.request_id][-1].final):
                return got[r.request_id]
        raise AssertionError("did not finish")

    assert isinstance(run(request(ctx, 1))[-1], RuntimeError)
    assert set(engine.prefix_cache.keys()) == set(engine.runner.prefix_kv)
    b = request(ctx, 2)
    items = run(b)
    assert not any(isinstance(x, BaseException) for x in items), items
    np.testing.assert_array_equal(np.concatenate([c.codes for c in items]),
                                  reference.generate(model, b.tokens, b.mask, b.params).codes)
