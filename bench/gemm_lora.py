"""Issue 42's open gap (2,048 rows over 64 adapters, +28% a frame step): would our own GEMM, with each row's LoRA
expand in its epilogue (and the MLP's SiLU*up in the gate_up GEMM's), beat cuBLAS + kernels/lora.py past 256 rows?
Per projection of CSM-1B at --rows rows over --adapters random rank --rank adapters (contiguous runs, the
scheduler's order), each as a CUDA graph of --reps calls, best of 5 (bench/gpu_profile.py's graph_timed), in us:

    cuBLAS         F.linear (gate_up: + silu_mul), the base as the model runs it past 16 rows
    + LoRA         the same + lora_add_ / lora_glu (what a mixed batch runs today)
    ours           _gemm_kernel alone (the best of CONFIGS for the shape; gate_up with the SiLU*up fused)
    ours + LoRA    lora_shrink + _gemm_kernel with the expand in its epilogue (shrink: lora_shrink alone, its part)

then the sums over a frame's calls (the backbone's 16 layers once, the depth decoder's 4 layers at each of 31
steps). The decision it makes: ours + LoRA within ~10% of cuBLAS over a frame takes the LoRA into our GEMM; ours
alone far slower than cuBLAS ends the idea. A component benchmark: where the time goes, not a claim.

python bench/gemm_lora.py --rows 2048 --adapters 64 --rank 16
TRITON_INTERPRET=1 python bench/gemm_lora.py --check   # CPU: dummy-tiny, fp32, the kernel against the torch reference
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from csmserve.models.lora import LoraPool, delta_torch

_BIG = tl.constexpr(1 << 30)
# (BM, BN, BK, stages, warps); gate_up's two accumulators: BM * BN <= 128 * 128 only
CONFIGS = [(128, 128, 64, 3, 8), (128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
           (128, 64, 64, 4, 4), (64, 256, 64, 3, 8), (64, 64, 64, 4, 4)]
MODULES = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
CALLS = {"backbone": 16, "decoder": 4 * 31}  # a frame's calls of one layer's projection: layers x steps


@triton.jit
def _gemm_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, UP_OFF, XA, B, RANKS, AD, rows_per, KS,
                 stride_bl, stride_br, N0, N1, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr, GLU: tl.constexpr, LORA: tl.constexpr, S: tl.constexpr, RB: tl.constexpr,
                 IEEE: tl.constexpr):
    # y [M, N] = x [M, K] @ w [N, K]^T (GLU: w = [gate; up] [2N, K], y = silu(gate) * up), the base rounded to the
    # model dtype as cuBLAS' output is; LORA: + each row's delta xa_a B_a (xa: lora_shrink's KS pieces [KS, M, S, RB]
    # fp32, added in order and rounded; the delta rounded before the add, as kernels/lora.py's), the tile's adapters
    # one at a time. Programs in groups of 8 row tiles per column block (L2 reuse of w)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    in_group = 8 * tl.cdiv(N, BN)
    first_m = pid // in_group * 8
    size_m = tl.minimum(num_m - first_m, 8)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mm = rm < M
    mn = rn < N
    rk = tl.arange(0, BK)
    x_ptr = X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptr = W + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BK, BN]: w^T's tile
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):  # K % BK == 0
        x = tl.load(x_ptr + k, mask=mm[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.load(w_ptr + k, mask=mn[None, :], other=0.0), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.load(w_ptr + k, mask=mn[None, :], other=0.0), acc)
        if GLU:
            u_tile = tl.load(w_ptr + UP_OFF * stride_wn + k, mask=mn[None, :], other=0.0)
            if IEEE:
                acc_u = tl.dot(x, u_tile, acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(x, u_tile, acc_u)
    dt = Y.dtype.element_ty
    g = acc.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    if LORA:
        ad = tl.load(AD + rm // rows_per, mask=mm, other=-1)
        todo = ad >= 0
        rr = tl.arange(0, RB)
        s = (pid_n * BN >= N0).to(tl.int32) + (pid_n * BN >= N1).to(tl.int32)  # the column block's slice (GLU: 0)
        while tl.max(todo.to(tl.int32), axis=0) > 0:
            a = tl.min(tl.where(todo, ad, _BIG), axis=0)
            sel = todo & (ad == a)
            todo = todo & (ad != a)
            a_l = a.to(tl.int64)
            xa = tl.zeros([BM, RB], dtype=tl.float32)
            xa_u = tl.zeros([BM, RB], dtype=tl.float32)
            for p in range(KS):
                piece = XA + (p * M + rm).to(tl.int64)[:, None] * (S * RB) + rr[None, :]
                xa += tl.load(piece + s * RB, mask=sel[:, None], other=0.0)
                if GLU:
                    xa_u += tl.load(piece + RB, mask=sel[:, None], other=0.0)
            b_ptr = B + a_l * stride_bl + rr.to(tl.int64)[:, None] * stride_br + rn[None, :]  # [RB, BN]
            mb = (rr < tl.load(RANKS + a_l))[:, None] & mn[None, :]
            if IEEE:
                d = tl.dot(xa.to(dt), tl.load(b_ptr, mask=mb, other=0.0), input_precision="ieee")
            else:
                d = tl.dot(xa.to(dt), tl.load(b_ptr, mask=mb, other=0.0))
            g += d.to(dt).to(tl.float32)  # rows of other adapters: xa 0, d 0
            if GLU:
                if IEEE:
                    du = tl.dot(xa_u.to(dt), tl.load(b_ptr + UP_OFF, mask=mb, other=0.0), input_precision="ieee")
                else:
                    du = tl.dot(xa_u.to(dt), tl.load(b_ptr + UP_OFF, mask=mb, other=0.0))
                u += du.to(dt).to(tl.float32)
    if GLU:
        g = g.to(dt).to(tl.float32)
        u = u.to(dt).to(tl.float32)
        g = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], g.to(dt), mask=mm[:, None] & mn[None, :])


def gemm(x, w, cfg, glu=False, lora=None, xa=None):
    """y = x w^T (glu: silu(gate) * up), + each row's LoRA delta from xa (lora_shrink's pieces) when lora is given."""
    m, k = x.shape
    n = w.shape[0] // (2 if glu else 1)
    bm, bn, bk, stages, warps = cfg
    assert k % bk == 0, (k, bk)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if lora is None:
        extra, s, rb = (x, x, x, x, 1, 0, 0, 0, n, n), 1, 16
    else:
        t = lora.target
        extra = (xa, lora.b, lora.pool.ranks, lora.rows, m // lora.rows.shape[0], xa.shape[0], lora.b.stride(0),
                 lora.b.stride(1), *((n, n) if glu else t.bounds))
        s, rb = len(t.slices), xa.shape[-1]
        assert glu or all(b % bn == 0 for b in t.bounds if b < n), "a column block across two slices"
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), n if glu else 0, *extra, BM=bm, BN=bn,
                       BK=bk, STAGES=stages, GLU=glu, LORA=lora is not None, S=s, RB=rb,
                       IEEE=x.dtype == torch.float32, num_warps=warps)
    return y


def _pool(model, adapters: int, rank: int, rows: int, device: str, scale: float = 0.02) -> LoraPool:
    p = LoraPool(model, max_loras=adapters, max_rank=rank)
    g = torch.Generator(device=device).manual_seed(0)
    for slot in range(adapters):
        w = torch.randn(rank, p.layout.width, generator=g, device=device) * scale
        p.weights[slot] = w.to(p.weights.dtype)
        p.ranks[slot] = rank
    p.rows = torch.tensor([r * adapters // rows for r in range(rows)], dtype=torch.int32, device=device)
    return p


def check() -> None:
    """dummy-tiny on the CPU (fp32, TRITON_INTERPRET=1): every module kind, with and without the LoRA, against the
    torch reference; rows of 5 adapters and rows without one."""
    from csmserve.kernels import lora as kl
    from csmserve.models.loader import load_csm

    model = load_csm("dummy-tiny")[0]
    p = _pool(model, 5, 8, 40, "cpu", scale=0.3)
    p.rows[:6] = -1
    for part in ("backbone", "decoder"):
        for mod in MODULES:
            layer = model.get_submodule(f"{part}.layers.0.{mod}")
            glu = "gate_up" in mod
            x = torch.randn(40, layer.weight.shape[1])
            base = F.linear(x, layer.weight)
            delta = delta_torch(x, layer.lora)
            assert delta.abs().max() > 1e-2 * base.abs().max()  # a delta the check can see
            for with_lora in (False, True):
                want = base + delta if with_lora else base
                if glu:
                    gate, up = want.chunk(2, -1)
                    want = F.silu(gate) * up
                got = gemm(x, layer.weight, (16, 16, 32, 1, 4), glu, layer.lora if with_lora else None,
                           kl.lora_shrink(x, layer.lora) if with_lora else None)
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err < 1e-5, f"{part} {mod} lora={with_lora}: relative error {err:.2e}"
                print(f"{part}.layers.0.{mod} lora={with_lora}: ok ({err:.1e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20, help="calls per timed CUDA graph")
    ap.add_argument("--check", action="store_true", help="CPU, TRITON_INTERPRET=1: correctness on dummy-tiny only")
    args = ap.parse_args()
    if args.check:
        return check()
    from gpu_profile import dummy_model, graph_timed

    from csmserve.kernels import lora as kl
    from csmserve.kernels.elementwise import silu_mul_triton

    model = dummy_model()
    _pool(model, args.adapters, args.rank, args.rows, "cuda")  # its layers hold it
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
                return gemm(x, w, cfg, glu, lora, kl.lora_shrink(x, lora))

            want = cublas_lora().float()
            err = ((ours_lora((64, 64, 64, 4, 4)).float() - want).abs().max() / want.abs().max()).item()
            assert err < 2e-2, f"{part} {mod}: ours + LoRA off by {err:.2e}"
            reps = args.reps
            t_cublas = graph_timed(lambda: [cublas() for _ in range(reps)], reps)
            t_cublas_lora = graph_timed(lambda: [cublas_lora() for _ in range(reps)], reps)
            ours = {}
            for cfg in CONFIGS:
                if glu and cfg[0] * cfg[1] > 128 * 128 or any(b % cfg[1] for b in lora.target.bounds if b < w.shape[0]):
                    continue
                ours[cfg] = graph_timed(lambda c=cfg: [gemm(x, w, c, glu) for _ in range(reps)], reps)
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
