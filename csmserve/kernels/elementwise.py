"""Small fused elementwise kernels for the frame step (CUDA)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from csmserve.kernels import pdl


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


@triton.jit
def _add_rms_norm_kernel(X, DELTA, H, Y, W, n_cols, stride_x, stride_d, stride_h, stride_y, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:  # the residual sum in the model dtype, as `x + delta` rounds it
        d = tl.load(DELTA + row * stride_d + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H + row * stride_h + cols, x, mask=ok)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    normed = (h * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Y + row * stride_y + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


def add_rms_norm_triton(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h) * weight) with h = x + delta (or x): one kernel for the residual add and the norm."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    d2 = x2 if delta is None else delta.reshape(-1, n)
    h = x2 if delta is None else torch.empty_like(x2)
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    BLOCK = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(x2.shape[0],)](x2, d2, h, y, weight, n, x2.stride(0), d2.stride(0), h.stride(0),
                                          y.stride(0), eps, HAS_DELTA=delta is not None, BLOCK=BLOCK,
                                          num_warps=4 if BLOCK <= 2048 else 8, **pdl.opts())
    return h.reshape(shape), y.reshape(shape)


@triton.jit
def _rope_qk_kernel(QKV, POS, COS, SIN, Q, K, stride_qkv, stride_pos, n_q, n_kv,
                    HD: tl.constexpr, HALF: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)  # q heads then k heads
    p = tl.load(POS + tok * stride_pos)
    i = tl.arange(0, HALF)
    src = QKV + tok * stride_qkv + head * HD
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    dt = Q.dtype.element_ty
    # the fp32 tables rounded to the model dtype first, as `rope_cos[pos].to(x.dtype)` does
    c = tl.load(COS + p * HD + i).to(dt).to(tl.float32)  # rotate-half layout: cos[:half] == cos[half:]
    s = tl.load(SIN + p * HD + i).to(dt).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if head < n_q:
        dst = Q + (tok * n_q + head) * HD
    else:
        dst = K + (tok * n_kv + head - n_q) * HD
    tl.store(dst + i, o1.to(dt))
    tl.store(dst + HALF + i, o2.to(dt))


def rope_qk_triton(qkv: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int
                   ) -> tuple[Tensor, Tensor]:
    """qkv [B, S, (n_q + 2 n_kv) * hd], pos [B, S], cos/sin tables [T, hd] fp32 -> q [B, S, n_q, hd],
    k [B, S, n_kv, hd] rotated (rotate-half), in one kernel."""
    B, S, width = qkv.shape
    hd = cos.shape[-1]
    x = qkv.reshape(B * S, width)
    p = pos.reshape(B * S)
    q = torch.empty(B, S, n_q, hd, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(B, S, n_kv, hd, dtype=qkv.dtype, device=qkv.device)
    _rope_qk_kernel[(B * S, n_q + n_kv)](x, p, cos, sin, q, k, x.stride(0), p.stride(0), n_q, n_kv,
                                         HD=hd, HALF=hd // 2, num_warps=1)
    return q, k


@triton.jit
def _store_kv_kernel(KC, VC, ROWS, POS, K, V, stride_pos, s_kb, s_vb, s_n, s_h, s_t, s_vn, s_vh, s_vt,
                     HD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(ROWS + b).to(tl.int64)
    p = tl.load(POS + b * stride_pos).to(tl.int64)
    d = tl.arange(0, HD)
    tl.store(KC + row * s_n + h * s_h + p * s_t + d, tl.load(K + b * s_kb + h * HD + d))
    tl.store(VC + row * s_vn + h * s_vh + p * s_vt + d, tl.load(V + b * s_vb + h * HD + d))


def store_kv_triton(k_cache: Tensor, v_cache: Tensor, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """k_cache/v_cache [N, Hkv, T, hd] (one layer; last dim contiguous), rows/pos [B], k/v [B, Hkv, hd]
    (each row's [Hkv, hd] contiguous; rows may be strided, as views into the qkv projection are):
    cache[rows[b], :, pos[b]] = k[b] for both, in one kernel."""
    B, n_kv, hd = k.shape
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != hd:
            raise ValueError("store_kv_triton: each row of k and v must be a contiguous [Hkv, hd] block")
    _store_kv_kernel[(B, n_kv)](k_cache, v_cache, rows, pos, k, v, pos.stride(0), k.stride(0), v.stride(0),
                                *k_cache.stride()[:3], *v_cache.stride()[:3], HD=hd, num_warps=1)
