"""Time to first audio with a 10 s voice prompt and a 60 s conversation context, cached and uncached.

python bench/prefix_ttfa.py --model dummy --load 0,64
The code is csmserve/apps/bench/prefix.py.
"""
from __future__ import annotations

import sys

from csmserve.apps.bench.prefix import main

if __name__ == "__main__":
    sys.exit(main())
