"""LoRA adapters' cost (issue 42): the frame step with 0, 1, 8 and 64 distinct random adapters (every projection of
the backbone and the depth decoder, rank 16 and 64) at several batch sizes, beside the base (a runner without a pool)
in the same run; then one stream through the engine with an adapter and without. Random full-size weights
(`--model dummy`'s); each runner is built, measured and freed in turn (at 2,048 slots one holds ~25 GB of KV).

python bench/lora.py --batches 1,64,2048 --adapters 0,1,8,64 --ranks 16,64
python bench/lora.py --batches 2048 --adapters 64 --ranks 16 --no-stream --runs base,kernels \
    --variant GLU_GROUPS=16,GLU_ROWS=32   # an A/B: the kernels with other constants, same process

A row's adapters are contiguous runs of slots (the scheduler orders a step's rows by adapter); "0" is the pool's
runner with every row on the base (its graphs without the LoRA kernels replay), "base" a runner without a pool.
"r16" runs as the server does (a lone adapter merged into the weights: engine/runner.py; measured at 0 and 1
adapters, the only counts it changes), "r16 kernels" with lora_merge off (the batched LoRA kernels at every count).
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from gpu_profile import admit_rows, dummy_model, frame_step_ms, load_pool, spread

from csmserve.engine.runner import MERGE_AFTER, ModelRunner


def adapters_step_ms(runner: ModelRunner, b: int, adapters: int, context: int, steps: int) -> float:
    """Mean frame step (ms) of b rows, the first `adapters` pool slots spread over them in contiguous runs (after
    MERGE_AFTER + 2 steps: a lone adapter is merged by then)."""
    slots = list(range(b))
    admit_rows(runner, slots, context, spread(b, adapters))
    return frame_step_ms(runner, slots, steps, warmup=MERGE_AFTER + 2)


def step_table(model, args) -> list[tuple]:
    batches = [int(b) for b in args.batches.split(",")]
    counts = [int(a) for a in args.adapters.split(",")]
    n = max(batches)
    rows = []
    kinds = args.runs.split(",")
    runs = [("base", None, False, "")] if "base" in kinds else []  # (label, rank, merge, variant)
    for r in args.ranks.split(","):
        runs += [(f"r{r}", int(r), True, "")] if "merged" in kinds else []
        runs += [(f"r{r} kernels", int(r), False, "")] if "kernels" in kinds else []
        runs += [(f"r{r} kernels {v}", int(r), False, v) for v in args.variants]
    for label, rank, merge, variant in runs:
        t0 = time.perf_counter()
        _set(variant)
        runner = ModelRunner(model, num_slots=n, max_seq_len=args.max_seq_len, buckets=batches,
                             max_loras=max(counts) if rank else 0, max_lora_rank=rank or 16, lora_merge=merge)
        if rank:
            load_pool(runner, model, rank, max(counts))
        print(f"{label}: graphs captured, pool loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        for b in batches:
            for a in (counts if rank else [0]):
                if a > b or (merge and a > 1):
                    continue
                ms = adapters_step_ms(runner, b, a, args.context, args.steps)
                rows.append((label, b, a if rank else "-", ms))
                print(f"| {label} | {b} | {rows[-1][2]} | {ms:.2f} |", flush=True)
        del runner
        _free(model)
    _set("")  # one_stream after: the defaults
    return rows


def one_stream(model, args) -> list[tuple]:
    """One stream through the engine (frames/s after its first chunk): the base, and an adapter of each rank with
    max(adapters) adapters loaded in the pool."""
    from csmserve.apps.bench.engine import one_stream as measure
    from csmserve.config import EngineConfig
    from csmserve.engine.engine import build_engine
    from csmserve.models.lora import random_adapter

    out = []
    for rank, merge in [(None, True)] + [(int(r), m) for r in args.ranks.split(",") for m in (True, False)]:
        n = max(int(a) for a in args.adapters.split(","))
        cfg = EngineConfig(max_slots=8, max_seq_len=args.max_seq_len, max_loras=n if rank else 0,
                           max_lora_rank=rank or 16, lora_merge=merge)
        engine = build_engine(model, None, cfg)
        if rank:
            for i in range(n):
                engine.load_adapter(f"a{i}", random_adapter(model.cfg, rank, seed=i).pin()).result()
        r = measure(engine, args.stream_frames, adapter="a0" if rank else None)
        out.append(("base" if rank is None else f"r{rank} adapter" + ("" if merge else ", kernels"), r["fps"],
                    r["ttfa_p50_ms"]))
        print(f"| {out[-1][0]} | {r['fps']:.1f} | {r['ttfa_p50_ms']:.1f} |", flush=True)
        engine.shutdown()
        del engine
        _free(model)
    return out


def _set(variant: str) -> None:
    """An A/B variant: kernels/lora.py's module constants ("NAME=V,NAME=V"; "" the defaults) for the runner built
    next (its graphs capture the launches they choose)."""
    from csmserve.kernels import lora as kl

    for name, value in _DEFAULTS.items():
        setattr(kl, name, value)
    for kv in filter(None, variant.split(",")):
        name, value = kv.split("=")
        if name not in _DEFAULTS:
            raise SystemExit(f"--variant: {name} is not one of {', '.join(_DEFAULTS)}")
        setattr(kl, name, int(value))


def _defaults() -> dict[str, int]:
    from csmserve.kernels import lora as kl

    names = ("TICKET_ROWS", "ADAPTER_SPLIT", "PIECE_K", "SHRINK_ROWS", "SHRINK_WIDE_FROM",
             "SHRINK_PIECE", "SHRINK_PIECES", "GLU_GROUPS", "GLU_ROWS", "GLU_PROGRAMS", "EXPAND_ROWS")
    return {n: getattr(kl, n) for n in names}


_DEFAULTS = _defaults()


def _free(model) -> None:
    from csmserve.models.lora import detach

    detach(model)  # the pool goes with the runner
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,2048")
    ap.add_argument("--adapters", default="0,1,8,64", help="distinct adapters spread over a batch's rows")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-seq-len", type=int, default=320)
    ap.add_argument("--stream-frames", type=int, default=300)
    ap.add_argument("--no-stream", action="store_true", help="the frame step only")
    ap.add_argument("--runs", default="base,merged,kernels", help="the frame step's runners: the base, the "
                    "adapters as served (merged), the batched kernels (an A/B's: kernels alone)")
    ap.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME=V,...",
                    help="A/B: one more kernels runner with kernels/lora.py's constants set so (e.g. "
                    "GLU_GROUPS=16,GLU_ROWS=32); repeatable")
    args = ap.parse_args()
    if not set(args.runs.split(",")) <= {"base", "merged", "kernels"}:
        raise SystemExit(f"--runs: {args.runs} is not a list of base, merged, kernels")
    print(f"kernels/lora.py: {_DEFAULTS}", flush=True)
    model = dummy_model()
    print("| runner | batch | adapters | frame step ms |\n|---|---|---|---|", flush=True)
    rows = step_table(model, args)
    base = {b: ms for label, b, _, ms in rows if label == "base"}
    print("\n| rank | batch | adapters | frame step ms | vs base |\n|---|---|---|---|---|")
    for label, b, a, ms in rows:
        if label != "base":
            vs = f"{100 * (ms / base[b] - 1):+.1f}%" if b in base else "-"
            print(f"| {label[1:]} | {b} | {a} | {ms:.2f} | {vs} |")
    if not args.no_stream:
        print("\n| one stream | frames/s | TTFA p50 ms |\n|---|---|---|", flush=True)
        one_stream(model, args)


if __name__ == "__main__":
    main()
