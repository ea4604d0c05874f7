"""Llama blocks shared by the CSM backbone and depth decoder.

Math only. Attention never owns a cache: it computes q/k/v with RoPE and hands
them to a `KVView`, which writes the new keys/values wherever the caller keeps
them and returns the attention output. The reference generator uses `DenseKV`;
the engine supplies its own views over slot-indexed buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from csmserve.models.fp8 import FP8Linear


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    # llama3 scaling, HF parametrisation; factor None = plain RoPE.
    rope_factor: float | None = 32.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    max_seq_len: int = 2048

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def llama3_inv_freq(cfg: LlamaConfig) -> Tensor:
    """Inverse frequencies [head_dim/2], float32, llama3-scaled as in HF `_compute_llama3_parameters`."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    if cfg.rope_factor is None:
        return inv
    low_wavelen = cfg.rope_original_max_pos / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_pos / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
    smooth = (cfg.rope_original_max_pos / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: LlamaConfig) -> tuple[Tensor, Tensor]:
    """cos, sin [max_seq_len, head_dim] float32, rotate-half layout, computed on the CPU whatever the default
    device (arange on meta, in loader.empty_model, imports sympy: ~2 s in every process that builds a model)."""
    pos = torch.arange(cfg.max_seq_len, dtype=torch.float32, device="cpu")
    freqs = pos[:, None] * llama3_inv_freq(cfg)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [B, S, H, hd]; cos/sin [B, S, hd] in x.dtype
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    # the residual stream h = x + delta (delta None: h = x) and its norm
    h = x if delta is None else x + delta
    return h, _rms_norm(h, weight, eps)


def _rope_qk(qkv: Tensor, pos: Tensor, cos_t: Tensor, sin_t: Tensor, n_q: int, n_kv: int) -> tuple[Tensor, Tensor]:
    # qkv [B, S, (n_q + 2 n_kv) hd], pos [B, S], tables [T, hd] fp32 -> q [B, S, n_q, hd], k [B, S, n_kv, hd]
    B, S, _ = qkv.shape
    hd = cos_t.shape[-1]
    q, k, _ = qkv.split([n_q * hd, n_kv * hd, n_kv * hd], -1)
    cos, sin = cos_t[pos].to(qkv.dtype), sin_t[pos].to(qkv.dtype)
    return _apply_rope(q.view(B, S, n_q, hd), cos, sin), _apply_rope(k.view(B, S, n_kv, hd), cos, sin)


def _silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _matmul_t(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, weight)


def _gemv():
    from csmserve.kernels import gemv  # Triton: imported only for CUDA tensors

    return gemv


def _matmul_t_gemv(x: Tensor, weight: Tensor) -> Tensor:
    if x.is_cuda and _gemv().applies(x, weight):
        return _gemv().gemv(x, weight)
    return F.linear(x, weight)


