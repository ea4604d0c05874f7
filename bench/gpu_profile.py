"""torch.profiler over a few eager calls of a GPU step: the bench scripts' shared measurement."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def cuda_profile(step: Callable[[], object], reps: int = 3) -> tuple[profile, int, float]:
    """Warm up `reps` calls, profile `reps` more -> (the profile, kernels per call, GPU ms per call)."""
    with torch.inference_mode():
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                step()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return prof, len(events) // reps, sum(e.device_time for e in events) / reps / 1e3


def graph_timed(fn: Callable[[], object], reps: int, tries: int = 5) -> float:
    """fn (`reps` calls of one kernel) captured as a CUDA graph, replayed `tries` times -> the best us per call."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(tries):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1e3 / reps)
    return best
