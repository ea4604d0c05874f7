"""The load benchmark's pieces that need no server: the jitter-buffer model, scenario specs, /metrics parsing,
and the summary of records."""
import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from csmserve.apps.bench import engine as eb
from csmserve.apps.bench.serve import report
from csmserve.apps.bench.serve.users import Playback, Scenario, parse_scenario, ran_dry


def stream(arrivals):
    p = Playback()
    for t, audio in arrivals:
        p.arrive(t, audio)
    return p


def test_real_time_stream_never_runs_dry():
    # 80 ms of audio every 80 ms, the first at t=1: playback never waits
    p = stream([(1 + 0.08 * k, 0.08 * (k + 1)) for k in range(50)])
    assert p.t_first == 1 and p.audio == pytest.approx(4.0)
    assert p.worst_lag == pytest.approx(0.0, abs=1e-9) and not ran_dry(p.worst_lag, 0.1)


def test_a_stall_runs_a_small_buffer_dry():
    # 0.32 s of audio at once, then nothing new for 0.5 s: playback of 0.32 s needs more at 0.32 + B
    arrivals = [(0.0, 0.32), (0.2, 0.32), (0.5, 0.64), (0.6, 2.0)]
    p = stream(arrivals)
    assert p.worst_lag == pytest.approx(0.5 - 0.32)
    assert ran_dry(p.worst_lag, 0.1) and not ran_dry(p.worst_lag, 0.3)


def test_slower_than_real_time_runs_any_buffer_dry_eventually():
    p = stream([(0.1 * k, 0.08 * (k + 1)) for k in range(100)])  # 0.8x real time
    assert ran_dry(p.worst_lag, 0.3)


def test_scenario_specs():
    base = Scenario(users=8, format="pcm", duration=5)
    s = parse_scenario("burst:users=2048,within=3", base)
    assert (s.mode, s.users, s.within, s.format, s.duration) == ("burst", 2048, 3.0, "pcm", 5)
    assert s.window(100.0) == (100.0, 103.0) and s.start_offset(1024) == pytest.approx(1.5)
    w = parse_scenario("ws:fresh=1,voices=4", base)
    assert w.fresh and w.voices == 4 and w.name == "ws 8 ws fresh 4v"
    c = parse_scenario("closed:format=mp3,ramp=10,warmup=2,duration=20", base)
    assert c.window(0.0) == (12.0, 32.0) and c.start_offset(4) == pytest.approx(5.0)
    for bad in ("nope", "closed:users", "closed:users=0", "closed:format=ogg", "closed:colour=red",
                "ws:fresh=maybe"):
        with pytest.raises(ValueError):
            parse_scenario(bad, base)


METRICS_BEFORE = """# HELP x
csmserve:time_to_first_audio_seconds_bucket{le="0.05",model_name="m"} 0.0
csmserve:time_to_first_audio_seconds_bucket{le="0.1",model_name="m"} 0.0
csmserve:time_to_first_audio_seconds_bucket{le="+Inf",model_name="m"} 0.0
csmserve:request_errors_total{model_name="m",status="503"} 1.0
csmserve:num_requests_running{model_name="m"} 0.0
csmserve:generated_frames_total{model_name="m"} 100.0
"""
METRICS_AFTER = """csmserve:time_to_first_audio_seconds_bucket{le="0.05",model_name="m"} 50.0
csmserve:time_to_first_audio_seconds_bucket{le="0.1",model_name="m"} 100.0
csmserve:time_to_first_audio_seconds_bucket{le="+Inf",model_name="m"} 100.0
csmserve:request_errors_total{model_name="m",status="503"} 4.0
csmserve:num_requests_running{model_name="m"} 7.0
csmserve:generated_frames_total{model_name="m"} 1100.0
csmserve:prefix_cache_hits_total{model_name="m"} 12.0
"""


def test_metrics_histogram_and_summary():
    before, after = report.parse(METRICS_BEFORE), report.parse(METRICS_AFTER)
    buckets = report.histogram_delta(before, after, report.TTFA)
    assert buckets[-1] == (float("inf"), 100.0)
    assert report.quantile(buckets, 0.5) == pytest.approx(0.05)
    assert report.quantile(buckets, 0.99) == pytest.approx(0.05 + 0.05 * 49 / 50)
    s = report.server_summary(before, after, [(1.0, before), (2.0, after), (3.0, after)], 1.0, 3.0)
    assert s["ttfa_count"] == 100 and s["ttfa_p50_ms"] == pytest.approx(50.0)
    assert s["errors"] == {"503": 3.0} and s["running_max"] == 7.0 and s["frames_per_s"] == 500.0
    assert s["prefix"] == {"csmserve:prefix_cache_hits_total": 12.0}
    assert report.server_summary(None, after, [], 0, 1) is None


