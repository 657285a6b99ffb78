"""FP8 E4M3 with per-channel / per-token scales: the FP8 baseline recipe.

``quantize(x, axis)`` scales each slice along ``axis`` (the reduced axis of a matmul) so
its amax maps to 448 and rounds to E4M3 (RNE, arithmetically like ``nvfp4``: jit-safe).
Weights [N, K] get one scale per output channel (axis=-1 reduces K), activations [T, K]
one per token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from quads_jax import nvfp4

E4M3_MAX = 448.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Tensor:
    values: jax.Array  # float8_e4m3fn, same shape as the input
    scale: jax.Array  # float32, keepdims (size 1 along the quantized axis)

    @property
    def shape(self):
        return self.values.shape

    def dequantize(self, dtype=jnp.float32):
        return (self.values.astype(jnp.float32) * self.scale).astype(dtype)


def _round(x, scale):
    # divided through float64 (``nvfp4.f64_div``; the scale too), not the integer long
    # division ``ieee_div`` takes on a GPU, whose loop would dominate the FP8 baseline's step.
    # On a GPU the quotient can then be one ulp off, which moves an E4M3 rounding only at a
    # midpoint; the FP8 baseline needs no cross-platform bits
    v = jnp.clip(nvfp4.f64_div(x.astype(jnp.float32), scale), -E4M3_MAX, E4M3_MAX)
    q = nvfp4.round_e4m3(jnp.abs(v))
    return jnp.where(v < 0, -q, q)


def quantize(x, axis: int = -1) -> FP8Tensor:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a floating-point array, got dtype {x.dtype}")
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, nvfp4.f64_div(amax, E4M3_MAX), 1.0)
    q = _round(x, scale)
    return FP8Tensor(values=q.astype(jnp.float8_e4m3fn), scale=scale)


def fake_quant(x, axis: int = -1):
    """quantize-dequantize in x's dtype with a straight-through gradient."""
    xs = jax.lax.stop_gradient(x)
    t = quantize(xs, axis)
    y = (_round(xs, t.scale) * t.scale).astype(x.dtype)
    return x + jax.lax.stop_gradient(y - x)
