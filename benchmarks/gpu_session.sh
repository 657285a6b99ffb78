#!/usr/bin/env bash
# One device call (<= 10 min) for what the open issues still need measured; each stage has its
# own time cap, and what a stage measured survives a later one's failure. STAGES picks the
# stages and their order:
#   gpu_tests      pytest -m gpu: every compiled kernel against its XLA reference (GPU_TESTS_K: a -k expression)
#   kernels        benchmarks/bench_kernels.py: the kernel registry, compiled on threads, checked then timed
#                  (KERNEL_REGIMES, KERNEL_MATCH, KERNEL_COMPILE_WORKERS: 8; 1 compiles each case in its run)
#   rollout_scale  benchmarks/bench_rollout.py: decode steps through the engine vs their byte limit (ROLLOUT_SCALE_ARGS;
#                  recipes may set KernelConfig fields, e.g. quads@command_buffers=kernels, to compare in one process)
#   train          benchmarks/bench_train.py: the train step per config (TRAIN_ARGS)
#   ncu            Nsight Compute's sections (speed of light, occupancy, warp states, scheduler, memory) for
#                  the first NCU_COUNT launches of the kernels named by NCU_KERNEL (a regex), run inside the
#                  kernel registry (NCU_REGIMES, NCU_MATCH): what bounds a kernel, where no timing says it
# The device returns only a few files: each stage's log and outputs are appended to one tar,
# $OUT/results.tar (extract with tar -xf), and removed.
# Usage (device, from the repo root, with .whl carried: scripts/gpu_wheels.sh fills it here):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; OUT=... bash benchmarks/gpu_session.sh
set -uo pipefail
o="${OUT:-runs/gpu}"
mkdir -p "$o"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} TRITON_HOME=/tmp/triton_home TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_HOME" "$TRITON_CACHE_DIR"
STAGES="${STAGES:-gpu_tests kernels rollout_scale train}"
DEADLINE="${DEADLINE:-575}"  # seconds from the start: no stage runs past it, so every log gets saved
stage() {
  local cap=$1 name=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  (( left < 20 )) && { echo "== $name skipped (${left}s left)"; return 0; }
  (( cap > left )) && cap=$left
  echo "== $name (cap ${cap}s)"
  timeout "$cap" "$@" > "$o/$name.log" 2>&1; echo "   rc=$?"
  grep -v -E "Warning|warn|^W[0-9]" "$o/$name.log" | grep -E '^\||^\{|rc=|Error|passed|failed' | tail -14 | cut -c1-400
  (cd "$o" && tar -rf results.tar "$name.log" $( [ -d "$name" ] && echo "$name" ) && rm -rf "$name.log" "$name")
}
run_stage() {
  case $1 in
    gpu_tests) stage "${GPU_TESTS_CAP:-150}" gpu_tests python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider \
                 ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ;;
    kernels) stage "${KERNELS_CAP:-240}" kernels python3 benchmarks/bench_kernels.py --out "$o/kernels" \
               --regimes "${KERNEL_REGIMES:-quant,weight_quant,dense,grouped,train_grouped,attention,routing}" --budget $(( ${KERNELS_CAP:-240} - 20 )) \
               --match "${KERNEL_MATCH:-}" --compile-workers "${KERNEL_COMPILE_WORKERS:-8}" ;;
    rollout_scale) stage "${ROLLOUT_SCALE_CAP:-330}" rollout_scale python3 benchmarks/bench_rollout.py --out "$o/rollout_scale" \
                     --budget $(( ${ROLLOUT_SCALE_CAP:-330} - 30 )) ${ROLLOUT_SCALE_ARGS:-} ;;
    train) stage "${TRAIN_CAP:-330}" train python3 benchmarks/bench_train.py --out "$o/train" --budget $(( ${TRAIN_CAP:-330} - 90 )) ${TRAIN_ARGS:-} ;;
    ncu) stage "${NCU_CAP:-180}" ncu ncu --clock-control none --target-processes all -k "regex:${NCU_KERNEL:-nvfp4_grouped_matmul}" \
           -c "${NCU_COUNT:-2}" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
           --section SchedulerStats --section MemoryWorkloadAnalysis python3 benchmarks/bench_kernels.py --out "$o/ncu" \
           --regimes "${NCU_REGIMES:-grouped}" --match "${NCU_MATCH:-}" --budget $(( ${NCU_CAP:-180} - 30 )) --compile-workers 1 ;;
    *) echo "unknown stage $1 (expected gpu_tests, kernels, rollout_scale, train or ncu)"; return 1 ;;
  esac
}
for s in $STAGES; do run_stage "$s"; done
