"""The engine benchmark (`csmserve bench`, also `python bench/engine_bench.py`): one stream, a
concurrency sweep, memory, and optionally transformers on the same weights. Prints markdown tables.

    csmserve bench                                   # dummy full-size weights on the local GPU
    csmserve bench --model dummy --sweep 1,8,64,256,512,1024,2048 --hf
    csmserve bench --model dummy-tiny --device cpu   # a tiny run that only checks the machinery

Random ("dummy") weights cost exactly what real ones do per frame, so the numbers hold for
sesame/csm-1b; a hub id or directory benchmarks that checkpoint instead.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

FRAME_S = 0.08
CPU_HINT = ("no CUDA device: csmserve bench measures the engine on a GPU; "
            "for a tiny run of the machinery on the CPU use `csmserve bench --model dummy-tiny`")


@dataclass
class Probe:
    """Timestamps of one request's chunks, recorded on the engine thread."""

    request_id: str = ""
    submit: float = 0.0
    first: float | None = None
    last: float | None = None
    frames: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, item) -> None:
        now = time.perf_counter()
        if isinstance(item, BaseException):
            self.error = item
            self.done.set()
            return
        if len(item.codes) and self.first is None:
            self.first = now
        self.frames += len(item.codes)
        self.last = now
        if item.final:
            self.done.set()

    def wait(self) -> "Probe":
        """Until it ends; RuntimeError (one line for the command) if it failed."""
        self.done.wait()
        self.check()
        return self

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"request failed: {self.error}")

    @property
    def ttfa(self) -> float:
        return self.first - self.submit


def short_prompt(n: int = 12, vocab: int = 128_256) -> tuple[np.ndarray, np.ndarray]:
    """n text frames ([n, 33] tokens and mask), tokens below `vocab` (the model's: dummy-tiny's bytes are 258)."""
    tokens, mask = np.zeros((n, 33), np.int64), np.zeros((n, 33), bool)
    tokens[:, 32] = (np.arange(n) + 1000) % vocab
    mask[:, 32] = True
    return tokens, mask


def submit(engine, frames: int, prompt_len: int = 12, prompt: tuple[np.ndarray, np.ndarray] | None = None,
           prefix_len: int = 0, adapter: str | None = None) -> Probe:
    """A request for `frames` frames (its prompt: `prompt`, else short_prompt(prompt_len); its first `prefix_len`
    frames a cacheable prefix; spoken with LoRA `adapter`, None: the base) submitted -> its Probe."""
    from csmserve.engine.request import Request
    from csmserve.sampling import SamplingParams

    tokens, mask = prompt or short_prompt(prompt_len, engine.runner.cfg.text_vocab_size)
    req = Request(tokens, mask, prefix_len=prefix_len, adapter=adapter,
                  params=SamplingParams(temperature=0.9, top_k=50, max_audio_length_ms=int(frames * 80)))
    p = Probe(request_id=req.request_id, submit=time.perf_counter())
    engine.submit(req, p)
    return p


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def one_stream(engine, frames: int, probes: int = 5, adapter: str | None = None) -> dict:
    submit(engine, 4, adapter=adapter).wait()  # warm
    ttfas = []
    for _ in range(probes):
        ttfas.append(submit(engine, 8, adapter=adapter).wait().ttfa)
    p = submit(engine, frames, adapter=adapter).wait()
    fps = (p.frames - 1) / max(p.last - p.first, 1e-9)
    return {"fps": fps, "rtf": fps * FRAME_S, "ttfa_p50_ms": pct(ttfas, 50) * 1e3, "frames": p.frames}


def sweep_point(engine, n: int, frames: int, probes: int) -> dict:
    load = [submit(engine, frames) for _ in range(n)]
    while sum(p.first is not None for p in load) < n:  # wait for all streams to be generating
        for p in load:
            p.check()
        time.sleep(0.005)
    steps0, frames0, t0 = engine.stats["steps"], engine.stats["frames"], time.perf_counter()
    mine0 = sum(p.frames for p in load)
    ttfas = []
    for _ in range(probes):  # requests arriving under load
        ttfas.append(submit(engine, 4).wait().ttfa)
    time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
    dt = time.perf_counter() - t0
    steps, made = engine.stats["steps"] - steps0, engine.stats["frames"] - frames0  # the probes' frames too
    mine = sum(p.frames for p in load) - mine0  # the n streams' own (the probes are another stream beside them)
    for p in load:
        p.wait()
    return {"n": n, "agg_fps": made / dt, "per_stream_fps": mine / dt / n, "step_ms": dt / max(steps, 1) * 1e3,
            "ttfa_p50_ms": pct(ttfas, 50) * 1e3, "ttfa_p99_ms": pct(ttfas, 99) * 1e3}


