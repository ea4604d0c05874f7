#!/usr/bin/env bash
# Everything that needs the H200, in one call: GPU tests, then benchmarks. Output under $OUT (or ./.out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then  # the server's wheels (scripts/gpu_wheels.sh; carry .whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
unpack_bundle() {  # the server's and Ray's packages from .bundle/ (scripts/ray_bundle.sh; carry .bundle) -> $RAY_SITE
  local site=${RAY_SITE:-/tmp/site}
  if [ ! -f "$site/.unpacked" ] && [ -f .bundle/ray-cp312.tar.xz ]; then
    mkdir -p "$site"
    for a in .bundle/ray-cp312.tar.xz .bundle/av-cp312.tar.xz; do [ -f "$a" ] && tar -C "$site" -xJf "$a"; done
    touch "$site/.unpacked"
  fi
}
use_bundle() { unpack_bundle; [ -f "${RAY_SITE:-/tmp/site}/.unpacked" ] && export PYTHONPATH=$PYTHONPATH:${RAY_SITE:-/tmp/site}; }
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
if [[ $what == serve ]]; then
  # the load benchmark through the real server (needs the wheels: bash scripts/gpu_wheels.sh, carry .whl):
  # one server start, then issue 12's acceptance set; SERVE_SCENARIOS replaces the set, SERVE_ARGS adds flags;
  # SERVE_TRACE=1: the server traces every request (--trace-requests into $OUT/serve_bench.trace), each
  # scenario's trace_report table in $OUT/serve_bench.trace.txt, the raw files as $OUT/serve_bench.trace.tgz
  scenarios=${SERVE_SCENARIOS:-"closed:users=1,audio_ms=2000,ramp=0,warmup=1,duration=10,label=idle_1_pcm_2s
    closed:users=256 closed:users=2048 closed:users=1024,format=mp3 closed:users=1024,format=opus
    ws:users=1024 burst:users=2048,within=3"}
  python bench/serve_bench.py --model dummy --max-seq-len 512 --max-slots ${SERVE_SLOTS:-2100} \
    --client-procs ${SERVE_PROCS:-8} --ramp ${SERVE_RAMP:-10} --warmup ${SERVE_WARMUP:-2} \
    --duration ${SERVE_DURATION:-20} --drain ${SERVE_DRAIN:-30} $(printf -- '--scenario %s ' $scenarios) \
    --out "$OUT/serve_bench" ${SERVE_TRACE:+--trace} ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve_bench.txt"
  if [[ -n ${SERVE_TRACE:-} && -d "$OUT/serve_bench.trace" ]]; then
    tar -C "$OUT" -czf "$OUT/serve_bench.trace.tgz" serve_bench.trace && rm -rf "$OUT/serve_bench.trace"
  fi
fi
if [[ $what == soak ]]; then
  [ -f .bundle/ray-cp312.tar.xz ] && use_bundle  # or the wheels of .whl, installed above
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
if [[ $what == probe2 ]]; then
  # GPU tests of everything merged, then the step at 2,048 with the depthwise upsample, admissions
  python -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/engine tests/models -x 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
  python bench/profile_mimi.py --batch 2048 --rows 12 2>&1 | tee "$OUT/profile_mimi.txt" | head -24
  python bench/frame_step.py --batches 1,64,2048 --steps 20 --fuse --codec 2>&1 | tee "$OUT/frame_step_codec.txt" | tail -6
  python bench/engine_bench.py --sweep 1,64,2048 --frames 60 --probes 8 2>&1 | tee "$OUT/engine_bench.txt" | tail -12
  python bench/admission.py --streams 2000 --rate 1000 --seconds 6 2>&1 | tee "$OUT/admission.txt" | tail -6
fi
if [[ $what == probe3 ]]; then
  python -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/engine tests/models 2>&1 | tee "$OUT/gpu_tests.txt" | tail -12
  python bench/profile_mimi.py --batch 2048 --rows 10 2>&1 | tee "$OUT/profile_mimi.txt" | sed -n 3,4p
  python bench/frame_step.py --batches 1,64,2048 --steps 20 --fuse --codec 2>&1 | tee "$OUT/frame_step_codec.txt" | tail -5
  python bench/admission.py --streams 2000 --rate 1000 --seconds 6 2>&1 | tee "$OUT/admission.txt" | tail -6
fi
if [[ $what == check ]]; then
  # after a change that must not change behaviour or speed (issue 17's tree): every GPU test, then the
  # engine benchmark at 1 and 2,048 streams, to set beside docs/benchmarks.md (one call, ~6 minutes)
  unpack_bundle > "$OUT/unpack.txt" 2>&1 &  # with .bundle carried: ready for the next call's soak or ray (CPU only)
  python -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/engine tests/models 2>&1 | tee "$OUT/gpu_tests.txt" | tail -12
  python bench/engine_bench.py --sweep 1,2048 --frames 60 --probes 8 --out "$OUT/engine_bench.md" 2>&1 | tee "$OUT/engine_bench.txt" | tail -12
  wait
fi
if [[ $what == layout ]]; then
  # Mimi's SEANet decoder channels-last (models/mimi_decoder.py) against the conv layout: GPU tests (graphs ==
  # eager with the new decoder in the frame step, speculation), the step at 2,048 profiled in both layouts,
  # precision, the frame step with Mimi in both (~7 minutes)
  unpack_bundle > "$OUT/unpack.txt" 2>&1 &
  python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels tests/engine tests/models} 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
  for lay in nct cl; do
    python bench/profile_mimi.py --batch 2048 --rows 14 --layout $lay 2>&1 | tee "$OUT/profile_mimi_$lay.txt" | head -22
  done
  python bench/mimi_precision.py --frames 100 --batch 8 --speed-batches 256,2048 2>&1 | tee "$OUT/mimi_precision.txt"
  for lay in nct cl; do
    echo "## CSMSERVE_MIMI_LAYOUT=$lay" | tee -a "$OUT/frame_step_codec.txt"
    CSMSERVE_MIMI_LAYOUT=$lay python bench/frame_step.py --batches 1,64,2048 --steps 20 --fuse --codec 2>&1 \
      | tee -a "$OUT/frame_step_codec.txt" | tail -5
  done
  wait
