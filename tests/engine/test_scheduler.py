"""CPU tests for the scheduler: admission, chunked prefill, finish, abort, one-step-late results."""
from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest


def upd(sched, step, codes):
    """Scheduler.update as per-row records."""
    return sched.update(step, codes).outputs()

from csmserve.config import EngineConfig
from csmserve.engine.request import Batch, Request, RequestStatus
from csmserve.sampling import SamplingParams
from csmserve.engine.scheduler import RequestOutput, Scheduler, SchedulerBusy

S = RequestStatus


def make_req(prompt_len: int = 1, max_frames: int = 100, seed: int | None = 1, rid: str | None = None) -> Request:
    tokens = np.arange(prompt_len * 33, dtype=np.int64).reshape(prompt_len, 33)
    mask = np.ones((prompt_len, 33), dtype=bool)
    params = SamplingParams(seed=seed, max_audio_length_ms=80 * max_frames)
    return Request(tokens, mask, params) if rid is None else Request(tokens, mask, params, request_id=rid)


def make_sched(**kw: int) -> Scheduler:
    # the plain layout: a prompt's last frame enters through its first frame step (first_frame_from_prefill:
    # its own tests below, and the random run)
    return Scheduler(EngineConfig(**{"max_slots": 4, "max_waiting": 8, "prefill_token_budget": 8,
                                     "max_prefill_chunk": 8, "first_frame_from_prefill": False, **kw}))


def frames(n: int, value: int = 7) -> np.ndarray:
    return np.full((n, 32), value, dtype=np.int64)


def eos_rows(batch: Batch, eos_slots: set[int], value: int = 7) -> np.ndarray:
    codes = frames(len(batch.decode_slots), value)
    for row, slot in enumerate(batch.decode_slots):
        if slot in eos_slots:
            codes[row] = 0
    return codes


# ---- admission, slots, counts

def test_admission_fifo_lowest_slot_and_reuse() -> None:
    sched = make_sched(max_slots=2)
    a, b, c = make_req(rid="a"), make_req(rid="b"), make_req(rid="c")
    for r in (a, b, c):
        sched.add(r)
    b1 = sched.schedule()
    assert [adm.slot for adm in b1.admissions] == [0, 1]
    assert (a.slot, b.slot, c.status) == (0, 1, S.WAITING)
    assert b1.decode_slots.tolist() == [0, 1] and b1.prefills == []
    assert (sched.num_waiting, sched.num_running, sched.num_free_slots) == (1, 2, 0)

    b2 = sched.schedule()  # c still waits: no slot free until results come back
    assert b2.admissions == [] and b2.decode_slots.tolist() == [0, 1]
    outs = upd(sched, b1.step, eos_rows(b1, {0}))  # a ends with EOS at its first frame
    assert [(o.request_id, o.finish_reason, o.codes.shape) for o in outs] == [
        ("a", "eos", (0, 32)), ("b", None, (1, 32))]
    assert a.status == S.FINISHED_EOS and a.slot is None and a.num_frames == 0

    b3 = sched.schedule()
    assert [(adm.slot, c.slot) for adm in b3.admissions] == [(0, 0)]
    assert b3.decode_slots.tolist() == [0, 1]
    assert (sched.num_waiting, sched.num_running, sched.num_free_slots) == (0, 2, 0)


def test_one_position_prompt_needs_no_prefill() -> None:
    sched = make_sched()
    r = make_req(prompt_len=1)
    sched.add(r)
    b = sched.schedule()
    (adm,) = b.admissions
    assert b.prefills == [] and b.decode_slots.tolist() == [adm.slot] and r.status == S.RUNNING
    assert adm.first_pos == 0
    np.testing.assert_array_equal(adm.first_tokens, r.tokens[0])
    np.testing.assert_array_equal(adm.first_mask, r.mask[0])


def test_admission_carries_sampling_params_and_last_prompt_frame() -> None:
    sched = make_sched()
    r = Request(np.arange(5 * 33).reshape(5, 33), np.ones((5, 33), bool),
                SamplingParams(temperature=0.5, top_k=7, top_p=0.8, seed=123))
    sched.add(r)
    (adm,) = sched.schedule().admissions
    assert (adm.temperature, adm.top_k, adm.top_p, adm.seed, adm.first_pos) == (0.5, 7, 0.8, 123, 4)
    np.testing.assert_array_equal(adm.first_tokens, r.tokens[4])


