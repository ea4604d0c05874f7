"""Where an idle engine's time to first audio goes: admission, prefill, first frame step, each timed
with a device sync around it (host launch time and device time), for a few prompt lengths.

python bench/ttfa_breakdown.py --prompts 12,166,1000
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from csmserve.apps.bench.engine import short_prompt
from csmserve.engine.request import Admission, PrefillChunk
from csmserve.engine.runner import ModelRunner
from csmserve.models.codec import load_codec
from csmserve.models.loader import load_csm


def timed(fn) -> tuple[float, float]:
    """(host ms until fn returns, ms until the device is done), from a synced start."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="12,166,1000")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp8-all"], help="EngineConfig.weights")
    ap.add_argument("--no-codec-stream", action="store_true", help="Mimi's decode in the frame's one graph")
    args = ap.parse_args()
    model, _, model_dir = load_csm("dummy", "cuda", torch.bfloat16)
    codec = load_codec("dummy", model_dir, None, torch.device("cuda"), torch.bfloat16)
    runner = ModelRunner(model, 8, 2048, mimi=codec, weights=args.weights, codec_stream=not args.no_codec_stream)
    print(f"weights {args.weights}, codec stream {runner.codec_stream is not None}")
    print("| prompt frames | admit host/device (ms) | prefill host/device (ms) | first step host/device (ms) |"
          " sum device (ms) |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for n in [int(x) for x in args.prompts.split(",")]:
            tokens, mask = short_prompt(n)  # [n, 33]: text frames
            rows = []
            for t in range(args.trials + 1):
                adm = [Admission(0, tokens[-1], mask[-1], n - 1, 0.9, 50, 1.0, t)]
                a = timed(lambda: runner.admit(adm))
                p = timed(lambda: runner.prefill([PrefillChunk(0, 0, tokens[:-1], mask[:-1])]))
                runner.host_pos[0] = n - 1
                s = timed(lambda: runner.step([0]).wait())
                if t:  # the first trial warms
                    rows.append((a, p, s))
            m = np.median(np.array(rows), axis=0)  # [3, 2]
            print(f"| {n} | {m[0, 0]:.2f} / {m[0, 1]:.2f} | {m[1, 0]:.2f} / {m[1, 1]:.2f} | "
                  f"{m[2, 0]:.2f} / {m[2, 1]:.2f} | {m[:, 1].sum():.2f} |", flush=True)


if __name__ == "__main__":
    main()
