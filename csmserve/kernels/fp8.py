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
