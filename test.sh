#!/usr/bin/env bash
# Runs the test suite on the CPU (8 simulated XLA devices), setting up the environment first.
#   ./test.sh            all tests
#   ./test.sh -k nvfp4   any pytest arguments
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv=$("$root/scripts/bootstrap.sh")
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=cpu
export XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}"
exec "$venv/bin/python" -m pytest "$@"
