"""Per-row FP8 (e4m3) quantization of a GEMM's activations in one kernel (models/fp8.py's torch
`quantize_rows_torch` is the reference): a program per row, the row in registers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    valid = i < K
    x = tl.load(X + r * stride_x + i, mask=valid, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    tl.store(Q + r * stride_q + i, q.to(tl.float8e4nv), mask=valid)
    tl.store(S + r, scale)


def quantize_rows_triton(x: Tensor) -> tuple[Tensor, Tensor]:
    M, K = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    _quantize_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=block,
                                num_warps=8 if block >= 4096 else 4)
    return q, s


# ---- weight-only FP8 GEMM for a few to tens of rows: e4m3 weights, activations as they are
# y[m, n] = scale[n] * sum_k x[m, k] * w8[n, k]: the weights go to bf16 in registers and through tl.dot,
# so only the weights' bytes (half of bf16's) stream from HBM and no kernel quantizes the activations.
# Split over K (SPLIT_K programs per output tile, their fp32 partial sums added after, deterministically) when N
# alone gives too few programs.

@triton.jit
def _weight_only_mm_kernel(X, W, S, Y, M, N, K, stride_x, stride_w, stride_y,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_per = K // SPLIT_K  # a multiple of BLOCK_K (the wrapper checks)
    # told to the compiler: K // SPLIT_K has no known factor past 16 // SPLIT_K, so at 8 splits (the down
    # projections) the e4m3 weights would load 2 bytes at a time (sm_90 PTX, Triton 3.6)
    k_lo = tl.multiple_of(pid_k * k_per, BLOCK_K)
    x_ptr = X + rm[:, None].to(tl.int64) * stride_x + (k_lo + rk)[None, :]  # [BM, BK]
    w_ptr = W + rn[None, :].to(tl.int64) * stride_w + (k_lo + rk)[:, None]  # [BK, BN]
    xm, wm = rm[:, None] < M, rn[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per, BLOCK_K):
        x = tl.load(x_ptr, mask=xm, other=0.0)
        w = tl.load(w_ptr, mask=wm, other=0.0)
        acc += tl.dot(x, w.to(x.dtype))
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    s = tl.load(S + rn, mask=rn < N, other=0.0)
    y = acc * s[None, :]
    y_ptr = Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr, y.to(Y.dtype.element_ty), mask=xm & wm)
    else:  # this split's partial sums [M, N] fp32 at Y[pid_k]; summed by the wrapper in a fixed order (no atomics:
        tl.store(y_ptr + pid_k * M * stride_y, y, mask=xm & wm)  # the same bits every run)


def weight_only_mm(x: Tensor, w8: Tensor, scale: Tensor, block_n: int = 64, block_k: int = 128,
                   split_k: int = 1, warps: int = 4, stages: int = 4) -> Tensor:
    """x [M, K] bf16/fp16 @ w8 [N, K]^T (e4m3) * scale [N] or [1, N] -> [M, N] in x's dtype."""
    M, K = x.shape
    N = w8.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert K % (block_k * split_k) == 0, (K, block_k, split_k)
    block_m = max(16, triton.next_power_of_2(M)) if M <= 64 else 64
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if split_k == 1 else \
        torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split_k)
    _weight_only_mm_kernel[grid](x, w8, scale, out, M, N, K, x.stride(0), w8.stride(0), out.stride(-2),
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                                 num_warps=warps, num_stages=stages)
    return out if split_k == 1 else out.sum(0).to(x.dtype)


def weight_only_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """(block_n, block_k, split_k, warps, stages) of weight_only_mm for an [m, k] @ [n, k]^T at a few rows, or None
    where it does not apply: 64 x 128 tiles, split over K until ~128 programs cover the GPU (the K = 8192 down
    projections' N alone gives 16-32)."""
    if k % 128:
        return None
    split = 1
    while triton.cdiv(n, 64) * split < 128 and split < 8 and k % (128 * split * 2) == 0:
        split *= 2
    return 64, 128, split, 4, 4

