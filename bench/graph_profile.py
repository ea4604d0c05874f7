"""Where a graphed frame step's time goes, as it runs in the engine: torch.profiler (CUPTI) over replays of the
runner's frame graphs, each kernel charged with the wall time it holds the head of the chain.

python bench/graph_profile.py --batches 1,4,16 --weights fp8-all [--codec] [--no-codec-stream]
python bench/graph_profile.py --batches 1,64 --adapters 64 --lora-rank 16   # the LoRA kernels' share (issue 42)
python bench/graph_profile.py --batches 2048 --adapters 64 --by-grid   # and which call sites (a grid each)

An eager profile times every kernel alone; in the graphs, PDL kernels start while the
one before still runs (docs/benchmarks.md, issue 16), so a kernel's own duration counts its wait too. Here the
kernels of each replay, sorted by start, are walked once: a kernel is charged from when the ones before it had all
ended (or its own start, if later) to its end; time with nothing running is the gap. Per kernel name: calls per
frame, mean duration, charged us per frame, and the frame's total, busy and gap time. With the codec stream (Mimi's
decode on a second stream beside the next generation) the two chains interleave and the charges mix: pass
--no-codec-stream, or leave out --codec, to read one chain.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict

import torch

from gpu_profile import admit_rows, dummy_model, load_pool, spread

from csmserve.engine.runner import ModelRunner


def charge(kernels: list[tuple[float, float, str]]) -> tuple[dict[str, float], float, float]:
    """kernels [(start, duration, name)] of one stretch -> ({name: charged us}, busy us, gap us)."""
    out: dict[str, float] = defaultdict(float)
    t, gap = None, 0.0
    for s, d, n in sorted(kernels):
        e = s + d
        if t is None:
            t = s
        if s > t:
            gap += s - t
            t = s
        if e > t:
            out[n] += e - t
            t = e
    return out, sum(out.values()), gap


def _name(event: dict, by_grid: bool) -> str:
    grid = event.get("args", {}).get("grid")
    return f"{event['name'][:60]} {grid}" if by_grid and grid else event["name"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--frames", type=int, default=5, help="replays profiled per batch")
    ap.add_argument("--rows", type=int, default=20, help="kernel names printed per batch")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp8-all"])
    ap.add_argument("--codec", action="store_true", help="include Mimi's streaming decode")
    ap.add_argument("--no-codec-stream", action="store_true", help="Mimi's decode in the frame's one graph")
    ap.add_argument("--adapters", type=int, default=0, help="random LoRA adapters spread over each batch's rows")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--by-grid", action="store_true", help="a kernel per (name, launch grid): which of a kernel's "
                    "call sites the time is in")
    args = ap.parse_args()
    from csmserve.models.llama import fuse_elementwise

    fuse_elementwise()
    batches = [int(b) for b in args.batches.split(",")]
    model = dummy_model()
    mimi = None
    if args.codec:
        from csmserve.models.mimi_loader import load_mimi

        mimi = load_mimi("dummy", dtype=torch.bfloat16, device="cuda")
    n = max(batches)
    runner = ModelRunner(model, num_slots=n, max_seq_len=512, buckets=batches, mimi=mimi, weights=args.weights,
                         codec_stream=not args.no_codec_stream, max_loras=args.adapters,
                         max_lora_rank=args.lora_rank)
    if args.adapters:
        load_pool(runner, model, args.lora_rank, args.adapters)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, weights {args.weights}, codec {args.codec}, "
          f"codec stream {runner.codec_stream is not None}, adapters {args.adapters} of rank {args.lora_rank}")
    for b in batches:
        admit_rows(runner, list(range(n)), args.context, spread(b, min(args.adapters, b)) + [-1] * (n - b))
        slots = list(range(b))
        for _ in range(3):
            runner.step(slots).wait()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.frames):
                runner.step(slots).wait()
                time.sleep(0.003)  # the GPU idles 3 ms between two frames: where one frame's kernels end
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            ev = json.load(f)["traceEvents"]
        kernels = sorted((float(e["ts"]), float(e.get("dur", 0)), _name(e, args.by_grid)) for e in ev
                         if e.get("cat") == "kernel")
        # one frame = the kernels between two gaps of > 1 ms (the host's sleep)
        frames, cur, end = [], [], 0.0
        for k in kernels:
            if cur and k[0] - end > 1000:
                frames.append(cur)
                cur = []
            cur.append(k)
            end = max(end, k[0] + k[1])
        if cur:
            frames.append(cur)
        per_name: dict[str, list[float]] = defaultdict(list)
        charged: dict[str, float] = defaultdict(float)
        busy = gap = span = 0.0
        for fr in frames:
            c, bu, g = charge(fr)
            for nme, t in c.items():
                charged[nme] += t / len(frames)
            busy, gap = busy + bu / len(frames), gap + g / len(frames)
            span += (max(s + d for s, d, _ in fr) - fr[0][0]) / len(frames)
            for s, d, nme in fr:
                per_name[nme].append(d)
        nf = len(frames)
        print(f"\n## batch {b}: {nf} frames, {len(kernels) / max(nf, 1):.0f} kernels a frame, span {span:.0f} us, "
              f"charged {busy:.0f} us, gaps {gap:.0f} us")
        print("| kernel | calls a frame | mean us | charged us a frame | share |")
        print("|---|---|---|---|---|")
        for nme, t in sorted(charged.items(), key=lambda kv: -kv[1])[:args.rows]:
            ds = per_name[nme]
            w = 70 + 20 * args.by_grid
            print(f"| {nme[:w]} | {len(ds) / nf:.0f} | {sum(ds) / len(ds):.2f} | {t:.0f} | {t / max(span, 1e-9):.1%} |")


if __name__ == "__main__":
    main()