fi
if [[ $what == gemv ]]; then
  # issue 16's second lever: GEMMs of <= 8 rows by kernels/gemv.py (CSMSERVE_GEMV=1, the default) against cuBLAS
  # (CSMSERVE_GEMV=0): GPU tests (kernel == F.linear, graphs == eager with it), each GEMM of the frame step, the
  # frame step at batches 1-8 and 64, one stream through the engine, the batch-1 profile (~8 minutes)
  python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels tests/engine/test_runner_gpu.py \
    tests/engine/test_engine_gpu.py tests/models} 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
  python bench/gemv.py --rows ${GEMV_ROWS:-1,2} 2>&1 | tee "$OUT/gemv.txt"
  for g in 0 1; do
    echo "## CSMSERVE_GEMV=$g" | tee -a "$OUT/frame_step_codec.txt" "$OUT/engine_bench.txt"
    CSMSERVE_GEMV=$g python bench/frame_step.py --batches ${GEMV_BATCHES:-1,2,4,8,64} --steps 30 --fuse --codec 2>&1 \
      | tee -a "$OUT/frame_step_codec.txt" | tail -6
    CSMSERVE_GEMV=$g python bench/engine_bench.py --sweep 1 --frames 60 --probes 4 2>&1 | tee -a "$OUT/engine_bench.txt" | tail -6
  done
  python bench/profile_step.py --batches 1 --fuse --codec --rows ${PROFILE_ROWS:-16} 2>&1 | tee "$OUT/profile.txt" | head -40
fi
if [[ $what == sweep ]]; then
  # issue 16: the sampler's and the depth attention's warps per batch size on the H200 (bench/kernel_sweep.py ->
  # $OUT/tuning.json, CSMSERVE_KERNEL_TUNING's format; SWEEP_ARGS="" sweeps the GEMVs too, ~4 min more), every GPU
  # test with that file, then the frame step (batch 1, 2, 64, 256, 2,048) and one stream with no tuning and the
  # depth attention unfused (the rules before), then with both; then the profile at batch 1 (~8 min)
  python bench/kernel_sweep.py --out "$OUT/tuning.json" ${SWEEP_ARGS---no-gemv} 2>&1 | tee "$OUT/sweep.txt" || exit 1
  CSMSERVE_KERNEL_TUNING=$OUT/tuning.json python -m pytest -q -m gpu -p no:cacheprovider \
    ${GPU_TESTS:-tests/kernels tests/engine tests/models} 2>&1 | tee "$OUT/gpu_tests.txt" | tail -8
  for t in off "$OUT/tuning.json"; do
    f=$([[ $t == off ]] && echo 0 || echo 1)
    echo "## CSMSERVE_KERNEL_TUNING=$t CSMSERVE_DEPTH_FUSED=$f" | tee -a "$OUT/frame_step_codec.txt" "$OUT/engine_bench.txt"
    CSMSERVE_KERNEL_TUNING=$t CSMSERVE_DEPTH_FUSED=$f python bench/frame_step.py --batches 1,2,64,256,2048 --steps 30 \
      --fuse --codec 2>&1 | tee -a "$OUT/frame_step_codec.txt" | tail -7
    CSMSERVE_KERNEL_TUNING=$t CSMSERVE_DEPTH_FUSED=$f python bench/engine_bench.py --sweep 1 --frames 150 --probes 8 \
      2>&1 | tee -a "$OUT/engine_bench.txt" | grep -A3 "one stream"
  done
  CSMSERVE_KERNEL_TUNING=$OUT/tuning.json python bench/profile_step.py --batches 1 --fuse --codec --rows 24 2>&1 \
    | tee "$OUT/profile.txt" | sed -n '/kernels,/,$p' | cut -c1-60,150-230 | head -30
fi
if [[ $what == pdl ]]; then
  # issue 16: programmatic dependent launch for the frame step's Triton kernels (kernels/pdl.py): the kernels' and
  # the runner's GPU tests with it, then the frame step (batch 1, 2, 64, 256, 2,048) and one stream with
  # CSMSERVE_PDL=0 and =1, then the profile at batch 1 (~5 min)
  python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels tests/engine/test_runner_gpu.py} 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -6
  for f in 0 1; do
    echo "## CSMSERVE_PDL=$f" | tee -a "$OUT/frame_step_codec.txt" "$OUT/engine_bench.txt"
    CSMSERVE_PDL=$f python bench/frame_step.py --batches 1,2,64,256,2048 --steps 30 --fuse --codec 2>&1 \
      | tee -a "$OUT/frame_step_codec.txt" | tail -7
    CSMSERVE_PDL=$f python bench/engine_bench.py --sweep 1 --frames 150 --probes 8 2>&1 \
      | tee -a "$OUT/engine_bench.txt" | grep -A3 "one stream"
  done
  python bench/profile_step.py --batches 1 --fuse --codec --rows 12 2>&1 | tee "$OUT/profile.txt" \
    | sed -n '/kernels,/,$p' | cut -c1-60,150-230 | head -18
