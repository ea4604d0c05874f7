#!/usr/bin/env bash
# Wheels the H200 image lacks for `scripts/gpu.sh serve` (the server and the load benchmark): CPython 3.12,
# manylinux x86_64, into .whl/ (git-ignored; name it in the device call's `carry`). scripts/gpu.sh installs
# them into /tmp/site when it finds .whl/. One version each, every dependency the image does not have
# named (it has anyio, h11, click, httpx, annotated-doc, numpy, prometheus-client, uvloop, rich).
# About 40 MB in all, av's ~36 MB of it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2        # fastapi imports opentelemetry
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0                                            # pydantic 2.14 needs >= 4.16
  uvicorn==0.54.0 httptools==0.9.0                                     # httptools: uvicorn's fast HTTP parser
  websockets==17.4 python-multipart==0.0.34 av==18.1.0
)
mkdir -p .whl
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
done
ls -l .whl && du -sh .whl
