#!/usr/bin/env bash
# One device call (<= 10 min) for what the open issues still need measured; each stage has its
# own time cap, and what a stage measured survives a later one's failure. Stages (STAGES picks
# a subset by name and their order; the default order is most-needed first):
#   triton_smoke  the Triton GEMM on the GPU: torch launch vs the torch reference, jax-triton vs Pallas (#5)
#   triton        the Triton section: parity and GEMM-only times, jax-triton vs torch vs Pallas (#5)
#   swap          decode GEMM variants (swap_ab, prmt decode, warps, tiles) at T=16, 64 (#8)
#   tiles         decode GEMM split-K, tile widths, K tiles, pipeline depth at T=16, 64 (#8)
#   prefill       T=4096: fused vs decode-once + BF16 dot, with a per-kernel breakdown (#8)
#   sass          tensor-core MMA instructions in the Pallas GEMM variants (#8)
#   decode        decode GEMMs vs BF16/FP8 dots (#8);  grouped: MoE grouped GEMM vs ragged_dot (#8)
#   train         nvfp4_w QAT overhead against BF16 (#4)
#   fused_check   the one-launch GEMMs over weights sharing an input, against XLA (gates the rollout's use)
#   rollout       output tok/s, 256 prompts x 512 new tokens, batch 64 (#5)
#   rollout_words the rollout of quads and nvfp4 with QUADS_GEMM_DECODE=words (code-word weights)
#   rollout_paths the rollout with the decode GEMMs on path "fused" and on "mgpu" (the Mosaic GPU
#                 kernel): tok/s and each path's agreement with the first (tokens, logprobs)
#   quant         the activation quantizer's configs (chunk, warps, RAC selection), bit-checked against XLA (#8)
#   mgpu_op       the whole nvfp4_matmul op, path mgpu vs fused vs the dots (MGPU_OP_ARGS) (#8)
#   op_ab         the whole op on both paths, each as it is now (the quantizer writes the GEMM's FP16
#                 operand, rows split over programs), with the quantizer writing codes ("_codes"),
#                 and as run 15 measured it ("_run15"), at the three decode shapes (OP_AB_ARGS) (#8)
#   mgpu_sweep    the Mosaic GPU kernel's configs (a ws probe first, in its own process) (MGPU_SWEEP_ARGS) (#8)
#   ncu           Nsight Compute on the NVFP4 kernels at decode shapes (benchmarks/ncu_probe.py):
#                 registers, occupancy, DRAM throughput, warp stalls, and their SASS (#8)
# The device returns only a few files: each stage's log and outputs are appended to one tar,
# $OUT/results.tar (extract with tar -xf), and removed.
# Usage (device, from the repo root, with .whl carried):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; OUT=... bash benchmarks/gpu_session.sh
set -uo pipefail
o="${OUT:-runs/gpu}"
mkdir -p "$o"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} TRITON_HOME=/tmp/triton_home TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_HOME" "$TRITON_CACHE_DIR"
ALL="op_ab quant triton_smoke fused_check rollout rollout_words rollout_paths mgpu_op mgpu_sweep ncu decode grouped sass prefill triton swap tiles train"
STAGES="${STAGES:-$ALL}"  # run in the order given
RECIPES="${RECIPES:-quads,fp8,nvfp4,bf16}"
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
    train) stage 90 train python3 benchmarks/bench_model.py --out "$o/train" --skip-rollout --batch 1 ;;
    fused_check)  # the one-launch GEMMs over several weights; if they fail, later stages launch one by one
      echo "== fused_check"
      if ! timeout 90 python3 benchmarks/fused_check.py > "$o/fused_check.log" 2>&1; then
        export QUADS_FUSE_SHARED_INPUT=0; echo "   failed: QUADS_FUSE_SHARED_INPUT=0 from here on"; fi
      grep -E "worst|Error" "$o/fused_check.log" | tail -3 | cut -c1-400
      (cd "$o" && tar -rf results.tar fused_check.log && rm -f fused_check.log) ;;
    rollout_words) QUADS_GEMM_DECODE=words stage "${ROLLOUT_CAP:-250}" rollout_words python3 benchmarks/bench_model.py --skip-train \
               --out "$o/rollout_words" --prompts 256 --new-tokens 512 --decode-batch 64 --recipes quads,nvfp4 --backends pallas ;;
    rollout_paths) stage "${ROLLOUT_CAP:-250}" rollout_paths python3 benchmarks/bench_model.py --skip-train --out "$o/rollout_paths" \
               --prompts "${PROMPTS:-256}" --new-tokens 512 --decode-batch 64 --recipes "$RECIPES" --backends "${BACKENDS:-pallas}" --paths fused,mgpu ;;
    quant) stage "${QUANT_CAP:-200}" quant python3 $BK --out "$o/quant" --only quant ;;
    op_ab) stage "${OP_AB_CAP:-240}" op_ab python3 benchmarks/mgpu_check.py --out "$o/op_ab" --op --variants \
               --budget $(( ${OP_AB_CAP:-240} - 25 )) ${OP_AB_ARGS:---shapes 4096:14336,2048:768,2048:6144 --ts 16,64,1} ;;
    mgpu_op) stage "${MGPU_OP_CAP:-160}" mgpu_op python3 benchmarks/mgpu_check.py --out "$o/mgpu_op" --op --budget $(( ${MGPU_OP_CAP:-160} - 25 )) ${MGPU_OP_ARGS:-} ;;
    mgpu_sweep)
      timeout 60 python3 benchmarks/mgpu_check.py --out /tmp/probe --probe ws > "$o/mgpu_probe.log" 2>&1
      echo "== ws probe rc=$?"; tail -2 "$o/mgpu_probe.log"; (cd "$o" && tar -rf results.tar mgpu_probe.log && rm -f mgpu_probe.log)
      stage "${MGPU_SWEEP_CAP:-200}" mgpu_sweep python3 benchmarks/mgpu_check.py --out "$o/mgpu_sweep" --budget $(( ${MGPU_SWEEP_CAP:-200} - 25 )) ${MGPU_SWEEP_ARGS:-} ;;
    ncu) stage "${NCU_CAP:-120}" ncu bash benchmarks/ncu_stage.sh "$o/ncu" ;;
    rollout) stage "${ROLLOUT_CAP:-250}" rollout python3 benchmarks/bench_model.py --skip-train --out "$o/rollout" --prompts 256 \
               --new-tokens 512 --decode-batch 64 --recipes "$RECIPES" --backends pallas ;;
    *) echo "unknown stage $1 (expected one of: $ALL)"; return 1 ;;
  esac
}
for s in $STAGES; do run_stage "$s"; done
