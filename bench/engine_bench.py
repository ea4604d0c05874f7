"""Engine benchmark: one stream, a concurrency sweep, memory, and transformers on the same weights.

python bench/engine_bench.py --model dummy --sweep 1,8,64,256,512,1024,2048 --hf
Prints markdown tables; --out FILE also writes them.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from csmserve.config import EngineConfig
from csmserve.engine.engine import Engine
from csmserve.engine.request import Request, SamplingParams
from csmserve.engine.runner import ModelRunner

FRAME_S = 0.08


@dataclass
class Probe:
    """Timestamps of one request's chunks, recorded on the engine thread."""

    submit: float = 0.0
    first: float | None = None
    last: float | None = None
    frames: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, item) -> None:
        now = time.perf_counter()
        if isinstance(item, BaseException):
            print("request failed:", item, file=sys.stderr)
            self.done.set()
            return
        if len(item.codes) and self.first is None:
            self.first = now
        self.frames += len(item.codes)
        self.last = now
        if item.final:
            self.done.set()

    @property
    def ttfa(self) -> float:
        return self.first - self.submit


def short_prompt(n: int = 12) -> tuple[np.ndarray, np.ndarray]:
    tokens, mask = np.zeros((n, 33), np.int64), np.zeros((n, 33), bool)
    tokens[:, 32] = np.arange(n) + 1000
    mask[:, 32] = True
    return tokens, mask


def submit(engine: Engine, frames: int, prompt_len: int = 12) -> Probe:
    p = Probe()
    req = Request(*short_prompt(prompt_len), params=SamplingParams(temperature=0.9, top_k=50,
                                                                    max_audio_length_ms=int(frames * 80)))
    p.submit = time.perf_counter()
    engine.submit(req, p)
    return p


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def one_stream(engine: Engine, frames: int) -> dict:
    submit(engine, 4).done.wait()  # warm
    ttfas = []
    for _ in range(5):
        p = submit(engine, 8)
        p.done.wait()
        ttfas.append(p.ttfa)
    p = submit(engine, frames)
    p.done.wait()
    fps = (p.frames - 1) / (p.last - p.first)
    return {"fps": fps, "rtf": fps * FRAME_S, "ttfa_p50_ms": pct(ttfas, 50) * 1e3, "frames": p.frames}


def sweep_point(engine: Engine, n: int, frames: int, probes: int) -> dict:
    load = [submit(engine, frames) for _ in range(n)]
    while sum(p.first is not None for p in load) < n:  # wait for all streams to be generating
        time.sleep(0.005)
    steps0, frames0, t0 = engine.stats["steps"], engine.stats["frames"], time.perf_counter()
    ttfas = []
    for _ in range(probes):  # requests arriving under load
        p = submit(engine, 4)
        p.done.wait()
        ttfas.append(p.ttfa)
    time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
    dt = time.perf_counter() - t0
    steps, made = engine.stats["steps"] - steps0, engine.stats["frames"] - frames0
    for p in load:
        p.done.wait()
    return {"n": n, "agg_fps": made / dt, "per_stream_fps": (made / dt) / n, "step_ms": dt / max(steps, 1) * 1e3,
            "ttfa_p50_ms": pct(ttfas, 50) * 1e3, "ttfa_p99_ms": pct(ttfas, 99) * 1e3}


