"""The bench scripts' shared measurements: torch.profiler over a few eager calls of a GPU step, a kernel's time in a
CUDA graph, the runner's frame step over random full-size weights."""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
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


def dummy_model() -> torch.nn.Module:
    """CSM-1B's shape with random weights (`--model dummy`), bf16 on the GPU."""
    from csmserve.models.loader import load_csm

    return load_csm("dummy", "cuda", torch.bfloat16)[0]


def sampler_inputs(B: int, V: int = 2048, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """kernels/sampler.py's inputs for B rows of V codes (the sampleable ones: CSMConfig.sampleable_codes) ->
    (logits [B, V] in dtype, temperature 0.9, top_k 50, top_p 1, seeds, frame indices), each [B] but the logits."""
    logits = (torch.randn(B, V, device="cuda") * 3).to(dtype)
    t = torch.full((B,), 0.9, device="cuda")
    k = torch.full((B,), 50, device="cuda")
    p = torch.ones(B, device="cuda")
    seed = torch.randint(0, 2**62, (B,), device="cuda")
    frame = torch.randint(0, 500, (B,), device="cuda")
    return logits, t, k, p, seed, frame


def admit_rows(runner, slots: list[int], context: int, adapters: list[int] | None = None) -> None:
    """Start a row at each slot as if `context` positions were prefilled (a text-only frame; its slot as its seed;
    adapters: each row's LoRA pool slot, else none): the rows the frame-step timings step."""
    from csmserve.engine.request import Admission

    W = runner.model.cfg.frame_width
    tok, mask = np.zeros(W, np.int64), np.zeros(W, bool)
    mask[-1] = True
    runner.admit([Admission(s, tok, mask, context, 0.9, 50, 1.0, s, adapter=a)
                  for s, a in zip(slots, adapters or [-1] * len(slots))])


def frame_step_ms(runner, slots: list[int], steps: int, warmup: int = 3) -> float:
    """The runner's frame step over the admitted rows at `slots`: `warmup` steps, then `steps` with the next always
    launched before the last is waited for (as the engine runs them) -> mean ms per step."""
    for _ in range(warmup):
        runner.step(slots).wait()
    torch.cuda.synchronize()
    t = time.perf_counter()
    prev = None
    for _ in range(steps):
        out = runner.step(slots)
        if prev is not None:
            prev.wait()
        prev = out
    prev.wait()
    return (time.perf_counter() - t) / steps * 1e3


class _Adapter:  # what the runner reads of engine/adapters.py's Adapter
    def __init__(self, weights) -> None:
        self.weights = weights


def load_pool(runner, model, rank: int, n: int) -> None:
    """n random adapters of `rank` (every projection) into the runner's LoRA pool slots 0..n-1."""
    from csmserve.models.lora import random_adapter

    for slot in range(n):
        runner.load_loras([(slot, _Adapter(random_adapter(model.cfg, rank, seed=slot).pin()))])
    torch.cuda.synchronize()
    assert len(runner.lora_loads_done()) == n


def spread(b: int, adapters: int) -> list[int]:
    """b rows' pool slots: the first `adapters` slots in contiguous runs (the scheduler's order), or all -1."""
    return [s * adapters // b if adapters else -1 for s in range(b)]
