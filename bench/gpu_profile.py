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
