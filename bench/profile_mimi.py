"""Where Mimi's batched streaming-decode step spends its GPU time (torch.profiler, eager = the graph's kernels).

python bench/profile_mimi.py --batch 2048 --rows 25
"""
from __future__ import annotations

import argparse

import torch

from gpu_profile import cuda_profile

from csmserve.models.mimi import MimiStream
from csmserve.models.mimi_loader import load_mimi


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layout", default="cl", help="cl (the engine's) or nct (the conv layout)")
    args = ap.parse_args()
    mimi = load_mimi("dummy", dtype=getattr(torch, args.dtype), device="cuda")
    st = MimiStream(mimi, args.batch + 1, "decode", 1, layout=args.layout)
    rows = torch.arange(args.batch, device="cuda")
    codes = torch.randint(0, 2048, (args.batch, 32, 1), device="cuda")
    prof, kernels, ms = cuda_profile(lambda: st.decode_step(codes, rows))
    print(f"\n## Mimi decode step ({'nct' if st.decoder is None else 'cl'}), batch {args.batch}: {kernels} kernels, {ms:.2f} ms GPU time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90))


if __name__ == "__main__":
    main()