def test_seeds_drawn_for_unseeded_and_kept_for_seeded() -> None:
    sched = make_sched(max_slots=8)
    unseeded = [make_req(seed=None) for _ in range(6)]
    seeded = make_req(seed=42)
    for r in [*unseeded, seeded]:
        sched.add(r)
    adms = sched.schedule().admissions
    seeds = [adm.seed for adm in adms]
    assert len(set(seeds[:6])) == 6 and all(0 <= s < 2**63 for s in seeds)
    assert seeds[6] == 42
    assert [r.params.seed for r in [*unseeded, seeded]] == seeds  # recorded on the request for replay


# ---- chunked prefill

def test_prefill_chunks_under_budget_while_running_slots_step() -> None:
    sched = make_sched(prefill_token_budget=8, max_prefill_chunk=8)
    runner = make_req(prompt_len=1, rid="run")
    sched.add(runner)
    assert sched.schedule().decode_slots.tolist() == [0]
    long, short1, short2 = make_req(21, rid="long"), make_req(3, rid="s1"), make_req(4, rid="s2")
    for r in (long, short1, short2):
        sched.add(r)

    plan = []
    for _ in range(5):
        b = sched.schedule()
        assert 0 in b.decode_slots  # the running stream steps every call, whatever the backlog
        assert sum(len(c.tokens) for c in b.prefills) <= 8
        for c in b.prefills:
            req = sched.slots[c.slot]
            np.testing.assert_array_equal(c.tokens, req.tokens[c.start:c.start + len(c.tokens)])
            np.testing.assert_array_equal(c.mask, req.mask[c.start:c.start + len(c.tokens)])
        plan.append(([(c.slot, c.start, len(c.tokens)) for c in b.prefills], b.decode_slots.tolist()))
    assert (long.slot, short1.slot, short2.slot) == (1, 2, 3)
    assert plan == [
        ([(1, 0, 8)], [0]),
        ([(1, 8, 8)], [0]),
        ([(1, 16, 4), (2, 0, 2), (3, 0, 2)], [0, 1, 2]),  # long and s1 complete: they step this same batch
        ([(3, 2, 1)], [0, 1, 2, 3]),
        ([], [0, 1, 2, 3]),
    ]
    assert long.num_prefilled == 20 and long.num_to_prefill == 0


def test_max_prefill_chunk_caps_one_slot_and_leaves_budget_to_the_next() -> None:
    sched = make_sched(prefill_token_budget=10, max_prefill_chunk=4)
    a, b = make_req(11, rid="a"), make_req(3, rid="b")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(c.slot, c.start, len(c.tokens)) for c in batch.prefills] == [(0, 0, 4), (1, 0, 2)]
    assert batch.decode_slots.tolist() == [1] and a.status == S.PREFILLING and b.status == S.RUNNING


# ---- finishing

def test_finish_on_eos_does_not_count_the_zero_frame() -> None:
    sched = make_sched()
    r = make_req()
    sched.add(r)
    steps = [sched.schedule() for _ in range(3)]
    o1 = upd(sched, steps[0].step, frames(1, 5))
    o2 = upd(sched, steps[1].step, frames(1, 0))
    assert [(o.frame_start, o.codes.tolist(), o.finish_reason) for o in o1 + o2] == [
        (0, [[5] * 32], None), (1, [], "eos")]
    assert r.status == S.FINISHED_EOS and r.num_frames == 1 and sched.num_free_slots == 4
    assert upd(sched, steps[2].step, frames(1, 9)) == []  # the frame in flight after EOS is dropped
    assert not sched.has_unfinished()


def test_finish_on_length_schedules_no_frame_past_the_limit() -> None:
    sched = make_sched()
    r = make_req(max_frames=3)
    sched.add(r)
    batches = [sched.schedule() for _ in range(5)]
    assert [b.decode_slots.tolist() for b in batches] == [[0], [0], [0], [], []]
    assert r.status == S.RUNNING and r.slot == 0  # holds the slot until the last frame is back
    outs = [o for b in batches for o in upd(sched, b.step, frames(len(b.decode_slots)))]
    assert [(o.frame_start, o.finish_reason) for o in outs] == [(0, None), (1, None), (2, "length")]
    assert r.status == S.FINISHED_LENGTH and r.num_frames == 3 and sched.num_free_slots == 4


