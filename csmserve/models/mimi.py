"""Mimi codec (Kyutai): SEANet + transformers + split RVQ, with per-row streaming state.

Math only. Whole-utterance `Mimi.encode` / `Mimi.decode` run without state. Streaming
runs through `MimiStream`: buffers preallocated for `max_rows` rows (slots), each step
gathers the conv tails of the rows it names (`index_select`), computes, and scatters the new
tails back (`index_copy_`). Transformer KV rings only get the step's new keys written in place;
on CUDA attention reads the rings in place (Triton `window_attention`), elsewhere it gathers
them. No host sync and no state allocation in a step, so a step of fixed (B, n) can be
captured in a CUDA graph. Spec: docs/reference/csm-mimi-spec.md §3.

Our parameter layout (loaders in `mimi_loader.py` convert HF and moshi names to it):
SEANet modules keep HF's `layers.N` indices; attention is one fused `qkv` Linear with q/k
in the rotate-half RoPE layout (HF's; moshi's interleaved q/k rows are permuted on load).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from csmserve.models.mimi_config import MimiConfig  # noqa: F401 (re-exported)
from csmserve.models.mimi_decoder import ChannelsLastDecoder
from csmserve.models.mimi_layers import (CausalConv, CausalConvTr, RowView, SplitRVQ, Stateful, Transformer,
                                         run_layers, seanet_decoder, seanet_encoder, window_attention_available)



# --------------------------------------------------------------------------- the codec


class Mimi(nn.Module):
    """encode: wav [B, 1, L] -> codes [B, Q, T] (T = ceil(L / frame_size) when ratios allow); decode: codes [B, K, T] -> [B, 1, T*frame_size]."""

    def __init__(self, cfg: MimiConfig = MimiConfig()):
        super().__init__()
        self.cfg = cfg
        d, s = cfg.hidden_size, cfg.latent_stride
        self.encoder = seanet_encoder(cfg)
        self.encoder_transformer = Transformer(cfg)
        self.downsample = CausalConv(d, d, 2 * s, stride=s, bias=False, replicate=True)
        self.quantizer = SplitRVQ(cfg)
        self.upsample = CausalConvTr(d, d, 2 * s, stride=s, groups=cfg.upsample_groups, bias=False)
        self.decoder_transformer = Transformer(cfg)
        self.decoder = seanet_decoder(cfg)
        for name, m in self.named_modules():
            if isinstance(m, Stateful):
                m.key = name

    @property
    def dtype(self) -> torch.dtype:
        return self.downsample.weight.dtype

    def latent(self, wav: Tensor, st: RowView | None = None) -> Tensor:
        # wav [B, 1, L] -> [B, D, T] (T = L / frame_size when streaming whole frames)
        x = run_layers(self.encoder, wav.to(self.dtype), st)
        return self.downsample(self.encoder_transformer(x, st), st)

    def decoder_input(self, codes: Tensor, st: RowView | None = None) -> Tensor:
        # codes [B, K, T] -> the SEANet decoder's input [B, D, 2T] (quantizer, upsample, transformer)
        return self.decoder_transformer(self.upsample(self.quantizer.decode(codes, self.dtype), st), st)

    def synth(self, codes: Tensor, st: RowView | None = None) -> Tensor:
        # codes [B, K, T] -> wav [B, 1, T * frame_size]
        return run_layers(self.decoder, self.decoder_input(codes, st), st)

    @torch.inference_mode()
    def encode(self, wav: Tensor) -> Tensor:
        # wav [B, 1, L] -> codes [B, Q, ~ceil(L / frame_size)]; each strided conv completes its last window
        return self.quantizer.encode(self.latent(wav))

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        return self.synth(codes)

    def stateful_modules(self, part: str) -> list[Stateful]:
        """part: "decode" or "encode" -> the modules whose state a stream of that kind carries."""
        root = [self.upsample, self.decoder_transformer, self.decoder] if part == "decode" else \
            [self.encoder, self.encoder_transformer, self.downsample]
        return [m for r in root for m in r.modules() if isinstance(m, Stateful)]


class MimiStream:
    """Per-row streaming state for `max_rows` rows (slots) and the step over any subset of them.

    step(x, rows): rows LongTensor [B] of distinct row ids; only those rows are read and written.
    A CUDA-graph bucket pads its batch with a spare row id (e.g. allocate max_rows + 1).
    max_frames: the most frames one step may carry (sizes the transformer ring slack).
    kernel: transformer attention reads the KV rings in place (Triton) instead of gathering the
    step's rows; None = when the state lives on CUDA and triton imports. Same results either way.
    layout: the decode's SEANet in "cl" (channels-last GEMMs, `ChannelsLastDecoder`: the engine's) or "nct" (the
    conv layout: the reference the tests and benches compare it with). Same math; the state differs.
    """

    def __init__(self, mimi: Mimi, max_rows: int, part: str = "decode", max_frames: int = 4,
                 device: torch.device | str | None = None, moshi_window: bool = False, kernel: bool | None = None,
                 layout: str = "cl"):
        if part not in ("decode", "encode"):
            raise ValueError(f"part must be 'decode' or 'encode', not {part!r}")
        if layout not in ("cl", "nct"):
            raise ValueError(f"layout must be 'cl' or 'nct', not {layout!r}")
        self.mimi, self.part, self.max_frames, self.moshi_window = mimi, part, max_frames, moshi_window
        device = device or mimi.downsample.weight.device
        self.bufs: dict[str, Tensor] = {}
        steps = max_frames * mimi.cfg.latent_stride
        modules = mimi.stateful_modules(part)
        self.decoder: ChannelsLastDecoder | None = None
        if part == "decode" and layout == "cl":
            self.decoder = ChannelsLastDecoder(mimi.decoder)
            seanet = {id(m) for m in mimi.decoder.modules()}
            modules = [m for m in modules if id(m) not in seanet] + [self.decoder]
        for m in modules:
            for name, (shape, dtype) in m.state_specs(steps).items():
                self.bufs[f"{m.key}.{name}"] = torch.zeros(max_rows, *shape, dtype=dtype or mimi.dtype, device=device)
        self.max_rows = max_rows
        self.frame_size = mimi.cfg.frame_size
        self.kernel = window_attention_available(torch.device(device)) if kernel is None else kernel

    def reset(self, rows: Tensor) -> None:
        """Zero the named rows (start new streams there); other rows are untouched."""
        for buf in self.bufs.values():
            buf.index_fill_(0, rows, 0)

    def _view(self, rows: Tensor, n: int) -> RowView:
        if n > self.max_frames:
            raise ValueError(f"{n} frames per step > max_frames={self.max_frames}")
        return RowView(self.bufs, rows, self.moshi_window, self.kernel)

    @torch.inference_mode()
    def decode_step(self, codes: Tensor, rows: Tensor) -> Tensor:
        # codes [B, K, n] -> pcm [B, n * frame_size] (dtype of the model)
        assert self.part == "decode"
        view = self._view(rows, codes.shape[-1])
        if self.decoder is None:
            return self.mimi.synth(codes, view)[:, 0]
        x = self.mimi.decoder_input(codes, view)  # [B, D, 2n], a transposed view of [B, 2n, D]
        return self.decoder(x.transpose(1, 2), view)  # -> [B, n * frame_size]

    @torch.inference_mode()
    def encode_step(self, wav: Tensor, rows: Tensor) -> Tensor:
        # wav [B, 1, n * frame_size] or [B, n * frame_size] -> codes [B, Q, n]
        assert self.part == "encode"
        wav = wav if wav.dim() == 3 else wav[:, None]
        fs = self.mimi.cfg.frame_size
        if wav.shape[-1] == 0 or wav.shape[-1] % fs:
            raise ValueError(f"streaming encode takes whole frames of {fs} samples, got {wav.shape[-1]}")
        view = self._view(rows, wav.shape[-1] // fs)
        return self.mimi.quantizer.encode(self.mimi.latent(wav, view))
