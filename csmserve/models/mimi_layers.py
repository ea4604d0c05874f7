"""Mimi building blocks: causal (transposed) convs, SEANet, the windowed RoPE transformer, split RVQ.

Each stateful module reads/writes its per-row streaming state through a `RowView` (None in
whole-utterance mode). Assembled by `csmserve.models.mimi.Mimi`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from csmserve.models.mimi_config import MimiConfig


# --------------------------------------------------------------------------- streaming state


class RowView:
    """The state rows one streaming step reads and writes. bufs[key] is [max_rows, ...].

    kernel: transformer attention reads the rows' KV rings in place (Triton, `window_attention`)
    instead of gathering them (`read`) for SDPA; same math, a third of the bytes.
    """

    def __init__(self, bufs: dict[str, Tensor], rows: Tensor, moshi_window: bool = False, kernel: bool = False):
        self.bufs, self.rows, self.moshi_window, self.kernel = bufs, rows, moshi_window, kernel

    def read(self, key: str) -> Tensor:
        return self.bufs[key].index_select(0, self.rows)

    def write(self, key: str, value: Tensor) -> None:
        buf = self.bufs[key]
        buf.index_copy_(0, self.rows, value.to(buf.dtype))

    def ring_index(self, slots: Tensor, capacity: int) -> Tensor:
        # slots [B, T] ring indices -> [B*T] flat (row, slot) indices into a ring [R, C, ...]
        return (self.rows[:, None] * capacity + slots).reshape(-1)

    def write_ring(self, key: str, slots: Tensor, value: Tensor, flat: Tensor | None = None) -> None:
        # buf [R, C, H, hd]; slots [B, T] ring indices (or flat = ring_index(slots, C)); value [B, T, H, hd].
        # Writes only these B*T entries in place; the rest of the ring is not touched.
        buf = self.bufs[key]
        R, C = buf.shape[:2]
        flat = self.ring_index(slots, C) if flat is None else flat
        buf.view(R * C, *buf.shape[2:]).index_copy_(0, flat, value.reshape(-1, *buf.shape[2:]).to(buf.dtype))


class Stateful(nn.Module):
    """A module carrying per-row streaming state; `key` is set by `Mimi` to its module name."""

    key: str = ""

    def state_specs(self, max_steps: int) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """slot name -> (per-row shape, dtype; None = the model dtype); max_steps: most steps per call."""
        return {}


# --------------------------------------------------------------------------- convolutions

class CausalConv(Stateful):
    """Causal Conv1d: left context (k-1)*d+1-s from zeros, the first sample (replicate), or state."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, replicate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, k))
        self.bias = nn.Parameter(torch.zeros(cout)) if bias else None
        self.stride, self.dilation, self.replicate = stride, dilation, replicate
        self.ctx = (k - 1) * dilation + 1 - stride

    def state_specs(self, max_steps: int) -> dict:
        if not self.ctx:
            return {}
        specs: dict = {"prev": ((self.weight.shape[1], self.ctx), None)}
        if self.replicate:
            specs["started"] = ((), torch.bool)
        return specs

    def _left(self, x: Tensor, st: RowView | None) -> Tensor:
        # -> [B, Cin, ctx]
        if st is None:
            return x[..., :1].expand(-1, -1, self.ctx) if self.replicate else x.new_zeros(*x.shape[:2], self.ctx)
        prev = st.read(self.key + ".prev")
        if self.replicate:  # a row's first step pads with its first sample
            started = st.read(self.key + ".started")[:, None, None]
            prev = torch.where(started, prev, x[..., :1].expand(-1, -1, self.ctx))
            st.write(self.key + ".started", torch.ones_like(st.rows, dtype=torch.bool))
        return prev

    def forward(self, x: Tensor, st: RowView | None = None) -> Tensor:
        # x [B, Cin, T] -> [B, Cout, ceil(T / stride)]
        if st is None and x.shape[-1] % self.stride:  # whole mode: complete the last window (HF, moshi 0.2.2)
            x = F.pad(x, (0, -x.shape[-1] % self.stride), mode="replicate" if self.replicate else "constant")
        if self.ctx:
            x = torch.cat([self._left(x, st), x], dim=-1)
            if st is not None:
                st.write(self.key + ".prev", x[..., x.shape[-1] - self.ctx:])
        return F.conv1d(x, self.weight, self.bias, self.stride, dilation=self.dilation)