fi
if [[ $what == loop ]]; then
  # issue 16, lever 2: codebooks 2..K-1 at 1-2 rows in one persistent kernel (kernels/depth_loop.py; off by default
  # until measured, CSMSERVE_DEPTH_LOOP=1 on; the tests set it themselves): its GPU tests
  # and the refactored kernels' (each pytest under a time limit: a barrier bug must not take the call), then the
  # frame step at batch 1, 2, 64 and one stream off, on, and with each of its options (LOOP_VARIANTS)
  timeout ${LOOP_TEST_S:-300} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_depth_loop_gpu.py \
    tests/kernels/test_sampler_gpu.py tests/kernels/test_depth_attention_gpu.py tests/engine/test_runner_gpu.py} 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -15
  for v in ${LOOP_VARIANTS:-CSMSERVE_DEPTH_LOOP=0 CSMSERVE_DEPTH_LOOP=1 CSMSERVE_DEPTH_LOOP=1,CSMSERVE_DEPTH_LOOP_AHEAD=0 \
      CSMSERVE_DEPTH_LOOP=1,CSMSERVE_DEPTH_LOOP_PREFETCH=0}; do  # a variant: comma-separated settings
    echo "## $v" | tee -a "$OUT/frame_step_codec.txt"
    env ${v//,/ } timeout 120 python bench/frame_step.py --batches ${LOOP_BATCHES:-1,2,64} --steps 30 --fuse --codec 2>&1 \
      | tee -a "$OUT/frame_step_codec.txt" | tail -4
  done
  for v in ${LOOP_ENGINE:-CSMSERVE_DEPTH_LOOP=0 CSMSERVE_DEPTH_LOOP=1}; do  # one stream through the engine
    echo "## $v" | tee -a "$OUT/engine_bench.txt"
    env ${v//,/ } timeout 150 python bench/engine_bench.py --sweep 1 --frames 150 --probes 8 2>&1 \
      | tee -a "$OUT/engine_bench.txt" | tail -6
  done
fi
if [[ $what == passes ]]; then
  # issue 16: the sampler's radix select in 2 passes for bfloat16 logits (kernels/sampler.py) against 4
  # (CSMSERVE_SAMPLER_FULL_PASSES=1): the sampler's and depth loop's GPU tests, the sampler alone, then the frame
  # step (batch 1, 2, 64, 2,048) and one stream with each; PASSES_PARTS picks the parts (~8 min for all)
  parts=${PASSES_PARTS:-tests bench frame engine}
  knob=${PASSES_KNOB:-CSMSERVE_SAMPLER_FULL_PASSES}  # the setting compared, =1 then =0 (or CSMSERVE_DEPTH_ATTN_EARLY)
  if [[ $parts == *tests* ]]; then
    timeout ${PASSES_TEST_S:-240} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_sampler_gpu.py \
      tests/kernels/test_depth_loop_gpu.py} 2>&1 | tee "$OUT/gpu_tests.txt" | tail -6
  fi
  [[ $parts == *bench* ]] && timeout 120 python bench/sampler.py 2>&1 | tee "$OUT/sampler.txt"
  for f in 1 0; do
    if [[ $parts == *frame* ]]; then
      echo "## $knob=$f" | tee -a "$OUT/frame_step_codec.txt"
      env $knob=$f timeout 150 python bench/frame_step.py --batches ${PASSES_BATCHES:-1,2,64,2048} \
        --steps 30 --fuse --codec 2>&1 | tee -a "$OUT/frame_step_codec.txt" | tail -5
    fi
    if [[ $parts == *engine* ]]; then
      echo "## $knob=$f" | tee -a "$OUT/engine_bench.txt"
      env $knob=$f timeout 120 python bench/engine_bench.py --sweep 1 --frames 150 --probes 8 2>&1 \
        | tee -a "$OUT/engine_bench.txt" | grep -A3 "one stream"
    fi
  done
  if [[ $parts == *loop* ]]; then  # the persistent depth loop with its new defaults, against the plain path
    for v in CSMSERVE_DEPTH_LOOP=0 CSMSERVE_DEPTH_LOOP=1; do
      echo "## $v" | tee -a "$OUT/frame_step_loop.txt"
      env $v timeout 120 python bench/frame_step.py --batches 1,2 --steps 30 --fuse --codec 2>&1 \
        | tee -a "$OUT/frame_step_loop.txt" | tail -3
    done
  fi
fi
if [[ $what == fp8mm ]]; then  # weight-only FP8 GEMM at 3+ rows: its test, then each GEMM against bf16 and w8a8
  python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_mm_gpu.py 2>&1 | tee "$OUT/fp8_mm_tests.txt"
  python bench/fp8_mm.py ${FP8MM_ARGS:-} 2>&1 | tee "$OUT/fp8_mm.txt"
fi
if [[ $what == fp8gemv ]]; then
  # issue 16, lever 3: FP8 weights through our GEMV at 1-2 rows (weight-only, kernels/gemv.py with scales): its GPU
  # tests and FP8's (the frame graphs with FP8 weights == eager), each GEMM alone (bf16 / e4m3; FP8GEMV_ELEMS: the
  # chunk sizes tried, bench/gemv.py --elems), the frame step with Mimi and one stream per EngineConfig.weights, then the logits' error
  # (w8a8 and weight-only); FP8GEMV_PARTS picks the parts
  parts=${FP8GEMV_PARTS:-tests gemm frame engine error}
  if [[ $parts == *tests* ]]; then
    timeout ${FP8GEMV_TEST_S:-300} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_gemv_gpu.py \
      tests/models/test_fp8_gpu.py tests/engine/test_speculate_gpu.py -k "fp8 or FP8 or gemv or tuned or pdl"} 2>&1 \
      | tee "$OUT/gpu_tests.txt" | tail -6
  fi
  if [[ $parts == *gemm* ]]; then
    for e in ${FP8GEMV_ELEMS:-8192 16384}; do
      timeout 150 python bench/gemv.py --rows 1,2 --fp8 --elems $e 2>&1 | tee -a "$OUT/gemv_fp8.txt"
    done
  fi
  for w in ${FP8GEMV_WEIGHTS:-bf16 fp8 fp8-all}; do
    if [[ $parts == *frame* ]]; then
      echo "## --weights $w" | tee -a "$OUT/frame_step_codec.txt"
      timeout 150 python bench/frame_step.py --batches ${FP8GEMV_BATCHES:-1,2,64,2048} --steps 30 --fuse --codec \
        --weights $w 2>&1 | tee -a "$OUT/frame_step_codec.txt" | tail -5
    fi
    if [[ $parts == *engine* ]]; then
      echo "## --weights $w" | tee -a "$OUT/engine_bench.txt"
      timeout 120 python bench/engine_bench.py --sweep 1 --frames 150 --probes 8 --weights $w 2>&1 \
        | tee -a "$OUT/engine_bench.txt" | grep -A3 "one stream"
    fi
  done
  [[ $parts == *error* ]] && timeout 200 python bench/fp8_error.py --utterances 2 --frames 32 --batches "" 2>&1 \
    | tee "$OUT/fp8_error.txt" | tail -8
