"""When to launch frame step N+1 while step N runs (the engine's loop, engine/engine.py).

Launched early (right after step N), N+1 only holds requests that arrived before step N started;
launched just before N ends, it also takes those that arrived during N: one frame step less time to
first audio under load. The pacer aims at the end of the running step, less twice the host's launch
cost and a safety share of the step, from the measured step time (the shorter of its running mean
and the last step, so a batch that shrank never waits on an old estimate). No estimate, or a host
that did not have to wait for the last step (it is the bottleneck): launch at once.
"""
from __future__ import annotations


class LaunchPacer:
    def __init__(self, safety: float = 0.15) -> None:
        self.safety = safety
        self.step_s: float | None = None  # running mean of the time between step ends
        self.last_s: float | None = None  # the last such time
        self.launch_s = 0.0  # running mean of the host's drain + schedule + launch time
        self.step_started: float | None = None  # when the step now running began (its predecessor ended)

    def step_done(self, t: float, waited: bool) -> None:
        """A step's results were read at t; `waited`: the host had to wait for them (so t ~ its end)."""
        if not waited:
            self.step_started = None
            return
        if self.step_started is not None:
            dt = t - self.step_started
            if self.step_s is None or dt < 3 * self.step_s:  # a gap after idling is not a step
                self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt
                self.last_s = dt
        self.step_started = t

    def launched(self, cost_s: float) -> None:
        self.launch_s = cost_s if self.launch_s == 0.0 else 0.8 * self.launch_s + 0.2 * cost_s

    def idle(self) -> None:
        """Nothing in flight: the next launch is not paced."""
        self.step_started = None

    def launch_at(self) -> float | None:
        """The time to launch the next step at, or None (now)."""
        if self.step_started is None or self.step_s is None:
            return None
        step = min(self.step_s, self.last_s)
        return self.step_started + step * (1 - self.safety) - 2 * self.launch_s
