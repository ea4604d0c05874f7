#!/usr/bin/env bash
# The README's test command: installs the project with its test extras, then runs the CPU test suite.
# With no arguments: the suite on 2 pytest-xdist workers (whole files per worker: module fixtures start
# once), then the `serial` tests alone (process trees killed and restarted on a deadline), then the Ray
# Serve tests (tests/ray_serve: a local Ray instance of their own). PYTEST_WORKERS=0 runs all in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,ray]"
python -m pip install -q --no-deps "moshi==0.2.13"  # streaming-decode reference; --no-deps keeps torch as installed
if [ $# -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
workers=${PYTEST_WORKERS:-2}
if [ "$workers" -gt 0 ]; then
  python -m pytest -q --ignore=tests/ray_serve -n "$workers" --dist loadfile -m "not gpu and not serial"
  python -m pytest -q --ignore=tests/ray_serve -m "serial and not gpu"
else
  python -m pytest -q --ignore=tests/ray_serve
fi
python -m pytest -q tests/ray_serve
