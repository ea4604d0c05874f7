"""The launch pacer (engine/pacing.py): when the next frame step is launched, on made-up times."""
import sys
from pathlib import Path

import pytest

from csmserve.engine.pacing import LaunchPacer


def test_no_estimate_no_pacing_then_just_before_the_running_step_ends():
    p = LaunchPacer(safety=0.1)
    assert p.launch_at() is None
    p.launched(0.001)
    p.step_done(10.000, waited=True)
    assert p.launch_at() is None  # one end seen: no step time yet
    p.step_done(10.010, waited=True)  # steps of 10 ms
    # the step now running began at 10.010: launch 10 ms later, less 10% and twice the launch cost
    assert p.launch_at() == pytest.approx(10.010 + 0.010 * 0.9 - 0.002)


def test_a_shorter_last_step_is_trusted_at_once_and_a_gap_is_not_a_step():
    p = LaunchPacer(safety=0.0)
    for t in (0.0, 0.010, 0.020, 0.030):
        p.step_done(t, waited=True)
    p.step_done(0.034, waited=True)  # the batch shrank: 4 ms steps now
    assert p.launch_at() == pytest.approx(0.034 + 0.004)
    p.idle()
    assert p.launch_at() is None
    p.step_done(5.0, waited=True)  # after idling: the gap is no step time
    p.step_done(5.004, waited=True)
    assert p.step_s < 0.011 and p.launch_at() == pytest.approx(5.004 + 0.004)


def test_a_host_that_did_not_wait_launches_at_once():
    p = LaunchPacer()
    p.step_done(0.0, waited=True)
    p.step_done(0.01, waited=True)
    assert p.launch_at() is not None
    p.step_done(0.05, waited=False)  # the host is the bottleneck: its read time says nothing of the GPU
    assert p.launch_at() is None


def test_the_engine_paces_from_the_generations_end_with_the_codec_on_its_own_stream():
    """With Mimi's decode on its own stream a step's results are read when the decode ends, but the next
    step may start when the generation ended, `codec_lag_s` earlier: that is the step end the pacer learns."""
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from host_step import StandInRunner, _Out, _request  # bench/host_step.py
    from csmserve.config import EngineConfig
    from csmserve.engine.engine import Engine

    class Lagged(_Out):
        def done(self) -> bool:
            return False  # the host waits for every step: the GPU sets the pace

        def codec_lag_s(self) -> float:
            return 0.003

    class Runner(StandInRunner):
        def step(self, slots, step_id=-1, from_prefill=False):
            out = super().step(slots, step_id)
            return None if out is None else Lagged(out.slots, out.codes, out.pcm)

    cfg = EngineConfig(max_slots=4, max_seq_len=4096)
    engine = Engine(Runner(cfg.max_slots), cfg, start=False, emit=lambda c, step, out: None)
    seen = []
    step_done = engine.pacer.step_done
    engine.pacer.step_done = lambda t, waited: (seen.append(time.perf_counter() - t), step_done(t, waited))
    engine.submit(_request(1, 0, 10**6))
    for _ in range(6):
        engine.step()
    assert len(seen) >= 4
    assert all(0.003 <= d < 0.003 + 0.05 for d in seen), seen
