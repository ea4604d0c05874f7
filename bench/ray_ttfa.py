"""What Ray Serve adds to the first audio chunk: the same model served by the plain server (`csmserve
serve`, its own process tree) and by `csmserve serve --ray` (1 replica: the same tree, behind the HAProxy
ingress), both up together, one request at a time, alternating, time from sending POST /v1/audio/speech to
its first body byte. What Ray adds is HAProxy's hop (the replica's API worker streams through it).

    python bench/ray_ttfa.py --model dummy-tiny --device cpu --requests 50
    python bench/ray_ttfa.py --model dummy --device cuda --requests 100 --max-slots 64 --out ray_ttfa.md

Each server is started as the load benchmark starts it (csmserve/apps/bench/serve/server.py: its log in a
temporary directory, its last lines in the error if it does not get ready).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from csmserve.apps.bench.serve.server import ServerProcess, child_env, serve_args  # noqa: E402


def first_byte_ms(client: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter()
    return (first - t0) * 1000


def measure(urls: dict[str, str], args) -> dict[str, list[float]]:
    """One request at a time, alternating between the servers (the same load on the machine for both;
    a shared CPU's noise falls on both alike)."""
    body = {"model": "tts-1", "voice": "alloy", "input": args.text, "response_format": args.format,
            "max_audio_length_ms": args.ms, "seed": 1}
    out: dict[str, list[float]] = {name: [] for name in urls}
    rtt: dict[str, list[float]] = {name: [] for name in urls}
    with httpx.Client(timeout=120) as client:
        for i in range(args.warmup + args.requests):
            names = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in names:
                ms = first_byte_ms(client, urls[name], body)
                t0 = time.perf_counter()
                client.get(f"{urls[name]}/v1/models").raise_for_status()
                if i >= args.warmup:
                    out[name].append(ms)
                    rtt[name].append((time.perf_counter() - t0) * 1000)
    for name, xs in rtt.items():
        print(f"GET /v1/models through {name}: p50 {statistics.median(xs):.1f} ms", file=sys.stderr)
    return out


def start(args, ray: bool, tmp: str) -> ServerProcess:
    """`csmserve serve` (an engine-core process and its API workers), or with `ray` `csmserve serve --ray
    --num-replicas 1`: its own Ray instance, the replica the same tree as the plain server's, HAProxy on the port.
    Both with the replica's threads (Ray gives a replica OMP_NUM_THREADS = its CPUs; the engine process inherits it)."""
    flags = serve_args(args, voices_db=":memory:")
    env = {"OMP_NUM_THREADS": str(max(1, int(args.cpus_per_replica)))}
    if ray:
        gpus = args.gpus_per_replica if args.gpus_per_replica is not None else (0 if args.device == "cpu" else 1)
        flags = ["--ray", "--num-replicas", "1", "--gpus-per-replica", str(gpus), "--cpus-per-replica",
                 str(args.cpus_per_replica), "--ingress-cpus", str(args.ingress_cpus), *flags]
        env["RAY_USAGE_STATS_ENABLED"] = "0"
    server = ServerProcess(flags, Path(tmp) / f"{'ray' if ray else 'plain'}.log", child_env(env))
    server.start(args.ready_timeout)
    return server


def stats(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=100)
    return {"p50": statistics.median(xs), "p90": q[89], "p99": q[98], "mean": statistics.fmean(xs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--server-args", default="", help="more `csmserve serve` flags for both, one string")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for each server's /ready")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--text", default="Hello there, this is a short sentence.")
    p.add_argument("--ms", type=int, default=400, help="max_audio_length_ms of each request")
    p.add_argument("--format", default="pcm")
    p.add_argument("--gpus-per-replica", type=float, default=None)
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--ingress-cpus", type=float, default=0.5)
    p.add_argument("--ray-env", action="append", default=[], metavar="K=V",
                   help="environment for `csmserve serve --ray` and its Ray instance")
    p.add_argument("--only", choices=("plain", "ray"), default=None)
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = p.parse_args()
    os.environ.update(kv.split("=", 1) for kv in args.ray_env)

    ray_name = "Ray Serve (1 replica, HAProxy)" + "".join(f" {kv}" for kv in args.ray_env)
    with ExitStack() as stack:
        tmp, urls = stack.enter_context(tempfile.TemporaryDirectory(prefix="csmserve-ray-ttfa-")), {}
        for name, ray in (("plain server", False), (ray_name, True)):
            if args.only in (None, "ray" if ray else "plain"):
                server = start(args, ray, tmp)
                stack.callback(server.stop)
                urls[name] = server.url
        results = measure(urls, args)
    rows = {k: stats(v) for k, v in results.items()}
    base_name = next(iter(rows))
    base = rows[base_name]
    lines = [f"first audio byte, {args.requests} requests to each, one at a time, alternating ({args.model}, "
             f"{args.device}, {args.format}, max_audio_length_ms={args.ms})", "",
             "| path | p50 ms | p90 ms | p99 ms | mean ms | p50 added | median of paired differences |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        paired = statistics.median(b - a for a, b in zip(results[base_name], results[name]))
        lines.append(f"| {name} | {r['p50']:.1f} | {r['p90']:.1f} | {r['p99']:.1f} | {r['mean']:.1f} | "
                     f"{r['p50'] - base['p50']:+.1f} | {paired:+.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
