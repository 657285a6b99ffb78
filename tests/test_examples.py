import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pjit_example_runs_and_learns(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pjit_sft.py"), "--steps", "12", "--out", str(tmp_path / "ck")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "identical: True" in p.stdout
