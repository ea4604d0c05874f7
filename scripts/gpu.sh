#!/usr/bin/env bash
# Everything that needs the H200, in one call: GPU tests, then benchmarks. Output under $OUT (or ./.out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee -a "$OUT/gpu.txt"
what=${1:-all}
if [[ $what == all || $what == tests ]]; then
  # the GPU image has no server dependencies (fastapi, av): the gpu-marked tests live in these folders
  python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels tests/engine tests/models} 2>&1 | tee "$OUT/gpu_tests.txt"
fi
if [[ $what == all || $what == frame ]]; then
  python bench/frame_step.py ${FRAME_ARGS:-} --fuse 2>&1 | tee "$OUT/frame_step.txt"
  python bench/frame_step.py ${FRAME_ARGS:-} --fuse --codec 2>&1 | tee "$OUT/frame_step_codec.txt"
fi
if [[ $what == all || $what == mimi ]]; then
  python bench/mimi_decode.py --device cuda --batches 1,8,64,256 --dtype bfloat16 2>&1 | tee "$OUT/mimi_decode.txt"
fi
if [[ $what == all || $what == engine ]]; then
  python bench/engine_bench.py ${ENGINE_ARGS:-} --out "$OUT/engine_bench.md" 2>&1 | tee "$OUT/engine_bench.txt"
fi
if [[ $what == all || $what == prefix ]]; then
  python bench/prefix_ttfa.py ${PREFIX_ARGS:-} --out "$OUT/prefix_ttfa.md" 2>&1 | tee "$OUT/prefix_ttfa.txt"
fi
if [[ $what == ttfa ]]; then
  python bench/ttfa_breakdown.py ${TTFA_ARGS:-} 2>&1 | tee "$OUT/ttfa_breakdown.txt"
fi
if [[ $what == profile ]]; then
  python bench/profile_step.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.txt"
fi
if [[ $what == ray ]]; then
  # Ray Serve (docs/scale-out.md). The GPU image lacks Ray and the server's packages: carry .bundle/ (built here by
  # scripts/ray_bundle.sh: ray-cp312.tar.xz, av-cp312.tar.xz) and it is unpacked into $RAY_SITE (/tmp/site).
  SITE=${RAY_SITE:-/tmp/site}
  if [ ! -d "$SITE/ray" ]; then
    mkdir -p "$SITE"
    for a in .bundle/ray-cp312.tar.xz .bundle/av-cp312.tar.xz; do [ -f "$a" ] && tar -C "$SITE" -xJf "$a"; done
  fi
  export PYTHONPATH=$PWD:$SITE RAY_USAGE_STATS_ENABLED=0
  python -c "import ray, fastapi, uvicorn, av; print('ray', ray.__version__, 'fastapi', fastapi.__version__)" \
    2>&1 | tee "$OUT/ray_env.txt"
  stop_server() {  # SIGTERM, 90 s, then SIGKILL and `ray stop`: no replica left on the GPU for the next setup
    kill -TERM "$1" 2>/dev/null
    for _ in $(seq 90); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
    kill -KILL "$1" 2>/dev/null
    wait "$1" 2>/dev/null
    python -c "import sys, ray.scripts.scripts as s; sys.argv = ['ray', 'stop', '--force']; s.main()" >/dev/null 2>&1 || true
  }
  MODEL_ARGS=${RAY_MODEL_ARGS:---model dummy}  # slots: sized from (the share of) GPU memory
  PARTS=${RAY_PARTS:-ttfa load}  # one device call is 10 minutes at most: RAY_PARTS=ttfa, then RAY_PARTS=load
  # 1. what Ray adds to the first chunk, 1 user: the plain server and 1 replica, requests alternating
  [[ $PARTS == *ttfa* ]] && python bench/ray_ttfa.py --model dummy --device cuda --max-slots 64 --max-seq-len 2048 --requests ${RAY_TTFA_REQUESTS:-200} \
    --cpus-per-replica 4 ${RAY_TTFA_ARGS:-} --out "$OUT/ray_ttfa.md" 2>&1 | grep -v "^(\|INFO\|WARNING" | tee "$OUT/ray_ttfa.txt"
  # 2. the load benchmark (SERVE_BENCH_CMD, default bench/serve_bench.py --url ...; + SERVE_BENCH_ARGS) against:
  #    the plain server, Ray with 1 replica,
  #    Ray with 2 replicas of half the GPU each; one server at a time on port 8100
  if [[ $PARTS == *load* && -f bench/serve_bench.py ]]; then
    for setup in ${RAY_SETUPS:-plain 1x1 2x0.5}; do  # replicas x GPU share each
      if [[ $setup == plain ]]; then
        name=plain; python -m csmserve serve $MODEL_ARGS --port 8100 > "$OUT/serve_$name.log" 2>&1 &
        want=0
      else
        n=${setup%%x*}; share=${setup#*x}; name="ray_$setup"
        python -m csmserve serve --ray $MODEL_ARGS --port 8100 --num-replicas "$n" --gpus-per-replica "$share" \
          --cpus-per-replica 4 ${RAY_SERVE_ARGS:-} > "$OUT/serve_$name.log" 2>&1 &
        want=$n
      fi
      pid=$!
      python - "$want" <<'PY' || { echo "$name did not get ready" | tee -a "$OUT/ray_bench.txt"; stop_server $pid; continue; }
import sys, time, httpx
want, deadline = int(sys.argv[1]), time.time() + 400
while time.time() < deadline:
    try:
        r = httpx.get("http://127.0.0.1:8100/ready", timeout=5)
        if r.status_code == 200 and (want == 0 or r.json()["replicas"]["ready"] >= want):
            sys.exit(0)
    except Exception:
        pass
    time.sleep(2)
sys.exit(1)
PY
      echo "== $name" | tee -a "$OUT/ray_bench.txt"
      ${SERVE_BENCH_CMD:-python bench/serve_bench.py --url http://127.0.0.1:8100} ${SERVE_BENCH_ARGS:-} 2>&1 |
        tee -a "$OUT/ray_bench.txt"
      stop_server $pid
    done
  fi
fi