def test_summary_of_records():
    sc = Scenario(mode="closed", users=2, ramp=0, warmup=0, duration=10)
    # kind, user, t_send, t_first, t_end, status, server_error, audio_s, first_audio_s, worst_lag, counted, detail
    records = [
        ["speech", 0, 0.5, 0.55, 5.0, "ok", False, 10.0, 0.08, 0.0, True, ""],
        ["speech", 1, 1.0, 1.2, 6.0, "ok", False, 10.0, 0.08, 0.2, True, ""],
        ["speech", 0, 5.0, None, 5.1, "http 503 server_busy", False, 0.0, 0.0, 0.0, True, ""],
        ["speech", 1, 6.0, 6.1, 12.0, "cut", False, 3.0, 0.08, 0.0, True, ""],
        ["speech", 0, 11.0, 11.1, 20.0, "ok", False, 10.0, 0.08, 0.0, False, ""],  # outside the window
    ]
    workers = [{"cpu_s": 1.0, "wall_s": 10.0, "lag_ms": {"p50": 1.0, "p99": 5.0, "max": 9.0}}]
    s = report.summarize(sc, records, 0.0, workers, None)
    assert s["requests"] == {"counted": 4, "ok": 2, "cut": 1, "all": 5, "per_s": 0.2}
    assert s["ttfa_ms"]["n"] == 3 and s["ttfa_ms"]["p50"] == pytest.approx(100.0)
    assert s["dry"] == {"100ms": 1, "300ms": 0, "of": 2}
    rates = sorted((10.0 - 0.08) / (t_end - t_first) for t_first, t_end in ((0.55, 5.0), (1.2, 6.0)))  # ok, counted
    assert s["audio_rate"] == {"p1": round(rates[0] + 0.01 * (rates[1] - rates[0]), 2),
                               "p50": round(sum(rates) / 2, 2)}
    assert s["errors"] == {"http 503 server_busy": 1}
    assert s["clients"]["cpu_per_proc_max"] == 0.1 and s["clients"]["loop_lag_p99_ms"] == 5.0
    assert "closed 2 pcm" in report.row(s) and "1 of 2" in report.row(s)



# ---- the engine tables against a fake engine: one frame per live request every STEP_S (every stream at 100
# frames/s, whatever the concurrency)
STEP_S = 0.01


class FakeEngine:
    def __init__(self, fail=False):
        self.runner = SimpleNamespace(cfg=SimpleNamespace(text_vocab_size=258))
        self.stats = {"steps": 0, "frames": 0}
        self.live, self.lock, self.stop, self.fail = [], threading.Lock(), threading.Event(), fail
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def submit(self, req, cb):
        if self.fail:  # e.g. "prompt is 12 frames; it must be 1..8 (max_seq_len)"
            cb(ValueError("prompt too long"))
            return
        with self.lock:
            self.live.append([cb, req.params.max_audio_length_ms // 80])

    def _loop(self):
        while not self.stop.is_set():
            time.sleep(STEP_S)
            with self.lock:
                live, self.live = self.live, []
                for item in live:
                    cb, left = item
                    item[1] -= 1
                    cb(SimpleNamespace(codes=np.zeros((1, 32), np.int64), final=item[1] == 0))
                    self.stats["frames"] += 1
                    if item[1] > 0:
                        self.live.append(item)
                self.stats["steps"] += 1

    def shutdown(self):
        self.stop.set()


def test_per_stream_fps_counts_the_streams_own_frames():
    """One load stream at 100 frames/s: the probes sent meanwhile are another stream, not its frames (1.6x)."""
    e = FakeEngine()
    try:
        r = eb.sweep_point(e, n=1, frames=300, probes=16)
    finally:
        e.shutdown()
    print(r)
    assert r["per_stream_fps"] == pytest.approx(1 / STEP_S, rel=0.15), r


def test_a_failed_request_is_one_error_line_not_a_traceback():
    """Every request failing in the engine (`--max-seq-len 8`, say): RuntimeError "request failed: ...", the
    command's one line (it was a TypeError's traceback in Probe.ttfa)."""
    e = FakeEngine(fail=True)
    try:
        with pytest.raises((RuntimeError, ValueError)):
            eb.one_stream(e, 24, probes=5)
    finally:
        e.shutdown()


def test_sweep_point_does_not_hang_on_a_failed_request():
    e = FakeEngine(fail=True)
    out = {}
    def run():
        try:
            out["r"] = eb.sweep_point(e, 2, 8, 2)
        except RuntimeError as err:
            out["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5)
    e.shutdown()
    assert not t.is_alive(), "sweep_point still waiting after 5 s for requests that already failed"
    assert "request failed" in str(out.get("error", ""))


def test_a_client_whose_parent_is_gone_stops_its_users():
    """stdin's EOF (the bench killed) queues "exit": the users stop as on "stop" (they went on loading the server)."""
    from csmserve.apps.bench.serve.users import Run, Scenario, run_users

    async def main():
        run = Run("http://127.0.0.1:9", ["x"], [], sc=Scenario(users=1, duration=1, ramp=0, warmup=0))
        user = asyncio.create_task(asyncio.sleep(3600))  # a user that keeps sending requests
        commands: asyncio.Queue = asyncio.Queue()
        commands.put_nowait({"cmd": "exit"})  # what read_stdin queues at EOF (the parent died)
        await asyncio.wait_for(run_users(run, commands, [user], 0.05, lambda: None), 3)
        assert user.cancelled()

    asyncio.run(main())
