#!/usr/bin/env bash
# Everything that needs the H200, in one call: GPU tests, then benchmarks. Output under $OUT (or ./.out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then  # the server's wheels (scripts/gpu_wheels.sh; carry .whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
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
if [[ $what == serve ]]; then
  # the load benchmark through the real server (needs the wheels: bash scripts/gpu_wheels.sh, carry .whl):
  # one server start, then issue 12's acceptance set; SERVE_SCENARIOS replaces the set, SERVE_ARGS adds flags
  scenarios=${SERVE_SCENARIOS:-"closed:users=1,audio_ms=2000,ramp=0,warmup=1,duration=10,label=idle_1_pcm_2s
    closed:users=256 closed:users=2048 closed:users=1024,format=mp3 closed:users=1024,format=opus
    ws:users=1024 burst:users=2048,within=3"}
  python bench/serve_bench.py --model dummy --max-seq-len 512 --max-slots ${SERVE_SLOTS:-2100} \
    --client-procs ${SERVE_PROCS:-4} --ramp ${SERVE_RAMP:-10} --warmup ${SERVE_WARMUP:-2} \
    --duration ${SERVE_DURATION:-20} --drain ${SERVE_DRAIN:-30} $(printf -- '--scenario %s ' $scenarios) \
    --out "$OUT/serve_bench" ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve_bench.txt"
fi
if [[ $what == soak ]]; then
  # the soak (issue 13; needs the wheels: bash scripts/gpu_wheels.sh, carry .whl): 1,000 users for 8 minutes,
  # disconnects, hostile requests, voice churn, conversations. Start (~30-60 s) + 480 s + checks fit one
  # 10-minute device call; SOAK_DURATION shortens it, SOAK_ARGS adds soak flags (e.g. "--users 2000")
  python bench/soak.py --model dummy --max-seq-len 512 --users ${SOAK_USERS:-1000} --max-slots ${SOAK_SLOTS:-2100} \
    --client-procs ${SOAK_PROCS:-4} --duration ${SOAK_DURATION:-480} --out "$OUT/soak" ${SOAK_ARGS:-} 2>&1 \
    | tee "$OUT/soak.txt"
fi
if [[ $what == probe ]]; then
  # a first look after the data-plane rewrite: the graphs on CUDA, one stream and 2,048, admissions, Mimi
  python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_runner_gpu.py tests/kernels 2>&1 | tee "$OUT/gpu_tests.txt" | tail -5
  python bench/engine_bench.py --sweep 2048 --frames 60 --probes 8 2>&1 | tee "$OUT/engine_bench.txt" | tail -12
  python bench/admission.py --streams 2000 --rate 1000 --seconds 6 2>&1 | tee "$OUT/admission.txt" | tail -4
  python bench/mimi_precision.py --frames 100 --batch 8 --speed-batches 256,2048 2>&1 | tee "$OUT/mimi_precision.txt"
  python bench/profile_mimi.py --batch 2048 --rows 20 2>&1 | tee "$OUT/profile_mimi.txt" | head -40
  python bench/serve_bench.py --model dummy --max-seq-len 512 --max-slots 2100 --client-procs 4 --ramp 8 \
    --warmup 2 --duration 10 --drain 20 --scenario closed:users=256 --scenario closed:users=2048 \
    --out "$OUT/serve_probe" 2>&1 | tee "$OUT/serve_probe.txt" | tail -30
fi
