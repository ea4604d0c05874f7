"""`csmserve bench`: the engine benchmark on this machine (apps/bench/engine.py), or with --serve the
server benchmark (apps/bench/serve/)."""
from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from csmserve.apps.bench.engine import add_arguments
    from csmserve.apps.bench.serve.bench import add_arguments as add_serve_arguments

    p = sub.add_parser("bench", help="the engine benchmark on this machine's GPU (tables of frames/s, latency)",
                       description="One stream, a concurrency sweep and memory on the local GPU, with random "
                                   "full-size weights by default (they cost what real ones do). Without a GPU: "
                                   "--model dummy-tiny for a tiny CPU run. With --serve: load through the real "
                                   "server (csmserve serve started with --model, --max-seq-len, ...) from "
                                   "streaming HTTP and WebSocket clients.")
    add_arguments(p)
    p.add_argument("--serve", action="store_true",
                   help="benchmark the server instead: closed loop, bursts, formats, WebSocket, several setups "
                        "(the flags below)")
    add_serve_arguments(p, shared=True)
    p.set_defaults(func=bench)


def bench(args: argparse.Namespace) -> int:
    if args.serve:
        from csmserve.apps.bench.serve.bench import run
    else:
        from csmserve.apps.bench.engine import run

    return run(args)
