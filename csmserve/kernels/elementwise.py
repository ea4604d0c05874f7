"""Small fused elementwise kernels for the frame step (CUDA)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _silu_mul_kernel(X, OUT, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=ok)


def silu_mul_triton(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2I] ([gate; up]) -> silu(gate) * up [..., I]."""
    shape = gate_up.shape
    x = gate_up.reshape(-1, shape[-1])
    n = shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    BLOCK = 1024
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, BLOCK))](x, out, n, x.stride(0), out.stride(0), BLOCK=BLOCK,
                                                          num_warps=4)
    return out.reshape(*shape[:-1], n)
