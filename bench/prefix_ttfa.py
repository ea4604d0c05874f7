"""Time to first audio with a long prompt prefix, cached and uncached:

    python bench/prefix_ttfa.py --model dummy --load 0,64

Two prompts of the shape users send: a stored voice (one 10 s reference turn: its text and 125 audio
frames) and a conversation (60 s of earlier turns), each followed by a short new text turn. Uncached,
the whole prompt is prefilled; cached, the prefix's KV is copied from the engine's prefix cache
(engine/prefix_cache.py) and only the new turn is prefilled. Each probe has new text behind the same
prefix (as a voice's or a conversation's next request has). Optionally under a load of running streams.
Prints a markdown table; --out also writes it.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from csmserve.apps.bench.engine import pct, submit

FRAMES_PER_S = 12.5
TEXT_FRAMES_PER_S = 4  # ~150 words per minute at ~1.5 tokens per word, plus the speaker tag
EOS_FRAME = 1


def turn_frames(seconds: float, rng: np.random.Generator, text_vocab: int, k: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """One context turn: its text frames then its audio frames (+ the all-zero end frame). [n, k+1]"""
    n_text = max(1, round(seconds * TEXT_FRAMES_PER_S))
    n_audio = round(seconds * FRAMES_PER_S)
    n = n_text + n_audio + EOS_FRAME
    tokens, mask = np.zeros((n, k + 1), np.int64), np.zeros((n, k + 1), bool)
    tokens[:n_text, k] = rng.integers(text_vocab // 2, text_vocab, n_text)
    mask[:n_text, k] = True
    tokens[n_text:n_text + n_audio, :k] = rng.integers(0, 2048, (n_audio, k))
    mask[n_text:, :k] = True
    return tokens, mask


def prompt_with_prefix(prefix: tuple[np.ndarray, np.ndarray], new_text: int, rng: np.random.Generator,
                       text_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, mask = prefix
    k = tokens.shape[1] - 1
    t_new, m_new = np.zeros((new_text, k + 1), np.int64), np.zeros((new_text, k + 1), bool)
    t_new[:, k] = rng.integers(text_vocab // 2, text_vocab, new_text)
    m_new[:, k] = True
    return np.concatenate([tokens, t_new]), np.concatenate([mask, m_new])


def context_prefix(seconds: float, turn_s: float, rng: np.random.Generator, text_vocab: int):
    turns = [turn_frames(min(turn_s, seconds - i * turn_s), rng, text_vocab)
             for i in range(int(np.ceil(seconds / turn_s)))]
    return np.concatenate([t for t, _ in turns]), np.concatenate([m for _, m in turns])


def probe(engine, prefix, cached: bool, new_text: int, frames: int, rng, text_vocab: int) -> float:
    p = submit(engine, frames, prompt=prompt_with_prefix(prefix, new_text, rng, text_vocab),
               prefix_len=len(prefix[0]) if cached else 0)
    p.wait()  # RuntimeError "request failed: ..." if it did
    return p.ttfa


def scenario(engine, name: str, prefix, args, rng, text_vocab: int) -> list[str]:
    rows = []
    stats = engine.prefix_cache.stats if engine.prefix_cache is not None else {}
    for cached in (False, True):
        if cached:
            probe(engine, prefix, True, args.new_text, 2, rng, text_vocab)  # the miss that stores it
        hits0 = stats.get("hits", 0)
        ttfas = [probe(engine, prefix, cached, args.new_text, args.frames, rng, text_vocab)
                 for _ in range(args.probes)]
        hits = stats.get("hits", 0) - hits0
        prefilled = args.new_text - 1 if cached else len(prefix[0]) + args.new_text - 1
        rows.append(f"| {name} | {len(prefix[0])} | {'cached' if cached else 'uncached'} | {prefilled} | "
                    f"{hits}/{args.probes} | {pct(ttfas, 50) * 1e3:.1f} | {pct(ttfas, 90) * 1e3:.1f} |")
    return rows


def run(args: argparse.Namespace) -> int:
    from csmserve.config import EngineConfig
    from csmserve.engine.engine import Engine
    from csmserve.engine.runner import ModelRunner
    from csmserve.models.codec import load_codec
    from csmserve.models.loader import load_csm

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and args.model != "dummy-tiny":
        raise RuntimeError("on the CPU, run --model dummy-tiny (a check of the machinery, not a measurement)")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, _, model_dir = load_csm(args.model, device, dtype)
    codec = load_codec(args.model, model_dir, None, torch.device(device), dtype)
    loads = [int(x) for x in args.load.split(",")]
    n_slots = max(loads) + 2
    cfg = EngineConfig(max_slots=n_slots, max_seq_len=args.max_seq_len, prefill_token_budget=args.prefill_budget,
                       max_prefill_chunk=args.prefill_budget)
    runner = ModelRunner(model, n_slots, args.max_seq_len, mimi=codec, max_prefill_tokens=cfg.prefill_token_budget)
    engine = Engine(runner, cfg)
    rng = np.random.default_rng(0)
    vocab = model.cfg.text_vocab_size
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    lines = [f"device: {name}, torch {torch.__version__}, model {args.model}, {dtype}, slots {n_slots}, "
             f"max_seq_len {args.max_seq_len}, prefill budget {args.prefill_budget} positions per step, "
             f"new turn {args.new_text} text frames, {args.probes} probes each",
             "", "| load (streams) | prompt | prefix frames | prefix | positions prefilled | cache hits | "
             "TTFA p50 (ms) | TTFA p90 (ms) |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    try:
        submit(engine, 4).done.wait()  # warm
        prompts = ((f"{args.voice_s:g} s voice", context_prefix(args.voice_s, args.voice_s, rng, vocab)),
                   (f"{args.context_s:g} s conversation", context_prefix(args.context_s, args.turn_s, rng, vocab)))
        for load in loads:
            running = [submit(engine, 10**6 // 80) for _ in range(load)]  # streams that run until aborted
            while sum(p.first is not None for p in running) < load:
                time.sleep(0.005)
            for label, prefix in prompts:
                for row in scenario(engine, label, prefix, args, rng, vocab):
                    lines.append(f"| {load} {row}")
                    print(lines[-1], flush=True)
            for p in running:
                engine.abort(p.request_id)
            for p in running:
                p.done.wait()
    finally:
        engine.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--model", default="dummy", help="dummy (full-size random weights), dummy-tiny, hub id or dir")
    ap.add_argument("--device", default=None)
    ap.add_argument("--voice-s", type=float, default=10.0, help="seconds of the voice's reference turn")
    ap.add_argument("--context-s", type=float, default=60.0, help="seconds of conversation context")
    ap.add_argument("--turn-s", type=float, default=10.0, help="seconds per conversation turn")
    ap.add_argument("--new-text", type=int, default=16, help="text frames of the new turn")
    ap.add_argument("--frames", type=int, default=4, help="frames generated per probe")
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--load", default="0", help="comma-separated numbers of running streams (e.g. 0,64)")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--prefill-budget", type=int, default=2048, help="prompt positions prefilled per step")
    ap.add_argument("--out")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = add_arguments(argparse.ArgumentParser(prog="prefix_ttfa", description=__doc__.split("\n\n")[0])).parse_args(argv)
    try:
        return run(args)
    except (RuntimeError, ValueError) as e:
        print(f"prefix_ttfa: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
