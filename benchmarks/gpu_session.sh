#!/usr/bin/env bash
# One or two device calls (~11 min in all) for what the open issues still need measured, most important first;
# each stage has its own time cap, and what a stage measured survives a later one's failure.
#   0. swap_ab GEMM variants against the current default (#8)
#   0b. prefill TFLOP/s: fused kernel vs path="dequant" (decode once + BF16 dot) (#8)
#   1. the Triton GEMM on the GPU: torch launch vs the torch reference, jax-triton vs Pallas (#5)
#   2. SASS: tensor-core MMA instructions in the Pallas GEMM (#8)
#   3. the Triton section: parity and GEMM-only times, jax-triton vs torch vs Pallas (#5)
#   4. decode GEMMs at T=16 with the fused per-token amax option, and grouped (#8)
#   5. the train step: nvfp4_w QAT overhead against BF16, with the mask-free STE (#4)
#   6. rollout tok/s, 256 prompts x 512 new tokens, batch 64, for bf16, fp8, nvfp4, quads (#5)
# Usage (device, from the repo root, with .whl carried):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; OUT=... bash benchmarks/gpu_session.sh
set -uo pipefail
o="${OUT:-runs/gpu}"
mkdir -p "$o"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} TRITON_HOME=/tmp/triton_home TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_HOME" "$TRITON_CACHE_DIR"
# STAGES picks a subset by name (default: all, in this order)
STAGES="${STAGES:-swap prefill triton_smoke sass triton decode train rollout}"
stage() { local cap=$1 name=$2; shift 2; [[ " $STAGES " == *" $name "* ]] || return 0; echo "== $name (cap ${cap}s)"; timeout "$cap" "$@" > "$o/$name.log" 2>&1; echo "   rc=$?"; grep -v -E "Warning|warn" "$o/$name.log" | tail -4; }
stage 150 swap python3 benchmarks/bench_kernels.py --only ceilings,swap --out "$o/swap"
stage 70 prefill python3 benchmarks/bench_kernels.py --only ceilings,prefill --out "$o/prefill"
stage 50 triton_smoke python3 benchmarks/triton_smoke.py
stage 40 sass python3 benchmarks/bench_kernels.py --only sass --out "$o/sass"
stage 70 triton python3 benchmarks/bench_kernels.py --only triton --out "$o/triton"
stage 90 decode python3 benchmarks/bench_kernels.py --quick --only ceilings,decode,grouped --out "$o/decode"
stage 100 train python3 benchmarks/bench_model.py --out "$o/model_train" --skip-rollout
stage 230 rollout python3 benchmarks/bench_model.py --skip-train --out "$o/model_rollout" --prompts 256 --new-tokens 512 --decode-batch 64 --recipes bf16,fp8,nvfp4,quads --backends pallas
