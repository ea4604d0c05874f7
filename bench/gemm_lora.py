"""Issue 42's open gap (2,048 rows over 64 adapters, +28% a frame step): would our own GEMM, with each row's LoRA
expand in its epilogue (and the MLP's SiLU*up in the gate_up GEMM's), beat cuBLAS + kernels/lora.py past 256 rows?
Per projection of CSM-1B at --rows rows over --adapters random rank --rank adapters (contiguous runs, the
scheduler's order), each as a CUDA graph of --reps calls, best of 5 (bench/gpu_profile.py's graph_timed), in us:

    cuBLAS         F.linear (gate_up: + silu_mul), the base as the model runs it past 16 rows
    + LoRA         the same + lora_add_ / lora_glu (what a mixed batch runs today)
    ours           kernels/lora.py's lora_gemm without adapters (the best of CONFIGS for the shape; gate_up with the
                   SiLU*up fused)
    ours + LoRA    lora_gemm: lora_shrink + the GEMM with the expand in its epilogue (shrink: lora_shrink alone)

then the sums over a frame's calls (the backbone's 16 layers once, the depth decoder's 4 layers at each of 31
steps). The decision it makes: ours + LoRA within ~10% of cuBLAS over a frame takes the LoRA into our GEMM
(kernels/lora.py GEMM_ROWS; the frame step: bench/lora.py --variant GEMM_ROWS=256); ours alone far slower than
cuBLAS ends the idea. A component benchmark: where the time goes, not a claim.

python bench/gemm_lora.py --rows 2048 --adapters 64 --rank 16
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from csmserve.models.lora import LoraPool

# (BM, BN, BK, stages, warps); gate_up's two accumulators: BM * BN <= 128 * 128 only
CONFIGS = [(128, 128, 64, 3, 8), (128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
           (128, 64, 64, 4, 4), (64, 256, 64, 3, 8), (64, 64, 64, 4, 4)]
MODULES = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
CALLS = {"backbone": 16, "decoder": 4 * 31}  # a frame's calls of one layer's projection: layers x steps


def _pool(model, adapters: int, rank: int, rows: int) -> LoraPool:
    """`adapters` random adapters of `rank` in a pool of the model's, the rows over them in contiguous runs."""
    from gpu_profile import spread

    p = LoraPool(model, max_loras=adapters, max_rank=rank)
    g = torch.Generator(device="cuda").manual_seed(0)
    for slot in range(adapters):
        w = torch.randn(rank, p.layout.width, generator=g, device="cuda") * 0.02
        p.weights[slot] = w.to(p.weights.dtype)
        p.ranks[slot] = rank
    p.rows = torch.tensor(spread(rows, adapters), dtype=torch.int32, device="cuda")
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20, help="calls per timed CUDA graph")
    args = ap.parse_args()
    from gpu_profile import dummy_model, graph_timed

    from csmserve.kernels import lora as kl
    from csmserve.kernels.elementwise import silu_mul_triton

    model = dummy_model()
    _pool(model, args.adapters, args.rank, args.rows)  # its layers hold it
    assert args.rows > kl.TICKET_ROWS, "past TICKET_ROWS only (below it the ticketed kernel runs, one launch)"
    print(f"{torch.cuda.get_device_name()}, {args.rows} rows over {args.adapters} rank-{args.rank} adapters; us a "
          f"call, CUDA graphs of {args.reps} calls, best of 5\n")
    print("| projection | K -> N | calls a frame | cuBLAS | + LoRA | ours (config) | ours + LoRA | shrink | ours + LoRA "
          "vs cuBLAS + LoRA |\n|---|---|---|---|---|---|---|---|---|")
    totals = [0.0] * 5
    for part, calls in CALLS.items():
        for mod in MODULES:
            layer = model.get_submodule(f"{part}.layers.0.{mod}")
            lora, w, glu = layer.lora, layer.weight, "gate_up" in mod
            x = torch.randn(args.rows, w.shape[1], device="cuda").bfloat16()

            def cublas():
                y = F.linear(x, w)
                return silu_mul_triton(y) if glu else y

            def cublas_lora():
                y = F.linear(x, w)
                return kl.lora_glu(y, x, lora) if glu else kl.lora_add_(x, y, lora)

            def ours_lora(cfg):
                return kl.lora_gemm(x, w, lora, glu, cfg)

            want = cublas_lora().float()
            err = ((ours_lora((64, 64, 64, 4, 4)).float() - want).abs().max() / want.abs().max()).item()
            assert err < 2e-2, f"{part} {mod}: ours + LoRA off by {err:.2e}"
            reps = args.reps
            t_cublas = graph_timed(lambda: [cublas() for _ in range(reps)], reps)
            t_cublas_lora = graph_timed(lambda: [cublas_lora() for _ in range(reps)], reps)
            ours = {}
            for cfg in CONFIGS:
                if glu and cfg[0] * cfg[1] > 128 * 128 or not kl.tile_fits(lora, cfg, glu):
                    continue
                ours[cfg] = graph_timed(lambda c=cfg: [kl.lora_gemm(x, w, None, glu, c) for _ in range(reps)], reps)
            best = min(ours, key=ours.get)
            t_ours_lora = graph_timed(lambda: [ours_lora(best) for _ in range(reps)], reps)
            t_shrink = graph_timed(lambda: [kl.lora_shrink(x, lora) for _ in range(reps)], reps)
            row = (t_cublas, t_cublas_lora, ours[best], t_ours_lora, t_shrink)
            totals = [a + b * calls / 1000 for a, b in zip(totals, row)]
            n = w.shape[0] // (2 if glu else 1)
            print(f"| {part} {mod} | {w.shape[1]} -> {n} | {calls} | {t_cublas:.1f} | {t_cublas_lora:.1f} | "
                  f"{ours[best]:.1f} ({'/'.join(map(str, best))}) | {t_ours_lora:.1f} | {t_shrink:.1f} | "
                  f"{t_ours_lora / t_cublas_lora - 1:+.0%} |", flush=True)
    c, cl, o, ol, sh = totals
    print(f"\nA frame's calls of these (ms): cuBLAS {c:.2f}; + LoRA {cl:.2f} ({cl - c:+.2f}); ours {o:.2f}; ours + "
          f"LoRA {ol:.2f} ({ol - c:+.2f} against cuBLAS; the shrinks {sh:.2f} of it)")


if __name__ == "__main__":
    main()
