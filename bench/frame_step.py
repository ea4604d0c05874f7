"""Frame-step time of the runner at several batch sizes (random full-size weights unless --tiny).

python bench/frame_step.py --batches 1,8,64,256 --context 256
"""
from __future__ import annotations

import argparse
import time

import torch

from gpu_profile import admit_rows, dummy_model, frame_step_ms

from csmserve.engine.runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--fuse", action="store_true",
                    help="the fused Triton elementwise kernels (ModelRunner uses them on CUDA anyway)")
    ap.add_argument("--codec", action="store_true", help="include the Mimi streaming decode (bf16)")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp8-all"], help="EngineConfig.weights")
    ap.add_argument("--no-codec-stream", action="store_true",
                    help="EngineConfig(codec_stream=False): Mimi's decode in the frame step's graph, after the generation")
    args = ap.parse_args()
    if args.fuse:
        from csmserve.models.llama import fuse_elementwise

        fuse_elementwise()
    batches = [int(b) for b in args.batches.split(",")]
    model = dummy_model()
    n = max(batches)
    t0 = time.perf_counter()
    mimi = None
    if args.codec:
        from csmserve.models.mimi_loader import load_mimi

        mimi = load_mimi("dummy", dtype=torch.bfloat16, device="cuda")
    runner = ModelRunner(model, num_slots=n, max_seq_len=args.max_seq_len, buckets=batches, mimi=mimi,
                         weights=args.weights, codec_stream=not args.no_codec_stream)
    print(f"capture {len(batches)} graphs: {time.perf_counter() - t0:.1f}s", flush=True)
    admit_rows(runner, list(range(n)), args.context)
    print("| batch | frame step ms | frames/s per stream | frames/s total |")
    print("|---|---|---|---|")
    for b in batches:
        slots = list(range(b))
        dt = frame_step_ms(runner, slots, args.steps) / 1e3
        admit_rows(runner, slots, args.context)  # rewind positions
        print(f"| {b} | {dt * 1e3:.2f} | {1 / dt:.1f} | {b / dt:.0f} |", flush=True)


if __name__ == "__main__":
    main()
