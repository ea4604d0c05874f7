"""The soak: N concurrent users for minutes against the real server: speech in several formats, 10% of
requests cut mid-stream (FIN / RST), 5% hostile, voices created and deleted, WebSocket conversations; it
reports responses >= 500, crashes, slots in use after, memory at start / middle / end and TTFA p99 over
time. Exit status 1 if any of those is not as it must be.

    python bench/soak.py --model dummy --users 1000 --duration 480 --client-procs 4 --out out/soak   # H200
    python bench/soak.py --model dummy-tiny --device cpu --users 12 --client-procs 2 --api-workers 2 \
        --duration 100 --audio-ms 240,800                                                             # CPU
    python bench/soak.py --url http://localhost:8000 --server-pid 1234 --users 64                     # running

The code is csmserve/apps/bench/serve/soak.py.
"""
from __future__ import annotations

import sys

from csmserve.apps.bench.serve.soak import main

if __name__ == "__main__":
    sys.exit(main())
