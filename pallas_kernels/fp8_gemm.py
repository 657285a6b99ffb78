"""FP8 W8A8 baseline: E4M3 weights [N, K] (per output channel) x E4M3 activations (per token).

This baseline's kernel is XLA's native FP8 dot (cuBLASLt on Hopper), so there is no Pallas
variant; ``backend`` is accepted for a uniform signature and ignored. Weights are stored
[N, K] and contracted on their last axis: with [K, N] XLA transposes the FP8 weight on
every call (measured at 0.2x the BF16 dot here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quads_jax import fp8
from pallas_kernels.float_grouped import grouped_dot_fp8
from pallas_kernels.grouped_gemm import check_group_sizes, expert_of_rows


def _check(x, w: fp8.FP8Tensor, ndim: int):
    if not isinstance(w, fp8.FP8Tensor) or w.values.ndim != ndim:
        raise ValueError(f"w: expected an FP8Tensor of rank {ndim} ([N, K] or [E, N, K]), got {type(w).__name__}")
    k = w.shape[-1]
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x: expected [T, {k}], got {tuple(x.shape)}")


def fp8_matmul(x, w: fp8.FP8Tensor, *, backend=None, out_dtype=jnp.bfloat16):
    """x [T, K] @ W.T with W8A8 E4M3 numerics (FP32 accumulation)."""
    del backend
    _check(x, w, 2)
    xq = fp8.quantize(x, axis=-1)  # [T, K], scale [T, 1]
    acc = jax.lax.dot_general(xq.values, w.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (acc * xq.scale * w.scale[:, 0][None, :]).astype(out_dtype)


def fp8_grouped_matmul(x, w: fp8.FP8Tensor, group_sizes, *, backend=None, out_dtype=jnp.bfloat16, grouped: str = "auto",
                       tiles=None):
    """Grouped W8A8 for sorted MoE rows; w [E, N, K] with scales [E, N, 1], read as stored
    (no transpose or cast per call). The unscaled E4M3 product runs through
    ``grouped_dot_fp8`` (``grouped``: tokamax's kernel reading one byte a weight on a GPU, or
    ``lax.ragged_dot``; ``tiles`` for tokamax); both scales are applied to its output."""
    del backend
    _check(x, w, 3)
    m = x.shape[0]
    group_sizes = check_group_sizes(group_sizes, m, w.shape[0])
    xq = fp8.quantize(x, axis=-1)
    # E4M3 activation values are exact in BF16, the operand tokamax's FP8-weight kernel takes
    acc = grouped_dot_fp8(xq.values.astype(jnp.bfloat16), w.values, group_sizes, impl=grouped, tiles=tiles)
    ex = expert_of_rows(group_sizes, m)
    scale = w.scale[..., 0]  # [E, N]
    ws = jnp.concatenate([scale, jnp.zeros((1, scale.shape[1]), jnp.float32)])[ex]  # [M, N]
    return (acc * xq.scale * ws).astype(out_dtype)