class CausalConvTr(Stateful):
    """ConvTranspose1d, all K-S overlap samples trimmed on the right; streaming carries them over."""

    def __init__(self, cin: int, cout: int, k: int, stride: int, groups: int = 1, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cin, cout // groups, k))
        self.bias = nn.Parameter(torch.zeros(cout)) if bias else None
        self.stride, self.groups, self.tail, self.cout = stride, groups, k - stride, cout

    def state_specs(self, max_steps: int) -> dict:
        return {"tail": ((self.cout, self.tail), None)} if self.tail else {}

    def _transposed(self, x: Tensor) -> Tensor:
        # x [B, Cin, T] -> [B, Cout, S*(T-1) + K]
        C, k, s = x.shape[1], self.weight.shape[-1], self.stride
        if self.groups == C == self.cout and k % s == 0:
            # depthwise (Mimi's 12.5 -> 25 Hz upsample): a broadcast product and an overlap-add; cuDNN's
            # grouped transposed conv took 9 ms of a 25 ms decode step at batch 2048 on the H200
            B, T, m = x.shape[0], x.shape[-1], k // s
            full = (x[:, :, :, None] * self.weight[None, :, 0, None, :]).view(B, C, T, m, s)  # [B, C, T, m, s]
            y = full.new_zeros(B, C, T + m - 1, s)
            for i in range(m):
                y[:, :, i:i + T] += full[:, :, :, i]
            y = y.view(B, C, (T + m - 1) * s)
            return y if self.bias is None else y + self.bias[:, None]
        return F.conv_transpose1d(x, self.weight, self.bias, self.stride, groups=self.groups)

    def forward(self, x: Tensor, st: RowView | None = None) -> Tensor:
        # x [B, Cin, T] -> y [B, Cout, S*T + tail] -> [B, Cout, S*T]
        y = self._transposed(x)
        n = y.shape[-1] - self.tail
        if st is None or not self.tail:
            return y[..., :n]
        prev = st.read(self.key + ".tail")  # overlap from the previous step
        rest = y[..., n:]  # the overlap into the next step, minus bias (added again there); saved first,
        st.write(self.key + ".tail", rest if self.bias is None else rest - self.bias[:, None])  # y changes next
        y[..., : self.tail] += prev  # in place: no copy of the whole output (a strided view goes on)
        return y[..., :n]


class Elu(nn.Module):
    def forward(self, x: Tensor, st: RowView | None = None) -> Tensor:
        return F.elu(x)


class ResBlock(nn.Module):
    """x + conv_k1(elu(conv_k3(elu(x)))) (identity shortcut)."""

    def __init__(self, cfg: MimiConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.conv1 = CausalConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation)
        self.conv2 = CausalConv(hidden, dim, 1)

    def forward(self, x: Tensor, st: RowView | None = None) -> Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x), st)), st)


def seanet_encoder(cfg: MimiConfig) -> nn.ModuleList:
    """HF `MimiEncoder.layers` order: [B, 1, L] -> [B, hidden, L / hop]."""
    nf, layers = cfg.num_filters, nn.ModuleList([CausalConv(1, cfg.num_filters, cfg.kernel_size)])
    for ratio in reversed(cfg.upsampling_ratios):
        for j in range(cfg.num_residual_layers):
            layers.append(ResBlock(cfg, nf, cfg.dilation_growth_rate ** j))
        layers.extend([Elu(), CausalConv(nf, nf * 2, ratio * 2, stride=ratio)])
        nf *= 2
    layers.extend([Elu(), CausalConv(nf, cfg.hidden_size, cfg.last_kernel_size)])
    return layers


