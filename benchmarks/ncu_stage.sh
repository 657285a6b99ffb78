#!/usr/bin/env bash
# Nsight Compute on benchmarks/ncu_probe.py's NVFP4 kernel launches (12: quantizer + GEMM for
# each of six ops): one report, printed as per-kernel details and as SASS, with the tensor-core
# MMA count of each kernel's SASS. Usage: bash benchmarks/ncu_stage.sh OUT_DIR
set -uo pipefail
d="$1"; mkdir -p "$d"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -z "$NCU" ] && { echo "no ncu"; exit 1; }
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # ncu saves and restores device memory around each replay
export XLA_FLAGS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}"  # plain launches, no CUDA graphs
"$NCU" --target-processes all --kernel-name regex:nvfp4 --launch-count 12 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
  -f -o "$d/probe" python3 benchmarks/ncu_probe.py > "$d/ncu_run.txt" 2>&1
echo "ncu rc=$?"; tail -5 "$d/ncu_run.txt"
"$NCU" -i "$d/probe.ncu-rep" --page details > "$d/details.txt" 2>&1
"$NCU" -i "$d/probe.ncu-rep" --page source --print-source sass > "$d/sass.txt" 2>&1
echo "details $(wc -l < "$d/details.txt") lines, sass $(wc -l < "$d/sass.txt") lines"
grep -E "^  nvfp4|^  [a-z_0-9]+ \(|Registers Per Thread|Achieved Occupancy|DRAM Throughput|Duration|Memory Throughput|Compute \(SM\) Throughput|Theoretical Occupancy|Block Limit Registers|Executed Ipc Active" "$d/details.txt" | head -140
python3 - "$d/sass.txt" <<'PY'
import re, sys
text = open(sys.argv[1], errors="replace").read()
parts = re.split(r"\n(?=\s*Kernel Name|\[\d+\] )", text)
for p in parts:
    head = p.strip().splitlines()[0][:120] if p.strip() else ""
    n = {op: len(re.findall(rf"\b{op}\b", p)) for op in ("HGMMA", "HMMA", "WARPGROUP", "LDS", "STS", "LDG", "PRMT", "FFMA")}
    if any(n.values()):
        print(head, n)
PY
rm -f "$d/probe.ncu-rep"; gzip -f "$d/sass.txt" "$d/details.txt"  # the report is large; the printed pages are what is kept
ls -la "$d"
