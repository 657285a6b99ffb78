"""The benchmark harness on a CPU (``--tiny``): every registry regime builds its cases, checks
each against its XLA reference and writes JSON and markdown; the rollout sweep runs the
engine. The device runs the same code at full size (benchmarks/gpu_session.sh)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, out, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--tiny", "--out", str(out), *args],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_kernel_registry_checks_every_case_against_its_reference(tmp_path):
    _run("bench_kernels.py", tmp_path, "--regimes", "quant,weight_quant,dense,grouped,attention")
    res = json.load(open(tmp_path / "kernels.json"))
    assert set(res["sections"]) >= {"ceilings", "quant", "weight_quant", "dense", "grouped", "attention"}
    for regime in ("quant", "weight_quant", "dense", "grouped", "attention"):
        rows = res["sections"][regime]
        kept = [r for r in rows if r.get("kept")]
        assert kept, regime
        for r in kept:  # every default implementation ran, was checked, and passed
            assert "error" not in r, r
            assert r["check"] == "bit-exact" if regime == "quant" else "FAILS" not in r["check"], r
            assert r["us"] > 0 and "fastest" in r
    md = open(tmp_path / "kernels.md").read()
    assert "## quant" in md and "**pallas default**" in md


@pytest.mark.slow
def test_rollout_sweep_times_every_recipe(tmp_path):
    # a recipe with a KernelConfig field set (the decode attention's XLA reference)
    # and at batch 2 only the recipe --recipes-for names there
    _run("bench_rollout.py", tmp_path, "--batches", "4,2", "--recipes", "bf16,quads,quads@decode_attention=xla", "--prompts", "8",
         "--new-tokens", "16", "--profile-batches", "4", "--recipes-for", "2=quads")
    res = json.load(open(tmp_path / "rollout.json"))
    assert sorted(k for k in res["sections"]["sweep"] if k.endswith("/B2")) == ["quads/B2"]
    for key in ("bf16/B4", "quads/B4", "quads@decode_attention=xla/B4"):
        row = res["sections"]["sweep"][key]
        assert row["step_ms"] > 0 and row["x_byte_limit"] > 0 and row["output_tok_per_s"] > 0 and row["prefill_ms"] > 0, row
        assert "kernels_us_per_step" in row or "kernels_error" in row, row  # CUPTI needs a GPU
    assert os.path.exists(tmp_path / "rollout.png")
    import gzip

    with gzip.open(tmp_path / "decode_step_quads_B4.hlo.txt.gz", "rt") as f:  # the profiled executable's HLO
        assert "HloModule" in f.read(2000)


def test_cache_copies_counts_copies_of_a_cache_inside_loops_only():
    """The rollout profile's check that XLA keeps the aliased KV caches in place: copies of a
    cache-shaped buffer in a loop body count, the entry computation's (one per call) do not."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_rollout import cache_copies

    hlo = """HloModule m
%body (p: (bf16[2,8,1,4])) -> (bf16[2,8,1,4]) {
  %a = bf16[2,8,1,4]{3,2,1,0} get-tuple-element(%p), index=0
  %c = bf16[2,8,1,4]{3,2,1,0} copy(%a)
  %d = f32[2,8,1,4]{3,2,1,0} copy(%x)
  ROOT %t = (bf16[2,8,1,4]) tuple(%c)
}

ENTRY %main (c0: bf16[2,8,1,4]) -> bf16[2,8,1,4] {
  %e = bf16[2,8,1,4]{3,2,1,0} copy(%c0)
}
"""
    assert cache_copies(hlo, "bfloat16[2,8,1,4]") == 1
    assert cache_copies(hlo.replace("%c = bf16[2,8,1,4]{3,2,1,0} copy(%a)", ""), "bf16[2,8,1,4]") == 0


def test_speed_ratios_pair_quads_with_recipes_of_the_same_batch_and_settings():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_rollout import speed_ratios

    sw = {"quads/B64": {"step_ms": 2.0, "output_tok_per_s": 900.0},
          "nvfp4_naive/B64": {"step_ms": 1.8, "output_tok_per_s": 1000.0},
          "bf16/B64": {"step_ms": 3.0},  # no generation timed: no tok/s ratio
          "nvfp4_naive/B256": {"step_ms": 1.0},  # another batch: not quads's pair
          "quads@command_buffers=xla/B64": {"step_ms": 4.0},
          "nvfp4_naive@command_buffers=xla/B64": {"step_ms": 3.0},
          "fp8/B64": {"skipped": "time budget"}}
    got = {(b, q, o): (round(st, 6), tp) for b, q, o, st, tp in speed_ratios(sw)}
    assert got == {(64, "quads", "nvfp4_naive"): (0.9, 0.9), (64, "quads", "bf16"): (1.5, None),
                   (64, "quads@command_buffers=xla", "nvfp4_naive@command_buffers=xla"): (0.75, None)}


def _square_sum(x):
    import jax.numpy as jnp

    y = jnp.sin(x) * 2.0
    return jnp.sum(y * y, axis=-1)  # one fusion on the CPU: its innermost frame is this line


def test_kernel_sources_name_the_line_and_its_caller():
    """A profiled kernel's name -> the innermost project frame of its HLO instruction and the
    innermost one in another function (read from the optimized HLO's stack-frame tables)."""
    import inspect
    import re

    import jax
    import jax.numpy as jnp

    from benchmarks import harness as H

    hlo = jax.jit(_square_sum).lower(jnp.ones((8, 16))).compile().as_text()  # the caller's line
    caller = inspect.currentframe().f_lineno - 1
    fusion = re.search(r"ROOT %(\S*fusion\S*) = ", hlo).group(1).replace(".", "_")
    line = inspect.getsourcelines(_square_sum)[1] + 4
    src = H.kernel_sources(hlo, [fusion, "no_such_kernel"], roots=("tests/",))
    assert src == {fusion: f"tests/test_benchmarks.py:{line} _square_sum < tests/test_benchmarks.py:{caller} "
                           "test_kernel_sources_name_the_line_and_its_caller"}
