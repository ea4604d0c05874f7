"""Where a mixed batch's LoRA time goes past 256 rows (issue 42's 2,048-row gap): each kernel of kernels/lora.py alone,
per projection of CSM-1B, at --rows rows over --adapters random rank --rank adapters in contiguous runs, us a call
(CUDA graphs of 20 calls, best of 5), against the passes it rides on: y's copy, silu_mul (the GLU's base). The GLU and
expand with every row's adapter and with none (the kernel's own structure), at several tiles (the expand also with the
shrink's pieces capped, SHRINK_PIECES); the shrink at several tiles. A component table for finding the time, not a
claim.

python bench/lora_kernels.py --rows 2048 --adapters 64 --rank 16
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from gpu_profile import dummy_model, graph_timed, spread

GLU_TILES = [(16, 8), (16, 16), (16, 32), (16, 64), (32, 8), (32, 16)]  # (GLU_ROWS, GLU_GROUPS)
PIECE_CAPS = [32, 4]  # SHRINK_PIECES: the expand over more or fewer pieces than the default's (the default tile)
EXPAND_TILES = [16, 32, 64]  # EXPAND_ROWS
SHRINK_TILES = [(16, 256), (32, 256), (64, 256), (16, 512), (32, 512), (16, 1024), (64, 1024)]  # ROWS, PIECE
MODULES = ["mlp.gate_up_proj", "mlp.down_proj", "self_attn.qkv_proj", "self_attn.o_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    from csmserve.kernels import lora as kl
    from csmserve.kernels.elementwise import silu_mul_triton
    from csmserve.models.lora import LoraPool

    model = dummy_model()
    p = LoraPool(model, max_loras=args.adapters, max_rank=args.rank)
    g = torch.Generator(device="cuda").manual_seed(0)
    for slot in range(args.adapters):
        w = torch.randn(args.rank, p.layout.width, generator=g, device="cuda") * 0.02
        p.weights[slot], p.ranks[slot] = w.to(p.weights.dtype), args.rank
    rows = {"ad": torch.tensor(spread(args.rows, args.adapters), dtype=torch.int32, device="cuda")}
    rows["none"] = torch.full_like(rows["ad"], -1)
    p.rows = rows["ad"].clone()
    defaults = {n: getattr(kl, n) for n in ("GLU_ROWS", "GLU_GROUPS", "EXPAND_ROWS", "SHRINK_ROWS", "SHRINK_WIDE_FROM",
                                           "SHRINK_PIECE", "SHRINK_PIECES")}

    def t(fn, **consts) -> str:
        for n, v in {**defaults, **consts}.items():
            setattr(kl, n, v)
        return f"{graph_timed(lambda: [fn() for _ in range(20)], 20):.1f}"

    print(f"{torch.cuda.get_device_name()}, {args.rows} rows over {args.adapters} rank-{args.rank} adapters; us a "
          f"call; kernels/lora.py's defaults {defaults}", flush=True)
    for part in ("decoder", "backbone"):
        for mod in MODULES:
            layer = model.get_submodule(f"{part}.layers.0.{mod}")
            lora, glu = layer.lora, "gate_up" in mod
            x = torch.randn(args.rows, layer.weight.shape[1], device="cuda").bfloat16()
            y = F.linear(x, layer.weight)
            n = y.shape[1] // 2 if glu else y.shape[1]
            h = torch.empty(args.rows, n, dtype=y.dtype, device="cuda")
            xa = kl.lora_shrink(x, lora)
            out = [f"copy(y) {t(y.clone)}"] + ([f"silu_mul {t(lambda: silu_mul_triton(y))}"] if glu else [])
            for who, r in rows.items():
                p.rows.copy_(r)
                if glu:
                    def run_glu() -> None:
                        kl._expand(xa, h, lora, n, y)

                    out += [f"glu[{who} rows {a} groups {b}] {t(run_glu, GLU_ROWS=a, GLU_GROUPS=b)}"
                            for a, b in GLU_TILES]
                else:
                    out += [f"expand[{who} rows {a}] {t(lambda: kl._expand(xa, y, lora, n), EXPAND_ROWS=a)}"
                            for a in EXPAND_TILES]
                    for c in PIECE_CAPS:
                        kl.SHRINK_PIECES = c
                        xc = kl.lora_shrink(x, lora)
                        if xc.shape[0] != xa.shape[0]:  # not the default's pieces again
                            out += [f"expand[{who} pieces {xc.shape[0]}] {t(lambda: kl._expand(xc, y, lora, n))}"]
                    kl.SHRINK_PIECES = defaults["SHRINK_PIECES"]
            p.rows.copy_(rows["ad"])
            wide = 1 << 30  # the tile as given at any row count
            out += [f"shrink[rows {a} piece {b}] "
                    f"{t(lambda: kl.lora_shrink(x, lora), SHRINK_ROWS=a, SHRINK_PIECE=b, SHRINK_WIDE_FROM=wide)}"
                    for a, b in SHRINK_TILES if lora.target.k % b == 0]
            print(f"{part} {mod}:\n  " + "\n  ".join(out), flush=True)
    for n, v in defaults.items():
        setattr(kl, n, v)


if __name__ == "__main__":
    main()
