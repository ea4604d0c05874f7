"""An idle engine's time to first audio on one timeline: the host's launches (CUDA runtime calls) and the
GPU's busy spans between a request's submit and its first chunk, from torch.profiler (CUPTI) traces.

python bench/ttfa_timeline.py --weights fp8-all --probes 4 --out DIR

Per probe: when the first runtime call and the first kernel came after submit, each busy span of the GPU
(kernels closer than --gap-us merged) with its kernel count and widest kernel, each graph launch, and the
first chunk's arrival (the engine thread's callback). Times in us from submit.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
import time

import torch

from csmserve.apps.bench import engine as eb


def spans(kernels: list[tuple[float, float, str]], gap: float) -> list[list]:
    """[start, end, count, widest name, widest us] per run of kernels with gaps < gap."""
    out: list[list] = []
    for s, d, n in sorted(kernels):
        if out and s - out[-1][1] < gap:
            o = out[-1]
            o[1], o[2] = max(o[1], s + d), o[2] + 1
            if d > o[4]:
                o[3], o[4] = n, d
        else:
            out.append([s, s + d, 1, n, d])
    return out


def main() -> None:
    ap = eb.add_arguments(argparse.ArgumentParser())
    ap.add_argument("--probes-traced", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--gap-us", type=float, default=8.0)
    ap.add_argument("--trace-dir", default=None, help="keep the chrome trace (gzipped) here")
    args = ap.parse_args()
    args.sweep = args.sweep or "1"
    args.probes = 8
    eb._fill_defaults(args)
    from csmserve.config import EngineConfig
    from csmserve.engine.engine import Engine
    from csmserve.engine.runner import ModelRunner

    model, codec, _ = eb.build(args, getattr(torch, args.dtype))
    eb.TEXT_VOCAB[0] = model.cfg.text_vocab_size
    cfg = EngineConfig(max_slots=8, max_seq_len=args.max_seq_len, prefill_token_budget=2048, weights=args.weights,
                       codec_stream=not args.no_codec_stream)
    runner = ModelRunner(model, 8, args.max_seq_len, mimi=codec, max_prefill_tokens=2048, weights=cfg.weights,
                         codec_stream=cfg.codec_stream)
    engine = Engine(runner, cfg)
    print(f"weights {args.weights}, codec stream {runner.codec_stream is not None}, prompt {args.prompt_len} frames")
    for _ in range(6):  # warm
        eb.submit(engine, 4, args.prompt_len).done.wait()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    probes, marks = [], []
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.probes_traced):
            time.sleep(0.05)  # idle: the engine blocks on its inbox
            with torch.profiler.record_function("probe_mark"):
                t_mark = time.perf_counter()
            p = eb.submit(engine, 4, args.prompt_len)
            p.done.wait()
            probes.append(p)
            marks.append(t_mark)
    engine.shutdown()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        with open(path, "rb") as f, gzip.open(os.path.join(args.trace_dir, f"ttfa_{args.weights}.json.gz"), "wb") as g:
            g.write(f.read())
    mark_ts = sorted(e["ts"] for e in ev if e.get("name") == "probe_mark")
    kernels = [(float(e["ts"]), float(e.get("dur", 0)), e["name"]) for e in ev
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [(float(e["ts"]), float(e.get("dur", 0)), e["name"]) for e in ev if e.get("cat") == "cuda_runtime"]
    ttfas = []
    for i, (p, t_mark) in enumerate(zip(probes, marks)):
        base = mark_ts[i] + (p.submit - t_mark) * 1e6  # trace us of the submit
        end = base + p.ttfa * 1e6
        ttfas.append(p.ttfa * 1e3)
        ks = [(s - base, d, n) for s, d, n in kernels if base <= s <= end]
        rs = [(s - base, d, n) for s, d, n in runtime if base <= s <= end]
        print(f"\n## probe {i}: TTFA {p.ttfa * 1e3:.2f} ms; {len(ks)} GPU ops, {len(rs)} runtime calls")
        if rs:
            print(f"first runtime call at {rs[0][0]:.0f} us ({rs[0][2]})")
        for s, d, n in rs:
            if "Graph" in n or "Synchronize" in n or "EventSynchronize" in n or d > 50:
                print(f"  host {s:8.0f} +{d:6.0f} us  {n}")
        busy = 0.0
        for s, e, c, n, d in spans(ks, args.gap_us):
            busy += e - s
            print(f"  gpu  {s:8.0f} .. {e:8.0f} us ({e - s:7.0f}): {c:5d} ops, widest {d:.0f} us {n[:70]}")
        print(f"gpu busy {busy:.0f} us of {p.ttfa * 1e6:.0f}; first chunk at {p.ttfa * 1e6:.0f} us")
    ttfas.sort()
    print(f"\nTTFA ms (profiled, so slower than unprofiled): {', '.join(f'{t:.2f}' for t in ttfas)}")


if __name__ == "__main__":
    main()
