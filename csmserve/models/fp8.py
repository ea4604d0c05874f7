"""FP8 (e4m3) weights for the Llama GEMMs (EngineConfig.weights): per-output-channel weight scales,
activations scaled per row when they enter a GEMM; everything between the GEMMs stays bf16.

    w8[o, :] = w[o, :] / s_w[o],  s_w[o] = max|w[o, :]| / 448            (once, at load)
    x8[r, :] = x[r, :] / s_x[r],  s_x[r] = max|x[r, :]| / 448            (every call: one kernel)
    y[r, o]  = s_x[r] s_w[o] sum_i x8[r, i] w8[o, i]                      (fp32 accumulation)

On Hopper that is `torch._scaled_mm` with row-wise scales (FP8 tensor cores, bf16 out). Why the
activations are quantized too rather than kept bf16 in a weight-only GEMM: torch's only FP8 GEMM
takes both operands in FP8, and a weight-only one would be our own dequantizing GEMM for every batch
size. Why per row: a row's numbers then never depend on the other rows of its batch (a per-tensor
scale would make a seeded request's codes depend on its neighbours). Elsewhere (CPU, float32
models, older GPUs) the same quantized numbers are multiplied in float32: the CPU tests run this code.
The embeddings, the codebook heads and the norms stay in the model's dtype.

At 1-16 rows on CUDA (gemv.MAX_ROWS; models/llama.py's fuse_gemv: a few streams' frame step, a short prefill) the
GEMM is kernels/gemv.py's weight-only one instead: the e4m3 weights times the activations as they are, no quantization kernel:

    y[r, o] = s_w[o] sum_i x[r, i] w8[o, i]                              (fp32 accumulation)

Up to 16 rows on Hopper outside fuse_gemv the same weight-only numbers come from
kernels/fp8.py's weight_only_mm (e4m3 tiles to bf16 in registers, tl.dot): the per-row quantization kernel and
`_scaled_mm` cost more there than the GEMM itself (docs/benchmarks.md, issue 16).

From there up to CSMSERVE_FP8_DENSE_ROWS rows (512) an FP8Linear on Hopper multiplies a bf16 copy of its dequantized
weight, bf16(w8 * s_w), through cuBLAS: the same weights as the e4m3 ones to within bf16's rounding of the product (2^-9
relative, against e4m3's 2^-4), the activations not quantized (the weight-only numbers, as at 1-16 rows), at bf16's
speed where the w8a8 GEMM's quantization kernel and `_scaled_mm` lose to it (measured on the H100: fp8-all's frame step
25-28% slower than bf16's at 24-64 rows, 10-13% at 256-512, level at 1,024; docs/benchmarks.md, issue 16). The copy
costs the bf16 model's bytes again; 0 makes none (w8a8 from WEIGHT_ONLY_ROWS + 1 rows, the e4m3 weights' memory only).

`weight_only = True` makes an FP8Linear compute those numbers in torch at any row count (the reference
of the kernel, and the error bench's weight-only rows).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
WEIGHT_ONLY_ROWS = 16  # weight_only_mm up to this many rows
# the bf16 copy past WEIGHT_ONLY_ROWS, to this many rows (CSMSERVE_FP8_DENSE_ROWS; 0: no copy, the e4m3 weights' memory
# only, w8a8 past WEIGHT_ONLY_ROWS: ~2.2 GB less for fp8-all, 25% slower at 64 rows)
DENSE_ROWS = int(os.environ.get("CSMSERVE_FP8_DENSE_ROWS", "512"))


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (x8 [M, K] e4m3, scale [M, 1] float32): x ~ x8 * scale, each row scaled to its own max."""
    if x.is_cuda:
        from csmserve.kernels.fp8 import quantize_rows_triton

        return quantize_rows_triton(x)
    return quantize_rows_torch(x)


def quantize_rows_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def hopper_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class FP8Linear(nn.Module):
    """nn.Linear without bias, its weight [N, K] in e4m3 with a scale per output channel."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        w8, scale = quantize_rows_torch(weight.detach())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight8", w8)  # [N, K] e4m3
        self.register_buffer("scale", scale.reshape(1, -1).contiguous())  # [1, N] float32
        self.fast = hopper_fp8(weight.device) and weight.dtype == torch.bfloat16 and \
            self.in_features % 16 == 0 and self.out_features % 16 == 0
        self.weight_only = False
        # [N, K] bf16(w8 * s_w), not in the state dict: made only where forward() would use it (Hopper, bf16)
        self.register_buffer("dense", self.dequantized().to(weight.dtype) if self.fast and DENSE_ROWS > WEIGHT_ONLY_ROWS
                             else None, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.weight_only:
            return weight_only_torch(x2, self.weight8, self.scale).to(x.dtype).reshape(*shape[:-1], self.out_features)
        if self.fast and x2.is_cuda and x2.dtype == torch.bfloat16 and len(x2) <= WEIGHT_ONLY_ROWS:
            from csmserve.kernels.fp8 import weight_only_config, weight_only_mm

            cfg = weight_only_config(len(x2), self.out_features, self.in_features)
            if cfg is not None:
                return weight_only_mm(x2, self.weight8, self.scale, *cfg).reshape(*shape[:-1], self.out_features)
        if self.dense is not None and WEIGHT_ONLY_ROWS < len(x2) <= DENSE_ROWS and x2.dtype == self.dense.dtype:
            return torch.nn.functional.linear(x2, self.dense).reshape(*shape[:-1], self.out_features)
        x8, sx = quantize_rows(x2)
        if self.fast:
            y = torch._scaled_mm(x8, self.weight8.t(), scale_a=sx, scale_b=self.scale, out_dtype=torch.bfloat16)
        else:  # the same numbers in float32: products of e4m3 values are exact, the sums in fp32
            y = (x8.float() @ self.weight8.float().t()) * sx * self.scale
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> Tensor:
        return self.weight8.float() * self.scale.t()  # [N, K]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fast={self.fast}"


def weight_only_torch(x: Tensor, w8: Tensor, scale: Tensor) -> Tensor:
    """x [M, K] (model dtype) @ e4m3 w8 [N, K]^T, times scale [1, N] -> [M, N] float32: the weight-only GEMM."""
    return (x.float() @ w8.float().t()) * scale.reshape(1, -1)


GEMMS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_weights(model: nn.Module, weights: str) -> None:
    """EngineConfig.weights, in place: "bf16" leaves the model as it is; "fp8" swaps the depth decoder's
    GEMMs (4 per layer, and the backbone -> decoder projection) for FP8Linear; "fp8-all" the
    backbone's too. Idempotent."""
    if weights == "bf16":
        return
    if weights not in ("fp8", "fp8-all"):
        raise ValueError(f"weights must be bf16, fp8 or fp8-all, got {weights!r}")
    stacks = [model.decoder] + ([model.backbone] if weights == "fp8-all" else [])
    for stack in stacks:
        for block in stack.layers:
            for parent in (block.self_attn, block.mlp):
                for name in GEMMS:
                    lin = getattr(parent, name, None)
                    if isinstance(lin, nn.Linear):
                        setattr(parent, name, FP8Linear(lin.weight))
    if isinstance(model.projection, nn.Linear):
        model.projection = FP8Linear(model.projection.weight)
