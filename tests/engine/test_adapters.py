"""CPU tests of the LoRA adapters' policy (engine/adapters.py) and the scheduler with it: a request waits in the
queue (never in a step) until its adapter's copy is done; the pool's slots LRU; every slot pinned -> the request
waits; unknown adapters refused at add; unload while in use; rows carry their pool slot, ordered by it; the prefix
cache keys on the adapter."""
from __future__ import annotations

import numpy as np
import pytest

from csmserve.config import EngineConfig
from csmserve.engine.adapters import AdapterLimitError, AdapterSlots, UnknownAdapterError
from csmserve.engine.prefix_cache import PrefixCache
from csmserve.engine.request import Request, RequestStatus
from csmserve.engine.scheduler import Scheduler
from csmserve.sampling import SamplingParams

S = RequestStatus


def req(rid: str, adapter: str | None = None, prompt_len: int = 1, frames: int = 100) -> Request:
    tokens = np.arange(prompt_len * 33, dtype=np.int64).reshape(prompt_len, 33)
    return Request(tokens, np.ones((prompt_len, 33), bool), SamplingParams(seed=1, max_audio_length_ms=80 * frames),
                   request_id=rid, adapter=adapter)


def sched(max_loras: int = 2, names=("ann", "bob", "cat"), **kw) -> Scheduler:
    pool = AdapterSlots(max_loras, max_adapters=8)
    for n in names:
        pool.add(n, weights=f"w-{n}", rank=16, nbytes=100)
    cfg = EngineConfig(**{"max_slots": 4, "max_waiting": 8, "prefill_token_budget": 64, "max_prefill_chunk": 64,
                          "first_frame_from_prefill": False, **kw})
    return Scheduler(cfg, adapters=pool)


def load_all(s: Scheduler) -> list:
    """The runner's side: take the copies asked for and finish them."""
    loads = s.adapters.take_loads()
    for slot, a in loads:
        s.adapters.loaded(slot, a)
    return loads


def finish(s: Scheduler, batch, eos: set[str]) -> None:
    codes = np.full((len(batch.decode_slots), 32), 7, np.int64)
    for row, slot in enumerate(batch.decode_slots):
        if s.slots[slot] is not None and s.slots[slot].request_id in eos:
            codes[row] = 0
    s.update(batch.step, codes)


def test_request_waits_in_the_queue_until_its_adapter_is_loaded():
    s = sched()
    a, base = req("a", "ann"), req("base")
    s.add(a)
    s.add(base)
    b1 = s.schedule()  # ann not resident: a waits (its copy asked for), the base request behind it goes on
    assert [s.slots[x.slot].request_id for x in b1.admissions] == ["base"]
    assert a.status is S.WAITING and s.num_waiting == 1
    loads = s.adapters.take_loads()
    assert [(slot, x.name) for slot, x in loads] == [(0, "ann")]
    b2 = s.schedule()  # the copy is not done yet: still waiting, no second copy
    assert b2.admissions == [] and s.adapters.take_loads() == []
    s.adapters.loaded(*loads[0])
    b3 = s.schedule()
    (adm,) = b3.admissions
    assert s.slots[adm.slot] is a and adm.adapter == 0 and a.status is S.RUNNING
    assert a.lora.pins == 1 and not s.adapters.idle


def test_unknown_adapter_refused_at_add_and_no_adapters_engine():
    s = sched()
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'zed' \\(loaded: ann, bob, cat\\)"):
        s.add(req("z", "zed"))
    plain = Scheduler(EngineConfig(max_slots=2))
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.add(req("z", "ann"))
    assert s.num_waiting == 0 and plain.num_waiting == 0


def test_rows_carry_their_pool_slot_ordered_by_it():
    s = sched(max_loras=2)
    for rid, ad in [("r0", "bob"), ("r1", None), ("r2", "ann"), ("r3", "bob")]:
        s.add(req(rid, ad, prompt_len=3))
    b0 = s.schedule()  # base admitted; ann and bob parked, both copies started (two free pool slots)
    load_all(s)
    b = s.schedule()
    owners = {x.slot: s.slots[x.slot].request_id for x in b.admissions}
    assert sorted(owners.values()) == ["r0", "r2", "r3"]
    pool_slot = {"ann": s.adapters.get("ann").slot, "bob": s.adapters.get("bob").slot}
    for x in b.admissions:
        assert x.adapter == pool_slot[s.slots[x.slot].adapter]
    for c in b.prefills:
        r = s.slots[c.slot]
        assert c.adapter == (-1 if r.adapter is None else pool_slot[r.adapter])
    b2 = s.schedule()
    steps = b2.decode_slots
    lora = [-1 if s.slots[x].adapter is None else pool_slot[s.slots[x].adapter] for x in steps]
    assert lora == sorted(lora) and len(steps) == 4
    for batch in (b0, b):
        finish(s, batch, set())
    frames = {n: s.adapters.get(n).stats["frames"] for n in ("bob", "ann")}
    finish(s, b2, set())  # one frame each: bob's two rows, ann's one
    frames = {n: s.adapters.get(n).stats["frames"] - frames[n] for n in ("bob", "ann")}
    assert frames == {"bob": 2, "ann": 1}


