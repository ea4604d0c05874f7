"""`csmserve` command line (also `python -m csmserve`): `speak` writes a WAV file (or the codes as .npy)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _speak_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("speak", help="generate speech for TEXT into a WAV file (or .npy codes)")
    p.add_argument("text", help="the text to speak")
    p.add_argument("-o", "--output", required=True, type=Path,
                   help="output file: .wav (24 kHz 16-bit mono) or .npy (Mimi codes [frames, 32])")
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
    from .server.cli import add_serve_parser

    add_serve_parser(sub)
    return parser


def speak(args: argparse.Namespace) -> int:
    import numpy as np

    from .api import CSM

    from .config import EngineConfig

    if args.output.suffix not in (".wav", ".npy"):
        raise SystemExit(f"csmserve speak: -o must end in .wav or .npy, got {args.output}")
    engine = EngineConfig(max_slots=1, max_seq_len=2048)  # one request: no need for a big slot pool
    csm = CSM(args.model, device=args.device, dtype=args.dtype, engine_config=engine)
    try:
        out = csm.generate(args.text, speaker=args.speaker, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, max_audio_length_ms=args.max_audio_length_ms)
    finally:
        csm.close()
    if args.output.suffix == ".npy":
        np.save(args.output, out.codes)
    else:
        write_wav(args.output, out.audio, out.sample_rate)
    print(f"{args.output}: {out.codes.shape[0]} frames, {out.duration_s:.2f} s of audio "
          f"(finish: {out.finish_reason}, seed {out.seed})")
    return 0


def write_wav(path: Path, audio: np.ndarray | None, sample_rate: int) -> None:
    import wave

    import numpy as np

    if audio is None:
        raise RuntimeError("no codec loaded, so no audio: write .npy codes instead")
    pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        print(f"csmserve {args.command}: error: {e}", file=sys.stderr)
        return 2
