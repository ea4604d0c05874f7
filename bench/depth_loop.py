"""The persistent depth loop (kernels/depth_loop.py) alone, where its time goes: us per launch (codebooks 2..31 at
1 and 2 rows) for each variant of its options, then per phase kind the time each phase holds the grid, the
busiest and the median program's work, and the barrier's release (the first program's start of the next phase
after the last arrival), from %globaltimer / %clock64 stamps (DepthLoop(timing=True)). Random full-size weights.

python bench/depth_loop.py --rows 1,2 --variants "default;CSMSERVE_DEPTH_LOOP_PREFETCH=0" --phases default
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from csmserve.engine.slots import DepthKV
from csmserve.models.sampler import sample


def _variant(spec: str) -> tuple[dict, dict]:
    """'A=1,warps=4' -> (env, DepthLoop kwargs): lower-case keys are kwargs."""
    env, kw = {}, {}
    for item in filter(None, spec.split(",")):
        if item == "default":
            continue
        k, v = item.split("=")
        (kw if k.islower() else env)[k] = int(v) if k.islower() else v
    return env, kw


def _loop(model, kv, spec, timing=False):
    from csmserve.kernels.depth_loop import DepthLoop

    env, kw = _variant(spec)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if "per_sm" in kw:
            kw["programs"] = kw.pop("per_sm") * torch.cuda.get_device_properties(0).multi_processor_count
        return DepthLoop(model, kv.k, kv.v, timing=timing, **kw)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _phases(loop, M, args_) -> None:
    loop(*args_)
    torch.cuda.synchronize()
    t = loop.times.cpu().numpy().astype(np.float64)  # [phases, P, 4]: start ns, end ns, start cyc, end cyc
    L = loop.d.n_layers
    per = 2 + 5 * L
    n = (loop.phases - 1) // per * per  # whole steps (the last phase samples only)
    cyc_ns = (t[n - 1, 0, 3] - t[0, 0, 2]) / (t[n - 1, 0, 1] - t[0, 0, 0])  # program 0 SM clock, cycles/ns
    work = (t[:, :, 3] - t[:, :, 2]) / cyc_ns / 1e3  # us
    end_last = t[:, :, 1].max(1)
    start_first = t[:, :, 0].min(1)
    wall = np.diff(np.concatenate([[start_first[0]], end_last])) / 1e3
    release = np.concatenate([(start_first[1:] - end_last[:-1]) / 1e3, [0.0]])
    straggle = (end_last - np.median(t[:, :, 1], 1)) / 1e3
    names = ["proj"] + [f"L{i} {x}" for i in range(L) for x in ("A qkv", "B attention", "C o", "D gate_up",
                                                                  "E down")] + ["F head"]
    print(f"\nrows {M}: per phase kind, mean over {n // per} steps (us); {cyc_ns:.3f} cycles/ns")
    print("| phase | holds the grid | busiest program's work | median program's work | last arrival after the "
          "median | barrier release |")
    print("|---|---|---|---|---|---|")
    tot = np.zeros(5)
    for r, name in enumerate(names):
        idx = np.arange(r, n, per)
        row = np.array([wall[idx].mean(), work[idx].max(1).mean(), np.median(work[idx], 1).mean(),
                        straggle[idx].mean(), release[idx].mean()])
        tot += row
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    print("| a step | " + " | ".join(f"{x:.2f}" for x in tot) + " |")
    print(f"whole launch: {(end_last[-1] - start_first[0]) / 1e3:.1f} us, stalls {loop.stalls()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--variants", default="default;CSMSERVE_DEPTH_LOOP_PREFETCH=0",
                    help="';'-separated; each comma-separated env settings (upper case) or DepthLoop kwargs "
                         "(per_sm, warps)")
    ap.add_argument("--phases", default="default", help="';'-separated variants to time phase by phase")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    from csmserve.models.loader import load_csm

    model = load_csm("dummy", "cuda", torch.bfloat16)[0]
    cfg = model.cfg
    K = cfg.num_codebooks
    for M in (int(r) for r in args.rows.split(",")):
        kv = DepthKV(cfg, M, torch.bfloat16, torch.device("cuda"))
        params = (torch.full((M,), 0.9, device="cuda"), torch.full((M,), 50, device="cuda"),
                  torch.ones(M, device="cuda"), torch.arange(M, device="cuda") + 11, torch.arange(M, device="cuda"))
        torch.manual_seed(0)
        h = torch.randn(M, cfg.backbone.dim, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            first = model.decode_frame(h, lambda lg, cb: sample(lg[:, :cfg.sampleable_codes], *params, cb), kv,
                                       torch.arange(K, device="cuda"), upto=2)
        call = (first, *params)
        print(f"\nrows {M}: one launch, codebooks 2..{K - 1}")
        print("| variant | us per launch | us per depth step | stalls |")
        print("|---|---|---|---|")
        for spec in args.variants.split(";"):
            loop = _loop(model, kv, spec)
            for _ in range(3):
                loop(*call)
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(args.iters):
                loop(*call)
            e1.record()
            torch.cuda.synchronize()
            us = e0.elapsed_time(e1) * 1e3 / args.iters
            print(f"| {spec} | {us:.1f} | {us / (K - 2):.1f} | {loop.stalls()} |", flush=True)
            del loop
        for spec in filter(None, args.phases.split(";")):
            print(f"\n### {spec}")
            _phases(_loop(model, kv, spec, timing=True), M, call)


if __name__ == "__main__":
    main()
