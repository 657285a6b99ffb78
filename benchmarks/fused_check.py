"""Compile and check, on the GPU, the one-launch GEMMs over several weights (q/k/v, gate/up)
against the separate XLA products; exits non-zero when they fail (gpu_session.sh then runs
the rollout with QUADS_FUSE_SHARED_INPUT=0)."""

import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from quads_jax import nvfp4

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((64, 1024)), jnp.bfloat16)
ws = [nvfp4.quantize(jnp.asarray(rng.standard_normal((n, 1024)) * 0.02, jnp.float32)) for n in (1024, 256, 256)]
wg = [nvfp4.quantize(jnp.asarray(rng.standard_normal((64, 512, 1024)) * 0.02, jnp.float32), keep_axes=(0,)) for _ in range(2)]
sizes = jnp.asarray(np.bincount(rng.integers(0, 64, 512), minlength=64), jnp.int32)
xg = jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16)
worst = 0.0
for rho in (0.0, 0.5):
    kw = dict(rac_ratio=rho, act_scale="token", out_dtype=jnp.float32)
    for got, want in zip(pk.nvfp4_matmul(x, ws, backend="pallas", **kw), pk.nvfp4_matmul(x, ws, backend="xla", **kw)):
        worst = max(worst, float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)))
    for got, want in zip(pk.nvfp4_grouped_matmul(xg, wg, sizes, backend="pallas", **kw), pk.nvfp4_grouped_matmul(xg, wg, sizes, backend="xla", **kw)):
        worst = max(worst, float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)))
print({"fused_launch_worst_rel_vs_xla": worst}, flush=True)
raise SystemExit(0 if worst < 1e-5 else 1)
