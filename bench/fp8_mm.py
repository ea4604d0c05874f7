"""Weight-only FP8 GEMM (kernels/fp8.py's weight_only_mm) at 3+ rows against what runs there today:
bf16 F.linear (cuBLAS) and FP8Linear's w8a8 path (quantize_rows_triton + torch._scaled_mm). Each GEMM alone,
graph-replayed over weight copies that do not fit in L2; us per call, the best of a few block configs, and the
max relative error against models/fp8.py's weight_only_torch.

python bench/fp8_mm.py --rows 4,8,16,32,64,128 [--shapes down,gate_up] [--more]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gpu_profile import graph_timed

from csmserve.kernels.fp8 import quantize_rows_triton, weight_only_mm
from csmserve.models.fp8 import quantize_rows_torch, weight_only_torch

# (name, N, K): CSM-1B's weights as [out, in]
SHAPES = [("backbone qkv", 3072, 2048), ("backbone o", 2048, 2048), ("backbone gate_up", 16384, 2048),
          ("backbone down", 2048, 8192), ("projection", 1024, 2048), ("depth qkv", 1536, 1024),
          ("depth o", 1024, 1024), ("depth gate_up", 16384, 1024), ("depth down", 1024, 8192)]
CONFIGS = [(64, 128, 1, 4, 4), (32, 256, 1, 4, 4), (128, 128, 1, 4, 3), (64, 256, 1, 4, 3), (32, 128, 1, 4, 5),
           (64, 128, 2, 4, 4), (32, 256, 2, 4, 4), (64, 128, 4, 4, 4), (32, 128, 4, 4, 4)]
MORE = [(16, 256, 4, 4, 4), (16, 512, 2, 4, 3), (32, 256, 4, 4, 3), (16, 128, 8, 4, 4), (32, 128, 8, 4, 4),
        (16, 256, 8, 2, 4), (32, 64, 8, 4, 6), (64, 64, 4, 4, 6)]  # --more: narrower tiles, deeper splits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8,16,32,64,128")
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--shapes", default="", help="comma-separated substrings of the GEMM names (default: all)")
    ap.add_argument("--more", action="store_true", help="also the MORE block configs")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| GEMM | rows | bf16 cuBLAS (us) | w8a8 quant+_scaled_mm (us) | weight-only (us) | its config "
          "(BN, BK, split, warps, stages) | weight-only GB/s | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    configs = CONFIGS + MORE * args.more
    for name, n, k in SHAPES:
        if args.shapes and not any(p in name for p in args.shapes.split(",")):
            continue
        copies = max(2, int(256e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        q = [quantize_rows_torch(w) for w in ws]
        w8s = [(a, s.reshape(1, -1).contiguous()) for a, s in q]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def bf16(x=x, ws=ws, copies=copies):
                for i in range(args.reps):
                    F.linear(x, ws[i % copies])

            def w8a8(x=x, w8s=w8s):
                for i in range(args.reps):
                    w8, s = w8s[i % len(w8s)]
                    x8, sx = quantize_rows_triton(x)
                    torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=s, out_dtype=torch.bfloat16)

            t_bf, t_88 = graph_timed(bf16, args.reps), graph_timed(w8a8, args.reps)
            best = None
            for cfg in configs:
                bn, bk, split, warps, stages = cfg
                if k % (bk * split):
                    continue

                def wo(x=x, w8s=w8s, cfg=cfg):
                    for i in range(args.reps):
                        w8, s = w8s[i % len(w8s)]
                        weight_only_mm(x, w8, s, *cfg)

                try:
                    t = graph_timed(wo, args.reps)
                except Exception as e:  # noqa: BLE001 - a config Triton cannot build: skip it
                    print(f"  {name} {m} {cfg}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            t_wo, cfg = best
            w8, s = w8s[0]
            ref = weight_only_torch(x, w8, s)
            err = ((weight_only_mm(x, w8, s, *cfg).float() - ref).abs().max() / ref.abs().max()).item()
            gbs = n * k / (t_wo * 1e-6) / 1e9
            print(f"| {name} [{n}, {k}] | {m} | {t_bf:.2f} | {t_88:.2f} | {t_wo:.2f} | {cfg} | {gbs:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
