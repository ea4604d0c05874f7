"""Where a frame step's GPU time goes: torch.profiler over eager frame steps (same kernels as the graph).

python bench/profile_step.py --batches 1,2048 --fuse
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from gpu_profile import cuda_profile

from csmserve.engine.request import Admission
from csmserve.engine.runner import ModelRunner
from csmserve.models.loader import load_csm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2048")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--fuse", action="store_true")
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--codec", action="store_true")
    args = ap.parse_args()
    if args.fuse:
        from csmserve.models.llama import fuse_elementwise

        fuse_elementwise()
    model = load_csm("dummy", "cuda", torch.bfloat16)[0]
    batches = [int(b) for b in args.batches.split(",")]
    n = max(batches)
    mimi = None
    if args.codec:
        from csmserve.models.mimi_loader import load_mimi

        mimi = load_mimi("dummy", dtype=torch.bfloat16, device="cuda")
    runner = ModelRunner(model, num_slots=n, max_seq_len=512, use_graphs=False, mimi=mimi)
    W = model.cfg.frame_width
    tok, mask = np.zeros(W, np.int64), np.zeros(W, bool)
    mask[-1] = True
    runner.admit([Admission(s, tok, mask, args.context, 0.9, 50, 1.0, s) for s in range(n)])
    for b in batches:
        ids = torch.arange(b, device="cuda")
        prof, kernels, ms = cuda_profile(lambda: runner.frame_step(ids, 512))
        print(f"\n## batch {b}: {kernels} kernels, {ms:.2f} ms GPU time per frame step")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