def seanet_decoder(cfg: MimiConfig) -> nn.ModuleList:
    """HF `MimiDecoder.layers` order: [B, hidden, T] -> [B, 1, T * hop]."""
    nf = cfg.num_filters * 2 ** len(cfg.upsampling_ratios)
    layers = nn.ModuleList([CausalConv(cfg.hidden_size, nf, cfg.kernel_size)])
    for ratio in cfg.upsampling_ratios:
        layers.extend([Elu(), CausalConvTr(nf, nf // 2, ratio * 2, stride=ratio)])
        for j in range(cfg.num_residual_layers):
            layers.append(ResBlock(cfg, nf // 2, cfg.dilation_growth_rate ** j))
        nf //= 2
    layers.extend([Elu(), CausalConv(nf, 1, cfg.last_kernel_size)])
    return layers


def run_layers(layers: nn.ModuleList, x: Tensor, st: RowView | None) -> Tensor:
    for layer in layers:
        x = layer(x, st)
    return x


# --------------------------------------------------------------------------- transformer


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        d, hd, h = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
        self.heads, self.head_dim = h, hd
        self.norm1 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.norm2 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.qkv = nn.Linear(d, 3 * h * hd, bias=False)  # rows: q, k, v; q/k rotate-half layout
        self.out = nn.Linear(h * hd, d, bias=False)
        self.fc1 = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.ls1 = nn.Parameter(torch.full((d,), cfg.layer_scale_initial_scale))
        self.ls2 = nn.Parameter(torch.full((d,), cfg.layer_scale_initial_scale))

    def attn(self, x: Tensor, cos: Tensor, sin: Tensor, attend: "Attend") -> Tensor:
        # x [B, T, D]; cos/sin [B, T, 1, hd]
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return self.out(attend(q, k, v).reshape(B, T, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: "Attend") -> Tensor:
        x = x + self.ls1 * self.attn(self.norm1(x), cos, sin, attend)
        return x + self.ls2 * self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Attend:
    """One layer's attention over the new keys (whole mode) or the row's KV ring (streaming).

    Streaming writes only the step's T new keys/values into the ring, at (row, pos % C). The ring
    is then read either by gathering the B rows (`index_select`, [B, C, H, hd] per k and v) for
    SDPA with a position mask, or in place by `window_attention` (RowView.kernel, CUDA) with the
    same mask computed in the kernel.
    """

    def __init__(self, st: RowView | None, key: str, slots: Tensor | None, mask: Tensor | None,
                 last: Tensor | None, window: int):
        self.st, self.key, self.slots, self.mask, self.last, self.window = st, key, slots, mask, last, window
        self.flat = None if st is None or slots is None else st.ring_index(slots, st.bufs[key + ".k0"].shape[1])
        self.layer = 0

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q/k/v [B, T, H, hd] -> [B, T, H, hd]
        if self.st is None:
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=self.mask).transpose(1, 2)
        st = self.st
        kk, vk = f"{self.key}.k{self.layer}", f"{self.key}.v{self.layer}"
        st.write_ring(kk, self.slots, k, self.flat)
        st.write_ring(vk, self.slots, v, self.flat)
        if st.kernel:
            return window_attention(q, st.bufs[kk], st.bufs[vk], st.rows, self.last, self.window, st.moshi_window)
        keys, values = st.read(kk).transpose(1, 2), st.read(vk).transpose(1, 2)  # [B, H, C, hd]
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=self.mask).transpose(1, 2)


class Transformer(Stateful):
    """Pre-norm LayerScale transformer over [B, D, T] (conv layout), causal sliding window W.

    Streaming: a ring of capacity C = W + max_steps - 1 per layer and row, so every query of a
    step still sees its full window (moshi's ring has C = W and drops the oldest key for all
    but the last query of a multi-step call; `moshi_window=True` reproduces that).
    """

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        hd = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def state_specs(self, max_steps: int) -> dict:
        # ring capacity C = W + max_steps - 1
        c, h, hd = self.cfg.sliding_window + max_steps - 1, self.cfg.num_attention_heads, self.cfg.head_dim
        specs: dict = {"pos": ((), torch.long)}
        for i in range(len(self.layers)):
            specs[f"k{i}"] = specs[f"v{i}"] = ((c, h, hd), None)
        return specs

    def _rope(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # pos [B, T] -> cos, sin [B, T, 1, hd] (fp32 math, cast like HF)
        freqs = pos.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _mask(self, pos: Tensor, kpos: Tensor, lo: Tensor) -> Tensor:
        # pos [B, T], kpos [B, S], lo [B, T] -> [B, 1, T, S]: lo < pos_k <= pos_q, pos_k >= 0
        kp = kpos[:, None, :]
        ok = (kp <= pos[..., None]) & (kp > lo[..., None]) & (kp >= 0)
        return ok[:, None]

    def forward(self, x: Tensor, st: RowView | None = None) -> Tensor:
        # x [B, D, T] -> [B, D, T]
        x = x.transpose(1, 2)
        B, T, _ = x.shape
        steps = torch.arange(T, device=x.device)
        pos0 = st.read(self.key + ".pos") if st is not None else torch.zeros(B, dtype=torch.long, device=x.device)
        pos = pos0[:, None] + steps  # [B, T] absolute positions of this row
        W = self.cfg.sliding_window
        last = mask = None
        if st is None:
            slots = None
            mask = self._mask(pos, pos, pos - W)
        else:
            C = st.bufs[self.key + ".k0"].shape[1]
            if T > C - W + 1:
                raise ValueError(f"{T} steps in one call > the ring's {C - W + 1}")
            last = pos0 + (T - 1)  # [B]
            slots = pos % C
            if not st.kernel:
                kpos = last[:, None] - (last[:, None] - torch.arange(C, device=x.device)) % C  # [B, C] slot positions
                lo = (last[:, None] if st.moshi_window else pos) - W
                mask = self._mask(pos, kpos, lo.expand(B, T))
            st.write(self.key + ".pos", pos0 + T)
        cos, sin = self._rope(pos, x.dtype)
        attend = Attend(st, self.key, slots, mask, last, W)
        for i, layer in enumerate(self.layers):
            attend.layer = i
            x = layer(x, cos, sin, attend)
        return x.transpose(1, 2)


# --------------------------------------------------------------------------- windowed ring attention kernel

_window_kernel = None


def _get_window_kernel():  # lazy: triton only comes with CUDA builds of torch
    global _window_kernel
    if _window_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _kernel(Q, K, V, O, ROWS, LAST, scale, C, W,
                    s_qb, s_qt, s_qh, s_kr, s_kc, s_kh, s_vr, s_vc, s_vh, s_ob, s_ot, s_oh,
                    T: tl.constexpr, TP: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                    MOSHI: tl.constexpr, IEEE: tl.constexpr):
            h = tl.program_id(0)  # a row's heads side by side: its ring is read in whole lines
            b = tl.program_id(1)
            row = tl.load(ROWS + b).to(tl.int64)
            last = tl.load(LAST + b).to(tl.int64)  # position of the step's last query
            t = tl.arange(0, TP)  # the step's queries, padded to the 16 rows tl.dot needs
            t_ok = t < T
            d = tl.arange(0, HD)
            q = tl.load(Q + b * s_qb + t[:, None] * s_qt + h * s_qh + d[None, :], mask=t_ok[:, None], other=0.0)
            qpos = last - (T - 1) + t  # [TP]
            if MOSHI:
                lo = tl.zeros([TP], tl.int64) + (last - W)
            else:
                lo = qpos - W
            m = tl.full([TP], float("-inf"), tl.float32)
            l = tl.zeros([TP], tl.float32)
            acc = tl.zeros([TP, HD], tl.float32)
            k_base = K + row * s_kr + h * s_kh
            v_base = V + row * s_vr + h * s_vh
            hi = tl.minimum(last + 1, C).to(tl.int32)  # slots written so far
            for start in range(0, hi, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                n_ok = n < hi
                kpos = last - (last - n + C) % C  # position held by slot n
                ok = n_ok[None, :] & (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > lo[:, None]) \
                    & (kpos[None, :] >= 0)
                k = tl.load(k_base + n[:, None] * s_kc + d[None, :], mask=n_ok[:, None], other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [TP, BLOCK_N]
                else:
                    s = tl.dot(q, tl.trans(k)) * scale
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key yet
                alpha = tl.exp(m - m_use)
                p = tl.exp(s - m_use[:, None])
                v = tl.load(v_base + n[:, None] * s_vc + d[None, :], mask=n_ok[:, None], other=0.0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                l = l * alpha + tl.sum(p, 1)
                m = m_new
            out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
            tl.store(O + b * s_ob + t[:, None] * s_ot + h * s_oh + d[None, :], out.to(O.dtype.element_ty),
                     mask=t_ok[:, None])

        _window_kernel = _kernel
    return _window_kernel


def window_attention(q: Tensor, k_ring: Tensor, v_ring: Tensor, rows: Tensor, last: Tensor, window: int,
                     moshi_window: bool = False) -> Tensor:
    """Attention of a step's T queries over each row's KV ring, read in place (no gather).

    q [B, T, H, hd]; k_ring/v_ring [R, C, H, hd] (slot = position % C, this step's keys already
    written); rows [B]; last [B] position of each row's last query. Query at position p sees
    the ring's keys at positions in (p - window, p] (moshi_window: (last - window, p]), >= 0.
    -> [B, T, H, hd]. One program per (head, row) reads the row's ring once for all T queries
    (only the slots written so far), so a step moves ~1 ring per layer instead of ~3 (gather
    read + write, SDPA read). No host sync, static launch: CUDA-graph safe.
    """
    B, T, H, hd = q.shape
    C = k_ring.shape[1]
    assert k_ring.stride(-1) == v_ring.stride(-1) == 1 and hd & (hd - 1) == 0 and B <= 65535
    q = q.contiguous() if q.stride(-1) != 1 else q
    out = torch.empty_like(q)
    _get_window_kernel()[(H, B)](
        q, k_ring, v_ring, out, rows.contiguous(), last.contiguous(), 1.0 / hd ** 0.5, C, window,
        q.stride(0), q.stride(1), q.stride(2), k_ring.stride(0), k_ring.stride(1), k_ring.stride(2),
        v_ring.stride(0), v_ring.stride(1), v_ring.stride(2), out.stride(0), out.stride(1), out.stride(2),
        T=T, TP=max(16, 1 << (T - 1).bit_length()), HD=hd, BLOCK_N=64, MOSHI=moshi_window,
        IEEE=q.dtype == torch.float32, num_warps=4)
    return out


def window_attention_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- quantizer


class SplitRVQ(nn.Module):
    """1 semantic + (Q-1) acoustic codebooks; both RVQs quantize the same latent."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        d, dim, ns = cfg.hidden_size, cfg.codebook_dim, cfg.num_semantic_quantizers
        self.n_sem = ns
        self.in_sem = nn.Parameter(torch.empty(dim, d, 1))
        self.out_sem = nn.Parameter(torch.empty(d, dim, 1))
        self.in_ac = nn.Parameter(torch.empty(dim, d, 1))
        self.out_ac = nn.Parameter(torch.empty(d, dim, 1))
        # codebook vectors, float32 whatever the model dtype; set by set_codebooks at load
        self.register_buffer("codebooks", torch.zeros(cfg.num_quantizers, cfg.codebook_size, dim), persistent=False)

    def set_codebooks(self, embed_sum: Tensor, usage: Tensor) -> None:
        # embed_sum [Q, bins, dim], usage [Q, bins] -> vectors in float32
        books = embed_sum.float() / usage.float().clamp(min=1e-5)[..., None]
        self.codebooks = books.to(self.codebooks.device)

    def _apply(self, fn, recurse=True):  # codebooks follow the device, stay float32
        books = self.codebooks
        super()._apply(fn, recurse)
        self.codebooks = books.to(self.codebooks.device)
        return self

    def _rvq_encode(self, x: Tensor, proj: Tensor, books: Tensor) -> Tensor:
        # x [B, D, T] -> codes [B, n, T]
        h = F.conv1d(x, proj).transpose(1, 2)  # [B, T, dim]
        B, T, dim = h.shape
        res = h.reshape(-1, dim).float()
        codes = []
        for book in books:
            idx = torch.cdist(res[None], book[None], p=2)[0].argmin(dim=-1)  # [B*T]
            res = res - book[idx]
            codes.append(idx)
        return torch.stack(codes, dim=1).view(B, T, -1).transpose(1, 2)

    def encode(self, x: Tensor) -> Tensor:
        # x [B, D, T] -> codes [B, Q, T] long
        ns = self.n_sem
        sem = self._rvq_encode(x, self.in_sem, self.codebooks[:ns])
        ac = self._rvq_encode(x, self.in_ac, self.codebooks[ns:])
        return torch.cat([sem, ac], dim=1)

    def decode(self, codes: Tensor, dtype: torch.dtype) -> Tensor:
        # codes [B, K, T] (K <= Q) -> [B, D, T]
        K, ns, bins = codes.shape[1], self.n_sem, self.codebooks.shape[1]
        flat = self.codebooks[:K].reshape(K * bins, -1)
        offs = torch.arange(K, device=codes.device)[None, :, None] * bins
        vecs = F.embedding(codes + offs, flat)  # [B, K, T, dim] float32
        out = F.conv1d(vecs[:, :ns].sum(1).transpose(1, 2).to(dtype), self.out_sem)
        if K > ns:
            out = out + F.conv1d(vecs[:, ns:].sum(1).transpose(1, 2).to(dtype), self.out_ac)
        return out