def test_length_limit_also_follows_max_seq_len() -> None:
    sched = make_sched(max_seq_len=10)
    r = make_req(prompt_len=8, max_frames=100)
    sched.add(r)
    assert sched.frame_limit(r) == 3  # frame steps at positions 7, 8, 9
    with pytest.raises(ValueError, match="max_seq_len"):
        sched.add(make_req(prompt_len=11))


def test_abort_waiting() -> None:
    sched = make_sched(max_slots=1)
    a, b = make_req(rid="a"), make_req(rid="b")
    sched.add(a)
    sched.add(b)
    assert sched.abort("b") is b and b.status == S.FINISHED_ABORTED and sched.num_waiting == 1
    assert sched.abort("b") is None and sched.abort("nope") is None
    assert [adm.slot for adm in sched.schedule().admissions] == [0] and a.slot == 0


def test_abort_prefilling_stops_its_chunks_and_frees_the_slot() -> None:
    sched = make_sched(max_slots=1)
    long, nxt = make_req(30, rid="long"), make_req(2, rid="next")
    sched.add(long)
    sched.add(nxt)
    assert [len(c.tokens) for c in sched.schedule().prefills] == [8]
    assert sched.abort("long") is long and long.status == S.FINISHED_ABORTED
    assert sched.num_prefilling == 0 and sched.num_free_slots == 1
    b = sched.schedule()
    assert [adm.slot for adm in b.admissions] == [0]
    assert [(c.slot, c.start, len(c.tokens)) for c in b.prefills] == [(0, 0, 1)] and b.decode_slots.tolist() == [0]


def test_abort_running_drops_frames_in_flight() -> None:
    sched = make_sched(max_slots=1)
    a, b = make_req(rid="a"), make_req(rid="b")
    sched.add(a)
    sched.add(b)
    s1 = sched.schedule()
    assert [o.request_id for o in upd(sched, s1.step, frames(1))] == ["a"]
    s2 = sched.schedule()  # a's second frame is now in flight
    assert sched.abort("a") is a and a.status == S.FINISHED_ABORTED and a.num_frames == 1
    s3 = sched.schedule()  # b takes the slot at once
    assert [adm.slot for adm in s3.admissions] == [0] and s3.decode_slots.tolist() == [0]
    assert upd(sched, s2.step, frames(1, 3)) == []  # a's in-flight frame: dropped, not given to b
    (o,) = upd(sched, s3.step, frames(1, 4))
    assert (o.request_id, o.frame_start, int(o.codes[0, 0])) == ("b", 0, 4)
    assert a.num_frames == 1 and sched.frames_generated(b) == 1


# ---- one step late

def test_late_results_with_the_finished_slot_already_reused() -> None:
    sched = make_sched(max_slots=2)
    a, keep = make_req(rid="a"), make_req(rid="keep")
    sched.add(a)
    sched.add(keep)
    s1 = sched.schedule()
    s2 = sched.schedule()  # in flight while the host reads s1
    assert upd(sched, s1.step, eos_rows(s1, {0}))[0].finish_reason == "eos"  # a ended in s1
    b = make_req(rid="b")
    sched.add(b)
    s3 = sched.schedule()  # b gets a's slot while a's extra frame from s2 is still in flight
    assert b.slot == 0 and s3.decode_slots.tolist() == [0, 1]
    outs = upd(sched, s2.step, np.stack([frames(1, 11)[0], frames(1, 12)[0]]))
    assert [(o.request_id, o.row, o.frame_start) for o in outs] == [("keep", 1, 1)]  # row 0 was a's: dropped
    outs = upd(sched, s3.step, np.stack([frames(1, 21)[0], frames(1, 22)[0]]))
    assert [(o.request_id, o.row, o.frame_start, int(o.codes[0, 0])) for o in outs] == [
        ("b", 0, 0, 21), ("keep", 1, 2, 22)]


