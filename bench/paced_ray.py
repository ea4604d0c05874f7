"""The load benchmark against the plain server and `csmserve serve --ray`, side by side (requests/s and its ratio,
TTFA, dry playbacks, the server's CPU). On a CPU with the paced stand-in engine (no GPU: its steps take the H200's
measured times, csmserve/engine/paced.py):

    python bench/paced_ray.py --model paced --device cpu --max-slots 256 --client-procs 1 \
        --scenario closed:users=64 --scenario closed:users=64,format=mp3

On the GPU: --model dummy (and --setup NAME=FLAGS for each shape, e.g. ray2="--ray --num-replicas 2
--gpus-per-replica 0.5"). The code is csmserve/apps/bench/serve/bench.py (its --setup).
"""
from __future__ import annotations

import sys

from csmserve.apps.bench.serve.bench import PACED_RAY_SETUPS, main

if __name__ == "__main__":
    sys.exit(main(prog="paced_ray", setups=PACED_RAY_SETUPS))