def test_lru_eviction_and_all_pinned_waits():
    s = sched(max_loras=1, max_slots=2)
    a, b = req("a", "ann", frames=1), req("b", "bob", frames=1)
    s.add(a)
    s.schedule()
    load_all(s)
    b1 = s.schedule()  # a runs with ann (pinned)
    s.add(b)
    b2 = s.schedule()  # bob needs ann's slot: pinned -> b waits, no copy
    assert b2.admissions == [] and s.adapters.take_loads() == [] and b.status is S.WAITING
    finish(s, b1, set())  # a's only frame: it ends (length) -> ann idle
    assert a.status is S.FINISHED_LENGTH and list(s.adapters.idle) == [0]
    s.schedule()  # now ann is evicted for bob
    loads = load_all(s)
    assert [x.name for _, x in loads] == ["bob"] and s.adapters.get("ann").slot == -1
    b4 = s.schedule()
    assert [s.slots[x.slot].request_id for x in b4.admissions] == ["b"] and b4.admissions[0].adapter == 0
    assert s.adapters.get("ann").stats["loads"] == 1 and s.adapters.get("bob").stats["requests"] == 1


def test_more_adapters_than_pool_slots_take_turns():
    """One pool slot, two adapters: the second's request parks until the first's requests end, then its copy
    replaces the idle first (LRU) and it runs."""
    s = sched(max_loras=1, max_slots=1)
    a1, a2, b = req("a1", "ann", frames=1), req("a2", "ann", frames=1), req("b", "bob", frames=1)
    s.add(a1)
    s.schedule()
    load_all(s)
    b1 = s.schedule()  # a1 runs
    s.add(b)
    s.add(a2)
    assert s.schedule().admissions == [] and s.adapters.take_loads() == []  # no request slot free: nothing loaded
    finish(s, b1, set())  # a1 ends: ann idle; b (bob) first in the queue, a2 (ann) behind it
    assert s.schedule().admissions == []  # b parks and bob's copy evicts idle ann; a2 parks (no pool slot)
    order = []
    for _ in range(8):
        load_all(s)
        bt = s.schedule()
        order += [s.slots[x.slot].request_id for x in bt.admissions]
        if len(bt.decode_slots):
            finish(s, bt, set())
    assert order == ["b", "a2"] and s.num_waiting == 0
    assert s.adapters.get("ann").stats["loads"] == 2 and s.adapters.get("bob").stats["loads"] == 1


def test_unload_while_in_use_finishes_its_requests_then_frees():
    s = sched(max_loras=2)
    a, q = req("a", "ann"), req("q", "ann")
    s.add(a)
    s.schedule()
    load_all(s)
    b1 = s.schedule()
    ann = s.adapters.get("ann")
    s.adapters.remove("ann")  # a runs; q is not yet queued
    with pytest.raises(UnknownAdapterError):
        s.add(q)
    assert ann.slot == 0 and ann.weights is not None and ann.removed
    finish(s, b1, {"a"})
    assert a.status is S.FINISHED_EOS and ann.slot == -1 and ann.weights is None and s.adapters.slots[0] is None
    s.adapters.add("ann", weights="new", rank=16, nbytes=100)  # the name again: another adapter
    assert s.adapters.get("ann").id != ann.id


def test_unload_idle_frees_at_once_and_abort_parked():
    s = sched(max_loras=1)
    s.add(req("a", "ann"))
    s.schedule()
    s.abort("a")  # parked, then aborted: no reference left
    assert s.num_waiting == 0 and not s._parked and s.adapters.get("ann").refs == 0
    load_all(s)  # its copy finishes anyway: ann resident and idle
    s.adapters.remove("ann")
    assert s.adapters.slots == [None] and not s.adapters.idle


