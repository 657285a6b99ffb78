#!/usr/bin/env bash
# Runs the test suite on the CPU (8 simulated XLA devices), setting up the environment first.
#   ./test.sh            all tests
#   ./test.sh -k nvfp4   any pytest arguments
# Two worker processes by default (pytest-xdist; each test runs in one of them; an idle worker
# takes tests queued for the other, so the long tests do not leave one waiting at the end):
# 14-17 minutes on a 2-core CPU where one process took 21. `-n 0` runs in this process, `-n N` in N.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv=$("$root/scripts/bootstrap.sh")
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=cpu
export XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}"
exec "$venv/bin/python" -m pytest -n 2 --dist worksteal "$@"
