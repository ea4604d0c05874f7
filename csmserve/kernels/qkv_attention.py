"""A depth layer's add + RMSNorm + qkv GEMV and its attention in one kernel (1-2 rows): the last program of a KV
head's columns attends.

At batch 1 the depth attention is a kernel of its own after the qkv GEMV, 120 a frame. In the graphed frame each is
charged ~4 us (bench/graph_profile.py: from the GEMV's end to its own), where the attention's own work is ~1 us a
layer (the persistent depth loop's phase B, docs/benchmarks.md): the rest is the kernel boundary (the GEMV's exit,
the PDL wait's release, the qkv read back). Here kernels/gemv.py's 1-2-row program (gemv_columns, the add +
RMSNorm fused in as norm_gemv does) stores its qkv columns, then counts itself in at its KV head's counter (an
acq_rel atomic after a CTA barrier: its stores are visible with its arrival). The head's last program to arrive,
all the head's columns then visible to it (acquire), resets the counter and runs kernels/depth_attention.py's
attention for each row: RoPE of the head's q and k, the new K and V into the cache at the row's position, attention
over the positions before it and the new one. A KV head's columns are its G query heads, its key and its value:
(G + 2) hd of them, in (G + 2) hd / BLOCK_N programs (BLOCK_N divides hd). The same GEMV and the same attention on
the stored qkv as the two kernels: the same bits.

Off by default: measured slower (docs/benchmarks.md, issue 16: the frame step at batch 1, bf16 4.63 -> 4.75-5.03 ms,
fp8-all 3.35 -> 3.54-3.83; every program pays its arrival, and one program per head attends for both rows, one
after the other). CSMSERVE_DEPTH_QKV_ATTN=1 turns it on; off, and with
CSMSERVE_DEPTH_ATTN_O=1 (the attention fused into the o projection instead): the two kernels (gemv.norm_gemv, then
depth_attention.depth_attend_triton).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from csmserve.kernels import depth_attention, gemv, pdl
from csmserve.kernels.depth_attention import attend_cached, cached_kv, rope_at

ON = os.environ.get("CSMSERVE_DEPTH_QKV_ATTN", "0") == "1"
# the GEMV's column block and warps here (0: gemv.config's): wider blocks, fewer programs to count in and to hold
# the attention's registers
BLOCK_N = int(os.environ.get("CSMSERVE_QKV_ATTN_BLOCK_N", "0"))
WARPS = int(os.environ.get("CSMSERVE_QKV_ATTN_WARPS", "0"))
MAX_HEADS = 64  # KV heads a counter buffer holds
MAX_POSITIONS = 64  # the depth cache's positions, read in one block

# device -> [MAX_HEADS] int32 arrivals, zero between calls (each call's last arrivals reset theirs). Shared by every
# call on the device: they run one after another on the stream, and a call counts only after its PDL wait
_COUNTERS: dict[torch.device, Tensor] = {}


def _counters(device: torch.device) -> Tensor | None:
    ctr = _COUNTERS.get(device)
    if ctr is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # never made inside a capture (it would live in the graph's pool): the two kernels then
        ctr = _COUNTERS[device] = torch.zeros(MAX_HEADS, dtype=torch.int32, device=device)
    return ctr


@triton.jit
def _attend_row(QKV, POS, COS, SIN, k_base, v_base, out_row, s_kt, s_vt, head, n_kv, scale, n_q, G: tl.constexpr,
                GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr, IEEE: tl.constexpr):
    p = tl.load(POS).to(tl.int64)
    c, s = rope_at(COS, SIN, p, out_row.dtype.element_ty, HD, HALF)
    kc1, kc2, vc = cached_kv(k_base, v_base, s_kt, s_vt, p, HD, HALF, BLOCK_P)
    attend_cached(QKV, p, c, s, k_base, v_base, out_row, s_kt, s_vt, head, n_kv, scale, n_q, kc1, kc2, vc, G, GP, HD,
                  HALF, BLOCK_P, IEEE)


@triton.jit
def _norm_qkv_attend_kernel(X, DELTA, H, NW, W, S, Y, M, N, K, stride_xm, stride_dm, stride_hm, stride_wn,
                            stride_ym, eps, POS, stride_pos, COS, SIN, KC, VC, OUT, CTR, s_kn, s_kh, s_kt, s_vn, s_vh,
                            s_vt, scale, n_q, HAS_DELTA: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
                            G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_P: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    gemv.gemv_columns(pid, X, DELTA, H, NW, W, S, Y, M, N, K, stride_xm, stride_dm, stride_hm, stride_wn, stride_ym,
                      0, eps, True, HAS_DELTA, TWO_ROWS, BLOCK_N, BLOCK_K, False, PRE_K, PDL, SCALED, None, False,
                      False, 64)
    # the KV head of this program's columns: [q heads 0..n_q) [k heads 0..n_kv) [v heads 0..n_kv), hd columns each
    n_kv = n_q // G
    c0 = pid * BLOCK_N
    head = tl.where(c0 < n_q * HD, c0 // (G * HD), ((c0 - n_q * HD) // HD) % n_kv)
    tl.debug_barrier()  # every thread's qkv stores issued before the arrival (release: visible with it)
    arrived = tl.atomic_add(CTR + head, 1, sem="acq_rel")
    if arrived == (G + 2) * HD // BLOCK_N - 1:  # the head's last program: all its q, k, v visible (acquire)
        tl.atomic_xchg(CTR + head, 0)  # for the next call (which counts only after its PDL wait)
        _attend_row(Y, POS, COS, SIN, KC + head * s_kh, VC + head * s_vh, OUT, s_kt, s_vt, head, n_kv, scale, n_q,
                    G, GP, HD, HALF, BLOCK_P, IEEE)
        if TWO_ROWS:
            _attend_row(Y + stride_ym, POS + stride_pos, COS, SIN, KC + s_kn + head * s_kh, VC + s_vn + head * s_vh,
                        OUT + n_q * HD, s_kt, s_vt, head, n_kv, scale, n_q, G, GP, HD, HALF, BLOCK_P, IEEE)


def applies(x: Tensor, norm_weight: Tensor, weight: Tensor, scale: Tensor | None, k_cache: Tensor, n_q: int,
            n_kv: int) -> bool:
    """Where norm_qkv_attend runs: gemv.norm_applies at 1-2 rows, weight the [q; k; v] projection [(n_q + 2 n_kv) hd,
    D], a KV head's columns a whole number of the GEMV's column blocks, the cache [>= B, n_kv, <= 64, hd]."""
    M, K = x.numel() // x.shape[-1], x.shape[-1]
    hd = k_cache.shape[-1]
    if not (ON and not depth_attention.ATTN_O and 1 <= M <= gemv.ELEMENTWISE_ROWS and n_kv >= 1 and n_q % n_kv == 0
            and n_kv <= MAX_HEADS and weight.shape[0] == (n_q + 2 * n_kv) * hd and k_cache.dim() == 4
            and k_cache.shape[0] >= M
            and k_cache.shape[1] == n_kv and 2 <= k_cache.shape[2] <= MAX_POSITIONS and k_cache.stride(3) == 1
            and hd % 2 == 0 and gemv.norm_applies(x, norm_weight, weight, False, scale)):
        return False
    cfg = _config(M, weight.shape[0], K, scale is not None)
    return cfg is not None and hd % cfg[0] == 0 and _counters(x.device) is not None


def _config(m: int, n: int, k: int, fp8: bool) -> tuple[int, int, int, int | None] | None:
    """(BLOCK_N, BLOCK_K, warps, stages): gemv.config's, or BLOCK_N / WARPS with gemv.blocks()' chunk for that BLOCK_N
    (None: no chunk divides K)."""
    cfg = gemv.config(m, n, k, False, True, fp8=fp8)
    if BLOCK_N:
        bn_bk = gemv.blocks(m, n, k, block_n=BLOCK_N)
        if bn_bk is None:
            return None
        cfg = (*bn_bk, *cfg[2:])
    if WARPS:
        cfg = (*cfg[:2], WARPS, cfg[3])
    return cfg


def norm_qkv_attend(x: Tensor, delta: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                    scale: Tensor | None, pos: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                    n_q: int, n_kv: int) -> tuple[Tensor, Tensor]:
    """(h, attention) with h = x + delta (or x) and the attention of qkv = rms_norm(h) * norm_weight @ weight^T
    (FP8: e4m3 weight times scale [N]): x/delta [..., D] (1-2 rows), pos [B] each row's position, cos/sin [T, hd]
    fp32, k_cache/v_cache [>= B, n_kv, P, hd] (one layer) -> h [..., D], [..., n_q hd]; the cache gets each row's
    rotated k and v at pos. As gemv.norm_gemv, then depth_attention.depth_attend_triton. The caller checks
    `applies`."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    d2 = x2 if delta is None else delta.reshape(-1, K).contiguous()
    h = x2 if delta is None else torch.empty_like(x2)
    M, N, hd = x2.shape[0], weight.shape[0], cos.shape[-1]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)  # qkv, read back by the heads' last programs
    out = torch.empty(M, n_q * hd, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = _config(M, N, K, scale is not None)
    G = n_q // n_kv
    _norm_qkv_attend_kernel[(triton.cdiv(N, bn),)](
        x2, d2, h, norm_weight, weight, weight if scale is None else scale, y, M, N, K, x2.stride(0), d2.stride(0),
        h.stride(0), weight.stride(0), y.stride(0), eps, pos, pos.stride(0), cos, sin, k_cache, v_cache, out,
        _counters(x.device), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), 1.0 / math.sqrt(hd), n_q, HAS_DELTA=delta is not None,
        TWO_ROWS=M > 1, BLOCK_N=bn, BLOCK_K=bk, PRE_K=gemv.pre_k(M, K, bk), SCALED=scale is not None, G=G,
        GP=max(16, triton.next_power_of_2(G)), HD=hd, HALF=hd // 2,
        BLOCK_P=max(16, triton.next_power_of_2(k_cache.shape[2])), IEEE=x.dtype == torch.float32,
        **gemv._launch_opts(warps, stages), **pdl.opts())
    return h.reshape(x.shape), out.reshape(*x.shape[:-1], n_q * hd)