def test_an_adapter_admitted_in_a_step_is_not_evicted_in_it():
    """Two pool slots, four adapters in one schedule(): the first two's requests are taken (pinned at once), so the
    last two's wants find no idle slot to evict: they wait, and no admitted request's adapter is lost."""
    s = sched(max_loras=2, names=("a", "b", "c", "d"), max_slots=8)
    for name in "abcd":
        s.add(req(name, name))
    s.schedule()
    load_all(s)
    b = s.schedule()
    assert sorted(s.slots[x.slot].request_id for x in b.admissions) == ["a", "b"]
    assert all(x.adapter == s.adapters.get(s.slots[x.slot].adapter).slot >= 0 for x in b.admissions)
    assert s.adapters.take_loads() == [] and s.num_waiting == 2


def test_limits():
    pool = AdapterSlots(max_loras=1, max_adapters=2)
    pool.add("a", None, 4, 1)
    with pytest.raises(ValueError, match="already loaded"):
        pool.add("a", None, 4, 1)
    pool.add("b", None, 4, 1)
    with pytest.raises(AdapterLimitError, match="max_cpu_loras = 2"):
        pool.add("c", None, 4, 1)


def test_prefix_cache_keys_on_the_adapter():
    pool = AdapterSlots(2, 8)
    pool.add("ann", None, 16, 100)
    cache = PrefixCache(1 << 20, 10)
    s = Scheduler(EngineConfig(max_slots=4, max_waiting=8, prefill_token_budget=64, first_frame_from_prefill=False),
                  prefix_cache=cache, adapters=pool)

    def run(rid, adapter):
        r = req(rid, adapter, prompt_len=6)
        r.prefix_len = 4
        s.add(r)
        for _ in range(3):
            b = s.schedule()
            load_all(s)
            hits = [x.prefix_hit for x in b.admissions if s.slots[x.slot] is r]
            if hits:
                return hits[0]

    assert run("base", None) is None and run("ann", "ann") is None  # the same frames, another adapter: a miss
    assert len(cache.keys()) == 2 and cache.stats["stores"] == 2
    base_key, ann_key = cache.keys()
    assert run("ann2", "ann") == ann_key and run("base2", None) == base_key


def test_a_request_parked_past_the_wait_limit_is_taken_out():
    """Every pool slot pinned: bob's request is parked; overdue_parked(before) takes out (aborts) the ones parked
    before `before` (the engine ends them with AdapterPoolFullError after max_lora_wait_s), releasing their
    adapter's wait, and leaves the later ones and everything running."""
    import time

    s = sched(max_loras=1, max_slots=3)
    a = req("a", "ann")
    s.add(a)
    s.schedule()
    load_all(s)
    s.schedule()  # a runs with ann (pinned)
    b1, b2 = req("b1", "bob"), req("b2", "bob")
    s.add(b1)
    s.schedule()
    t = time.perf_counter()
    s.add(b2)
    s.schedule()
    assert s.num_parked == 2 and s.adapters.get("bob").waiting == 2
    assert s.overdue_parked(b1.parked_at) == [] and s.num_parked == 2  # none parked before b1 was
    late = s.overdue_parked(t)
    assert late == [b1] and b1.status is S.FINISHED_ABORTED and s.num_parked == 1 and b2.status is S.WAITING
    assert s.adapters.get("bob").waiting == 1 and a.status is S.RUNNING
    assert s.overdue_parked(time.perf_counter()) == [b2] and s.num_parked == 0 and s.num_waiting == 0


def test_a_parked_request_whose_adapter_got_its_slot_waits_for_an_engine_slot():
    """ann's request is parked, its copy then done (a free pool slot left), but the engine slots were taken by base
    requests behind it: past the wait limit it is not taken out (it waits for a slot as a base request does), and
    the first slot that frees is its."""
    import time

    s = sched(max_loras=2, max_slots=2)
    r1 = req("r1")
    s.add(r1)
    s.schedule()
    a, r2, r3 = req("a", "ann"), req("r2"), req("r3")
    for r in (a, r2, r3):
        s.add(r)
    s.schedule()  # ann not resident: a parked (its copy asked for); r2 takes the last engine slot, r3 queued
    assert a.status is S.WAITING and r2.status is not S.WAITING and s.num_parked == 1
    load_all(s)
    assert s.adapters.get("ann").ready and s.adapters.slots.count(None) == 1
    s.schedule()
    assert s.overdue_parked(time.perf_counter()) == [] and a.status is S.WAITING
    s.abort("r1")
    s.schedule()
    assert a.status is not S.WAITING and r3.status is S.WAITING
