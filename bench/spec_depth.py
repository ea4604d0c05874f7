"""What draft/verify over codebooks (EngineConfig.spec_depth = k) costs on the real shape, per k and batch.

Random weights' heads do not agree, so their acceptance rate says nothing about sesame/csm-1b; here
acceptance is *set*: every draft is accepted with probability a (Speculator.forced_acceptance, the
rule's own uniform; not exact, timing only) and the frame step is replayed from its CUDA graph at
a = 0, 0.5, 0.8, 1. Printed per k and batch: ms per frame plain and with speculation at each a, the
cost of one verify pass (the slope of frame time over verify passes) against k single depth steps,
and the acceptance rate at which k breaks even with the plain step (measured: interpolated between
the a's; model: iid acceptance, the slowest row of the batch sets the passes).

    python bench/spec_depth.py                       # k 2..8, batches 1, 64, 2048
    python bench/spec_depth.py --ks 2,4 --batches 1,8 --weights fp8
"""
from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from csmserve.engine.request import Admission
from csmserve.engine.runner import ModelRunner
from csmserve.engine.speculate import Speculator

ALPHAS = (0.0, 0.5, 0.8, 1.0)


def rounds_distribution(alpha: float, k: int, remaining: int) -> np.ndarray:
    """P(a row needs n verify passes), n = 0..remaining, for iid acceptance alpha (engine/speculate.py:
    a pass commits the accepted drafts and one more code; drafts past the last codebook do not exist)."""
    out = np.zeros(remaining + 1)
    state = {remaining: 1.0}
    for n in range(1, remaining + 1):
        nxt: dict[int, float] = {}
        for r, pr in state.items():
            nv = min(k, r)
            for i in range(nv + 1):
                pi = alpha ** i * (1 - alpha) if i < nv else alpha ** nv
                commits = i + 1 if i < nv else nv + (1 if r > nv else 0)
                left = r - commits
                if left <= 0:
                    out[n] += pr * pi
                else:
                    nxt[left] = nxt.get(left, 0.0) + pr * pi
        state = nxt
    return out


def expected_passes(alpha: float, k: int, remaining: int, batch: int) -> float:
    """E[max over the batch's rows of their verify passes]: the graph runs until the slowest row is done."""
    cdf = np.cumsum(rounds_distribution(alpha, k, remaining))
    return float(sum(1 - cdf[n - 1] ** batch for n in range(1, remaining + 1)))


def time_step(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    W = runner.cfg.frame_width
    tok, mask = np.zeros(W, np.int64), np.zeros(W, bool)
    mask[-1] = True
    slots = list(range(batch))
    runner.admit([Admission(s, tok, mask, context, 0.9, 50, 1.0, s) for s in slots])
    for _ in range(2):
        runner.step(slots).wait()
    torch.cuda.synchronize()
    t = time.perf_counter()
    runner.step(slots).wait()
    est = time.perf_counter() - t
    n = max(3, min(steps, int(1.5 / max(est, 1e-4))))  # ~1.5 s per point at most
    t = time.perf_counter()
    prev = None
    for _ in range(n):
        out = runner.step(slots)
        if prev is not None:
            prev.wait()
        prev = out
    prev.wait()
    return (time.perf_counter() - t) / n * 1e3


def capture(runner: ModelRunner, spec: Speculator | None) -> None:
    from csmserve.engine.slots import DepthKV

    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.spec = spec
    runner.depth_kv = spec.kv if spec is not None else DepthKV(runner.cfg, runner.buckets[-1], runner.dtype,
                                                                runner.device)
    runner.graphs = runner.frame_graphs()


def break_even_measured(alphas, times, plain) -> str:
    if times[0] <= plain:
        return "0 (always faster)"
    for (a0, t0), (a1, t1) in zip(zip(alphas, times), zip(alphas[1:], times[1:])):
        if t1 <= plain < t0:
            return f"{a0 + (t0 - plain) / (t0 - t1) * (a1 - a0):.2f}"
    return "never (slower at 1.0)"


def break_even_model(a: float, c: float, k: int, remaining: int, batch: int, plain: float) -> str:
    t = lambda alpha: a + c * expected_passes(alpha, k, remaining, batch)  # noqa: E731
    if t(0.0) <= plain:
        return "0"
    if t(1.0) > plain:
        return "never"
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t(mid) > plain else (lo, mid)
    return f"{hi:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="2,3,4,5,6,7,8")
    ap.add_argument("--batches", default="1,64,2048")
    ap.add_argument("--context", type=int, default=256, help="backbone positions already in each slot")
    ap.add_argument("--steps", type=int, default=20, help="timed frame steps per point (fewer past ~1.5 s)")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp8-all"])
    ap.add_argument("--model", default="dummy", help="dummy (random full-size weights) or a checkpoint")
    args = ap.parse_args()
    from csmserve.models.loader import load_csm

    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    model = load_csm(args.model, "cuda", torch.bfloat16)[0]
    runner = ModelRunner(model, num_slots=max(batches), max_seq_len=args.context + 64, buckets=batches,
                         use_graphs=False, weights=args.weights)
    K = model.cfg.num_codebooks
    remaining = K - 2  # codebooks after the first depth pass: at most this many verify passes
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, model {args.model}, weights "
          f"{args.weights}, context {args.context}", flush=True)
    capture(runner, None)
    plain = {b: time_step(runner, b, args.context, args.steps) for b in batches}
    print("\n| batch | plain frame step (ms) |\n|---|---|")
    for b in batches:
        print(f"| {b} | {plain[b]:.2f} |", flush=True)
    print("\n| k | batch | plain (ms) | " + " | ".join(f"spec, acceptance {a:g} (ms)" for a in ALPHAS)
          + " | verify pass (ms) | k single depth steps (ms) | break-even acceptance, measured | model |")
    print("|---" * (len(ALPHAS) + 7) + "|")
    alpha = torch.zeros((), device="cuda")
    for k in ks:
        spec = Speculator(model, k, runner.buckets[-1])
        spec.forced_acceptance = alpha
        t0 = time.perf_counter()
        capture(runner, spec)
        cap = time.perf_counter() - t0
        for b in batches:
            times = []
            for a in ALPHAS:
                alpha.fill_(a)
                times.append(time_step(runner, b, args.context, args.steps))
            passes = np.array([expected_passes(a, k, remaining, b) for a in ALPHAS])
            slope, icept = np.polyfit(passes, np.array(times), 1)  # ms = icept + slope * passes
            single = slope - (times[0] - plain[b]) / remaining  # spec at 0 runs `remaining` passes for as many steps
            print(f"| {k} | {b} | {plain[b]:.2f} | " + " | ".join(f"{t:.2f}" for t in times)
                  + f" | {slope:.3f} | {k * single:.3f} | {break_even_measured(ALPHAS, times, plain[b])} | "
                  f"{break_even_model(icept, slope, k, remaining, b, plain[b])} |", flush=True)
        print(f"<!-- k={k}: graphs captured in {cap:.1f}s, conditional nodes {spec.conditional} -->", flush=True)


if __name__ == "__main__":
    main()
