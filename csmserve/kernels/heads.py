"""Gathered codebook-head GEMV: every output row reads its own head (speculation's ragged codebooks).

out[n] = head_t[heads[n]] @ x[rows[n]] for a [H, Vp, D] stack of heads; a program per (row, block of
the vocab), fp32 accumulation. The torch fallback (CSMModel.codebook_logits_at) gathers the heads
with bmm; on CUDA that would copy each row's 4 MB head before reading it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _head_gemv_kernel(X, W, HEADS, ROWS, OUT, D, V, stride_x, stride_wh, stride_wv, stride_o,
                      BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    vb = tl.program_id(1)
    head = tl.load(HEADS + n).to(tl.int64)
    row = tl.load(ROWS + n).to(tl.int64)
    rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = rv < V
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        md = rd < D
        x = tl.load(X + row * stride_x + rd, mask=md, other=0.0).to(tl.float32)
        w = tl.load(W + head * stride_wh + rv[:, None] * stride_wv + rd[None, :], mask=mv[:, None] & md[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(OUT + n * stride_o + rv, acc, mask=mv)


def gathered_head_logits(x: Tensor, head_t: Tensor, heads: Tensor, rows: Tensor | None, vocab: int) -> Tensor:
    """x [M, D]; head_t [H, Vp, D] (contiguous); heads [N] in [0, H); rows [N] in [0, M) (None: arange)
    -> float32 [N, vocab]."""
    N = heads.shape[0]
    D = x.shape[-1]
    x = x.contiguous()
    if rows is None:
        rows = torch.arange(N, device=x.device)
    out = torch.empty(N, vocab, dtype=torch.float32, device=x.device)
    BLOCK_V = 64
    _head_gemv_kernel[(N, triton.cdiv(vocab, BLOCK_V))](
        x, head_t, heads, rows, out, D, vocab, x.stride(0), head_t.stride(0), head_t.stride(1), out.stride(0),
        BLOCK_V=BLOCK_V, BLOCK_D=128, num_warps=4)
    return out
