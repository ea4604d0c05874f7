#!/usr/bin/env bash
# The README's test command: installs the project with its test extras, then runs the CPU test suite.
# With no arguments:
#   1. the suite on PYTEST_WORKERS (default 2: CI's 2 cores) pytest-xdist workers, whole files per worker
#      (module fixtures start once), each process with one OpenMP thread: 2 workers and their servers'
#      spinning OpenMP threads on 2 cores cost more than they gave (measured: the suite 564 -> 494 s);
#   2. the `serial` tests alone (they measure real-time pacing, which a neighbour worker skews);
#   3. the Ray Serve tests (tests/ray_serve: a local Ray instance of their own).
# PYTEST_WORKERS=0 runs 1 and 2 in one process, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,ray]"
python -m pip install -q --no-deps "moshi==0.2.13"  # streaming-decode reference; --no-deps keeps torch as installed
if [ $# -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
workers=${PYTEST_WORKERS:-2}
if [ "$workers" -gt 0 ]; then
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python -m pytest -q --ignore=tests/ray_serve -n "$workers" --dist loadfile \
    -m "not gpu and not serial"
  python -m pytest -q --ignore=tests/ray_serve -m "serial and not gpu"
else
  python -m pytest -q --ignore=tests/ray_serve
fi
python -m pytest -q tests/ray_serve
