import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # 15-25 s on 2 cores; the default suite stays near 15 minutes
def test_pjit_example_runs_and_learns(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pjit_sft.py"), "--steps", "12", "--out", str(tmp_path / "ck")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "identical: True" in p.stdout


@pytest.mark.slow
def test_two_process_run_agrees_with_one_process(tmp_path):
    """jax.distributed on localhost: 2 CPU processes x 2 devices (gloo collectives) train the
    example's sharded steps and checkpoint once; the losses equal a 1-process 4-device run."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(ROOT, "examples", "pjit_sft.py")
    base = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    two = dict(base, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    args = ["--steps", "4"]
    procs = [subprocess.Popen([sys.executable, script, *args, "--out", str(tmp_path / "ck2"), "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i), "--losses-json", str(tmp_path / "two.json")],
                              env=two, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    one = subprocess.run([sys.executable, script, *args, "--out", str(tmp_path / "ck1"), "--losses-json", str(tmp_path / "one.json")],
                         env=dict(base, XLA_FLAGS="--xla_force_host_platform_device_count=4"), capture_output=True, text=True, timeout=600)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert all("identical: True" in o and "/2]" in o for o in outs)
    a, b = json.load(open(tmp_path / "one.json")), json.load(open(tmp_path / "two.json"))
    assert a["devices"] == b["devices"] == 4 and b["processes"] == 2
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5)


def test_readme_quickstart_runs_as_written():
    """examples/quickstart.py is the README's quickstart, verbatim."""
    src = open(os.path.join(ROOT, "examples", "quickstart.py")).read()
    readme = open(os.path.join(ROOT, "README.md")).read()
    body = src.split('"""', 2)[2].strip()
    assert body in readme, "README's quickstart differs from examples/quickstart.py"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    err = float(p.stdout.split("relative error:")[1].split()[0])
    gap = float(p.stdout.split("rollout:")[1].split()[0])
    assert 0.02 < err < 0.3 and 0 < gap < 2.0, p.stdout
