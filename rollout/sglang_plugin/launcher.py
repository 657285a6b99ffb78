"""Build (and run) the SGLang server command for a QUADS NVFP4 export.

    python -m rollout.sglang_plugin.launcher --model-path exports/nvfp4 --port 30000 -- --tp 8

The child process imports this package, registers ``quads_nvfp4`` and then runs
``sglang.launch_server`` with the remaining arguments, so the method exists in every
SGLang worker that the server spawns from it.
"""

from __future__ import annotations

import json
import os
import sys

from rollout.sglang_plugin import METHOD_NAME


def read_rac_ratio(model_path: str) -> float:
    with open(os.path.join(model_path, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    if qc.get("quant_algo") != "NVFP4":
        raise ValueError(f"{model_path}: expected an NVFP4 export (quantization_config.quant_algo == 'NVFP4'), "
                         f"got {qc.get('quant_algo')!r}; write one with `quads export --nvfp4`")
    return float(qc.get("quads", {}).get("rac_ratio", 0.0))


def launch_command(model_path: str, *, host: str = "127.0.0.1", port: int = 30000, tp: int = 1,
                   extra_args: list[str] | None = None, python: str = sys.executable) -> list[str]:
    """The argv that starts SGLang with the QUADS method on ``model_path``."""
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model_path not found: {model_path}")
    read_rac_ratio(model_path)  # fail early on a non-NVFP4 directory
    return [python, "-m", "rollout.sglang_plugin.launcher", "--run", "--model-path", model_path,
            "--quantization", METHOD_NAME, "--host", host, "--port", str(port), "--tp-size", str(tp),
            *(extra_args or [])]


def _run(argv: list[str]):
    from rollout.sglang_plugin import register

    register()
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args

    run_server(prepare_server_args(argv))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--run":
        return _run(argv[1:])
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--print-only", action="store_true")
    a, extra = ap.parse_known_args(argv)
    cmd = launch_command(a.model_path, host=a.host, port=a.port, tp=a.tp, extra_args=[x for x in extra if x != "--"])
    print(" ".join(cmd))
    if not a.print_only:
        os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