fi
if [[ $what == loopphase ]]; then
  # issue 16, lever 2: where the persistent depth loop's time goes (bench/depth_loop.py): its GPU tests, then us per
  # launch for each variant of its options at 1 and 2 rows, then per phase kind from in-kernel time stamps
  timeout ${LOOP_TEST_S:-240} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_depth_loop_gpu.py} \
    2>&1 | tee "$OUT/gpu_tests.txt" | tail -8
  P0=CSMSERVE_DEPTH_LOOP_PREFETCH=0
  timeout ${LOOP_BENCH_S:-420} python bench/depth_loop.py --rows ${LOOP_ROWS:-1,2} \
    --variants "${LOOP_VARIANTS:-default;$P0;$P0,CSMSERVE_DEPTH_LOOP_AHEAD=0;$P0,CSMSERVE_DEPTH_LOOP_ELEMS=8192;$P0,CSMSERVE_DEPTH_LOOP_POLL=atomic;$P0,CSMSERVE_DEPTH_LOOP_ELEMS=8192,warps=4,per_sm=2}" \
    --phases "${LOOP_PHASES:-default;$P0}" 2>&1 | tee "$OUT/depth_loop.txt"
fi
if [[ $what == depthfused ]]; then
  # issue 16, lever 2: the depth decoder's RoPE + K/V store + attention in one kernel (kernels/depth_attention.py,
  # CSMSERVE_DEPTH_FUSED=1) against the three kernels it replaces: its GPU tests, the runner's graphs == eager
  # with it on, then the frame step at batch 1, 2, 64, 2,048 and one stream through the engine, off then on (~6 min)
  python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_depth_attention_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -4
  CSMSERVE_DEPTH_FUSED=1 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_runner_gpu.py \
    tests/engine/test_speculate_gpu.py 2>&1 | tee -a "$OUT/gpu_tests.txt" | tail -4
  for f in 0 1; do
    echo "## CSMSERVE_DEPTH_FUSED=$f" | tee -a "$OUT/frame_step_codec.txt" "$OUT/engine_bench.txt"
    CSMSERVE_DEPTH_FUSED=$f python bench/frame_step.py --batches 1,2,64,2048 --steps 30 --fuse --codec 2>&1 \
      | tee -a "$OUT/frame_step_codec.txt" | tail -6
    CSMSERVE_DEPTH_FUSED=$f python bench/engine_bench.py --sweep 1 --frames 150 --probes 8 2>&1 \
      | tee -a "$OUT/engine_bench.txt" | grep -A3 "one stream"
  done
  CSMSERVE_DEPTH_FUSED=1 python bench/profile_step.py --batches 1 --fuse --codec --rows 16 2>&1 | tee "$OUT/profile.txt" | head -30
fi
if [[ $what == verify ]]; then
  # the session's last check: every GPU test, the frame step at batch 1, 2, 64 (our GEMV at 1-2 rows), the engine
  # at 1 and 2,048 streams (~6 minutes)
  unpack_bundle > "$OUT/unpack.txt" 2>&1 &
  python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels tests/engine tests/models} 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -15
  python bench/frame_step.py --batches 1,2,64 --steps 30 --fuse --codec 2>&1 | tee "$OUT/frame_step_codec.txt" | tail -5
  python bench/engine_bench.py --sweep 1,2048 --frames 60 --probes 8 --out "$OUT/engine_bench.md" 2>&1 \
    | tee "$OUT/engine_bench.txt" | tail -10
  wait
fi
if [[ $what == final ]]; then
  # Mimi's transposed convs: GEMM (default) or cuDNN's, whichever is faster here, then the load benchmark
  log="$OUT/final.log"
  gemm=$(python bench/profile_mimi.py --batch 2048 --rows 8 2>&1 | tee -a "$log" | sed -n 's/.*kernels, \([0-9.]*\) ms GPU time.*/\1/p')
  cudnn=$(CSMSERVE_MIMI_GEMM_MAX_T=0 python bench/profile_mimi.py --batch 2048 --rows 8 2>&1 | tee -a "$log" | sed -n 's/.*kernels, \([0-9.]*\) ms GPU time.*/\1/p')
  echo "Mimi decode step at 2048: GEMM transposed convs $gemm ms, cuDNN $cudnn ms" | tee -a "$log"
  if python -c "import sys; sys.exit(0 if float('$gemm') < float('$cudnn') else 1)"; then export CSMSERVE_MIMI_GEMM_MAX_T=512; else export CSMSERVE_MIMI_GEMM_MAX_T=0; fi
  echo "using CSMSERVE_MIMI_GEMM_MAX_T=$CSMSERVE_MIMI_GEMM_MAX_T" | tee -a "$log"
  python bench/frame_step.py --batches 1,64,2048 --steps 20 --fuse --codec 2>&1 | tee -a "$log" | tail -5
  SERVE_RAMP=${SERVE_RAMP:-8} SERVE_DURATION=${SERVE_DURATION:-15} SERVE_DRAIN=${SERVE_DRAIN:-20} bash scripts/gpu.sh serve
fi
if [[ $what == ray ]]; then
  # Ray Serve (docs/scale-out.md). The GPU image lacks Ray and the server's packages: carry .bundle/ (built here by
  # scripts/ray_bundle.sh: ray-cp312.tar.xz, av-cp312.tar.xz) and it is unpacked into $RAY_SITE (/tmp/site).
  SITE=${RAY_SITE:-/tmp/site}
  unpack_bundle
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
  # 1. what Ray adds to the first chunk, 1 user: the plain server and 1 replica, requests alternating; once per
  #    proxy transport (--proxy-transport: grpc, the default, against Ray's actor calls), one after the other
  if [[ $PARTS == *ttfa* ]]; then
    for transport in ${RAY_TTFA_TRANSPORTS:-grpc actor}; do
      python bench/ray_ttfa.py --model dummy --device cuda --max-slots 64 --max-seq-len 2048 --requests ${RAY_TTFA_REQUESTS:-200} \
        --cpus-per-replica 4 --proxy-transport $transport ${RAY_TTFA_ARGS:-} --out "$OUT/ray_ttfa_$transport.md" 2>&1 \
        | grep -v "^(\|INFO\|WARNING" | tee "$OUT/ray_ttfa_$transport.txt"
    done
  fi
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
      # the logs are too large to come back whole: their warnings and errors, counted, and the last lines
      log="$OUT/serve_$name.log"
      { grep -E "ERROR|WARNING|Error|Traceback" "$log" | sed -E 's/^[0-9-]+ [0-9:,]+ //; s/pid=[0-9]+/pid=N/g' |
          cut -c1-240 | sort | uniq -c | sort -rn | head -60; echo "-- last lines"; tail -40 "$log"; } \
        > "$OUT/serve_$name.problems.txt" 2>&1
      rm -f "$log"
    done
  fi
