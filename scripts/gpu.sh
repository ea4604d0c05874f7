#!/usr/bin/env bash
# GPU tests and benchmarks: bash scripts/gpu.sh MODE [MODE ...] runs the modes in order on a CUDA machine, the GPU and
# commit in $OUT/gpu.txt, every output under $OUT (default .out/). docs/benchmarks.md: the numbers each mode made.
#   tests      the gpu-marked tests (GPU_TESTS: folders or files)
#   frame      the frame step alone, graph replay with Mimi, ms per batch (FRAME_BATCHES, FRAME_ARGS)
#   engine     the engine: one stream's frames/s and idle TTFA, then N streams (ENGINE_ARGS; --hf: transformers)
#   admission  arrivals/s admitted into 2,000 running streams, their wait to a first frame (ADMISSION_ARGS)
#   mimi       Mimi's streaming step per batch against transformers' decode; bf16 against float32
#   prefix     TTFA with a voice / conversation prefix, cached and uncached (PREFIX_ARGS)
#   ttfa       where an idle engine's first audio goes (TTFA_PROMPTS)
#   fp8        FP8 weights' logits against bf16's, and the frame step per weights (FP8_ARGS)
#   kernels    each GEMM of the frame step alone against cuBLAS; the sampler alone (GEMV_ARGS, SAMPLER_ARGS)
#   profile    a graphed frame step's GPU time per kernel (PROFILE_BATCHES, PROFILE_ARGS); Mimi's step at 2,048
#   sweep      this GPU's kernel launch tables -> $OUT/tuning.json, its kernel tests, frame step and one stream with it
#   serve      load through the real server (SERVE_SCENARIOS, SERVE_ARGS, SERVE_* below; carry .whl or .bundle)
#   soak       the soak: 1,000 users for 8 minutes, errors, crashes, slots, memory (SOAK_*; carry .whl or .bundle)
#   ray        Ray Serve against the plain server: TTFA added at 1 user, then load (RAY_*; carry .bundle)
#   scaleout   issue 40: plain against --ray (1 replica; 2 half-GPU replicas, under MPS: --mps auto) at 2,048 pcm,
#              1,024 mp3, 1,024 WS, bursts (SCALEOUT_SETUPS: plain 1x1 2x0.5; RAY_SERVE_ARGS="--mps off": without)
#   ab         before/after: frame step at 1, 64, 2,048 and engine at 1, 2,048 streams, ab_old/ against this tree
#   lora       LoRA adapters' cost per step and one stream (bench/lora.py), then through the server (LORA_PARTS)
# WEIGHTS="bf16 fp8-all" runs frame, engine, ttfa and profile once per weights (default bf16).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD OUT=${OUT:-.out} WEIGHTS=${WEIGHTS:-bf16}
mkdir -p "$OUT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ $# -eq 0 ]; then sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; fi
if compgen -G ".whl/*.whl" > /dev/null; then  # the server's wheels (scripts/gpu_wheels.sh; carry .whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
unpack_bundle() {  # the server's and Ray's packages from .bundle/ (scripts/ray_bundle.sh; carry .bundle) -> $RAY_SITE
  local site=${RAY_SITE:-/tmp/site} a
  if [ ! -f "$site/.unpacked" ] && [ -f .bundle/ray-cp312.tar.xz ]; then
    mkdir -p "$site"
    for a in .bundle/ray-cp312.tar.xz .bundle/av-cp312.tar.xz; do [ -f "$a" ] && tar -C "$site" -xJf "$a"; done
    touch "$site/.unpacked"
  fi
}
use_bundle() { unpack_bundle; [ -f "${RAY_SITE:-/tmp/site}/.unpacked" ] && export PYTHONPATH=$PYTHONPATH:${RAY_SITE:-/tmp/site}; }

