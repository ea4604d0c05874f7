"""`csmserve` command line (also `python -m csmserve`). For now: `speak`, writing codes to .npy."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _speak_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("speak", help="generate speech for TEXT (for now: the Mimi codes, as .npy)")
    p.add_argument("text", help="the text to speak")
    p.add_argument("-o", "--output", required=True, type=Path, help="output file (.npy: codes [frames, 32])")
    p.add_argument("--model", default="sesame/csm-1b",
                   help="hub id, local directory, or dummy / dummy-tiny (random weights, no download)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--speaker", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.9, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="<= 0 disables")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="default: a random seed")
    p.add_argument("--max-audio-length-ms", type=int, default=10_000)
    p.set_defaults(func=speak)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="csmserve", description="Streaming inference for Sesame CSM-1B.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _speak_parser(sub)
    return parser


def speak(args: argparse.Namespace) -> int:
    import numpy as np

    from .api import CSM

    if args.output.suffix != ".npy":
        raise SystemExit(f"csmserve speak: -o must end in .npy for now (codes), got {args.output}")
    csm = CSM(args.model, device=args.device, dtype=args.dtype)
    out = csm.generate(args.text, speaker=args.speaker, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, max_audio_length_ms=args.max_audio_length_ms)
    np.save(args.output, out.codes)
    print(f"{args.output}: {out.codes.shape[0]} frames, {out.duration_s:.2f} s of audio "
          f"(finish: {out.finish_reason}, seed {out.seed})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        print(f"csmserve {args.command}: error: {e}", file=sys.stderr)
        return 2