fi
if [[ $what == load ]]; then
  # issue 12's load benchmark through the real server at chosen settings (carry .bundle). This session's runs
  # (docs/benchmarks.md names them load, load2..load4: the modes of their commits) are these variables:
  #   LOAD_ENGINE=1   the engine benchmark first (one stream, 2,048)
  #   LOAD_SPEC=1     speculation's cost per k first (bench/spec_depth.py, issue 16)
  #   LOAD_ARGS       one `serve` flag for the first server, as --flag=value (e.g. --prefill-token-budget=4096);
  #                   LOAD_SCENARIOS its scenarios
  #   LOAD_ARGS2      a second server's flags (e.g. --chunk-frames=4), LOAD_SCENARIOS2 its set: the comparison
  #   LOAD_TRACE=1    the first server traces every request (--trace-requests): per scenario, where the time to
  #                   first audio went (bench/trace_report.py), printed after the table
  use_bundle
  [[ -n ${LOAD_ENGINE:-} ]] && python bench/engine_bench.py --sweep 1,2048 --frames 60 --probes 8 \
    --out "$OUT/engine_bench.md" 2>&1 | tee "$OUT/engine_bench.txt" | tail -8
  [[ -n ${LOAD_SPEC:-} ]] && timeout ${SPEC_TIMEOUT:-150} python bench/spec_depth.py \
    ${SPEC_ARGS:---ks 2,4,8 --batches 1,64,2048 --steps 10} 2>&1 | tee "$OUT/spec_depth.txt" | tail -20
  SERVE_ARGS=${LOAD_ARGS:+--server-args="$LOAD_ARGS"} SERVE_SCENARIOS=${LOAD_SCENARIOS:-"closed:users=2048
    closed:users=1024,format=mp3 closed:users=1024,format=opus ws:users=1024 burst:users=2048,within=3"} \
    SERVE_TRACE=${LOAD_TRACE:-} SERVE_RAMP=6 SERVE_DURATION=12 SERVE_DRAIN=15 bash scripts/gpu.sh serve \
    | grep -v "^(" | sed '/^### trace: /,$d' | tail -14
  [[ -n ${LOAD_TRACE:-} && -f "$OUT/serve_bench.trace.txt" ]] && cat "$OUT/serve_bench.trace.txt"
  if [[ -n ${LOAD_ARGS2:-} ]]; then
    mv "$OUT/serve_bench.txt" "$OUT/serve_bench_a.txt"
    SERVE_ARGS=--server-args="$LOAD_ARGS2" SERVE_SCENARIOS=${LOAD_SCENARIOS2:-"closed:users=2048"} SERVE_RAMP=6 \
      SERVE_DURATION=12 SERVE_DRAIN=15 OUT="$OUT/b" bash scripts/gpu.sh serve > /dev/null 2>&1
    [ -f "$OUT/b/serve_bench.txt" ] && grep -v "^(" "$OUT/b/serve_bench.txt" | tail -6 | tee "$OUT/serve_bench_b.txt"
    rm -rf "$OUT/b"
  fi
fi
if [[ $what == final3 ]]; then
  # one stream through the engine again (issue 17's check, a second sample), then Ray Serve against the plain
  # server at 256 and 1,024 users (issue 14; carry .bundle)
  python bench/engine_bench.py --sweep 1 --frames 60 --probes 8 --out "$OUT/engine_bench.md" 2>&1 | tee "$OUT/engine_bench.txt" | tail -8
  RAY_PARTS="ttfa load" RAY_TTFA_REQUESTS=${RAY_TTFA_REQUESTS:-150} RAY_SETUPS=${RAY_SETUPS:-"plain 1x1 2x0.5"} \
    RAY_MODEL_ARGS=${RAY_MODEL_ARGS:-"--model dummy --max-seq-len 512 --max-slots 1100"} \
    SERVE_BENCH_ARGS=${SERVE_BENCH_ARGS:-"--client-procs 4 --ramp 5 --warmup 2 --duration 10 --drain 10 --scenario closed:users=256 --scenario closed:users=1024 --out $OUT/ray_load"} \
    bash scripts/gpu.sh ray
fi
if [[ $what == final2 ]]; then
  # the load benchmark again with the new defaults (API workers, prefix cache), then Ray Serve (carry .bundle)
  use_bundle
  export RAY_USAGE_STATS_ENABLED=0
  SERVE_SCENARIOS="closed:users=256 closed:users=2048 closed:users=1024,format=mp3 closed:users=1024,format=opus ws:users=1024" \
    SERVE_RAMP=6 SERVE_DURATION=12 SERVE_DRAIN=15 bash scripts/gpu.sh serve
  RAY_PARTS="ttfa load" RAY_SETUPS="1x1 2x0.5" RAY_TTFA_REQUESTS=100 \
    SERVE_BENCH_ARGS="--client-procs 4 --ramp 6 --warmup 2 --duration 12 --drain 15 --scenario closed:users=256 --out $OUT/ray_load" \
    bash scripts/gpu.sh ray
fi
if [[ $what == codecstream ]]; then
  # issue 16: Mimi's decode on its own stream beside the next frame's generation (EngineConfig.codec_stream): its
  # GPU tests, then per CODECSTREAM_WEIGHTS the frame step with Mimi (CODECSTREAM_BATCHES) and one stream through the
  # engine, the one-graph step (--no-codec-stream) first; CODECSTREAM_PARTS picks the parts (~4 min for all);
  # CODECSTREAM_VARIANTS="stream" only the codec stream (e.g. beside CSMSERVE_CODEC_PRIORITY=0 for its priority)
  parts=${CODECSTREAM_PARTS:-tests frame engine}
  if [[ $parts == *tests* ]]; then
    timeout ${CODECSTREAM_TEST_S:-240} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/engine/test_codec_stream_gpu.py \
      tests/engine/test_runner_gpu.py} 2>&1 | tee "$OUT/codec_stream_tests.txt" | tail -15
  fi
  for w in ${CODECSTREAM_WEIGHTS:-bf16 fp8-all}; do
    for v in ${CODECSTREAM_VARIANTS:---no-codec-stream stream}; do  # "stream": the default, no flag
      flag=${v/#stream/}
      if [[ $parts == *frame* ]]; then
        echo "== frame step, weights $w ${flag:-(codec stream, priority ${CSMSERVE_CODEC_PRIORITY:--1})}" | tee -a "$OUT/codec_stream_frame.txt"
        python bench/frame_step.py --batches ${CODECSTREAM_BATCHES:-1,2,64,2048} --steps 30 --fuse --codec --weights $w $flag \
          2>&1 | tee -a "$OUT/codec_stream_frame.txt" | tail -6
      fi
      if [[ $parts == *engine* ]]; then
        echo "== one stream, weights $w ${flag:-(codec stream, priority ${CSMSERVE_CODEC_PRIORITY:--1})}" | tee -a "$OUT/codec_stream_engine.txt"
        python bench/engine_bench.py --sweep 1 --frames 150 --probes 8 --weights $w $flag 2>&1 \
          | tee -a "$OUT/codec_stream_engine.txt" | grep -A3 "one stream\|^device" | head -12
      fi
    done
  done
fi
ab_frame_engine() {  # TAG PARTS WEIGHTS VARIANT ENVS ARGS BATCHES: one variant's frame step and one stream, appended
  # to $OUT/TAG_frame.txt and $OUT/TAG_engine.txt (ENVS: environment for both; ARGS: engine-bench flags)
  local tag=$1 parts=$2 w=$3 v=$4 envs=$5 args=$6 batches=$7
  if [[ $parts == *frame* ]]; then
    echo "== frame step, weights $w, $v" | tee -a "$OUT/${tag}_frame.txt"
    env $envs python bench/frame_step.py --batches $batches --steps 30 --fuse --codec --weights $w \
      2>&1 | tee -a "$OUT/${tag}_frame.txt" | tail -6
  fi
  if [[ $parts == *engine* ]]; then
    echo "== one stream, weights $w, $v" | tee -a "$OUT/${tag}_engine.txt"
    env $envs python bench/engine_bench.py --sweep 1 --frames 150 --probes ${ENGINE_PROBES:-8} --weights $w $args 2>&1 \
      | tee -a "$OUT/${tag}_engine.txt" | grep -A3 "one stream\|^device" | head -12
  fi
}
ab_tuning_fp8() {  # TAG FILE: fp8-all's frame step at 1 / 2 rows and one stream, without a tuning file, then with FILE
  local t
  for t in unset "$2"; do
    ab_frame_engine "$1" "frame engine" fp8-all "$t" "$([[ $t == unset ]] || echo "CSMSERVE_KERNEL_TUNING=$t")" "" 1,2
  done
}
if [[ $what == edges ]]; then
  # issue 16: the depth step's edges (the embedding gathered in the projection's GEMV and the final norm in the head's:
  # CSMSERVE_GEMV_EDGES; the attention and the o projection in one kernel: CSMSERVE_DEPTH_ATTN_O; the sampler's
  # parameters and noise, the attention's static position before the PDL wait: CSMSERVE_SAMPLER_EARLY,
  # CSMSERVE_DEPTH_POS_EARLY). EDGES_PARTS: tests frame engine ttfa; EDGES_VARIANTS: off (all four 0), on (the
  # defaults), or one VAR=value; per EDGES_WEIGHTS the frame step with Mimi (EDGES_BATCHES) and one stream
  parts=${EDGES_PARTS:-tests frame engine}
  off="CSMSERVE_GEMV_EDGES=0 CSMSERVE_DEPTH_ATTN_O=0 CSMSERVE_SAMPLER_EARLY=0 CSMSERVE_DEPTH_POS_EARLY=0"
  if [[ $parts == *ttfa* ]]; then  # where an idle engine's first audio goes, per weights, with the defaults
    for w in ${EDGES_WEIGHTS:-bf16 fp8-all}; do
      python bench/ttfa_breakdown.py --prompts 12 --weights $w 2>&1 | tee -a "$OUT/edges_ttfa.txt" | tail -3
    done
  fi
  if [[ $parts == *tests* ]]; then
    timeout ${EDGES_TEST_S:-300} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_gemv_gpu.py \
      tests/kernels/test_depth_attention_gpu.py tests/kernels/test_sampler_gpu.py tests/engine/test_runner_gpu.py \
      tests/engine/test_codec_stream_gpu.py} 2>&1 | tee "$OUT/edges_tests.txt" | tail -15
  fi
  for w in ${EDGES_WEIGHTS:-bf16 fp8-all}; do
    for v in ${EDGES_VARIANTS:-off on}; do
      case $v in off) envs=$off;; on) envs="";; *) envs=$v;; esac
      ab_frame_engine edges "$parts" $w $v "$envs" "" ${EDGES_BATCHES:-1,2,64,2048}
    done
  done
