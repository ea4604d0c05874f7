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
if [[ $what == spec ]]; then  # draft/verify over codebooks: cost per k and batch, break-even acceptance
  python bench/spec_depth.py ${SPEC_ARGS:-} 2>&1 | tee "$OUT/spec_depth.txt"
fi
if [[ $what == fp8 ]]; then  # FP8 weights: logits' error against bf16 (teacher forcing) and frame-step speed
  python bench/fp8_error.py ${FP8_ARGS:-} 2>&1 | tee "$OUT/fp8_error.txt"
fi
if [[ $what == profile ]]; then
  python bench/profile_step.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.txt"
fi
