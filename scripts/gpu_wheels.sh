#!/usr/bin/env bash
# Downloads into .whl/ the wheels that the GPU image lacks (tokamax and its pure-Python needs),
# for a device call that carries .whl and starts with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
# The set was found by importing tokamax on the image (2026-12-05): fire, termcolor, six, tqdm and
# treescope are imported by xprof's CLI tools, which tokamax's benchmarking module loads.
# jax-triton 0.3.1: 0.4 imports names that only triton 3.7 has (the image's torch 2.11 carries
# triton 3.6), and then stubs its whole CUDA backend: "'_Stub' object has no attribute 'backend'".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
py="${PYTHON:-python3}"
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for p in tokamax==0.0.17 qwix einshape immutabledict absl-py xprof==2.24.2 pydantic pydantic-core annotated-types \
         typing-inspection tensorboardx fire termcolor six tqdm treescope jax-triton==0.3.1; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl "$p"
done
ls .whl