m_tests() {  # the gpu-marked tests (the GPU image has no server packages: those tests live in these folders); one
  # line per test in $OUT/gpu_tests.txt as it ends, so a call cut by its time limit still says what passed
  python -m pytest -v -m gpu -p no:cacheprovider --durations=15 ${GPU_TESTS:-tests/kernels tests/engine tests/models} \
    2>&1 | tee "$OUT/gpu_tests.txt" | grep -vE " PASSED | SKIPPED |^$" | tail -60
}
m_frame() {  # the frame step alone: one CUDA graph with Mimi's decode on its stream, ms per step, per batch and weights
  local w
  for w in $WEIGHTS; do
    echo "== weights $w" | tee -a "$OUT/frame_step.txt"
    python bench/frame_step.py --batches ${FRAME_BATCHES:-1,2,16,64,2048} --steps 30 --fuse --codec --weights $w \
      ${FRAME_ARGS:-} 2>&1 | tee -a "$OUT/frame_step.txt"
  done
}
m_engine() {  # the engine: one stream (frames/s, idle TTFA), then the sweep (aggregate frames/s, TTFA of arrivals)
  local w
  for w in $WEIGHTS; do
    python bench/engine_bench.py ${ENGINE_ARGS:---sweep 1,2048 --frames 60 --probes 8} --weights $w \
      --out "$OUT/engine_bench_$w.md" 2>&1 | tee -a "$OUT/engine_bench.txt"
  done
}
m_admission() {  # admission at scale: arrivals/s admitted into running streams, the step with them against without
  python bench/admission.py ${ADMISSION_ARGS:---streams 2000 --rate 1000 --seconds 6} 2>&1 | tee "$OUT/admission.txt"
}
m_mimi() {  # Mimi's streaming step per batch (eager, graphed) against transformers' whole decode; bf16 against float32
  python bench/mimi_decode.py --device cuda --batches ${MIMI_BATCHES:-1,8,64,256} --dtype bfloat16 2>&1 \
    | tee "$OUT/mimi_decode.txt"
  python bench/mimi_decode.py --device cuda --batches 256,2048 --dtype float32 2>&1 | tee -a "$OUT/mimi_decode.txt"
  python bench/mimi_precision.py --frames 100 --batch 8 2>&1 | tee "$OUT/mimi_precision.txt"
}
m_prefix() {  # TTFA with a 10 s voice / 60 s conversation prefix, cached and uncached, idle and under load
  python bench/prefix_ttfa.py ${PREFIX_ARGS:---load 0,64} --out "$OUT/prefix_ttfa.md" 2>&1 | tee "$OUT/prefix_ttfa.txt"
}
m_ttfa() {  # where an idle engine's first audio goes: admission, prefill, first frame step, each to device completion
  local w
  for w in $WEIGHTS; do
    python bench/ttfa_breakdown.py --prompts ${TTFA_PROMPTS:-12,166} --weights $w 2>&1 | tee -a "$OUT/ttfa_breakdown.txt"
  done
}
m_fp8() {  # FP8 weights: top-1 agreement and KL of every codebook's logits against bf16, then the frame step per weights
  python bench/fp8_error.py ${FP8_ARGS:-} 2>&1 | tee "$OUT/fp8_error.txt"
  WEIGHTS="bf16 fp8 fp8-all" FRAME_BATCHES=${FRAME_BATCHES:-1,2,64,2048} m_frame
}
m_kernels() {  # each GEMM of the frame step alone (ours against cuBLAS, bf16 and e4m3), then the sampler alone
  python bench/gemv.py ${GEMV_ARGS:---rows 1,2,4,16 --fp8} 2>&1 | tee "$OUT/gemv.txt"
  python bench/sampler.py ${SAMPLER_ARGS:-} 2>&1 | tee "$OUT/sampler.txt"
}
m_profile() {  # where a graphed frame step's time goes per kernel (PDL waits counted once); Mimi's step at 2,048
  local w
  for w in $WEIGHTS; do
    python bench/graph_profile.py --batches ${PROFILE_BATCHES:-1,4,16} --weights $w ${PROFILE_ARGS:-} 2>&1 \
      | tee -a "$OUT/graph_profile.txt" | tail -30
  done
  python bench/profile_mimi.py --batch 2048 --rows 14 2>&1 | tee "$OUT/profile_mimi.txt" | head -24
}
m_sweep() {  # this GPU's launch tables (SWEEP_ARGS: bench/kernel_sweep.py's; default the sampler and attention only)
  local t envs
  python bench/kernel_sweep.py --out "$OUT/tuning.json" ${SWEEP_ARGS---no-gemv} 2>&1 | tee "$OUT/sweep.txt" || return 1
  CSMSERVE_KERNEL_TUNING=$OUT/tuning.json python -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 \
    | tee "$OUT/sweep_tests.txt" | tail -8
  for t in unset "$OUT/tuning.json"; do  # the frame step and one stream without the file (kernels/tuning.py's), then with
    echo "== CSMSERVE_KERNEL_TUNING $t" | tee -a "$OUT/sweep_frame.txt" "$OUT/sweep_engine.txt"
    envs=(-u CSMSERVE_KERNEL_TUNING); [[ $t == unset ]] || envs=("CSMSERVE_KERNEL_TUNING=$t")
    env "${envs[@]}" python bench/frame_step.py --batches 1,2,64,2048 --steps 30 --fuse --codec --weights "${WEIGHTS%% *}" \
      2>&1 | tee -a "$OUT/sweep_frame.txt" | tail -6
    env "${envs[@]}" python bench/engine_bench.py --sweep 1 --frames 150 --probes 8 --weights "${WEIGHTS%% *}" 2>&1 \
      | tee -a "$OUT/sweep_engine.txt" | grep -A3 "one stream"
  done
}
m_serve() {  # load through the real server: one start, then each scenario (bench/serve_bench.py; carry .whl or .bundle)
  # SERVE_SCENARIOS replaces issue 12's set, SERVE_ARGS adds flags (--server-args="--flag=value" for the server's);
  # SERVE_TRACE=1: the server traces every request (--trace-requests), each scenario's trace_report table in
  # $OUT/serve_bench.trace.txt, the raw files as $OUT/serve_bench.trace.tgz
  [ -f .bundle/ray-cp312.tar.xz ] && use_bundle
  local s args=() scenarios=${SERVE_SCENARIOS:-"closed:users=1,audio_ms=2000,ramp=0,warmup=1,duration=10,label=idle_1_pcm_2s
    closed:users=256 closed:users=2048 closed:users=1024,format=mp3 closed:users=1024,format=opus
    ws:users=1024 burst:users=2048,within=3"}
  for s in $scenarios; do args+=(--scenario "$s"); done
  python bench/serve_bench.py --model dummy --max-seq-len 512 --max-slots ${SERVE_SLOTS:-2100} \
    --client-procs ${SERVE_PROCS:-8} --ramp ${SERVE_RAMP:-10} --warmup ${SERVE_WARMUP:-2} \
    --duration ${SERVE_DURATION:-20} --drain ${SERVE_DRAIN:-30} "${args[@]}" \
    --out "$OUT/serve_bench" ${SERVE_TRACE:+--trace} ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve_bench.txt"
  if [[ -n ${SERVE_TRACE:-} && -d "$OUT/serve_bench.trace" ]]; then
    tar -C "$OUT" -czf "$OUT/serve_bench.trace.tgz" serve_bench.trace && rm -rf "$OUT/serve_bench.trace"
  fi
}
m_soak() {  # the soak (docs/reliability.md): 1,000 users for 480 s, disconnects, hostile requests, voice churn,
  # conversations; start + 480 s + checks fit one 10-minute device call. SOAK_DURATION, SOAK_USERS, SOAK_ARGS
  [ -f .bundle/ray-cp312.tar.xz ] && use_bundle
  python bench/soak.py --model dummy --max-seq-len 512 --users ${SOAK_USERS:-1000} --max-slots ${SOAK_SLOTS:-2100} \
    --client-procs ${SOAK_PROCS:-4} --duration ${SOAK_DURATION:-480} --out "$OUT/soak" ${SOAK_ARGS:-} 2>&1 \
    | tee "$OUT/soak.txt"
}
stop_server() {  # SIGTERM, 90 s, then SIGKILL and `ray stop`: no replica left on the GPU for the next setup
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 90); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -KILL "$1" 2>/dev/null
  wait "$1" 2>/dev/null
  python -c "import sys, ray.scripts.scripts as s; sys.argv = ['ray', 'stop', '--force']; s.main()" >/dev/null 2>&1 || true
}
m_ray() {  # Ray Serve (docs/scale-out.md) against the plain server; the bundle unpacked into $RAY_SITE (/tmp/site).
  # RAY_PARTS: ttfa (what Ray adds to the first chunk at 1 user, bench/ray_ttfa.py) and load (SERVE_BENCH_CMD + SERVE_BENCH_ARGS against each RAY_SETUPS:
  # plain, or replicas x GPU share; one server at a time on port 8100). One device call is 10 minutes at most.
  local setup name n share want pid log
  unpack_bundle
  export PYTHONPATH=$ROOT:${RAY_SITE:-/tmp/site} RAY_USAGE_STATS_ENABLED=0
  python -c "import ray, fastapi, uvicorn, av; print('ray', ray.__version__, 'fastapi', fastapi.__version__)" \
    2>&1 | tee "$OUT/ray_env.txt"
  if [[ ${RAY_PARTS:-ttfa load} == *ttfa* ]]; then  # the plain server and one replica, requests alternating
    python bench/ray_ttfa.py --model dummy --device cuda --max-slots 64 --max-seq-len 512 \
      --requests ${RAY_TTFA_REQUESTS:-200} ${RAY_TTFA_ARGS:-} --out "$OUT/ray_ttfa.md" 2>&1 \
      | grep -v "^(\|INFO\|WARNING" | tee "$OUT/ray_ttfa.txt"
  fi
  [[ ${RAY_PARTS:-ttfa load} == *load* ]] || return 0
  for setup in ${RAY_SETUPS:-plain 1x1 2x0.5}; do
    if [[ $setup == plain ]]; then
      name=plain want=0
      python -m csmserve serve ${RAY_MODEL_ARGS:---model dummy} --port 8100 > "$OUT/serve_$name.log" 2>&1 &
    else
      n=${setup%%x*} share=${setup#*x} name="ray_$setup" want=${setup%%x*}
      python -m csmserve serve --ray ${RAY_MODEL_ARGS:---model dummy} --port 8100 --num-replicas "$n" \
        --gpus-per-replica "$share" --cpus-per-replica 4 ${RAY_SERVE_ARGS:-} > "$OUT/serve_$name.log" 2>&1 &
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
    ${SERVE_BENCH_CMD:-python bench/serve_bench.py --url http://127.0.0.1:8100} ${SERVE_BENCH_ARGS:-} 2>&1 \
      | tee -a "$OUT/ray_bench.txt"
    stop_server $pid
    grep -h "NVIDIA MPS" "$OUT/serve_$name.log" | cut -c1-200 | tee -a "$OUT/ray_bench.txt"
    log="$OUT/serve_$name.log"  # too large to come back whole: its warnings and errors, counted, and the last lines
    { grep -E "ERROR|WARNING|Error|Traceback" "$log" | sed -E 's/^[0-9-]+ [0-9:,]+ //; s/pid=[0-9]+/pid=N/g' |
        cut -c1-240 | sort | uniq -c | sort -rn | head -60; echo "-- last lines"; tail -40 "$log"; } \
      > "$OUT/serve_$name.problems.txt" 2>&1
    rm -f "$log"
  done
}
m_scaleout() {  # issue 40's acceptance in one call: plain, then --ray with 1 replica, then 2 half-GPU replicas, each
  # under its own time limit (a part cut short still leaves the others); SCALEOUT_ARGS: the clients' pacing
  local c=${SCALEOUT_ARGS:-"--client-procs 6 --ramp 4 --warmup 1 --duration 8 --drain 12"}
  local idle=${SCALEOUT_IDLE-"--scenario closed:users=1,audio_ms=2000,ramp=0,warmup=1,duration=6,label=idle_1_pcm_2s"}
  local u=${SCALEOUT_USERS:-2048} setup limit args part
  local load=${SCALEOUT_LOAD:-"--scenario closed:users=$u --scenario closed:users=$((u / 2)),format=mp3 --scenario ws:users=$((u / 2))"}
  local burst=${SCALEOUT_BURST-"--scenario burst:users=$u,within=3"} limits=(${SCALEOUT_LIMITS:-160 210 170})
  use_bundle; ulimit -n 65536 2>/dev/null || true
  export RAY_PARTS=load RAY_MODEL_ARGS=${RAY_MODEL_ARGS:-"--model dummy --max-seq-len 512"}
  # 2 half-GPU replicas: SCALEOUT_HALF's scenarios (all: the load); SCALEOUT_IDLE= / SCALEOUT_BURST= leave those out
  local half=${SCALEOUT_HALF:-"--scenario closed:users=$u $burst"}
  [[ $half == all ]] && half=$load
  for part in "plain ${limits[0]} $idle $load" "1x1 ${limits[1]} $idle $load $burst" "2x0.5 ${limits[2]} $half"; do
    read -r setup limit args <<< "$part"
    [[ " ${SCALEOUT_SETUPS:-plain 1x1 2x0.5} " == *" $setup "* ]] || continue
    RAY_SETUPS=$setup SERVE_BENCH_ARGS="$c $args --out $OUT/scaleout_$setup" timeout "$limit" bash "$0" ray
    pkill -f "csmserve serve" 2>/dev/null; sleep 2
    python -c "import sys, ray.scripts.scripts as s; sys.argv = ['ray', 'stop', '--force']; s.main()" >/dev/null 2>&1
    for pipe in /tmp/csmserve-mps-*/pipe; do  # a part cut short by its limit: its server's MPS daemon too
      [ -d "$pipe" ] && echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 30 nvidia-cuda-mps-control
    done
  done
  grep -E "^== |^\| " "$OUT/ray_bench.txt" > "$OUT/scaleout_summary.txt"; cat "$OUT/scaleout_summary.txt"
}
m_ab() {  # before/after in one call (issue 41's check): the old tree in ab_old/, untracked, made with
  # `git archive <commit> --prefix=ab_old/ csmserve bench pyproject.toml | tar -x && git rev-parse --short <commit>
  # > ab_old/COMMIT`, against this tree, alternating old/new AB_PAIRS times (2: the second pair gives the spread);
  # each tree's own bench scripts; $OUT/ab_frame.txt, $OUT/ab_engine.txt, the rows side by side in $OUT/ab_summary.txt
  [ -d ab_old/csmserve ] || { echo "ab: no ab_old/ (see scripts/gpu.sh's ab)"; return 1; }
  local i tree label part
  for i in $(seq ${AB_PAIRS:-2}); do
    for tree in ab_old .; do
      label=$([[ $tree == . ]] && echo "new $(git rev-parse --short HEAD 2>/dev/null)" || echo "old $(cat ab_old/COMMIT 2>/dev/null)")
      echo "== $label, pair $i" | tee -a "$OUT/ab_frame.txt" "$OUT/ab_engine.txt"
      PYTHONPATH=$ROOT/$tree:$PYTHONPATH timeout ${AB_TIMEOUT_S:-240} python $tree/bench/frame_step.py \
        ${AB_FRAME_ARGS:---batches 1,64,2048 --steps 30 --fuse --codec} 2>&1 | tee -a "$OUT/ab_frame.txt" | grep "^| [0-9]"
      PYTHONPATH=$ROOT/$tree:$PYTHONPATH timeout ${AB_TIMEOUT_S:-240} python $tree/bench/engine_bench.py \
        ${AB_ENGINE_ARGS:---sweep 1,2048 --frames 60 --probes 8} 2>&1 | tee -a "$OUT/ab_engine.txt" | grep "^| "
    done
  done
  for part in frame engine; do
    echo "## $part"; grep -E '^== |^\| (1|64|2048|csmserve) \|' "$OUT/ab_$part.txt"
  done > "$OUT/ab_summary.txt"
  cat "$OUT/ab_summary.txt"
}
m_lora() {  # LoRA adapters (issue 42): LORA_PARTS "step" (bench/lora.py: the frame step and one stream with 0, 1, 8, 64
  # rank-16 / rank-64 adapters at 1, 64, 2,048 rows, the base in the same run) and "serve" (through the server: 1,024
  # users of the base, then spread over 64 random rank-16 adapters, pcm and WebSocket, one server start)
  if [[ ${LORA_PARTS:-step serve} == *step* ]]; then
    timeout ${LORA_STEP_S:-300} python bench/lora.py ${LORA_ARGS:---batches 1,64,2048 --adapters 0,1,8,64 --ranks 16,64} \
      2>&1 | tee "$OUT/lora.txt"
  fi
  if [[ ${LORA_PARTS:-step serve} == *serve* ]]; then
    SERVE_SLOTS=${SERVE_SLOTS:-1100} SERVE_SCENARIOS=${LORA_SCENARIOS:-"closed:users=1024,label=base_1024
      closed:users=1024,adapters=64,label=lora64_1024 ws:users=1024,adapters=64,label=lora64_ws"} m_serve
  fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee -a "$OUT/gpu.txt"
rc=0
for what in "$@"; do
  if declare -F "m_$what" > /dev/null; then "m_$what" || rc=1
  else echo "gpu.sh: no mode '$what' (bash scripts/gpu.sh lists them)"; rc=2; fi
done
exit $rc
