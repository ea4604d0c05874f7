#!/usr/bin/env bash
# The README's test command: installs the project with its test extras, then runs the CPU test suite.
# With no arguments: the suite, then the Ray Serve tests (tests/ray_serve: a local Ray instance of their own).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,ray]"
python -m pip install -q --no-deps "moshi==0.2.13"  # streaming-decode reference; --no-deps keeps torch as installed
if [ $# -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
python -m pytest -q --ignore=tests/ray_serve
python -m pytest -q tests/ray_serve
