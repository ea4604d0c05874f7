"""The Triton sampler alone (kernels/sampler.py): us per call, the radix select's passes for the logits' dtype (2 for
bfloat16, the frame step's), per batch size.

python bench/sampler.py [--batches 1,64,2048] [--reps 64]

Each is a CUDA graph of `--reps` calls, best of 5 replays (temperature 0.9, top_k 50, top_p 1; greedy too).
"""
from __future__ import annotations

import argparse

import torch

from csmserve.kernels import sampler
from gpu_profile import graph_timed, sampler_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,2048")
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)  # the sampleable codes (CSMConfig.sampleable_codes)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, V {args.vocab}, warps {sampler.WARPS}")
    print("| dtype | B | sampled (us) | passes | greedy (us) |")
    print("|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for B in (int(b) for b in args.batches.split(",")):
            torch.manual_seed(B)
            logits, t, k, p, seed, frame = sampler_inputs(B, args.vocab, dtype)
            t0 = torch.zeros_like(t)
            sampled = graph_timed(lambda: [sampler.sample_triton(logits, t, k, p, seed, frame, 3)
                                           for _ in range(args.reps)], args.reps)
            greedy = graph_timed(lambda: [sampler.sample_triton(logits, t0, k, p, seed, frame, 3)
                                          for _ in range(args.reps)], args.reps)
            print(f"| {str(dtype)[6:]} | {B} | {sampled:.2f} | {sampler.radix_passes(dtype)} | {greedy:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
