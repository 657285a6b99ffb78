#!/usr/bin/env bash
# One device call (<= 10 min) for what the open issues still need measured; each stage has its
# own time cap, and what a stage measured survives a later one's failure. Stages (STAGES picks
# a subset by name and their order; the default order is most-needed first):
#   gpu_tests     pytest -m gpu: every compiled kernel against its XLA reference (GPU_TESTS_K: a -k expression)
#   train         the trainer-scale benchmark (benchmarks/bench_train.py; TRAIN_ARGS)
#   rollout       output tok/s, 256 prompts x 512 new tokens, batch 64, every recipe
#   rollout_scale benchmarks/bench_rollout.py: decode steps vs their byte limit across batches,
#                 expert GEMMs vs tokamax, the RAC quantizer at K=2048 (ROLLOUT_SCALE_ARGS)
#   triton_smoke  the SGLang plugin's Triton GEMM: torch launch vs the torch reference, jax-triton vs Pallas
#   triton        the Triton section: parity and GEMM-only times, jax-triton vs torch vs Pallas
#   swap, tiles   decode GEMM variants and tiles at T=16, 64
#   prefill       T=4096: fused vs decode-once + BF16 dot, with a per-kernel breakdown
#   sass          tensor-core MMA instructions in the Pallas GEMM variants
#   decode        decode GEMMs vs BF16/FP8 dots;  grouped: MoE grouped GEMM vs ragged_dot
#   quant         the activation quantizer's layouts at decode and rollout sizes, bit-checked against XLA
#   ncu           Nsight Compute on the NVFP4 kernels at decode shapes (benchmarks/ncu_probe.py)
# The device returns only a few files: each stage's log and outputs are appended to one tar,
# $OUT/results.tar (extract with tar -xf), and removed.
# Usage (device, from the repo root, with .whl carried: scripts/gpu_wheels.sh fills it here):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; OUT=... bash benchmarks/gpu_session.sh
set -uo pipefail
o="${OUT:-runs/gpu}"
mkdir -p "$o"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} TRITON_HOME=/tmp/triton_home TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_HOME" "$TRITON_CACHE_DIR"
ALL="gpu_tests train rollout_scale rollout quant triton_smoke decode grouped prefill ncu sass triton swap tiles"
STAGES="${STAGES:-$ALL}"  # run in the order given
RECIPES="${RECIPES:-quads,fp8,nvfp4_naive,bf16}"
DEADLINE="${DEADLINE:-575}"  # seconds from the start: no stage runs past it, so every log gets saved
stage() {
  local cap=$1 name=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  (( left < 20 )) && { echo "== $name skipped (${left}s left)"; return 0; }
  (( cap > left )) && cap=$left
  echo "== $name (cap ${cap}s)"
  timeout "$cap" "$@" > "$o/$name.log" 2>&1; echo "   rc=$?"
  grep -v -E "Warning|warn|^W[0-9]" "$o/$name.log" | grep -E '^\||^\{|rc=|Error|/' | tail -14 | cut -c1-400
  (cd "$o" && tar -rf results.tar "$name.log" $( [ -d "$name" ] && echo "$name" ) && rm -rf "$name.log" "$name")
}
BK="benchmarks/bench_kernels.py"
run_stage() {
  case $1 in
    triton_smoke) stage 45 triton_smoke python3 benchmarks/triton_smoke.py ;;
    triton) stage 60 triton python3 $BK --out "$o/triton" --only triton ;;
    swap) stage "${SWAP_CAP:-100}" swap python3 $BK --out "$o/swap" --only swap ;;
    tiles) stage "${TILES_CAP:-300}" tiles python3 $BK --out "$o/tiles" --only tiles ;;
    prefill) stage 45 prefill python3 $BK --out "$o/prefill" --only prefill --quick ;;
    sass) stage 60 sass python3 $BK --out "$o/sass" --only sass ;;
    decode) stage "${DECODE_CAP:-170}" decode python3 $BK --out "$o/decode" --only ceilings,decode ${DECODE_QUICK:+--quick} ;;
    grouped) stage "${GROUPED_CAP:-100}" grouped python3 $BK --out "$o/grouped" --only grouped ;;
    gpu_tests) stage "${GPU_TESTS_CAP:-150}" gpu_tests python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider \
                 ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ;;
    train) stage "${TRAIN_CAP:-330}" train python3 benchmarks/bench_train.py --out "$o/train" --budget $(( ${TRAIN_CAP:-330} - 90 )) ${TRAIN_ARGS:-} ;;
    quant) stage "${QUANT_CAP:-200}" quant python3 benchmarks/bench_rollout.py --out "$o/quant" --sections quant \
               --quant-shapes "${QUANT_SHAPES:-1x4096,16x4096,64x1024,256x1024,256x2048,2048x512}" ;;
    ncu) stage "${NCU_CAP:-120}" ncu bash benchmarks/ncu_stage.sh "$o/ncu" ;;
    rollout_scale) stage "${ROLLOUT_SCALE_CAP:-400}" rollout_scale python3 benchmarks/bench_rollout.py --out "$o/rollout_scale" \
               --budget $(( ${ROLLOUT_SCALE_CAP:-400} - 30 )) ${ROLLOUT_SCALE_ARGS:-} ;;
    rollout) stage "${ROLLOUT_CAP:-250}" rollout python3 benchmarks/bench_model.py --skip-train --out "$o/rollout" --prompts 256 \
               --new-tokens 512 --decode-batch 64 --recipes "$RECIPES" --backends pallas ;;
    *) echo "unknown stage $1 (expected one of: $ALL)"; return 1 ;;
  esac
}
for s in $STAGES; do run_stage "$s"; done
