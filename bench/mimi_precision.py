"""Mimi decode in bfloat16 against float32 on the real shape: how far the audio moves (SNR, max error). What each
costs per streaming step: bench/mimi_decode.py --dtype.

    python bench/mimi_precision.py --device cuda --frames 100 --batch 8

The same random weights of the real shape in both dtypes (`dummy_init`; no trained weights can be
had here, so this measures the arithmetic, not a trained model's sensitivity), the same random codes,
decoded frame by frame through MimiStream as the engine does. SNR = 10 log10(|ref|^2 / |bf16 - ref|^2)
over the whole audio, per row, reported as min / median; max abs error over every sample.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from csmserve.models.mimi import Mimi, MimiConfig, MimiStream  # noqa: E402
from csmserve.models.mimi_loader import dummy_init  # noqa: E402


def stream_decode(mimi: Mimi, codes: torch.Tensor, layout: str = "cl") -> torch.Tensor:
    """codes [B, K, T] -> float32 audio [B, T * frame_size], one frame per step."""
    B = codes.shape[0]
    st = MimiStream(mimi, B, "decode", 1, layout=layout)
    rows = torch.arange(B, device=codes.device)
    out = [st.decode_step(codes[:, :, t:t + 1], rows).float() for t in range(codes.shape[-1])]
    return torch.cat(out, -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    ref_model = dummy_init(Mimi(MimiConfig())).to(args.device, torch.float32).eval()
    bf_model = dummy_init(Mimi(MimiConfig())).to(args.device, torch.float32).eval()
    bf_model.load_state_dict(ref_model.state_dict())
    bf_model = bf_model.to(torch.bfloat16)
    codes = torch.randint(0, 2048, (args.batch, 32, args.frames), device=args.device)
    with torch.inference_mode():
        ref = stream_decode(ref_model, codes, "nct")
        got = stream_decode(bf_model, codes)
        got_nct = stream_decode(bf_model, codes, "nct")
        cl32 = stream_decode(ref_model, codes, "cl")
        whole = ref_model.decode(codes)[:, 0].float()
    def snr_of(x: torch.Tensor) -> torch.Tensor:  # [B] dB against the float32 conv-layout stream
        return 10 * torch.log10(ref.pow(2).sum(-1) / (x - ref).pow(2).sum(-1).clamp_min(1e-30))

    err, snr = got - ref, snr_of(got)
    whole_snr = 10 * torch.log10(whole.pow(2).sum() / (whole - ref).pow(2).sum().clamp_min(1e-30))
    print(f"device {args.device}, {args.batch} rows x {args.frames} frames, random weights of the real shape")
    print("| | SNR min (dB) | SNR median (dB) | max abs error | audio RMS |")
    print("|---|---|---|---|---|")
    print(f"| bfloat16 streaming (cl, the engine's) vs float32 streaming (nct) | {snr.min():.1f} | "
          f"{snr.median():.1f} | {err.abs().max():.2e} | {ref.pow(2).mean().sqrt():.3e} |")
    for name, x in (("bfloat16 streaming, nct", got_nct), ("float32 streaming, cl", cl32)):
        s = snr_of(x)
        print(f"| {name} vs float32 streaming (nct) | {s.min():.1f} | {s.median():.1f} | "
              f"{(x - ref).abs().max():.2e} | |")
    print(f"| float32 streaming vs float32 whole (the streaming decode's own exactness) | {whole_snr:.1f} | | "
          f"{(whole - ref).abs().max():.2e} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
