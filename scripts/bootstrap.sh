#!/usr/bin/env bash
# Creates (once) the Python 3.12 virtual environment this project runs in and prints its path.
# The environment is keyed by a hash of pyproject.toml and scripts/sglang-*.txt, so a dependency
# change makes a new one.
# Override the location with QUADS_VENV=/path.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

find_python() {
  for cand in "python3.12" "python3"; do
    if command -v "$cand" >/dev/null 2>&1; then
      if PYENV_VERSION="${PYENV_VERSION:-3.12.1}" "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        echo "$cand"; return 0
      fi
    fi
  done
  echo "error: Python >= 3.12 not found (tried python3.12 and python3; with pyenv: pyenv install 3.12)" >&2
  return 1
}

hash=$(cat "$root/pyproject.toml" "$root"/scripts/sglang-*.txt | sha256sum | cut -c1-12)
venv="${QUADS_VENV:-$HOME/.cache/quads-jax/venv-py312-$hash}"
if [ ! -f "$venv/.quads-ready" ]; then
  py=$(find_python)
  echo "[bootstrap] creating $venv (one time; downloads jax, flax, torch, ...)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  PYENV_VERSION="${PYENV_VERSION:-3.12.1}" "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  # Dependencies come from pyproject.toml (base + torch + test extras).
  deps=$("$venv/bin/python" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = list(p["dependencies"])
for extra in ("torch", "test"):
    deps += p["optional-dependencies"][extra]
print("\n".join(deps))
PY
)
  mapfile -t deparr <<<"$deps"
  "$venv/bin/python" -m pip install -q "${deparr[@]}" >&2
  # The real SGLang for the plugin's tests, without its CUDA-only requirements (see the file)
  sgl=$("$venv/bin/python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["sglang"][0])' "$root/pyproject.toml")
  "$venv/bin/python" -m pip install -q --no-deps "$sgl" >&2
  "$venv/bin/python" -m pip install -q -r "$root/scripts/sglang-cpu.txt" -c "$root/scripts/sglang-constraints.txt" >&2
  # The project itself, editable: its metadata and entry points (SGLang finds the quads_nvfp4
  # plugin through them); the wrappers still put their own checkout first on PYTHONPATH.
  "$venv/bin/python" -m pip install -q --no-deps -e "$root" >&2
  touch "$venv/.quads-ready"
fi
echo "$venv"
