"""Admission at scale in the engine core: how many requests per second it admits while thousands of
streams run, and what the admissions cost the frame step.

    python bench/admission.py --model dummy --streams 2000 --rate 1000 --seconds 8

The engine runs as in the engine-core process: its loop on a thread, every step's rows pickled once
per client (4 stand-in API workers) as they would leave the process, nothing else. First `--streams`
long requests are admitted and run alone (the baseline: frame step time, rows per step); then, while
they run, short requests (a `--prompt`-frame text prompt, `--frames` frames of audio) arrive at
`--rate` per second (Poisson). Printed: requests admitted per second (first frame out), time from
submit to first frame p50 / p99, frame step time and rows per step with and without the arrivals.
"""
from __future__ import annotations

import argparse
import pickle
import sys
import threading
import time

import numpy as np
import torch

from csmserve.apps.bench.engine import short_prompt
from csmserve.config import EngineConfig
from csmserve.engine.engine import build_engine
from csmserve.engine.outputs import CLIENT_SHIFT
from csmserve.engine.request import Request
from csmserve.sampling import SamplingParams


class _Probe:
    """emit(): records each request's first frame (vectorised over the step's rows), each step's time
    and rows, and pickles the step per client as the engine-core process does."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.steps: dict[int, list] = {}  # step id -> [time, rows]

    def __call__(self, client: int, step, out) -> None:
        now = time.perf_counter()
        pickle.dumps(step, protocol=5)
        if step.step > 0 and len(step.rows):
            rec = self.steps.setdefault(step.step, [now, 0])
            rec[1] += len(step.rows)
            new = step.handles[(step.frame_start == 0) & step.has_frame]
            for h in new.tolist():  # rows that start: one entry each
                self.first.setdefault(h, now)


def run(args: argparse.Namespace) -> dict:
    from csmserve.api import CSM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = EngineConfig(max_slots=args.streams + args.spare, max_seq_len=args.max_seq_len, max_waiting=100_000,
                       prefill_token_budget=args.prefill_budget)
    csm = CSM(args.model, device=device, dtype=args.dtype, codec_dtype=args.codec_dtype, engine_config=cfg)
    probe = _Probe()
    emit_clients = 4
    t0 = time.perf_counter()
    engine = build_engine(csm.model, csm.mimi, cfg, start=True, emit=probe)
    print(f"engine: {cfg.max_slots} slots, built in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    n = 0

    def make(frames: int, prompt: int) -> Request:
        nonlocal n
        r = Request(*short_prompt(prompt, csm.model.cfg.text_vocab_size),
                    SamplingParams(temperature=0.9, top_k=50, seed=n, max_audio_length_ms=80 * frames))
        r.handle = ((n % emit_clients) << CLIENT_SHIFT) | n
        n += 1
        return r

    longs = [make(10**6 // 80, args.prompt) for _ in range(args.streams)]
    for r in longs:
        engine.submit(r)
    while len(probe.first) < args.streams:  # every long stream running
        time.sleep(0.05)
    base_steps = _window(probe, engine, args.warmup, args.seconds / 2)
    shorts = [make(args.frames, args.prompt) for _ in range(int(args.rate * args.seconds * 1.2) + 10)]
    submitted: dict[int, float] = {}
    stop = threading.Event()

    def arrivals() -> None:
        t = time.perf_counter()
        for r in shorts:
            if stop.is_set():
                return
            t += rng.exponential(1.0 / args.rate)
            d = t - time.perf_counter()
            if d > 0:
                time.sleep(d)
            submitted[r.handle] = time.perf_counter()
            engine.submit(r)

    th = threading.Thread(target=arrivals, daemon=True)
    th.start()
    load_steps = _window(probe, engine, 1.0, args.seconds)
    stop.set()
    th.join()
    t_end = time.perf_counter()
    # the same step without arrivals at more rows: the frame step's cost per row, to compare the loaded
    # step with an idle one of as many rows (arrivals add rows: their own frame steps)
    more = [make(10**6 // 80, args.prompt) for _ in range(args.extra_streams)]
    for r in more:
        engine.submit(r)
    while sum(1 for r in more if r.handle in probe.first) < len(more):
        time.sleep(0.05)
    time.sleep(1.0)  # the arrivals' requests have ended
    base2 = _window(probe, engine, args.warmup, args.seconds / 2)
    lat = [probe.first[h] - t for h, t in submitted.items() if h in probe.first and t < t_end - 1.0]
    admitted = sum(1 for h, t in submitted.items() if h in probe.first and t_end - 1.0 - args.seconds < t < t_end - 1.0)
    engine.shutdown()
    res = {"streams": args.streams, "rate": args.rate, "admitted_per_s": admitted / args.seconds,
           "ttf_p50_ms": 1e3 * float(np.percentile(lat, 50)) if lat else float("nan"),
           "ttf_p99_ms": 1e3 * float(np.percentile(lat, 99)) if lat else float("nan"),
           "base_step_ms": base_steps[0], "base_rows": base_steps[1],
           "load_step_ms": load_steps[0], "load_rows": load_steps[1],
           "base2_step_ms": base2[0], "base2_rows": base2[1]}
    per_row = (base2[0] - base_steps[0]) / max(1.0, base2[1] - base_steps[1])  # ms per extra row
    res["same_rows_ms"] = base_steps[0] + per_row * (load_steps[1] - base_steps[1])
    print("| streams | arrivals/s | admitted/s | submit to first frame p50 / p99 (ms) | step alone (ms, rows) "
          "| step alone, more rows (ms, rows) | step with arrivals (ms, rows) | alone at as many rows (ms) "
          "| slower by |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {res['streams']} | {res['rate']:.0f} | {res['admitted_per_s']:.0f} | {res['ttf_p50_ms']:.1f} / "
          f"{res['ttf_p99_ms']:.1f} | {res['base_step_ms']:.2f} ({res['base_rows']:.0f}) | "
          f"{res['base2_step_ms']:.2f} ({res['base2_rows']:.0f}) | "
          f"{res['load_step_ms']:.2f} ({res['load_rows']:.0f}) | {res['same_rows_ms']:.2f} | "
          f"{100 * (res['load_step_ms'] / res['same_rows_ms'] - 1):+.1f}% |", flush=True)
    return res


def _window(probe: _Probe, engine, warmup: float, seconds: float) -> tuple[float, float]:
    """(mean ms per step, mean rows per step) over `seconds` after `warmup`; prints the host's share."""
    time.sleep(warmup)
    st = dict(engine.stats)
    t0 = time.perf_counter()
    time.sleep(seconds)
    t1 = time.perf_counter()
    steps = sorted(v for v in list(probe.steps.values()) if t0 <= v[0] <= t1)
    if len(steps) < 2:
        return float("nan"), float("nan")
    ms = 1e3 * (steps[-1][0] - steps[0][0]) / (len(steps) - 1)
    n = engine.stats["steps"] - st["steps"]
    host = 1e3 * (engine.stats["host_s"] - st["host_s"]) / max(1, n)
    bound = (engine.stats["gpu_bound_steps"] - st["gpu_bound_steps"]) / max(1, n)
    print(f"  window: {n} steps, {ms:.2f} ms per step, host {host:.2f} ms per step, "
          f"the host waited for the device in {100 * bound:.0f}% of steps", flush=True)
    return ms, float(np.mean([r for _, r in steps]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="admission", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--codec-dtype", default=None)
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--spare", type=int, default=512, help="slots beyond the long streams, for the arrivals")
    ap.add_argument("--extra-streams", type=int, default=256, help="long streams added for the second baseline")
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--frames", type=int, default=2, help="frames each arriving request generates")
    ap.add_argument("--prompt", type=int, default=16, help="prompt frames of every request")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--prefill-budget", type=int, default=2048)
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
