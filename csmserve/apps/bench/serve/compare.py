"""The same load benchmark against several server setups, one after the other, side by side: by default the
plain `csmserve serve` and `csmserve serve --ray` on the same flags (bench/paced_ray.py). Each setup's server is
started, made fully ready (every Ray replica), driven by bench.py's scenarios (the same client processes' code,
real HTTP and WebSocket streams), its CPU measured over each window, then stopped before the next one starts.

    python bench/paced_ray.py --model paced --device cpu --max-slots 256 --scenario closed:users=64 \\
        --scenario closed:users=64,format=mp3
    python bench/paced_ray.py --model dummy --setup plain= --setup ray1="--ray --num-replicas 1" \\
        --setup ray2="--ray --num-replicas 2 --gpus-per-replica 0.5" --scenario closed:users=2048   # a GPU

Printed: each setup's own table (bench.py's), then per scenario a row per setup with requests/s and its ratio
to the first setup, TTFA p50 / p99, dry playbacks, errors, and the server's CPU (cores over the window, and
per second of audio it delivered).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from csmserve.apps.bench.serve import bench, report
from csmserve.apps.bench.serve.server import ServerProcess

DEFAULT_SETUPS = ("plain=", "ray=--ray")


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    bench.add_arguments(ap)
    ap.add_argument("--setup", action="append", default=None, metavar="NAME=FLAGS",
                    help="a server setup: NAME=more `csmserve serve` flags after the shared ones (repeatable; "
                         "the first is the baseline of the ratios; default: plain= and ray=--ray)")
    return ap


def parse_setups(specs: list[str] | None) -> list[tuple[str, list[str]]]:
    import shlex

    out = []
    for spec in specs or DEFAULT_SETUPS:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--setup must be NAME=FLAGS, got {spec!r}")
        out.append((name.strip(), shlex.split(flags)))
    if len({n for n, _ in out}) != len(out):
        raise ValueError("--setup names must differ")
    return out


def wait_replicas(url: str, timeout: float) -> None:
    """Until /ready says every replica is ready (a Ray application; the plain server: /ready 200 is all)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/ready", timeout=5)
            reps = r.json().get("replicas") if r.status_code == 200 else None
            if r.status_code == 200 and (not isinstance(reps, dict) or reps.get("ready", 0) >= reps.get("total", 0)):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url}: not every replica ready after {timeout:g} s")


def _cores(s: dict) -> float | None:
    cpu = (s.get("server") or {}).get("cpu")
    return None if not cpu else cpu["engine"] + cpu["workers"] + cpu["other"]


def table(results: list[tuple[str, list[dict]]]) -> list[str]:
    """Per scenario, a row per setup: its numbers and requests/s against the first setup's."""
    f = report._f
    lines = ["| scenario | setup | requests/s | x first | TTFA p50 / p99 (ms) | dry 100 / 300 ms | errors | "
             "server CPU (cores) | server CPU ms per s of audio |", "|---|---|---|---|---|---|---|---|---|"]
    base = {s["name"]: s for s in results[0][1]}
    for i, sc in enumerate(results[0][1]):
        for name, scenarios in results:
            s = scenarios[i]
            per_s, first = s["requests"]["per_s"], base[sc["name"]]["requests"]["per_s"]
            ratio = f"{per_s / first:.2f}" if per_s and first else "-"
            cores = _cores(s)
            audio_per_s = (per_s or 0) * (s["audio_s_mean"] or 0)
            per_audio = 1e3 * cores / audio_per_s if cores is not None and audio_per_s else None
            errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "0"
            lines.append(f"| {s['name']} | {name} | {f(per_s, '{:.1f}')} | {ratio} | {f(s['ttfa_ms']['p50'])} / "
                         f"{f(s['ttfa_ms']['p99'])} | {s['dry']['100ms']} / {s['dry']['300ms']} of {s['dry']['of']} | "
                         f"{errors} | {f(cores, '{:.2f}')} | {f(per_audio)} |")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.url:
        raise ValueError("the comparison starts each setup's server itself: no --url")
    setups = parse_setups(args.setup)
    base = bench._out_base(args.out)
    tmp = tempfile.TemporaryDirectory(prefix="csmserve-compare-")
    out_base = base or Path(tmp.name) / "compare"
    results: list[tuple[str, list[dict]]] = []
    try:
        for name, flags in setups:
            serve_args = bench.server_args(args) + flags
            log = f"{out_base}.{name}.server.log"
            env = bench._child_env({"RAY_USAGE_STATS_ENABLED": "0"} | (
                {} if os.environ.get("CSMSERVE_VOICES_DB") else {"CSMSERVE_VOICES_DB": f"{out_base}.{name}.voices.db"}))
            server = ServerProcess(serve_args, log, env)
            print(f"== {name}: csmserve serve {' '.join(serve_args)} (log: {log})", file=sys.stderr, flush=True)
            t = time.monotonic()
            try:
                server.start(args.ready_timeout)
                wait_replicas(server.url, args.ready_timeout)
                print(f"ready in {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
                sub = copy.copy(args)
                sub.out, sub.trace, sub.server_log = f"{out_base}.{name}", None, None
                print(f"\n### {name}\n", flush=True)
                bench.run(sub, server=server)
            finally:
                server.stop()
            results.append((name, json.loads(Path(f"{out_base}.{name}.json").read_text())["scenarios"]))
        lines = ["", f"### side by side ({', '.join(n for n, _ in setups)}; commit {bench._commit()}, "
                     f"{os.cpu_count()} cores)", "", *table(results)]
        print("\n".join(lines), flush=True)
        if base:
            Path(f"{base}.md").write_text("\n".join(lines) + "\n")
    finally:
        tmp.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = add_arguments(argparse.ArgumentParser(
        prog="paced_ray", description="The load benchmark against the plain server and Ray Serve (or any "
                                      "setups), side by side. csmserve/apps/bench/serve/compare.py."))
    args = ap.parse_args(argv)
    try:
        return run(args)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"paced_ray: error: {e}", file=sys.stderr)
        return 2
