"""engine/outputs.py's Router: one EngineStep's rows -> each stream's chunks.

The Router scatters a step's rows into per-stream buffers without a Python loop over rows; these tests hold it
to a plain per-row reference (`_Reference`, the rule written out row by row) over many streams with ragged
starts and ends, long-form segments, EOS rows, aborts, errors, rows of streams that are not open and shuffled
row orders, and check what any correct router must do (every frame once, in order, to its own stream, PCM with
its codes). Then the growth of chunks with a stream's lead over real time (`max_chunk_frames`, `grow_lead_s`).
"""
from __future__ import annotations

import numpy as np
import pytest

from csmserve.config import EngineConfig
from csmserve.engine.outputs import EV_ERROR, EV_FINAL, EngineStep, Event, Progress, Router, SlowReaderError

K, FS = 4, 8
_REASONS = (None, "eos", "length")


def _step(handles, frame_start, final=None) -> EngineStep:
    n = len(handles)
    z = np.zeros(n, np.int64)
    return EngineStep(1, 0, np.arange(n), np.asarray(handles, np.int64), np.asarray(frame_start, np.int64), z,
                      np.ones(n, bool), np.zeros(n, np.uint8), np.zeros(n, bool) if final is None else final)


def test_rows_with_a_request_s_first_frame_are_delivered_before_the_others():
    router = Router(K, first_chunk_frames=1, chunk_frames=1)
    got: list[tuple[str, int]] = []
    for h in (1, 2, 3, 4):
        router.open(h, f"r{h}", lambda c, h=h: got.append((c.request_id, c.frame_start)))
    codes = np.arange(4 * K).reshape(4, K)
    pcm = np.zeros((4, FS), np.float32)
    # rows 0 and 2 continue their streams (frames 7, 3); rows 1 and 3 are new requests' first frames
    router.deliver(_step([1, 2, 3, 4], [7, 0, 3, 0]), codes, pcm)
    assert [r for r, _ in got] == ["r2", "r4", "r1", "r3"]
    # each stream still gets its own row's codes
    got.clear()
    seen = {}
    for h in (1, 2, 3, 4):
        router.streams[h].sink = lambda c, h=h: seen.__setitem__(h, c.codes.copy())
    router.deliver(_step([1, 2, 3, 4], [8, 1, 4, 1]), codes, pcm)
    assert all(np.array_equal(seen[h], codes[i:i + 1]) for i, h in enumerate((1, 2, 3, 4)))


class _Reference:
    """The chunking rule, row by row (what the Router did before it was vectorised)."""

    def __init__(self, first: int, chunk: int) -> None:
        self.first, self.chunk, self.s = first, chunk, {}

    def open(self, h: int, sink) -> None:
        self.s[h] = {"sink": sink, "codes": [], "pcm": [], "emitted": 0, "segment": 0, "chunks": 0}

    def _flush(self, st, final, reason, segment_end=None) -> None:
        codes = np.concatenate(st["codes"]) if st["codes"] else np.zeros((0, K), np.int64)
        audio = np.concatenate(st["pcm"]) if st["pcm"] else np.zeros(0, np.float32)
        st["sink"]((codes, audio, st["emitted"], final, reason, st["segment"],
                    segment_end or (reason if final else None)))
        st["emitted"] += len(codes)
        st["chunks"] += 1
        st["codes"], st["pcm"] = [], []

    def deliver(self, out: EngineStep, codes, pcm) -> None:
        for i in np.argsort(out.frame_start != 0, kind="stable"):
            st = self.s.get(int(out.handles[i]))
            if st is None:
                continue
            if out.has_frame[i]:
                st["codes"].append(codes[i:i + 1])
                st["pcm"].append(pcm[i])
            end = int(out.end[i])
            if out.final[i]:
                del self.s[int(out.handles[i])]
                self._flush(st, True, _REASONS[end])
            elif end:
                self._flush(st, False, None, segment_end=_REASONS[end])
                st["segment"], st["chunks"] = int(out.segment[i]) + 1, 0
            elif len(st["codes"]) >= (self.first if st["chunks"] == 0 else self.chunk):
                self._flush(st, False, None)
        for ev in out.events:
            st = self.s.pop(ev.handle, None)
            if st is None:
                continue
            if ev.kind == EV_FINAL:
                st["segment"] = ev.segment
                self._flush(st, True, ev.payload)
            else:
                st["sink"](("error", ev.payload[1]))


