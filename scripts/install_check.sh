#!/usr/bin/env bash
# A new user's install, as the README gives it: a fresh venv, the CPU torch, then `pip install .` (no extra).
# Every command must work from it: --help (without importing torch or the server), speak, serve (/ready).
# CI runs it (.ci/run); locally: bash scripts/install_check.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-$(mktemp -d)/venv}"
WORK="$(mktemp -d)"
PORT="${CSMSERVE_CHECK_PORT:-8765}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q .
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
cd "$WORK"  # away from the checkout: the installed package, not the source tree
"$VENV/bin/csmserve" --help >/dev/null
"$VENV/bin/python" -m csmserve --help >/dev/null
"$VENV/bin/python" - <<'PY'
import subprocess, sys
probe = ("import sys, runpy; sys.argv = ['csmserve', '--help']\n"
         "try:\n    runpy.run_module('csmserve', run_name='__main__')\nexcept SystemExit:\n    pass\n"
         "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'fastapi', 'uvicorn', 'av'})\n"
         "sys.stderr.write(repr(heavy))")
out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
assert out.returncode == 0 and out.stderr.strip() == "[]", f"csmserve --help imported {out.stderr}"
PY
"$VENV/bin/csmserve" speak "Hi." -o hi.wav --model dummy-tiny --device cpu -q
test "$(head -c 4 hi.wav)" = "RIFF"
"$VENV/bin/csmserve" serve --model dummy-tiny --device cpu --port "$PORT" --log-level warning \
  --voices-db "$WORK/voices.db" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  if "$VENV/bin/python" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/ready').status_code != 200)" 2>/dev/null; then
    echo "install check: --help, speak and serve (/ready) work from a fresh venv"
    exit 0
  fi
  kill -0 $SERVER 2>/dev/null || { echo "install check: csmserve serve exited" >&2; exit 1; }
  sleep 0.5
done
echo "install check: csmserve serve never answered /ready" >&2
exit 1
