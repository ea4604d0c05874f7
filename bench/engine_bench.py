"""Engine benchmark: one stream, a concurrency sweep, memory, and transformers on the same weights.

python bench/engine_bench.py --model dummy --sweep 1,8,64,256,512,1024,2048 --hf
Prints markdown tables; --out FILE also writes them. The code is csmserve/apps/bench/engine.py (`csmserve bench`).
"""
from __future__ import annotations

import sys

from csmserve.apps.bench.engine import main

if __name__ == "__main__":
    sys.exit(main())
