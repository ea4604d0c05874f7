"""Load through the real server: starts `csmserve serve`, real HTTP/WebSocket streaming clients in several
processes, closed loop / bursts / every format / WebSocket conversations; prints requests/s, TTFA p50/p99,
per-stream audio rate and how many streams' playback ran dry with a 100 ms / 300 ms jitter buffer.

    python bench/serve_bench.py --model dummy --max-slots 2100 --users 256
    python bench/serve_bench.py --scenario closed:users=1024,format=mp3 --scenario ws:users=1024 --out out/serve
    python bench/serve_bench.py --url http://localhost:8000 --users 64    # an already running server

Also `csmserve bench --serve ...`. The code is csmserve/apps/bench/serve/.
"""
from __future__ import annotations

import sys

from csmserve.apps.bench.serve.bench import main

if __name__ == "__main__":
    sys.exit(main())
