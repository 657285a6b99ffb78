#!/usr/bin/env bash
# The issue-6 experiment on one H200, in one device call (~10 min):
#   1. SFT base policy of configs/h200_moe64.yaml (in /tmp/quads_rl_h200/base),
#   2. `quads gap`: every recipe and RAC ratio on held-out prompts (XLA backend: the same
#      numbers as the Pallas kernels up to accumulation order, and 12 fewer kernel compiles),
#   3. `quads compare`: GRPO runs of bf16, nvfp4_naive and quads from that base (Pallas kernels).
# Results (CSV, JSON, PNG, logs; no checkpoints: the device returns a limited number of files)
# are copied to $OUT/rl after each stage.
# Usage (device): OUT=/some/dir [SKIP_GAP=1] bash benchmarks/rl_h200.sh [RL_STEPS] [RECIPES]
set -uo pipefail
dest="${OUT:-runs/h200}"/rl
out=/tmp/quads_rl_h200  # work dir: the base checkpoint stays here, only results go to $OUT
save() { mkdir -p "$dest"; tar -C "$out" --exclude=./base --exclude='*/checkpoints' --exclude='*/tb' --exclude='*/weight_sync' -cf - . | tar -C "$dest" -xf -; }
steps="${1:-30}"
recipes="${2:-bf16,nvfp4_naive,quads}"
cfg=configs/h200_moe64.yaml
rm -rf "$out"; mkdir -p "$out"
trap save EXIT
trap 'exit 143' TERM INT  # a timeout still saves what is done (through the EXIT trap)
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
py="${PYTHON:-python3}"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u) > "$out/env.txt" 2>&1
t0=$(date +%s)
if [ -z "${SKIP_GAP:-}" ]; then
  $py -m quads_jax.cli gap --config $cfg --out "$out" --set kernels.backend=xla 2>&1 | tr '\r' '\n' | tee "$out/gap.log"
  echo "[rl_h200] gap done after $(( $(date +%s) - t0 )) s"
  save
fi
$py -m quads_jax.cli compare --config $cfg --out "$out" --recipes "$recipes" --set rl.steps="$steps" 2>&1 | tr '\r' '\n' | tee "$out/compare.log"
echo "[rl_h200] compare done after $(( $(date +%s) - t0 )) s"
save