def hf_reference(hf_model, batches: list[int], frames: int, compiled: bool) -> list[dict]:
    out = []
    for b in batches:
        ids = torch.full((b, 12), 1000, dtype=torch.long, device="cuda")
        ids[:, 0] = 128000
        kw = dict(max_new_tokens=frames, do_sample=True, top_k=50, temperature=0.9, depth_decoder_do_sample=True,
                  depth_decoder_top_k=50, depth_decoder_temperature=0.9)
        hf_model.generate(input_ids=ids, **{**kw, "max_new_tokens": 3})  # warm (compiles when static)
        torch.cuda.synchronize()
        t = time.perf_counter()
        seq = hf_model.generate(input_ids=ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        n = seq.shape[1] if seq.dim() == 3 else frames
        out.append({"batch": b, "compiled": compiled, "fps_per_stream": n / dt, "fps_total": b * n / dt})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sweep", default="1,8,64,256,512,1024,2048")
    ap.add_argument("--frames", type=int, default=150, help="frames per request in the sweep")
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--no-codec", action="store_true")
    ap.add_argument("--codec-dtype", default="bfloat16")
    ap.add_argument("--hf", action="store_true", help="also run transformers on the same weights")
    ap.add_argument("--hf-compile", action="store_true", help="and its static-cache compile recipe")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    sweep = [int(x) for x in args.sweep.split(",")]
    lines: list[str] = []

    def emit(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    model, codec, hf_model = build(args, dtype)
    n_slots = max(sweep) + args.probes
    cfg = EngineConfig(max_slots=n_slots, max_seq_len=args.max_seq_len, max_waiting=4 * n_slots,
                       prefill_token_budget=2048)
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    runner = ModelRunner(model, n_slots, args.max_seq_len, mimi=codec)
    capture_s = time.perf_counter() - t
    engine = Engine(runner, cfg)
    emit(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {args.dtype}, "
         f"slots {n_slots}, max_seq_len {args.max_seq_len}, codec {'on' if codec is not None else 'off'}, "
         f"graphs captured for {len(runner.buckets)} buckets in {capture_s:.1f}s")
    one = one_stream(engine, 250)
    emit("\n| one stream | frames/s | real-time factor | time to first audio p50 (ms) |\n|---|---|---|---|")
    emit(f"| csmserve | {one['fps']:.1f} | {one['rtf']:.2f}x | {one['ttfa_p50_ms']:.1f} |")
    emit("\n| streams | aggregate frames/s | per-stream frames/s | frame step (ms) | TTFA p50 (ms) | TTFA p99 (ms) |")
    emit("|---|---|---|---|---|---|")
    best = 0
    for n in sweep:
        r = sweep_point(engine, n, args.frames, args.probes)
        if r["per_stream_fps"] >= 12.5:
            best = max(best, n)
        emit(f"| {n} | {r['agg_fps']:.0f} | {r['per_stream_fps']:.1f} | {r['step_ms']:.2f} | "
             f"{r['ttfa_p50_ms']:.1f} | {r['ttfa_p99_ms']:.1f} |")
    emit(f"\nlargest swept concurrency with every stream >= 12.5 frames/s: {best}")
    kv = runner.kv.bytes_per_slot
    emit(f"memory: backbone KV {kv / 2**20:.1f} MiB per slot at max_seq_len {args.max_seq_len}; "
         f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB in total "
         f"({torch.cuda.max_memory_allocated() / n_slots / 2**20:.1f} MiB per slot incl. weights)")
    engine.shutdown()
    if hf_model is not None:
        del runner, engine
        torch.cuda.empty_cache()
        emit("\n| transformers CsmForConditionalGeneration | batch | frames/s per stream | frames/s total |")
        emit("|---|---|---|---|")
        for r in hf_reference(hf_model, [1, 32], 40, False):
            emit(f"| eager | {r['batch']} | {r['fps_per_stream']:.1f} | {r['fps_total']:.1f} |")
        if args.hf_compile:
            hf_model.generation_config.cache_implementation = "static"
            hf_model.depth_decoder.generation_config.cache_implementation = "static"
            for r in hf_reference(hf_model, [1], 40, True):
                emit(f"| static cache + compile | {r['batch']} | {r['fps_per_stream']:.1f} | {r['fps_total']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def build(args, dtype):
    """Our model (and codec), and transformers' model holding the same weights when --hf."""
    from csmserve.models.loader import load_csm

    if args.hf:
        try:
            return build_with_hf(args, dtype)
        except Exception as e:  # an older transformers on the GPU image: bench ourselves, say so
            print(f"transformers reference unavailable ({type(e).__name__}: {e}); dummy weights", flush=True)
            args.hf = False
    model = load_csm(args.model, "cuda", dtype)[0]
    codec = None if args.no_codec else load_codec_for(args, dtype, None)
    return model, codec, None


def build_with_hf(args, dtype):
    """transformers' CsmForConditionalGeneration with random weights, saved; ours loads the same file."""
    import tempfile

    from transformers import CsmConfig, CsmForConditionalGeneration

    from csmserve.models.loader import load_csm

    def rope(low: float, high: float, orig: int) -> dict:
        return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": orig}

    cfg = CsmConfig(rope_parameters=rope(0.125, 0.5, 1024),
                    depth_decoder_config={"rope_parameters": rope(0.001953125, 0.0078125, 16)})
    with torch.device("cuda"):
        hf_model = CsmForConditionalGeneration(cfg).to(dtype).eval()
    args.ckpt_dir = tempfile.mkdtemp()
    hf_model.save_pretrained(args.ckpt_dir)
    model = load_csm(args.ckpt_dir, "cuda", dtype)[0]
    codec = None if args.no_codec else load_codec_for(args, dtype, hf_model)
    return model, codec, hf_model


def load_codec_for(args, dtype, hf_model):
    from csmserve.models.mimi_loader import load_mimi

    codec_dtype = getattr(torch, args.codec_dtype)
    if hf_model is not None:  # the codec inside the same checkpoint
        return load_mimi(args.ckpt_dir, dtype=codec_dtype, device="cuda")
    return load_mimi("dummy", dtype=codec_dtype, device="cuda")


if __name__ == "__main__":
    main()