def test_update_checks_step_order_and_row_count() -> None:
    sched = make_sched()
    sched.add(make_req())
    s1, s2 = sched.schedule(), sched.schedule()
    with pytest.raises(ValueError, match="rows"):
        upd(sched, s1.step, frames(2))  # rejected without consuming step s1
    with pytest.raises(RuntimeError, match="never came back"):
        upd(sched, s2.step, frames(1))
    assert len(upd(sched, s1.step, frames(1))) == 1 and len(upd(sched, s2.step, frames(1))) == 1


def test_lost_steps_are_skipped_once_their_requests_are_aborted() -> None:
    sched = make_sched()  # the engine's recovery from a failed step: abort everything, drop the results
    r = make_req(rid="r")
    sched.add(r)
    sched.schedule()
    sched.abort("r")
    sched.add(make_req(rid="new"))
    b = sched.schedule()
    (o,) = upd(sched, b.step, frames(1))
    assert o.request_id == "new" and sched.num_inflight_steps == 0


def test_steps_without_frames_need_no_codes() -> None:
    sched = make_sched()
    b = sched.schedule()
    assert b.empty and upd(sched, b.step, frames(0)) == []
    sched.add(make_req(20))
    b = sched.schedule()  # prefill only
    assert b.decode_slots.tolist() == [] and upd(sched, b.step, frames(0)) == []


def test_output_codes_are_copies() -> None:
    sched = make_sched()
    sched.add(make_req())
    b = sched.schedule()
    host = frames(1, 5)
    (o,) = upd(sched, b.step, host)
    host[:] = 9  # the runner reuses its pinned buffer for the next step
    assert int(o.codes[0, 0]) == 5


# ---- backpressure and validation

def test_busy_past_max_waiting_never_blocks() -> None:
    sched = make_sched(max_slots=1, max_waiting=2)
    for _ in range(3):  # one for the free slot, two queued
        sched.add(make_req())
    with pytest.raises(SchedulerBusy, match="busy"):
        sched.add(make_req())
    sched.schedule()  # one moves into the slot
    assert (sched.num_waiting, sched.num_running) == (2, 1)
    with pytest.raises(SchedulerBusy, match="busy"):
        sched.add(make_req())


def test_max_waiting_zero_admits_into_free_slots_and_queues_none() -> None:
    sched = make_sched(max_slots=2, max_waiting=0)
    a, b = make_req(), make_req()
    sched.add(a)
    sched.add(b)
    with pytest.raises(SchedulerBusy):
        sched.add(make_req())
    sched.schedule()
    assert a.admit_time is not None and b.admit_time >= a.arrival_time and sched.num_running == 2


def test_rejects_bad_or_duplicate_requests() -> None:
    sched = make_sched()
    r = make_req(rid="x")
    sched.add(r)
    with pytest.raises(ValueError, match="already"):
        sched.add(make_req(rid="x"))
    with pytest.raises(ValueError, match=r"\[P, 33\]"):
        sched.add(Request(np.zeros((3, 32), np.int64), np.ones((3, 32), bool)))
    with pytest.raises(ValueError, match="1.."):
        sched.add(Request(np.zeros((0, 33), np.int64), np.ones((0, 33), bool)))


# ---- a whole run against a fake runner, with random arrivals, prompts, EOS and aborts

def expected_frame(seed: int, k: int) -> np.ndarray:
    if k == seed % 11:
        return np.zeros(32, np.int64)
    return np.full(32, (seed * 31 + k) % 2047 + 1, np.int64)