fi
if [[ $what == graphprofile ]]; then  # where a graphed frame step's time goes (PDL overlap counted once per kernel)
  for w in ${GRAPHPROF_WEIGHTS:-bf16 fp8-all}; do
    timeout 200 python bench/graph_profile.py --batches ${GRAPHPROF_BATCHES:-1,4,16} --weights $w ${GRAPHPROF_ARGS:-} 2>&1 \
      | tee -a "$OUT/graph_profile.txt" | tail -30
  done
fi
if [[ $what == mma ]]; then
  # issue 16: GEMMs of 3-16 rows by kernels/gemv.py's tensor-core kernel (CSMSERVE_GEMV_MMA_ROWS=16), split over K
  # (CSMSERVE_GEMV_MMA_SPLIT=8: up to 8 splits), against cuBLAS / weight_only_mm (=2). MMA_PARTS: tests gemv frame
  # engine; MMA_VARIANTS: VAR=value sets for the frame step; MMA_GEMV_ARGS: e.g. --mma-sweep
  parts=${MMA_PARTS:-tests gemv frame engine}
  if [[ $parts == *tests* ]]; then
    timeout ${MMA_TEST_S:-300} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_gemv_gpu.py \
      tests/models/test_fp8_gpu.py tests/engine/test_runner_gpu.py} 2>&1 | tee "$OUT/mma_tests.txt" | tail -5
  fi
  if [[ $parts == *gemv* ]]; then
    timeout 200 python bench/gemv.py --rows ${MMA_ROWS:-4,16} --fp8 ${MMA_GEMV_ARGS:-} 2>&1 | tee "$OUT/mma_gemv.txt" | tail -25
  fi
  for w in ${MMA_WEIGHTS:-bf16 fp8-all}; do
    for v in ${MMA_VARIANTS:-CSMSERVE_GEMV_MMA_ROWS=16 CSMSERVE_GEMV_MMA_SPLIT=8 CSMSERVE_GEMV_MMA_ROWS=2}; do
      ab_frame_engine mma "$parts" $w $v "$v" "" ${MMA_BATCHES:-1,2,4,16,64}
    done
  done
