"""Skinny GEMMs (M <= 8 rows): y [M, N] = x [M, K] @ w [N, K]^T, each weight read once for all M rows.

At batch 1-4 a frame is ~560 of these (31 depth steps x (4 layers x 4 + projection + head) + the
backbone's 64): 2-32 MB each, where cuBLAS' GEMV kernels (+ a split-K reduction) run at ~40% of HBM
bandwidth (docs/benchmarks.md, the batch-1 profile). Here a program owns BLOCK_N output columns for
all rows and walks K in BLOCK_K chunks (fp32 accumulation); BLOCK_N is chosen so that ~512 programs
cover N (every SM several, so enough loads are in flight), BLOCK_K so that one chunk of a program is
a few KB (16-byte loads, 4 warps). No split-K, so no second kernel and no workspace.

glu=True: w is [gate; up] [2I, K] and y = silu(x @ gate^T) * (x @ up^T) [M, I]: the MLP's first GEMM
and its SiLU*up in one kernel (the gate and up tiles of a column block read together).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_ROWS = 8  # above this, cuBLAS' GEMMs
_PROGRAMS = 512  # the grid to aim at: ~4 programs per SM on an H100/H200 (132 SMs)
_ELEMS = 4096  # weights per program per chunk at 1-2 rows (8 KB bf16)
NUM_WARPS = 4


@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, UP_OFF,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    mn = rn < N
    rm = tl.arange(0, M_PAD)
    mm = rm < M
    rk0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (the caller checks)
        rk = k0 + rk0
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
        w = tl.load(w_rows + rk[None, :], mask=mn[:, None], other=0.0).to(tl.float32)  # [BN, BK]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if GLU:
            u = tl.load(w_rows + UP_OFF * stride_wn + rk[None, :], mask=mn[:, None], other=0.0).to(tl.float32)
            acc_up += tl.sum(x[:, None, :] * u[None, :, :], axis=2)
    if GLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = Y + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def blocks(m: int, n: int, k: int) -> tuple[int, int, int] | None:
    """(M_PAD, BLOCK_N, BLOCK_K) for an [m, k] @ [n, k]^T, or None where this kernel does not apply."""
    if not 1 <= m <= MAX_ROWS or k < 128:
        return None
    m_pad = triton.next_power_of_2(m)
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < _PROGRAMS:
        block_n //= 2
    # a program's chunk: ~4,096 weights (8 KB bf16), fewer as the rows grow ([M_PAD, BN, BK] fp32 products)
    elems = max(1024, min(_ELEMS, 2 * _ELEMS // m_pad))
    block_k = min(triton.next_power_of_2(k), max(128, elems // block_n))
    if k % block_k:
        return None
    return m_pad, block_n, block_k


def applies(x: Tensor, weight: Tensor, glu: bool = False) -> bool:
    m = x.numel() // x.shape[-1]
    n = weight.shape[0] // (2 if glu else 1)
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(-1) == 1 and blocks(m, n, x.shape[-1]) is not None)


def gemv(x: Tensor, weight: Tensor, glu: bool = False) -> Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] (glu: weight [2I, K] -> silu(gate) * up [..., I]).
    The caller checks `applies` (else F.linear)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    N = weight.shape[0] // (2 if glu else 1)
    m_pad, bn, bk = blocks(M, N, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, bn),)](x2, weight, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0), N,
                                        M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, GLU=glu, num_warps=NUM_WARPS)
    return y.reshape(*x.shape[:-1], N)
