"""The frame step's GEMMs at a few rows: cuBLAS (F.linear) against kernels/gemv.py, per shape and M.

python bench/gemv.py --rows 1,2,4,16 [--fp8]

Each shape is timed as a CUDA graph of `--reps` calls over as many distinct weight copies as make
> 256 MB (so every call reads its weight from HBM, not from the 50 MB L2, as in the frame step where
~2.4 GB of weights pass between two reads of one). Prints us per call and the bandwidth it reaches.
--fp8: also our GEMV over e4m3 weights with per-channel scales (FP8Linear's, weight-only), its GB/s on
its own bytes, its error against the same numbers in torch (models/fp8.py's weight_only_torch), and FP8Linear's
own GEMM on the same weights (weight_only_mm up to 16 rows, the per-row quantization + _scaled_mm past it: what the
frame step runs where our kernel does not apply).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from csmserve.kernels import gemv
from csmserve.models.fp8 import FP8Linear, weight_only_torch
from gpu_profile import graph_timed

# (name, N, K, glu): CSM-1B's backbone (Llama-1B) and depth decoder (100M), the projection, the heads
SHAPES = [
    ("backbone qkv", 3072, 2048, False), ("backbone o", 2048, 2048, False),
    ("backbone gate_up+silu", 8192, 2048, True), ("backbone down", 2048, 8192, False),
    ("codebook0 head", 2051, 2048, False), ("projection", 1024, 2048, False),
    ("depth qkv", 1536, 1024, False), ("depth o", 1024, 1024, False),
    ("depth gate_up+silu", 8192, 1024, True), ("depth down", 1024, 8192, False),
    ("depth head", 2112, 1024, False),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--programs", type=int, default=None, help="gemv._PROGRAMS (the grid aimed at)")
    ap.add_argument("--elems", type=int, default=None, help="gemv._ELEMS (weights per program per chunk)")
    ap.add_argument("--warps", type=int, default=None, help="gemv.NUM_WARPS")
    ap.add_argument("--fp8", action="store_true", help="also e4m3 weights (weight-only)")
    ap.add_argument("--shapes", default="", help="only the SHAPES whose name contains one of these (comma list)")
    args = ap.parse_args()
    gemv._PROGRAMS = args.programs or gemv._PROGRAMS
    gemv._ELEMS = args.elems or gemv._ELEMS
    gemv.NUM_WARPS = args.warps or gemv.NUM_WARPS
    print(f"programs {gemv._PROGRAMS}, elems {gemv._ELEMS}, warps {gemv.NUM_WARPS}, "
          f"tensor-core rows {gemv.MAX_ROWS}")
    dt = torch.bfloat16
    extra = " fp8 gemv (us) | fp8 GB/s | fp8 max rel err | FP8Linear (us) |" if args.fp8 else ""
    print("| shape | N x K | M | cuBLAS (us) | gemv (us) | cuBLAS GB/s | gemv GB/s | max abs err (gemv vs cuBLAS) |"
          + extra)
    print("|---|---|---|---|---|---|---|---|" + "---|---|---|---|" * args.fp8)
    only = [t for t in args.shapes.split(",") if t]
    for name, n, k, glu in SHAPES:
        if only and not any(t in name for t in only):
            continue
        rows = 2 * n if glu else n
        mb = rows * k * 2
        copies = max(1, (256 << 20) // mb + 1)
        ws = [torch.randn(rows, k, device="cuda", dtype=dt) * 0.02 for _ in range(copies)]
        lins = []
        if args.fp8:
            copies8 = max(1, (256 << 20) // (mb // 2) + 1)
            lins = [FP8Linear(ws[i % copies]) for i in range(copies8)]
        w8s = [(lin.weight8, lin.scale.reshape(-1).contiguous()) for lin in lins]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dt)

            def ref(w):
                y = F.linear(x, w) if isinstance(w, torch.Tensor) else w(x)
                if glu:
                    a, b = y.chunk(2, -1)
                    y = F.silu(a) * b
                return y

            if not gemv.applies(x, ws[0], glu):
                print(f"| {name} | {n}x{k} | {m} | | n/a | | | |")
                continue

            def run_ref(fp8=False):
                for i in range(args.reps):
                    ref(lins[i % len(lins)] if fp8 else ws[i % copies])

            def timed(fp8=False):
                """Our kernel's us per call over the weight copies (fp8: the e4m3 ones)."""
                def f():
                    for i in range(args.reps):
                        if fp8:
                            w8, s = w8s[i % len(w8s)]
                            gemv.gemv(x, w8, glu, s)
                        else:
                            gemv.gemv(x, ws[i % copies], glu)
                return graph_timed(f, args.reps)

            t_ref, t_g = graph_timed(run_ref, args.reps), timed()
            err = (gemv.gemv(x, ws[0], glu).float() - ref(ws[0]).float()).abs().max().item()
            line = (f"| {name} | {n}x{k} | {m} | {t_ref:.2f} | {t_g:.2f} | {mb / t_ref / 1e3:.0f} | "
                    f"{mb / t_g / 1e3:.0f} | {err:.2e} |")
            if args.fp8:
                t8 = timed(fp8=True)
                w8, s = w8s[0]
                want = weight_only_torch(x, w8, s)
                if glu:
                    a, b = want.chunk(2, -1)
                    want = F.silu(a) * b
                rel = ((gemv.gemv(x, w8, glu, s).float() - want).abs().max() / want.abs().max()).item()
                t_lin = graph_timed(lambda: run_ref(fp8=True), args.reps)
                line += f" {t8:.2f} | {mb / 2 / t8 / 1e3:.0f} | {rel:.1e} | {t_lin:.2f} |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