def _as_tuple(c):
    if isinstance(c, BaseException):
        return ("error", str(c))
    return (c.codes, c.audio, c.frame_start, c.final, c.finish_reason, c.segment, c.segment_end)


def _script(seed: int, streams: int, steps: int):
    """Steps of a random workload: per step the rows (handle, frame, segment, has_frame, end, final), in a random
    order (with stray rows of streams not open here), the events, and the handles opened before it. Each row's codes say whose frame it is: [h, frame, seg, 1]."""
    rng = np.random.default_rng(seed)
    plan = {}
    for h in range(1, streams + 1):
        plan[h] = {"start": int(rng.integers(0, steps // 2)), "segments": [int(x) for x in rng.integers(0, 7, rng.integers(1, 4))],
                   "eos": [bool(x) for x in rng.random(3) < 0.5], "abort": rng.random() < 0.15,
                   "error": rng.random() < 0.05, "pause": int(rng.integers(0, 3))}
    state = {h: {"seg": 0, "f": 0, "sf": 0, "done": False, "wait": 0} for h in plan}
    out = []
    for s in range(steps):
        opens = [h for h in plan if plan[h]["start"] == s]
        rows, events = [], []
        for h, p in plan.items():
            st = state[h]
            if st["done"] and rng.random() < 0.1:  # a row of a request this client dropped (aborted, failed, done)
                rows.append((h, st["f"], st["seg"], True, 0, False))
            if s <= p["start"] or st["done"]:
                continue
            if st["wait"]:  # a long-form stream between segments: no rows (its next prompt prefills)
                st["wait"] -= 1
                continue
            if (p["abort"] or p["error"]) and rng.random() < 0.08:
                events.append(Event(h, EV_FINAL if p["abort"] else EV_ERROR,
                                    "abort" if p["abort"] else ("RuntimeError", f"failed {h}"), st["seg"]))
                st["done"] = True
                continue
            seg_len, last_seg = p["segments"][st["seg"]], st["seg"] == len(p["segments"]) - 1
            if st["sf"] < seg_len:  # a frame; the segment's last one ends it by length unless it ends by EOS
                end = 2 if st["sf"] + 1 == seg_len and not p["eos"][st["seg"]] else 0
                rows.append((h, st["f"], st["seg"], True, end, bool(end) and last_seg))
                st["f"] += 1
                st["sf"] += 1
            else:  # the all-zero frame: the segment ends by EOS (a length end came with its last frame)
                end = 1
                rows.append((h, st["f"], st["seg"], False, 1, last_seg))
            if end:
                if last_seg:
                    st["done"] = True
                else:
                    st["seg"] += 1
                    st["sf"] = 0
                    st["wait"] = p["pause"]
        for _ in range(int(rng.integers(0, 3))):  # rows of requests this client never opened (or closed)
            rows.append((int(rng.integers(10_000, 10_010)), 5, 0, True, 0, False))
        rng.shuffle(rows)
        out.append((opens, rows, events))
    return out


def _run(router_or_ref, script, first_only_opens=True):
    got: dict[int, list] = {}
    order: list[tuple[int, int]] = []
    wakes: list[dict[int, int]] = []
    for s, (opens, rows, events) in enumerate(script):
        for h in opens:
            def sink(c, h=h):
                got.setdefault(h, []).append(c)
                order.append((s, h))
                wakes[-1][h] = wakes[-1].get(h, 0) + 1
            router_or_ref.open(h, f"r{h}", sink) if isinstance(router_or_ref, Router) else router_or_ref.open(h, sink)
        m = len(rows)
        a = np.array([r[:3] for r in rows], np.int64).reshape(m, 3)
        codes = np.concatenate([a, np.ones((m, 1), np.int64)], axis=1)  # [M, K] whose frame it is
        pcm = (a[:, :1] * 1000 + a[:, 1:2]).astype(np.float32) + np.arange(FS, dtype=np.float32) / 100  # [M, FS]
        step = EngineStep(s, 0, np.arange(m), a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(),
                          np.array([r[3] for r in rows], bool).reshape(m), np.array([r[4] for r in rows], np.uint8).reshape(m),
                          np.array([r[5] for r in rows], bool).reshape(m), events)
        wakes.append({})
        router_or_ref.deliver(step, codes, pcm)
    return got, order, wakes


@pytest.mark.parametrize("seed", range(12))
def test_many_ragged_streams_chunk_as_the_per_row_rule(seed):
    rng = np.random.default_rng(100 + seed)
    first, chunk = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    script = _script(seed, streams=int(rng.integers(5, 90)), steps=40)
    got, order, wakes = _run(Router(K, first, chunk), script)
    ref, ref_order, _ = _run(_Reference(first, chunk), script)
    assert order == ref_order  # the same streams woken, in the same order, in the same steps
    assert set(got) == set(ref)
    for h in ref:
        mine = [_as_tuple(c) for c in got[h]]
        assert len(mine) == len(ref[h]), h
        for a, b in zip(mine, ref[h]):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, (h, a, b)
    assert all(n == 1 for w in wakes for n in w.values())  # one wake-up per consumer per step


@pytest.mark.parametrize("seed", range(6))
def test_every_frame_reaches_its_own_stream_once_in_order(seed):
    """Independent of the reference: a stream's chunks hold exactly the frames sent to it, in order, with their
    own PCM; chunks never span segments; the last chunk (and only it) is final."""
    script = _script(1000 + seed, streams=120, steps=50)
    sent: dict[int, list] = {}
    opened = {h for opens, _, _ in script for h in opens}
    done: set[int] = set()
    for opens, rows, events in script:
        for h, f, seg, has, _, final in rows:
            if has and h in opened and h not in done:
                sent.setdefault(h, []).append((f, seg))
            if final:
                done.add(h)
        done |= {ev.handle for ev in events}
    got, _, _ = _run(Router(K, 2, 3), script)
    for h, chunks in got.items():
        chunks = [c for c in chunks if not isinstance(c, BaseException)]
        frames = [(int(r[1]), int(r[2])) for c in chunks for r in c.codes]
        assert all(int(r[0]) == h for c in chunks for r in c.codes)  # never another stream's frame
        if chunks and chunks[-1].final:
            assert frames == sent.get(h, [])
        else:  # failed: what it got before is a prefix of what was sent
            assert frames == sent.get(h, [])[:len(frames)]
        for c in chunks:
            assert {int(r[2]) for r in c.codes} <= {c.segment}  # one segment per chunk
            want = (np.repeat(c.codes[:, 0] * 1000 + c.codes[:, 1], FS).astype(np.float32)
                    + np.tile(np.arange(FS, dtype=np.float32) / 100, len(c.codes)))
            np.testing.assert_array_equal(c.audio, want)  # each frame's own PCM, in its order
        starts = [c.frame_start for c in chunks]
        assert starts == [int(x) for x in np.cumsum([0] + [len(c.codes) for c in chunks])[:len(chunks)]]
        assert [c.final for c in chunks].count(True) <= 1 and (not any(c.final for c in chunks[:-1]))


def test_streams_past_the_first_slab_keep_their_frames():
    """The slab grows (64 stream rows, then 128, ...) while streams have frames pending; a closed stream's row is
    reused by a new one without its frames."""
    router = Router(K, first_chunk_frames=3, chunk_frames=3)
    got: dict[int, list] = {}
    for h in range(50):
        router.open(h, "r", lambda c, h=h: got.setdefault(h, []).append(c.codes[:, 0].tolist()))
    frame = lambda hs: np.array([[h, 0, 0, 0] for h in hs], np.int64)  # noqa: E731
    router.deliver(_step(list(range(50)), [1] * 50), frame(range(50)), np.zeros((50, FS), np.float32))
    for h in range(50, 200):  # two regrowths with every first stream holding a frame
        router.open(h, "r", lambda c, h=h: got.setdefault(h, []).append(c.codes[:, 0].tolist()))
    router.deliver(_step(list(range(200)), [2] * 50 + [0] * 150), frame(range(200)), np.zeros((200, FS), np.float32))
    fin = np.zeros(200, bool)
    fin[:50] = True
    router.deliver(_step(list(range(200)), [3] * 50 + [1] * 150, final=fin), frame(range(200)),
                   np.zeros((200, FS), np.float32))
    assert all(got[h] == [[h] * 3] for h in range(50))  # 3 frames, across both regrowths
    router.open(500, "r", lambda c: got.setdefault(500, []).append(c.codes[:, 0].tolist()))  # a freed row
    router.deliver(_step([500], [0], final=np.array([True])), frame([500]), np.zeros((1, FS), np.float32))
    assert got[500] == [[500]]
    assert not any(h in got for h in range(50, 200))
    router.deliver(_step(list(range(50, 200)), [2] * 150), frame(range(50, 200)), np.zeros((150, FS), np.float32))
    assert all(got[h] == [[h] * 3] for h in range(50, 200))  # their first chunk: 3 frames


def test_a_router_of_the_engine_s_capacity_never_regrows():
    """Router.of: the slab holds max_slots + max_waiting streams from the first open, so opening up to that many
    never copies it (a regrowth's copy at 2,048 -> 4,096 rows held the delivering thread 0.5 s)."""
    router = Router.of(EngineConfig(max_slots=300, max_waiting=100), K)
    router.open(0, "r", lambda c: None)
    router.deliver(_step([0], [0]), np.zeros((1, K), np.int64), np.zeros((1, FS), np.float32))
    codes, pcm = router._codes, router._pcm
    for h in range(1, 400):
        router.open(h, "r", lambda c: None)
    assert router._codes is codes and router._pcm is pcm and len(router._n) == 400
    router.open(400, "r", lambda c: None)  # past it: doubled, as without a capacity
    assert len(router._n) == 800


def test_a_reader_far_behind_real_time_is_dropped():
    t = [0.0]
    aborted = []
    router = Router(K, 1, 1, abort=aborted.append, clock=lambda: t[0])
    got = []
    progress = Progress()
    router.open(7, "slow", got.append, max_lag_s=1.0, progress=progress)
    for f in range(40):  # generated at 4x real time; the consumer takes nothing
        t[0] += 0.02
        router.deliver(_step([7], [f]), np.ones((1, K), np.int64), np.zeros((1, FS), np.float32))
        if aborted:
            break
    assert aborted == [] and not isinstance(got[-1], BaseException)  # ahead of real time is not behind
    for f in range(40, 80):
        t[0] += 0.2  # now far slower than the audio: playback would have passed what the reader took
        router.deliver(_step([7], [f]), np.ones((1, K), np.int64), np.zeros((1, FS), np.float32))
        if aborted:
            break
    assert aborted == ["slow"] and isinstance(got[-1], SlowReaderError) and 7 not in router.streams


# ---- chunks growing with the lead (EngineConfig.max_chunk_ms, chunk_grow_lead_ms)

def _play(step_s: list[float], first: int = 1, chunk: int = 2, max_chunk: int = 12, grow_lead_s: float = 0.5):
    """One stream whose frame k is made at sum(step_s[:k+1]): -> [(arrival time, frames)] of its chunks."""
    t = [0.0]
    router = Router(K, first, chunk, max_chunk_frames=max_chunk, grow_lead_s=grow_lead_s, clock=lambda: t[0])
    chunks = []
    router.open(1, "r", lambda c: chunks.append((t[0], len(c.codes))))
    for k, dt in enumerate(step_s):
        t[0] += dt
        fin = np.array([k == len(step_s) - 1])
        router.deliver(_step([1], [k], final=fin), np.ones((1, K), np.int64), np.zeros((1, FS), np.float32))
    return chunks


def _dry_s(chunks, buffer_s: float = 0.0) -> float:
    """Seconds a player starting buffer_s after the first chunk's arrival runs out of audio (80 ms a frame)."""
    t0, have, dry = chunks[0][0] + buffer_s, 0.0, 0.0
    for t, frames in chunks:
        due = max(0.0, t - t0 - dry)  # audio played by now, had it never stopped
        if due > have:
            dry += due - have
        have += frames * 0.08
    return dry


def test_chunks_grow_with_the_lead_up_to_the_bound():
    chunks = _play([0.02] * 300)  # 4x real time
    sizes = [n for _, n in chunks]
    assert sizes[0] == 1 and sizes[1] == 2  # the first chunk as ever; then chunk_frames until the lead is there
    assert max(sizes) == 12 and all(n <= 12 for n in sizes)  # bounded (max_chunk_frames)
    assert sizes.index(12) < 40  # reached in a few seconds of audio
    # each chunk after the first: max(chunk_frames, (lead - grow_lead) / 2 frames) from the lead when the one before
    # it went out, at most the bound (the last chunk ends the stream early)
    sent = 0
    for (t_prev, n_prev), (_, n) in zip(chunks[:-2], chunks[1:-1]):
        sent += n_prev
        lead = sent * 0.08 - (t_prev - chunks[0][0])
        want = max(2, min(12, int((lead - 0.5) / 0.16))) if lead > 0.5 else 2
        assert n == want, (t_prev, lead, n, want)
    assert len(chunks) < 300 / 8  # far fewer messages than 150 at 2 frames


def test_no_growth_at_real_time_or_under_the_lead_threshold():
    assert {n for _, n in _play([0.08] * 200)[1:-1]} == {2}  # at real time the lead never builds
    assert {n for _, n in _play([0.1] * 200)[1:-1]} == {2}  # slower than real time
    assert {n for _, n in _play([0.02] * 200, max_chunk=2)[1:-1]} == {2}  # the bound at chunk_frames: off


@pytest.mark.parametrize("seed", range(8))
def test_growth_never_makes_playback_run_dry(seed):
    """Against fixed chunks on the same step times: fast stretches (a lead builds) then the engine slowing to
    and past real time (up to 2.5 frames of audio a step), with jitter: growth adds no dry time at all."""
    rng = np.random.default_rng(seed)
    steps: list[float] = []
    for _ in range(6):
        steps += list(np.clip(rng.normal(rng.uniform(0.01, 0.2), 0.01, int(rng.integers(10, 80))), 0.001, None))
    grown, fixed = _play(steps), _play(steps, max_chunk=2)
    assert max(n for _, n in grown) <= 12
    assert _dry_s(grown) <= _dry_s(fixed) + 1e-9
    # and at or faster than real time a player with a 300 ms buffer never runs dry, whatever the chunk sizes
    fast = list(np.clip(rng.normal(0.05, 0.02, 300), 0.001, 0.08))
    assert _dry_s(_play(fast), buffer_s=0.3) == 0.0


def test_a_segment_s_first_chunk_stays_small_and_chunks_never_span_segments():
    t = [0.0]
    router = Router(K, 1, 2, max_chunk_frames=12, grow_lead_s=0.5, clock=lambda: t[0])
    chunks = []
    router.open(1, "r", chunks.append)
    seg, f = 0, 0
    for k in range(200):  # 4x real time; a segment ends by length every 50 frames
        t[0] += 0.02
        end = (k + 1) % 50 == 0
        step = EngineStep(k, 0, np.arange(1), np.array([1]), np.array([f]), np.array([seg]), np.ones(1, bool),
                          np.array([2 if end else 0], np.uint8), np.array([end and k == 199]))
        router.deliver(step, np.array([[f, seg, 0, 1]]), np.zeros((1, FS), np.float32))
        f += 1
        seg += end
    by_seg = {}
    for c in chunks:
        assert set(c.codes[:, 1].tolist()) <= {c.segment}
        by_seg.setdefault(c.segment, []).append(len(c.codes))
    assert sorted(by_seg) == [0, 1, 2, 3]
    for s, sizes in by_seg.items():
        assert sizes[0] == 1 and sum(sizes) == 50  # the seam's first chunk is small (time to audio after it)
    assert max(max(v) for v in by_seg.values()) > 2  # and they grew within a segment
    assert [c.segment_end for c in chunks if c.segment_end] == ["length"] * 4


def test_the_engine_config_sets_the_growth():
    r = Router.of(EngineConfig(chunk_frames=3, max_chunk_ms=400, chunk_grow_lead_ms=200), K)
    assert (r.first_chunk_frames, r.chunk_frames, r.max_chunk_frames, r.grow_lead_s) == (1, 3, 5, 0.2)
    assert Router.of(EngineConfig(chunk_frames=3, max_chunk_ms=0), K).max_chunk_frames == 3  # off
    assert Router.of(EngineConfig(), K).max_chunk_frames == 12  # the default: 1 s at most (960 ms)
    for bad in ({"max_chunk_ms": -1}, {"chunk_grow_lead_ms": -5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