def _gemv_weight(x: Tensor, layer: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """(weight, per-channel scale or None) of a layer kernels/gemv.py can run on x (CUDA), or None."""
    if not x.is_cuda:
        return None
    if type(layer) is nn.Linear:
        return layer.weight, None
    if type(layer) is FP8Linear:
        return layer.weight8, layer.scale  # [N, K] e4m3, [1, N] float32
    return None


def _lora(layer: nn.Module):
    """The layer's LoRA weights (models/lora.py LoraLayer) when this forward runs LoRA rows (its pool's rows set:
    the runner's), else None."""
    lora = getattr(layer, "lora", None)
    return lora if lora is not None and lora.pool.rows is not None else None


def _lora_kernels():
    from csmserve.kernels import lora  # Triton: imported only for CUDA tensors

    return lora


def _plus_lora(x: Tensor, y: Tensor, lora) -> Tensor:
    """y (x's base projection, a fresh tensor) + each row's LoRA delta: kernels/lora.py on CUDA (in place), the
    torch math elsewhere."""
    if y.is_cuda and _lora_kernels().applies(x, lora):
        return _lora_kernels().lora_add_(x, y, lora)
    from csmserve.models.lora import delta_torch

    return y + delta_torch(x, lora)


def _base(x: Tensor, layer: nn.Module) -> Tensor:
    return matmul_t(x, layer.weight) if type(layer) is nn.Linear else layer(x)


def _linear_gemv(x: Tensor, layer: nn.Module) -> Tensor:
    ws, lora = _gemv_weight(x, layer), _lora(layer)
    if ws is not None and _gemv().applies(x, ws[0], False, ws[1], lora):
        return _gemv().gemv(x, ws[0], scale=ws[1], lora=lora)
    return _linear(x, layer)


def _glu_gemv(x: Tensor, layer: nn.Module) -> Tensor:
    ws, lora = _gemv_weight(x, layer), _lora(layer)
    if ws is not None and _gemv().applies(x, ws[0], True, ws[1], lora):
        return _gemv().gemv(x, ws[0], glu=True, scale=ws[1], lora=lora)
    return _glu(x, layer)


def _glu(x: Tensor, layer: nn.Module) -> Tensor:
    gate_up, lora = _base(x, layer), _lora(layer)
    if lora is None:
        return silu_mul(gate_up)
    # the deltas go in before the SiLU: kernels/lora.py's lora_glu is silu_mul's kernel
    if gate_up.is_cuda and _lora_kernels().applies(x, lora):
        return _lora_kernels().lora_glu(gate_up, x, lora)
    from csmserve.models.lora import delta_torch

    return silu_mul(gate_up + delta_torch(x, lora))


def _norm_then(x: Tensor, delta: Tensor | None, norm: "RMSNorm", layer: nn.Module, gated: bool
               ) -> tuple[Tensor, Tensor]:
    x, y = add_rms_norm(x, delta, norm.weight, norm.eps)
    return x, (glu(y, layer) if gated else linear(y, layer))


def _norm_then_gemv(x: Tensor, delta: Tensor | None, norm: "RMSNorm", layer: nn.Module, gated: bool
                    ) -> tuple[Tensor, Tensor]:
    ws, lora = _gemv_weight(x, layer), _lora(layer)
    if ws is not None and _gemv().norm_applies(x, norm.weight, ws[0], gated, ws[1], lora):
        return _gemv().norm_gemv(x, delta, norm.weight, norm.eps, ws[0], gated, ws[1], lora=lora)
    return _norm_then(x, delta, norm, layer, gated)


def _embed_linear(idx: Tensor, table: Tensor, layer: nn.Module) -> Tensor:
    return linear(F.embedding(idx, table), layer)


def _embed_linear_gemv(idx: Tensor, table: Tensor, layer: nn.Module) -> Tensor:
    ws, lora = _gemv_weight(table, layer), _lora(layer)
    if ws is not None and _gemv().gather_applies(idx, table, ws[0], ws[1], lora):
        return _gemv().gather_gemv(idx, table, ws[0], ws[1], lora=lora)
    return _embed_linear(idx, table, layer)


def _norm_matmul_t(x: Tensor, delta: Tensor | None, norm: "RMSNorm", weight: Tensor) -> Tensor:
    return matmul_t(add_rms_norm(x, delta, norm.weight, norm.eps)[1], weight)


def _norm_matmul_t_gemv(x: Tensor, delta: Tensor | None, norm: "RMSNorm", weight: Tensor) -> Tensor:
    if x.is_cuda and _gemv().norm_applies(x, norm.weight, weight):
        return _gemv().norm_gemv(x, delta, norm.weight, norm.eps, weight)[1]
    return _norm_matmul_t(x, delta, norm, weight)


def _linear(x: Tensor, layer: nn.Module) -> Tensor:
    y = _base(x, layer)
    lora = _lora(layer)
    return y if lora is None else _plus_lora(x, y, lora)


def linear(x: Tensor, layer: nn.Module) -> Tensor:
    """layer(x) for a bias-free nn.Linear through `matmul_t` (a GEMV kernel at a few rows, once
    `fuse_gemv()`), an FP8Linear through the same kernel at a few rows (weight-only: its e4m3 weights
    times the activations as they are; FP8Linear's own forward at more rows: models/fp8.py); any other
    layer as it is. A layer with LoRA weights (`layer.lora`, models/lora.py) in a forward with LoRA rows adds each
    row's delta: inside the GEMV at 1-16 rows, kernels/lora.py after the GEMM above, the torch math on the CPU."""
    return linear_impl(x, layer)


# The elementwise pieces, swappable for fused Triton kernels by `fuse_elementwise()` (same math,
# one kernel each: residual add + norm, RoPE of q and k from the qkv projection, SiLU * up), and the
# GEMMs at a few rows (x @ w^T; the MLP's [gate; up] GEMM + SiLU*up; norm_then: a block's residual
# add + RMSNorm and the GEMM after it, (h, y) = (x + delta, layer(norm(h))), gated: glu; embed_linear:
# layer(table[idx]), the gather in the GEMM; norm_matmul_t: norm(x + delta) @ weight^T), by `fuse_gemv()`.
add_rms_norm, rope_qk, silu_mul = _add_rms_norm, _rope_qk, _silu_mul
matmul_t, linear_impl, glu, norm_then = _matmul_t, _linear, _glu, _norm_then
embed_linear, norm_matmul_t = _embed_linear, _norm_matmul_t


def fuse_elementwise() -> None:
    """Replace the elementwise pieces with fused Triton kernels (CUDA): far fewer kernels per frame."""
    global add_rms_norm, rope_qk, silu_mul
    from csmserve.kernels.elementwise import add_rms_norm_triton, rope_qk_triton, silu_mul_triton

    add_rms_norm, rope_qk, silu_mul = add_rms_norm_triton, rope_qk_triton, silu_mul_triton


def fuse_gemv(on: bool = True) -> None:
    """GEMMs of 1-16 rows (CUDA, bf16/fp16 or FP8Linear's e4m3; gemv.MAX_ROWS) by kernels/gemv.py, the MLP's SiLU*up
    fused into its first one, and at 1-2 rows each block's two residual add + RMSNorm into the GEMM after them, the
    depth step's embedding gather into the projection's GEMM and its final norm into the head's; off: F.linear
    (cuBLAS: the tests' reference). Read when a graph is captured: set it before the runner is built."""
    global matmul_t, linear_impl, glu, norm_then, embed_linear, norm_matmul_t
    matmul_t, linear_impl, glu, norm_then = ((_matmul_t_gemv, _linear_gemv, _glu_gemv, _norm_then_gemv) if on
                                             else (_matmul_t, _linear, _glu, _norm_then))
    embed_linear, norm_matmul_t = ((_embed_linear_gemv, _norm_matmul_t_gemv) if on else (_embed_linear, _norm_matmul_t))


class KVView(Protocol):
    """The caches' interface; implementations subclass it for attend_qkv's default."""

    def begin(self, pos: Tensor) -> None:
        """Called once per forward, before the layers: pos [B, S] absolute positions of the new tokens."""
        ...

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, S, Hq, hd], k/v [B, S, Hkv, hd] for the new positions -> [B, S, Hq, hd]."""
        ...

    def attend_qkv(self, layer: int, qkv: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int) -> Tensor | None:
        """RoPE, store and attention from the projection qkv [B, S, (n_q + 2 n_kv) hd] in one kernel ->
        [B, S, n_q hd], where the view has one (DepthKV); None: the caller ropes q and k and calls attend()."""
        return None


class DenseKV(KVView):
    """Contiguous per-row cache k, v [L, B, Hkv, T, hd]; rows write at `pos` and attend to keys <= pos.

    Only the first `kv_len` keys are read (set it to the context in use so the cost follows it).
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.rows = torch.arange(batch, device=device)[:, None]  # [B, 1]
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.kv_len = max_len
        self.mask = None

    def begin(self, pos: Tensor) -> None:
        self.pos = pos
        keys = torch.arange(self.kv_len, device=pos.device)
        self.mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, S, kv_len]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rows = self.rows[: q.shape[0]]
        self.k[layer][rows, :, self.pos] = k
        self.v[layer][rows, :, self.pos] = v
        keys = self.k[layer, : q.shape[0], :, : self.kv_len]
        values = self.v[layer, : q.shape[0], :, : self.kv_len]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=self.mask,
                                             enable_gqa=True)
        return out.transpose(1, 2)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[1]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # fused [q; k; v] rows, rotate-half RoPE layout (HF convention)
        self.qkv_proj = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * self.hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)

    def forward(self, qkv: Tensor, pos: Tensor, cos_t: Tensor, sin_t: Tensor, kv: KVView, layer: int) -> Tensor:
        # qkv [B, S, (Hq + 2 Hkv) hd]: qkv_proj of the normed input (Block: norm_then)
        B, S, _ = qkv.shape
        out = kv.attend_qkv(layer, qkv, cos_t, sin_t, self.n_heads, self.n_kv)
        if out is not None:
            return linear(out, self.o_proj)
        q, k = rope_qk(qkv, pos, cos_t, sin_t, self.n_heads, self.n_kv)
        v = qkv[..., (self.n_heads + self.n_kv) * self.hd:].view(B, S, self.n_kv, self.hd)
        out = kv.attend(layer, q, k, v)
        return linear(out.reshape(B, S, self.n_heads * self.hd), self.o_proj)