fi
if [[ $what == qkvattn ]]; then
  # issue 16: a depth layer's add + RMSNorm + qkv GEMV and its attention in one kernel at 1-2 rows (kernels/qkv_attention.py;
  # CSMSERVE_DEPTH_QKV_ATTN=0: the two kernels). QKVATTN_PARTS: tests frame engine profile; QKVATTN_VARIANTS: 0 1
  parts=${QKVATTN_PARTS:-tests frame engine}
  if [[ $parts == *tests* ]]; then
    timeout ${QKVATTN_TEST_S:-300} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_qkv_attention_gpu.py \
      tests/kernels/test_gemv_gpu.py tests/kernels/test_depth_attention_gpu.py tests/engine/test_runner_gpu.py} 2>&1 \
      | tee "$OUT/qkvattn_tests.txt" | tail -8
  fi
  for w in ${QKVATTN_WEIGHTS:-bf16 fp8-all}; do
    for v in ${QKVATTN_VARIANTS:-0 1}; do
      ab_frame_engine qkvattn "$parts" $w $v "CSMSERVE_DEPTH_QKV_ATTN=$v" "" ${QKVATTN_BATCHES:-1,2,4,16,64}
    done
    if [[ $parts == *profile* ]]; then
      timeout 200 python bench/graph_profile.py --batches 1,2 --weights $w 2>&1 | tee -a "$OUT/qkvattn_profile.txt" | tail -22
    fi
  done
fi
if [[ $what == frameio ]]; then
  # issue 16: the frame step's prologue and epilogue in one kernel each (kernels/frame_io.py; CSMSERVE_FRAME_IO=0:
  # the torch ops), the depth decoder's first step (positions 0-1) in one kernel per layer (CSMSERVE_DEPTH_FIRST=0:
  # the torch path), the step after an idle engine's first frame launched once it is done (--no-first-frame-alone:
  # overlapped), and where an idle engine's first audio goes on one timeline (bench/ttfa_timeline.py).
  # FRAMEIO_PARTS: tests timeline ttfa frame engine; FRAMEIO_WEIGHTS; FRAMEIO_VARIANTS: off (all three off), on,
  # frameio0, first0, alone0
  parts=${FRAMEIO_PARTS:-tests timeline frame engine}
  if [[ $parts == *tests* ]]; then
    timeout ${FRAMEIO_TEST_S:-300} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_frame_io_gpu.py \
      tests/engine/test_runner_gpu.py tests/engine/test_codec_stream_gpu.py tests/engine/test_engine_gpu.py} 2>&1 \
      | tee "$OUT/frameio_tests.txt" | tail -15
  fi
  if [[ $parts == *timeline* ]]; then
    for w in ${FRAMEIO_WEIGHTS:-bf16 fp8-all}; do
      python bench/ttfa_timeline.py --weights $w --probes-traced 3 --trace-dir "$OUT/traces" 2>&1 \
        | tee -a "$OUT/frameio_timeline.txt" | tail -4
    done
  fi
  if [[ $parts == *ttfa* ]]; then
    for w in ${FRAMEIO_WEIGHTS:-bf16 fp8-all}; do
      python bench/ttfa_breakdown.py --prompts 12 --weights $w 2>&1 | tee -a "$OUT/frameio_ttfa.txt" | tail -3
    done
  fi
  for w in ${FRAMEIO_WEIGHTS:-bf16 fp8-all}; do
    for v in ${FRAMEIO_VARIANTS:-off on}; do
      envs=""; args=""
      case $v in
        off) envs="CSMSERVE_FRAME_IO=0 CSMSERVE_DEPTH_FIRST=0"; args="--no-first-frame-alone --no-first-frame-from-prefill";;
        prefill0) args="--no-first-frame-from-prefill";;
        frameio0) envs="CSMSERVE_FRAME_IO=0";; first0) envs="CSMSERVE_DEPTH_FIRST=0";; alone0) args="--no-first-frame-alone";;
      esac
      ab_frame_engine frameio "$parts" $w $v "$envs" "$args" ${FRAMEIO_BATCHES:-1,2,64,2048}
    done
  done
