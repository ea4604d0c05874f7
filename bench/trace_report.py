"""Per-request timelines of `csmserve serve --trace-requests DIR` joined: where the time to first audio
went, for all requests and the slowest (p90, p99), their GC pauses and steps waited, the step times.

    python bench/trace_report.py DIR
    python bench/trace_report.py DIR --since 1234.5 --until 1260.5    # perf_counter window (received)

The code is csmserve/apps/bench/serve/trace_report.py; `bench/serve_bench.py --trace` runs it per scenario.
"""
from __future__ import annotations

import sys

from csmserve.apps.bench.serve.trace_report import main

if __name__ == "__main__":
    sys.exit(main())