class MLP(nn.Module):
    """The MLP's weights only: Block applies them (gate_up fused with the norm before it, `norm_then`)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.intermediate, bias=False)  # [gate; up]
        self.down_proj = nn.Linear(cfg.intermediate, cfg.dim, bias=False)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, delta: Tensor | None, pos: Tensor, cos_t: Tensor, sin_t: Tensor, kv: KVView,
                layer: int) -> tuple[Tensor, Tensor]:
        """The residual stream arrives as x + delta (the previous block's MLP output, not yet added: the
        add is fused into this block's first norm). Returns (residual, this block's MLP output)."""
        attn, mlp = self.self_attn, self.mlp
        x, qkv = norm_then(x, delta, self.input_layernorm, attn.qkv_proj, False)
        a = attn(qkv, pos, cos_t, sin_t, kv, layer)
        x, h = norm_then(x, a, self.post_attention_layernorm, mlp.gate_up_proj, True)  # h = silu(gate) * up
        return x, linear(h, mlp.down_proj)


class Llama(nn.Module):
    """A stack of blocks and the final norm: embeddings in, normed hidden states out."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_seq_len, hd] fp32
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: Tensor, pos: Tensor, kv: KVView, normed: bool = True) -> Tensor | tuple[Tensor, Tensor]:
        # x [B, S, D]; pos [B, S] absolute positions -> the final-normed hidden states [B, S, D]; normed=False:
        # (x, delta) before the final add + norm, for the caller to fuse them into its GEMM (norm_matmul_t)
        kv.begin(pos)
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, pos, self.rope_cos, self.rope_sin, kv, i)
        if not normed:
            return x, delta
        return add_rms_norm(x, delta, self.norm.weight, self.norm.eps)[1]

    def new_kv(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> DenseKV:
        c = self.cfg
        return DenseKV(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, dtype, device)