fi
if [[ $what == wide ]]; then
  # issue 16: the tensor-core kernel's 32- and 64-row tiles (CSMSERVE_GEMV_MMA_ROWS / _ROWS_FP8 up to 64; both 16 by
  # default) and the e4m3 weights' own launch table at 1-2 rows (bench/kernel_sweep.py --fp8). Two calls of ~8 min:
  # WIDE_PARTS="gemv frame tests" (per GEMM at 32 / 64 rows against cuBLAS and FP8Linear's own GEMM; the frame step at
  # 16 / 32 / 64 rows with the tiles off and on; the tests at 64 rows), then WIDE_PARTS=sweep (the e4m3 table ->
  # $OUT/tuning_fp8.json, every gemv test with it, fp8-all's frame step at 1 / 2 rows and one stream without and with)
  parts=${WIDE_PARTS:-gemv frame tests}
  if [[ $parts == *gemv* ]]; then
    timeout 240 python bench/gemv.py --rows ${WIDE_ROWS:-32,64} --fp8 --mma-rows 64 ${WIDE_GEMV_ARGS:-} 2>&1 \
      | tee "$OUT/wide_gemv.txt" | tail -25
  fi
  if [[ $parts == *frame* ]]; then
    for wv in "bf16 rows16 CSMSERVE_GEMV_MMA_ROWS=16" "bf16 rows64 CSMSERVE_GEMV_MMA_ROWS=64" \
              "fp8-all rows16 CSMSERVE_GEMV_MMA_ROWS_FP8=16" "fp8-all rows64 CSMSERVE_GEMV_MMA_ROWS_FP8=64" \
              "fp8-all both64 CSMSERVE_GEMV_MMA_ROWS=64 CSMSERVE_GEMV_MMA_ROWS_FP8=64"; do
      read -r w v envs <<< "$wv"
      ab_frame_engine wide frame $w $v "$envs" "" ${WIDE_BATCHES:-16,32,64}
    done
  fi
  if [[ $parts == *tests* ]]; then
    CSMSERVE_GEMV_MMA_ROWS=64 CSMSERVE_GEMV_MMA_ROWS_FP8=64 timeout ${WIDE_TEST_S:-200} python -m pytest -q -m gpu \
      -p no:cacheprovider ${GPU_TESTS:-tests/kernels/test_gemv_gpu.py tests/kernels/test_tuning.py \
      tests/models/test_fp8_gpu.py tests/engine/test_runner_gpu.py} 2>&1 | tee "$OUT/wide_tests.txt" | tail -8
  fi
  if [[ $parts == *sweep* ]]; then
    timeout 300 python bench/kernel_sweep.py --out "$OUT/tuning_fp8.json" --fp8 --no-gemv --only-gemv \
      --budget-s ${WIDE_SWEEP_S:-8} ${WIDE_SWEEP_ARGS:-} 2>&1 | tee "$OUT/wide_sweep.txt" | tail -20 || exit 1
    CSMSERVE_KERNEL_TUNING=$OUT/tuning_fp8.json timeout 120 python -m pytest -q -m gpu -p no:cacheprovider \
      tests/kernels/test_gemv_gpu.py -k "tuned or fp8" 2>&1 | tee "$OUT/wide_sweep_tests.txt" | tail -4
    ab_tuning_fp8 wide_sweep "$OUT/tuning_fp8.json"
  fi
fi
if [[ $what == dense ]]; then
  # issue 16: FP8Linear's bf16 copy of its dequantized weight from 17 to CSMSERVE_FP8_DENSE_ROWS rows (models/fp8.py),
  # and the e4m3 launch table at 1-2 rows (DENSE_TUNING: a bench/kernel_sweep.py --fp8 JSON). DENSE_PARTS: tests
  # buckets tuning; buckets: the frame step with Mimi per batch, bf16 then fp8-all with the copy (512) and without (0)
  parts=${DENSE_PARTS:-tests buckets tuning}
  if [[ $parts == *tests* ]]; then
    timeout ${DENSE_TEST_S:-120} python -m pytest -q -m gpu -p no:cacheprovider -rf --tb=line tests/models/test_fp8_gpu.py \
      "tests/engine/test_speculate_gpu.py::test_fp8_frame_graphs_equal_eager" 2>&1 | tee "$OUT/dense_tests.txt" | tail -8
    timeout 60 python -m pytest -q -m gpu -p no:cacheprovider -rf --tb=line tests/kernels/test_gemv_gpu.py \
      -k "stages or split_over_k" 2>&1 | tee -a "$OUT/dense_tests.txt" | tail -4
  fi
  if [[ $parts == *buckets* ]]; then
    for wv in "bf16 512" "fp8-all 512" "fp8-all 0"; do
      read -r w d <<< "$wv"
      ab_frame_engine dense frame $w "dense=$d" "CSMSERVE_FP8_DENSE_ROWS=$d" "" ${DENSE_BATCHES:-1,2,16,24,64,256,512,1024,2048}
    done
  fi
  if [[ $parts == *tuning* && -n ${DENSE_TUNING:-} ]]; then
    ab_tuning_fp8 dense_tuning "$DENSE_TUNING"
  fi
fi
if [[ $what == l2 ]]; then
  # issue 16: the depth weights' first CSMSERVE_L2_RESIDENT_MB kept in L2 across depth steps (engine/residency.py).
  # L2_PARTS: tests frame engine sweep; L2_VARIANTS: the window sizes (0: off); per L2_WEIGHTS the frame step with
  # Mimi at L2_BATCHES and one stream; sweep: batch 1 / 2 at more sizes (L2_SWEEP)
  parts=${L2_PARTS:-tests frame engine}
  python - <<'PY' 2>&1 | tee "$OUT/l2_device.txt"
import torch
from csmserve.engine.residency import _ATTR_MAX_PERSISTING_L2, _ATTR_MAX_WINDOW, device_attribute
d = torch.device("cuda")
print(torch.cuda.get_device_name(), "L2", torch.cuda.get_device_properties(d).L2_cache_size / 2**20, "MB;",
      "max persisting", device_attribute(_ATTR_MAX_PERSISTING_L2, d) / 2**20, "MB; max window",
      device_attribute(_ATTR_MAX_WINDOW, d) / 2**20, "MB")
PY
  if [[ $parts == *tests* ]]; then
    timeout ${L2_TEST_S:-150} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/engine/test_residency_gpu.py} \
      2>&1 | tee "$OUT/l2_tests.txt" | tail -6
  fi
  for w in ${L2_WEIGHTS:-bf16 fp8-all}; do
    for v in ${L2_VARIANTS:-0 max}; do
      ab_frame_engine l2 "$parts" $w "L2=$v" "CSMSERVE_L2_RESIDENT_MB=$v" "" ${L2_BATCHES:-1,2,16,64,2048}
    done
  done
  if [[ $parts == *sweep* ]]; then
    for w in ${L2_WEIGHTS:-bf16 fp8-all}; do
      for v in ${L2_SWEEP:-0 8 16 24 32 max 0}; do
        ab_frame_engine l2_sweep frame $w "L2=$v" "CSMSERVE_L2_RESIDENT_MB=$v" "" 1,2
      done
    done
  fi
fi