def hf_reference(hf_model, batches: list[int], frames: int, compiled: bool) -> list[dict]:
    import torch

    out = []
    for b in batches:
        ids = torch.full((b, 12), 1000, dtype=torch.long, device="cuda")
        ids[:, 0] = 128000
        kw = dict(max_new_tokens=frames, do_sample=True, top_k=50, temperature=0.9, depth_decoder_do_sample=True,
                  depth_decoder_top_k=50, depth_decoder_temperature=0.9)
        # warm: the static cache is sized by max_new_tokens, so the compiled run warms with the same shape
        hf_model.generate(input_ids=ids, **(kw if compiled else {**kw, "max_new_tokens": 3}))
        torch.cuda.synchronize()
        t = time.perf_counter()
        seq = hf_model.generate(input_ids=ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        n = seq.shape[1] if seq.dim() == 3 else frames
        out.append({"batch": b, "compiled": compiled, "fps_per_stream": n / dt, "fps_total": b * n / dt})
    return out


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--model", default="dummy", help="dummy (random full-size weights), dummy-tiny, a hub id or a "
                                                     "local directory (default: dummy)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda; cpu only with dummy-tiny)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="the model's dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--sweep", default=None, help="comma-separated concurrencies (default: 1,8,64,256,512,1024,2048 "
                                                  "on cuda, 1,2,4 on cpu)")
    ap.add_argument("--frames", type=int, default=None, help="frames per request in the sweep (default: 150; cpu 8)")
    ap.add_argument("--one-stream-frames", type=int, default=None,
                    help="frames of the single-stream run (default: 250; cpu 24)")
    ap.add_argument("--probes", type=int, default=None,
                    help="requests sent under load per sweep point (default: 16; cpu 2)")
    ap.add_argument("--max-seq-len", type=int, default=512, help="positions per slot (default: 512)")
    ap.add_argument("--no-codec", action="store_true", help="codes only: leave Mimi's decode out")
    ap.add_argument("--codec-dtype", default=None, choices=["bfloat16", "float32"],
                    help="the Mimi codec's dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--no-first-frame-from-prefill", action="store_true",
                    help="an idle engine's first frame through the backbone (serve's --first-frame-from-prefill false)")
    ap.add_argument("--no-codec-stream", action="store_true",
                    help="Mimi's decode after the generation in one graph (serve's --codec-stream false)")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp8-all"],
                    help="the GEMMs' weights: fp8 the depth decoder's, fp8-all the backbone's too (default: bf16)")
    ap.add_argument("--hf", action="store_true", help="also run transformers on the same weights (cuda)")
    ap.add_argument("--hf-compile", action="store_true", help="with --hf: also its static-cache compile recipe")
    ap.add_argument("--out", help="also write the tables to this file (default: none)")
    return ap


