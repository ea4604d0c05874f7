#!/usr/bin/env bash
# The README's test command: installs the project with its test extras, then runs the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps "moshi==0.2.13"  # streaming-decode reference; --no-deps keeps torch as installed
python -m pytest -q "$@"
