"""What Ray Serve adds to the first audio chunk: the same model served by the plain server (`csmserve
serve`, its own process) and by `csmserve serve --ray`'s application (1 replica, through Serve's proxy), one
request at a time, time from sending POST /v1/audio/speech to its first body byte. Ray's streaming
path puts each ASGI message in the replica's queue and the proxy pulls whatever is there: no batching
interval (unlike Ray Serve LLM's RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS / stream_batching_interval_ms,
50 ms, which this path does not use); this measures what remains (the request's hop to the replica, one
message per batch back: over gRPC by default, --proxy-transport actor for Ray's actor calls).

    python bench/ray_ttfa.py --model dummy-tiny --device cpu --requests 50
    python bench/ray_ttfa.py --model dummy-tiny --device cpu --requests 50 --proxy-transport actor
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


@contextmanager
def plain(args) -> Iterator[str]:
    """`csmserve serve` in its own process (as the Ray replica is in its own), with the replica's threads."""
    port = free_port()
    cmd = [sys.executable, "-m", "csmserve", "serve", "--port", str(port), "--log-level", "warning"]
    for name, value in flags(args).items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    threads = str(max(1, int(args.cpus_per_replica)))  # Ray gives a replica OMP_NUM_THREADS = its CPUs
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the plain server did not start")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@contextmanager
def on_ray(args) -> Iterator[str]:
    from csmserve.ray.app import build_app, ensure_importable, parse_flags, set_ray_environment, spec_from_args

    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else (0 if args.device == "cpu" else 1)
    app_flags = {**flags(args), "num_replicas": 1, "gpus_per_replica": gpus,
                 "cpus_per_replica": args.cpus_per_replica, "proxy_transport": args.proxy_transport}
    ensure_importable()
    set_ray_environment(spec_from_args(parse_flags(app_flags))[1])  # as `csmserve serve --ray` (--ray-env wins)
    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False, **({"num_cpus": args.ray_cpus} if args.ray_cpus else {}))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_flags), name="csmserve", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


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
    p.add_argument("--ray-cpus", type=int, default=None, help="num_cpus of the local Ray instance")
    p.add_argument("--proxy-transport", choices=("grpc", "actor"), default="grpc",
                   help="serve --ray's --proxy-transport: how Serve's proxy reaches the replica")
    p.add_argument("--ray-env", action="append", default=[], metavar="K=V",
                   help="environment for the Ray instance (e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0)")
    p.add_argument("--only", choices=("plain", "ray"), default=None)
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = p.parse_args()
    os.environ.update(kv.split("=", 1) for kv in args.ray_env)

    ray_name = f"Ray Serve (1 replica, {args.proxy_transport})" + "".join(f" {kv}" for kv in args.ray_env)
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
