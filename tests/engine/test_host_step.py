"""The host's work per engine step stays vectorised: bounded at 2,048 rows with a stand-in runner.

Measured on an idle 2-core CPU at commit time: ~5-9 ms per step on the engine side and ~3-6 ms on one
worker's router (a quarter of the rows) at 2,048 rows with 80 admissions per step (bench/host_step.py).
The bound is generous (loaded CI machines) but a per-row Python loop creeping back into the engine
step (tens of microseconds per row) would pass it.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from host_step import measure  # noqa: E402 (bench/host_step.py)


def test_host_time_per_step_at_2048_rows_is_bounded():
    m = measure(2048, clients=4, admit=80, steps=10)
    assert m["engine_ms"] < 60, m
    assert m["router_ms"] < 60, m
    assert m["chunks"] > 0


def test_host_time_grows_far_less_than_the_rows():
    small, large = measure(64, clients=4, admit=0, steps=10), measure(2048, clients=4, admit=0, steps=10)
    # 32x the rows: per-row Python objects would make it ~32x; vectorised it is a few x
    assert large["engine_ms"] < 12 * max(small["engine_ms"], 0.5), (small, large)