class FakeRunner:
    """Models a slot's device state: KV length, first input position, frame counter, seed."""

    def __init__(self, max_slots: int, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len
        self.kv_len = [0] * max_slots
        self.first_pos = [0] * max_slots
        self.frame = [0] * max_slots
        self.seed = [0] * max_slots
        self.from_prefill_steps = 0

    def run(self, batch: Batch) -> np.ndarray:
        for adm in batch.admissions:  # reset the slot's row
            self.kv_len[adm.slot], self.frame[adm.slot] = 0, 0
            self.first_pos[adm.slot], self.seed[adm.slot] = adm.first_pos, adm.seed
        heads = set()
        for c in batch.prefills:
            assert c.start == self.kv_len[c.slot], "prefill chunks must be contiguous"
            self.kv_len[c.slot] += len(c.tokens)
            if c.head:  # it took the last prompt frame too (first_frame_from_prefill)
                heads.add(c.slot)
                assert self.kv_len[c.slot] == self.first_pos[c.slot] + 1, "a head chunk ends at the last prompt frame"
            else:
                assert self.kv_len[c.slot] <= self.first_pos[c.slot], "prefill stops before the last prompt frame"
        assert len(set(batch.decode_slots)) == len(batch.decode_slots)
        # from_prefill: every row's first frame, and every row's prompt completed by a head chunk of this batch
        assert batch.from_prefill == bool(heads)
        assert not batch.from_prefill or set(batch.decode_slots.tolist()) == heads
        rows = []
        for s in batch.decode_slots:
            assert self.kv_len[s] < self.max_seq_len
            if batch.from_prefill:  # its last prompt frame's KV is the prefill's: the step adds none
                assert self.frame[s] == 0 and self.kv_len[s] == self.first_pos[s] + 1
            else:
                assert self.kv_len[s] == self.first_pos[s] + self.frame[s], "frame step before prefill completed"
                self.kv_len[s] += 1
            rows.append(expected_frame(self.seed[s], self.frame[s]))
            self.frame[s] += 1
        self.from_prefill_steps += batch.from_prefill
        return np.stack(rows) if rows else np.zeros((0, 32), np.int64)


@pytest.mark.parametrize("seed", range(5))
def test_random_run_against_fake_runner(seed: int) -> None:
    rng = random.Random(seed)
    cfg = EngineConfig(max_slots=5, max_waiting=6, max_seq_len=64, prefill_token_budget=12, max_prefill_chunk=7)
    sched, runner = Scheduler(cfg), FakeRunner(cfg.max_slots, cfg.max_seq_len)
    got: dict[str, list[np.ndarray]] = {}
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    prev: Batch | None = None
    prev_codes = np.zeros((0, 32), np.int64)

    def collect(outs: list[RequestOutput]) -> None:
        for o in outs:
            assert o.frame_start == sum(len(c) for c in got[o.request_id])
            assert o.request_id not in aborted
            got[o.request_id].append(o.codes)

    for t in range(400):
        if t < 250 and rng.random() < 0.4:
            r = make_req(rng.randint(1, 40), rng.randint(1, 30), rng.choice([None, rng.randrange(1000)]))
            try:
                sched.add(r)
                reqs[r.request_id], got[r.request_id] = r, []
            except SchedulerBusy:
                assert sched.num_waiting == cfg.max_waiting
        if reqs and rng.random() < 0.08:
            victim = rng.choice(list(reqs))
            if sched.abort(victim) is not None:
                aborted.add(victim)
        batch = sched.schedule()
        assert sum(len(c.tokens) for c in batch.prefills) <= cfg.prefill_token_budget
        assert sched.num_running + sched.num_prefilling + sched.num_free_slots == cfg.max_slots
        assert batch.decode_slots.tolist() == sorted(batch.decode_slots.tolist())
        codes = runner.run(batch)
        if prev is not None:
            collect(upd(sched, prev.step, prev_codes))
        prev, prev_codes = batch, codes
    collect(upd(sched, prev.step, prev_codes))
    assert runner.from_prefill_steps > 0  # idle moments: first frames from the prefill's hidden state

    assert not sched.has_unfinished() and sched.num_free_slots == cfg.max_slots and sched.num_inflight_steps == 0
    finished = {S.FINISHED_EOS: 0, S.FINISHED_LENGTH: 0, S.FINISHED_ABORTED: 0}
    for rid, r in reqs.items():
        finished[r.status] += 1
        if r.params.seed is None:  # aborted while waiting: never admitted, nothing produced
            assert r.status == S.FINISHED_ABORTED and not got[rid]
            continue
        out = np.concatenate(got[rid]) if got[rid] else np.zeros((0, 32), np.int64)
        want = [expected_frame(r.params.seed, k) for k in range(sched.frame_limit(r))]
        eos_at = next((k for k, f in enumerate(want) if not f.any()), None)
        want = np.stack(want[:eos_at]) if eos_at != 0 else np.zeros((0, 32), np.int64)
        if r.status == S.FINISHED_ABORTED:
            np.testing.assert_array_equal(out, want[:len(out)])
        else:
            assert r.status == (S.FINISHED_EOS if eos_at is not None else S.FINISHED_LENGTH)
            np.testing.assert_array_equal(out, want)
        assert r.num_frames == len(out)
    assert all(n > 0 for n in finished.values()), finished


def test_first_frames_from_the_prefill_take_the_last_prompt_frame_into_it():
    """first_frame_from_prefill (the default): on a step whose rows all make their first frame and whose prefill
    completes all their prompts, each final chunk takes the prompt's last frame too (head) and the batch is
    from_prefill; a request joining running ones, or a prefill over the budget with that frame, keeps the plain
    layout."""
    s = make_sched(first_frame_from_prefill=True, prefill_token_budget=12, max_prefill_chunk=12)
    a, b = make_req(5, 4), make_req(3, 4)
    s.add(a)
    s.add(b)
    b0 = s.schedule()
    assert [(c.slot, c.start, len(c.tokens), c.head) for c in b0.prefills] == [(0, 0, 5, True), (1, 0, 3, True)]
    np.testing.assert_array_equal(b0.prefills[0].tokens, a.tokens)
    assert b0.first_frames and b0.from_prefill and b0.decode_slots.tolist() == [0, 1]
    b1 = s.schedule()
    assert not b1.first_frames and not b1.from_prefill
    c = make_req(4, 4)
    s.add(c)  # joins two running rows: the plain layout
    b2 = s.schedule()
    assert [(len(ch.tokens), ch.head) for ch in b2.prefills] == [(3, False)]
    assert not b2.first_frames and not b2.from_prefill
    # alone on an idle engine, but its final chunk fills the budget: no room for the last frame
    s2 = make_sched(first_frame_from_prefill=True, prefill_token_budget=8, max_prefill_chunk=8)
    s2.add(make_req(9, 4))
    b = s2.schedule()
    assert [(len(ch.tokens), ch.head) for ch in b.prefills] == [(8, False)]
    assert b.first_frames and not b.from_prefill
    # a prompt of one frame has nothing to prefill: its first frame is a plain step
    s3 = make_sched(first_frame_from_prefill=True)
    s3.add(make_req(1, 4))
    b = s3.schedule()
    assert not b.prefills and b.first_frames and not b.from_prefill


def test_a_rebuild_keeps_the_request_s_own_context_while_it_fits():
    """max_seq_len 40, a 20-frame context (a voice's clip), segments of 3 text frames and 8 of audio: segment 1
    does not fit after segment 0, so the slot is prefilled again from 0 with room 30. The context fits: it comes
    first (segment 0 does not fit beside it). It was dropped, for this and every later segment, because no segment
    fitted beside it."""
    K = 32

    def frames(n: int, tag: int) -> tuple[np.ndarray, np.ndarray]:
        t = np.zeros((n, K + 1), np.int64)
        t[:, K] = tag * 100 + np.arange(n) + 1
        m = np.zeros((n, K + 1), bool)
        m[:, K] = True
        return t, m

    s = Scheduler(EngineConfig(max_slots=1, max_seq_len=40, prefill_token_budget=64, max_prefill_chunk=64,
                               first_frame_from_prefill=False))
    ctx, t0, t1 = frames(20, 9), frames(3, 1), frames(3, 2)
    req = Request(np.concatenate([ctx[0], t0[0]]), np.concatenate([ctx[1], t0[1]]),
                  SamplingParams(seed=1, max_audio_length_ms=None, max_segment_length_ms=8 * 80),
                  segments=deque([t1]), context_len=20)
    s.add(req)
    prev = None
    for _ in range(20):
        b = s.schedule()
        if prev is not None:
            s.update(prev.step, np.full((len(prev.decode_slots), K), 5, np.int64))
        prev = b
        if b.resumes:
            break
    assert req.segment == 1 and req.prompt_start == 0  # prefilled again from position 0
    np.testing.assert_array_equal(req.tokens[:20], ctx[0])
    np.testing.assert_array_equal(req.tokens[20:], t1[0])
