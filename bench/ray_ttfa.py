"""What Ray Serve adds to the first audio chunk: the same model served by the plain server (`csmserve
serve`, its own process tree) and by `csmserve serve --ray` (1 replica: the same tree, behind the HAProxy
ingress), both up together, one request at a time, alternating, time from sending POST /v1/audio/speech to
its first body byte. What Ray adds is HAProxy's hop (the replica's API worker streams through it).

    python bench/ray_ttfa.py --model dummy-tiny --device cpu --requests 50
    python bench/ray_ttfa.py --model dummy --device cuda --requests 100 --max-slots 64 --out ray_ttfa.md
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_byte_ms(client: httpx.Client, url: str, body: dict) -> tuple[float, float]:
    """-> (ms to the first body byte, ms to the last)."""
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter()
    return (first - t0) * 1000, (time.perf_counter() - t0) * 1000


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
                ms, _ = first_byte_ms(client, urls[name], body)
                t0 = time.perf_counter()
                client.get(f"{urls[name]}/v1/models").raise_for_status()
                if i >= args.warmup:
                    out[name].append(ms)
                    rtt[name].append((time.perf_counter() - t0) * 1000)
    for name, xs in rtt.items():
        print(f"GET /v1/models through {name}: p50 {statistics.median(xs):.1f} ms", file=sys.stderr)
    return out


def flags(args) -> dict:
    f = {"model": args.model, "device": args.device, "dtype": args.dtype, "max_slots": args.max_slots,
         "max_seq_len": args.max_seq_len, "voices_db": ":memory:", "log_level": "warning"}
    return {k: v for k, v in f.items() if v is not None}


def _start(cmd: list[str], env: dict, url: str, what: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.time() + 600
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()


def _env(args) -> dict:
    """Both trees with the replica's threads (Ray gives a replica OMP_NUM_THREADS = its CPUs; the engine process
    inherits it)."""
    threads = str(max(1, int(args.cpus_per_replica)))
    return {**os.environ, "OMP_NUM_THREADS": threads,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@contextmanager
def plain(args) -> Iterator[str]:
    """`csmserve serve` (an engine-core process and its API workers), its own process tree."""
    port = free_port()
    cmd = [sys.executable, "-m", "csmserve", "serve", "--port", str(port), "--log-level", "warning"]
    for name, value in flags(args).items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    url = f"http://127.0.0.1:{port}"
    proc = _start(cmd, _env(args), url, "the plain server")
    try:
        yield url
    finally:
        _stop(proc)


@contextmanager
def on_ray(args) -> Iterator[str]:
    """`csmserve serve --ray --num-replicas 1`: its own Ray instance, the replica the same tree as the plain
    server's, HAProxy on the port."""
    port = free_port()
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else (0 if args.device == "cpu" else 1)
    cmd = [sys.executable, "-m", "csmserve", "serve", "--ray", "--port", str(port), "--log-level", "warning",
           "--num-replicas", "1", "--gpus-per-replica", str(gpus), "--cpus-per-replica", str(args.cpus_per_replica),
           "--ingress-cpus", str(args.ingress_cpus)]
    for name, value in flags(args).items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    url = f"http://127.0.0.1:{port}"
    proc = _start(cmd, {**_env(args), "RAY_USAGE_STATS_ENABLED": "0"}, url, "csmserve serve --ray")
    try:
        yield url
    finally:
        _stop(proc)


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
        urls = {}
        if args.only != "ray":
            urls["plain server"] = stack.enter_context(plain(args))
        if args.only != "plain":
            urls[ray_name] = stack.enter_context(on_ray(args))
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
