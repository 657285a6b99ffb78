"""The SGLang plugin's Triton W4A4 + RAC GEMM called from JAX through jax-triton (the one
module of the plugin package that imports JAX: the plugin itself never imports it).

    xq, rq = quantize_activations_rac(x, rac_ratio=0.5, act_scale="token")
    y = triton_nvfp4_matmul(xq, rq, w)      # the kernel torch/SGLang runs, on JAX arrays

It takes the same NVFP4 operands as ``nvfp4_matmul`` (after its activation quantizer), so
on the GPU both engines can be checked to compute the same numbers on the same inputs
(``tests/test_gpu.py``, on the device). Needs a GPU and the ``jax_triton`` package
(not a dependency: carry its wheel); there is no interpret mode through jax-triton, the CPU
tests run the kernel itself in Triton's interpreter instead.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp



def import_jax_triton():
    """``import jax_triton``, undoing its import-time ``TRITON_CACHE_DIR=""`` (jax-triton 0.3.1),
    which makes every later Triton launch from torch in the same process fail with "Could not
    create or locate cache dir"."""
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if before is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = before
    return jax_triton


def _bits(scales):
    return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def triton_nvfp4_matmul(xq, rq, w, *, out_dtype=jnp.bfloat16, config=None):
    """q(x) [T, K] (and the selected residual, or None) times the NVFP4 weight [N, K] -> [T, N].

    Each operand is a ``quads_jax.nvfp4.NVFP4Tensor`` (anything with ``codes``, ``scales``
    and ``global_scale`` of its layout)."""
    jt = import_jax_triton()

    from rollout.sglang_plugin.tiles import pick_tiles
    from rollout.sglang_plugin.triton_gemm import w4a4_rac_gemm_kernel

    t, k = xq.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"w: K={w.shape[1]} does not match the activations' K={k}")
    cfg = config or pick_tiles(t, n, k)
    gx = jnp.reshape(jnp.asarray(xq.global_scale, jnp.float32), (t,))
    gw = jnp.reshape(jnp.asarray(w.global_scale, jnp.float32), (1,))
    rc, rs = (rq.codes, _bits(rq.scales)) if rq is not None else (xq.codes, _bits(xq.scales))
    dtype = out_dtype if cfg.split_k == 1 else jnp.float32
    out = jt.triton_call(
        xq.codes, _bits(xq.scales), gx, rc, rs, w.codes, _bits(w.scales), gw, t, n,
        kernel=w4a4_rac_gemm_kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, t, n), dtype),
        grid=(-(-t // cfg.block_m), -(-n // cfg.block_n), cfg.split_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        HAS_RAC=rq is not None, F32_OPERANDS=False, SWAP_AB=cfg.swap_ab,
    )
    return out[0] if cfg.split_k == 1 else out.sum(0).astype(out_dtype)