def _fill_defaults(args: argparse.Namespace) -> None:
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(CPU_HINT)
    cpu = args.device == "cpu"
    if cpu and args.model != "dummy-tiny":
        raise RuntimeError(CPU_HINT)
    if cpu and (args.hf or args.hf_compile):
        raise RuntimeError("--hf needs a CUDA device")
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.codec_dtype = args.codec_dtype or ("float32" if cpu else "bfloat16")
    args.sweep = args.sweep or ("1,2,4" if cpu else "1,8,64,256,512,1024,2048")
    args.frames = args.frames or (8 if cpu else 150)
    args.one_stream_frames = args.one_stream_frames or (24 if cpu else 250)
    args.probes = args.probes if args.probes is not None else (2 if cpu else 16)
    try:
        sweep = [int(x) for x in str(args.sweep).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep must be comma-separated integers, got {args.sweep!r}") from None
    if not sweep or min(sweep) < 1:
        raise ValueError(f"--sweep must list concurrencies >= 1, got {args.sweep!r}")
    args.sweep = sweep


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by `args` (see add_arguments), printing its tables."""
    import torch

    from csmserve.config import EngineConfig
    from csmserve.engine.engine import Engine
    from csmserve.engine.runner import ModelRunner

    _fill_defaults(args)
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype)
    lines: list[str] = []

    def emit(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    model, codec, hf_model = build(args, dtype)
    n_slots = max(args.sweep) + args.probes
    cfg = EngineConfig(max_slots=n_slots, max_seq_len=args.max_seq_len, max_waiting=4 * n_slots,
                       prefill_token_budget=2048, weights=args.weights, codec_stream=not args.no_codec_stream,
                       first_frame_from_prefill=not args.no_first_frame_from_prefill)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    runner = ModelRunner(model, n_slots, args.max_seq_len, mimi=codec, max_prefill_tokens=cfg.prefill_token_budget,
                         weights=cfg.weights, codec_stream=cfg.codec_stream)
    capture_s = time.perf_counter() - t
    engine = Engine(runner, cfg)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    emit(f"device: {name}, torch {torch.__version__}, model {args.model}, dtype {args.dtype}, "
         f"slots {n_slots}, max_seq_len {args.max_seq_len}, codec {'on' if codec is not None else 'off'}, "
         f"weights {cfg.weights}, codec_stream {runner.codec_stream is not None}, "
         f"first_frame_from_prefill {cfg.first_frame_from_prefill}, "
         f"{'graphs captured' if cuda else 'eager (no graphs)'} for {len(runner.buckets)} buckets in {capture_s:.1f}s")
    try:
        one = one_stream(engine, args.one_stream_frames, max(5, args.probes))
        emit("\n| one stream | frames/s | real-time factor | time to first audio p50 (ms) |\n|---|---|---|---|")
        emit(f"| csmserve | {one['fps']:.1f} | {one['rtf']:.2f}x | {one['ttfa_p50_ms']:.1f} |")
        emit("\n| streams | aggregate frames/s | per-stream frames/s | frame step (ms) | TTFA p50 (ms) "
             "| TTFA p99 (ms) |")
        emit("|---|---|---|---|---|---|")
        best = 0
        for n in args.sweep:
            r = sweep_point(engine, n, args.frames, args.probes)
            if r["per_stream_fps"] >= 12.5:
                best = max(best, n)
            emit(f"| {n} | {r['agg_fps']:.0f} | {r['per_stream_fps']:.1f} | {r['step_ms']:.2f} | "
                 f"{r['ttfa_p50_ms']:.1f} | {r['ttfa_p99_ms']:.1f} |")
        emit(f"\nlargest swept concurrency with every stream >= 12.5 frames/s (real time): {best}")
        kv = runner.kv.bytes_per_slot
        mem = f"memory: backbone KV {kv / 2**20:.1f} MiB per slot at max_seq_len {args.max_seq_len}"
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            mem += (f"; peak allocated {peak / 2**30:.1f} GiB in total "
                    f"({peak / n_slots / 2**20:.1f} MiB per slot incl. weights)")
        emit(mem)
    finally:
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
    return 0


def build(args, dtype):
    """Our model and its codec (the one that goes with --model: random for dummies); with --hf, transformers'
    model with random weights and ours loaded from the same saved file (its codec too)."""
    import torch

    from csmserve.models.codec import load_codec
    from csmserve.models.loader import load_csm

    codec_dtype = getattr(torch, args.codec_dtype)
    if args.hf:
        try:
            hf_model, ckpt = hf_checkpoint(dtype)
        except Exception as e:  # an older transformers on the GPU image: bench ourselves, say so
            print(f"transformers reference unavailable ({type(e).__name__}: {e}); dummy weights", flush=True)
            args.hf = False
        else:
            from csmserve.models.mimi_loader import load_mimi

            codec = None if args.no_codec else load_mimi(ckpt, dtype=codec_dtype, device="cuda")
            return load_csm(ckpt, "cuda", dtype)[0], codec, hf_model
    model, _, model_dir = load_csm(args.model, args.device, dtype)
    codec = None if args.no_codec else load_codec(args.model, model_dir, None, torch.device(args.device), codec_dtype)
    return model, codec, None


def hf_checkpoint(dtype):
    """transformers' CsmForConditionalGeneration with random weights on CUDA, saved -> (it, the directory)."""
    import tempfile

    import torch

    from csmserve.extras import require

    transformers = require("transformers", "test", "--hf (the transformers reference)")

    def rope(low: float, high: float, orig: int) -> dict:
        return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": orig}

    cfg = transformers.CsmConfig(rope_parameters=rope(0.125, 0.5, 1024),
                                 depth_decoder_config={"rope_parameters": rope(0.001953125, 0.0078125, 16)})
    with torch.device("cuda"):
        hf_model = transformers.CsmForConditionalGeneration(cfg).to(dtype).eval()
    ckpt = tempfile.mkdtemp()
    hf_model.save_pretrained(ckpt)
    return hf_model, ckpt


def main(argv: list[str] | None = None) -> int:
    ap = add_arguments(argparse.ArgumentParser(prog="engine_bench", description=__doc__.split("\n\n")[0]))
    args = ap.parse_args(argv)
    try:
        return run(args)
    except (RuntimeError, ValueError) as e:
        print(f"engine_bench: error: {e}", file=sys.stderr)
        return 2
