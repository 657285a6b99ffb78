"""The NVFP4 kernels once each at rollout-decode shapes, for Nsight Compute (``ncu``) to
profile: ``benchmarks/gpu_session.sh`` stage ``ncu`` runs it under ncu and keeps the
per-kernel details (registers, occupancy, DRAM throughput, warp stalls) and the SASS.

Order of the NVFP4 launches (each W4A4 op is a quantizer launch, then its GEMM):
  dense 16 x 4096 -> 14336 at rho 0 and 0.5, dense 64 x 4096 -> 14336 at rho 0 and 0.5,
  grouped 512 rows (64 tokens x top-8), 64 experts, 1024 -> 512 at rho 0 and 0.5.
"""

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from quads_jax import nvfp4


def main():
    rng = np.random.default_rng(0)
    x = lambda t, k: jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((14336, 4096)) * 0.02, jnp.float32))
    for t in (16, 64):
        xt = x(t, 4096)
        for rho in (0.0, 0.5):
            f = jax.jit(lambda a, rho=rho: pk.nvfp4_matmul(a, w, rac_ratio=rho, act_scale="token", backend="pallas"))
            jax.block_until_ready(f(xt))
    wg = nvfp4.quantize(jnp.asarray(rng.standard_normal((64, 512, 1024)) * 0.02, jnp.float32), keep_axes=(0,))
    sizes = jnp.asarray(np.bincount(rng.integers(0, 64, 512), minlength=64), jnp.int32)
    xg = x(512, 1024)
    for rho in (0.0, 0.5):
        f = jax.jit(lambda a, rho=rho: pk.nvfp4_grouped_matmul(a, wg, sizes, rac_ratio=rho, act_scale="token", backend="pallas"))
        jax.block_until_ready(f(xg))
    print("ncu_probe done", flush=True)


if __name__ == "__main__":
    main()
