"""The launch pacer (EngineConfig.late_launch): when the next frame step is launched, on made-up times."""
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
