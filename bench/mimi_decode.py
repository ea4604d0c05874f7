"""Mimi decode speed: our streaming decode_step (eager and CUDA-graphed) vs transformers' MimiModel.decode.

    python bench/mimi_decode.py --device cuda --batches 1,8,64,256 --dtype bfloat16
    python bench/mimi_decode.py --device cpu --frames 2 --batches 1,2          # smoke test

Random weights of the real shape (shared with transformers' model when it imports). Prints a
markdown table: milliseconds per call; "x RT" = audio seconds produced per wall second.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from csmserve.models.mimi import Mimi, MimiConfig, MimiStream  # noqa: E402
from csmserve.models.mimi_loader import dummy_init, load_hf_state_dict  # noqa: E402


def build(cfg: MimiConfig, dtype: torch.dtype, device: str):
    """-> (ours, hf or None) with the same weights."""
    try:
        import transformers as tf

        hf = tf.MimiModel(tf.MimiConfig(**cfg.hf_kwargs())).eval()
        with torch.no_grad():
            for name, t in hf.state_dict().items():  # spread codebooks so decode is not degenerate
                if name.endswith("embed_sum"):
                    t.copy_(torch.randn(t.shape))
        ours = Mimi(cfg)
        load_hf_state_dict(ours, hf.state_dict())
        hf = hf.to(device=device, dtype=dtype)
    except ImportError:
        hf, ours = None, dummy_init(Mimi(cfg))
    return ours.to(device=device, dtype=dtype).eval(), hf


def timer(device: str) -> Callable[[Callable[[], object], int, int], float]:
    """-> time(fn, warmup, iters): mean milliseconds per call."""
    def run(fn: Callable[[], object], warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    return run


def graphed_step(st: MimiStream, codes: torch.Tensor, rows: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Capture one decode_step for these static (codes, rows) shapes; returns the replay function."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            st.decode_step(codes, rows)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = st.decode_step(codes, rows)

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--frames", type=int, default=10, help="whole-utterance decode length (also run at 1 frame)")
    ap.add_argument("--step-frames", type=int, default=1, help="frames per streaming step")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the tiny test config instead of the real shape")
    ap.add_argument("--no-graph", action="store_true")
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = MimiConfig.tiny() if args.tiny else MimiConfig()
    ours, hf = build(cfg, dtype, args.device)
    run = timer(args.device)
    graphs = args.device.startswith("cuda") and not args.no_graph
    n, fs = args.step_frames, cfg.frame_size
    # one spare row: a bucket smaller than max_rows would pad with it
    st = MimiStream(ours, max_rows=max(batches) + 1, part="decode", max_frames=n)
    g = torch.Generator().manual_seed(0)

    print(f"Mimi decode, {'tiny' if args.tiny else 'real'} shape, {args.dtype}, device {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, "
          f"{n} frame(s) per streaming step, ms per call (mean of {args.iters})\n")
    head = ["batch", "stream step eager", "x RT eager"]
    head += ["stream step graph", "x RT graph"] if graphs else []
    head += [f"ours whole {args.frames}f"]
    head += ["HF decode 1f", f"HF decode {args.frames}f"] if hf is not None else []
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    audio_s = n * fs / cfg.sampling_rate
    for b in batches:
        codes = torch.randint(0, cfg.codebook_size, (b, cfg.num_quantizers, n), generator=g).to(args.device)
        rows = torch.arange(b, device=args.device)
        st.reset(rows)
        eager = run(lambda: st.decode_step(codes, rows), args.warmup, args.iters)
        cells = [str(b), f"{eager:.3f}", f"{b * audio_s / (eager / 1e3):.1f}"]
        if graphs:
            replay = graphed_step(st, codes, rows)
            gms = run(replay, args.warmup, args.iters)
            cells += [f"{gms:.3f}", f"{b * audio_s / (gms / 1e3):.1f}"]
        long = torch.randint(0, cfg.codebook_size, (b, cfg.num_quantizers, args.frames), generator=g).to(args.device)
        cells.append(f"{run(lambda: ours.decode(long), 1, max(1, args.iters // 4)):.3f}")
        if hf is not None:
            with torch.inference_mode():
                one = long[..., :1]
                cells.append(f"{run(lambda: hf.decode(one), 1, max(1, args.iters // 4)):.3f}")
                cells.append(f"{run(lambda: hf.decode(long), 1, max(1, args.iters // 4)):.3f}")
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
