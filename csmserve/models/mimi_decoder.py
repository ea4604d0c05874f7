"""The SEANet decoder's streaming step in channels-last layout: every conv a GEMM over [B*T, C].

`seanet_decoder` (mimi_layers.py) runs in the conv layout [B, C, T]: on CUDA, cuDNN converts every
bf16 conv to NHWC and back and falls back to a slow kernel for the transposed convs (at batch 2048
on the H200: 8.9 ms of one transposed conv, 2.7 ms of layout conversions, 5 ms of ELUs and adds over
strided views, of a 25 ms step). Here activations stay [B, T, C] and contiguous:

- a transposed conv with K = 2S is y[tS + j] = x[t] W[:, :, j] + x[t-1] W[:, :, S+j]: two GEMMs of
  the rows [B*(1+T), Cin] (the state row x[-1], then the step's T) into [B*(1+T), S*Cout], which *is*
  [B, (1+T)*S, Cout]: no overlap-add, no reshuffle. Its streaming state is the last input row.
- a causal conv (K taps, dilation d) is one GEMM of the rows [B*(ctx+T), Cin] (state + input) into
  [B, ctx+T, K, Cout] and a sum of K shifted slices (Cout < Cin), or one GEMM of the K shifted inputs
  side by side [B*T, K*Cin] (Cout >= Cin, the first conv at T = 2). Its state is the last ctx input rows.
- ELU is written straight into the next conv's input buffer, behind its state rows (one pass).

Same math as the conv layout (tests/models/test_mimi_decoder.py: equal in float32), different state
(rows [ctx, Cin] of inputs instead of [Cin, ctx] / the transposed conv's output tail).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from csmserve.models.mimi_layers import CausalConv, CausalConvTr, Elu, ResBlock, RowView, Stateful


def _elu_into(dst: Tensor, x: Tensor, act: bool) -> None:
    # dst [B, T, C] (a view behind the state rows) <- elu(x) or x, one pass
    if act:
        torch.ops.aten.elu.out(x, 1.0, 1, 1, out=dst)
    else:
        dst.copy_(x)


class _Conv:
    """A stride-1 causal conv: weight [Cout, Cin, K], dilation d; ctx = (K-1)*d input rows of state."""

    def __init__(self, conv: CausalConv, key: str, act: bool):
        w = conv.weight.detach()
        cout, cin, k = w.shape
        if conv.stride != 1 or conv.replicate:
            raise ValueError("the channels-last decoder takes stride-1, zero-padded causal convs")
        self.key, self.act, self.k, self.d, self.cin, self.cout = key, act, k, conv.dilation, cin, cout
        self.ctx = (k - 1) * conv.dilation
        b = conv.bias.detach() if conv.bias is not None else w.new_zeros(cout)
        self.unfold = k > 1 and cout >= cin
        if k == 1:
            self.w, self.b = w[:, :, 0].t(), b  # [Cin, Cout] (a transposed view: cuBLAS reads it as is)
        elif self.unfold:
            self.w, self.b = w.permute(2, 1, 0).reshape(k * cin, cout).contiguous(), b  # [K*Cin, Cout]
        else:
            self.w = w.permute(1, 2, 0).reshape(cin, k * cout).contiguous()  # [Cin, K*Cout], tap-major
            self.b = torch.cat([b, b.new_zeros((k - 1) * cout)])  # the bias rides on tap 0

    def spec(self) -> dict:
        return {self.key: ((self.ctx, self.cin), None)} if self.ctx else {}

    def __call__(self, x: Tensor, st: RowView | None) -> Tensor:
        # x [B, T, Cin] (any strides) -> [B, T, Cout] contiguous; ELU on the input if self.act
        B, T, _ = x.shape
        if not self.ctx:
            inp = F.elu(x) if self.act else x
            return torch.addmm(self.b, inp.reshape(B * T, self.cin), self.w).view(B, T, self.cout)
        n = self.ctx + T
        inp = torch.empty(B, n, self.cin, dtype=x.dtype, device=x.device)  # [B, ctx + T, Cin]
        if st is None:
            inp[:, : self.ctx].zero_()
        else:
            inp[:, : self.ctx] = st.read(self.key)
        _elu_into(inp[:, self.ctx:], x, self.act)
        if st is not None:
            st.write(self.key, inp[:, T:])
        k, d, cout = self.k, self.d, self.cout
        if self.unfold:
            cols = torch.cat([inp[:, i * d: i * d + T] for i in range(k)], dim=-1)  # [B, T, K*Cin]
            return torch.addmm(self.b, cols.view(B * T, k * self.cin), self.w).view(B, T, cout)
        z = torch.addmm(self.b, inp.view(B * n, self.cin), self.w).view(B, n, k, cout)  # [B, ctx+T, K, Cout]
        y = torch.add(z[:, :T, 0], z[:, d: d + T, 1])
        for i in range(2, k):
            y += z[:, i * d: i * d + T, i]
        return y


class _ConvTr:
    """A transposed conv, K = 2S, groups 1: weight [Cin, Cout, K]; state: the last input row."""

    def __init__(self, conv: CausalConvTr, key: str, act: bool):
        w = conv.weight.detach()
        cin, cout, k = w.shape
        s = conv.stride
        if conv.groups != 1 or k != 2 * s:
            raise ValueError("the channels-last decoder takes transposed convs with groups 1 and K = 2 * stride")
        self.key, self.act, self.s, self.cin, self.cout = key, act, s, cin, cout
        self.wa = w[:, :, :s].permute(0, 2, 1).reshape(cin, s * cout).contiguous()  # [Cin, S*Cout] phase-major
        self.wb = w[:, :, s:].permute(0, 2, 1).reshape(cin, s * cout).contiguous()
        b = conv.bias.detach() if conv.bias is not None else w.new_zeros(cout)
        self.b = b.repeat(s)  # [S*Cout]

    def spec(self) -> dict:
        return {self.key: ((1, self.cin), None)}

    def __call__(self, x: Tensor, st: RowView | None) -> Tensor:
        # x [B, T, Cin] -> [B, T*S, Cout] (a view with a gap row per batch row); ELU on the input if self.act
        B, T, _ = x.shape
        n = 1 + T
        inp = torch.empty(B, n, self.cin, dtype=x.dtype, device=x.device)  # [B, 1 + T, Cin]
        if st is None:
            inp[:, :1].zero_()
        else:
            inp[:, :1] = st.read(self.key)
        _elu_into(inp[:, 1:], x, self.act)
        if st is not None:
            st.write(self.key, inp[:, T:])
        flat = inp.view(B * n, self.cin)
        out = torch.empty(B * n, self.s * self.cout, dtype=x.dtype, device=x.device)
        # out row r = b*(1+T) + t (t < T): inp[r+1] Wa + inp[r] Wb; row t = T straddles two rows, dropped
        body = out[: B * n - 1]
        torch.addmm(self.b, flat[1:], self.wa, out=body)
        body.addmm_(flat[:-1], self.wb)
        return out.view(B, n * self.s, self.cout)[:, : T * self.s]


class _Res:
    """ResBlock: x + conv2(elu(conv1(elu(x)))), conv2 K = 1."""

    def __init__(self, block: ResBlock, key: str):
        self.conv1, self.conv2 = _Conv(block.conv1, key + ".1", True), _Conv(block.conv2, key + ".2", True)

    def spec(self) -> dict:
        return {**self.conv1.spec(), **self.conv2.spec()}

    def __call__(self, x: Tensor, st: RowView | None) -> Tensor:
        return self.conv2(self.conv1(x, st), st).add_(x)  # [B, T, C]


class ChannelsLastDecoder(Stateful):
    """`seanet_decoder`'s layers as a channels-last streaming step: [B, T, hidden] -> [B, T * hop].

    Built from the decoder as loaded (weights copied in GEMM layouts, the model's dtype and device);
    its state specs name one buffer per conv (`key` + ".<layer>[.<conv>]"). An `Elu` layer becomes the
    next conv's input activation.
    """

    def __init__(self, layers: nn.ModuleList, key: str = "decoder_cl"):
        super().__init__()
        self.key = key
        self.ops: list[_Conv | _ConvTr | _Res] = []
        act = False
        for i, layer in enumerate(layers):
            k = f"{key}.{i}"
            if isinstance(layer, Elu):
                act = True
                continue
            if isinstance(layer, CausalConv):
                self.ops.append(_Conv(layer, k, act))
            elif isinstance(layer, CausalConvTr):
                self.ops.append(_ConvTr(layer, k, act))
            elif isinstance(layer, ResBlock) and not act:
                self.ops.append(_Res(layer, k))
            else:
                raise ValueError(f"the channels-last decoder does not know {type(layer).__name__} here")
            act = False

    def state_specs(self, max_steps: int) -> dict:
        specs = {k: v for op in self.ops for k, v in op.spec().items()}
        return {k[len(self.key) + 1:]: v for k, v in specs.items()}  # MimiStream prefixes `key.`

    def forward(self, x: Tensor, st: RowView | None = None) -> Tensor:
        # x [B, T, hidden] -> pcm [B, T * hop]
        for op in self.ops:
            x = op(x, st)
        return x[..., 0]
