"""The load benchmark through the real server (`csmserve bench --serve`, `python bench/serve_bench.py`).

It starts `csmserve serve` (or targets --url), drives it through its public API only, HTTP and
WebSocket, with real streaming clients in several processes, and prints what users see: requests/s,
time to first audio, per-stream audio rate, and how many streams' playback ran dry.

    bench.py     flags, the server and the client processes, each scenario, the table and files
    scenario.py  closed loop / burst / WebSocket conversations: who sends what when, the window
    worker.py    a client process: an asyncio loop of many users, JSON lines to the parent
    users.py     one HTTP streaming user, one WebSocket conversation; a record per request or turn
    meters.py    seconds of audio received, from each format's framing (no decoding)
    playback.py  a jitter buffer: did the stream run dry
    metrics.py   the server's /metrics before, during and after
    report.py    records -> numbers -> the markdown table
    server.py    `csmserve serve` as a subprocess, readiness, benchmark voices
"""
from __future__ import annotations


def add_arguments(ap, shared: bool = False):
    from csmserve.apps.bench.serve.bench import add_arguments as add

    return add(ap, shared)


def run(args) -> int:
    from csmserve.apps.bench.serve.bench import run as run_

    return run_(args)


def main(argv=None) -> int:
    from csmserve.apps.bench.serve.bench import main as main_

    return main_(argv)
