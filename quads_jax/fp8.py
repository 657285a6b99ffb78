"""FP8 E4M3 with per-channel / per-token scales: the FP8 baseline recipe.

``quantize(x, axis)`` scales each slice along ``axis`` (the reduced axis of a matmul) so
its amax maps to 448 and rounds to E4M3 (round to nearest even, by the native conversion).
Weights [N, K] get one scale per output channel (axis=-1 reduces K), activations [T, K]
one per token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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


def _round(x, inv):
    """x times its slice's inverse scale, clipped to +-448 and rounded to E4M3 by the native
    conversion (round to nearest even; Hopper's ``cvt.rn.satfinite``) -> float8_e4m3fn. A multiply by the reciprocal, as FP8 inference engines
    quantize: elementwise work a memory-bound fusion hides. The trainer's fake quant and the
    rollout's weights and activations all come through here, so both sides round alike."""
    return jnp.clip(x.astype(jnp.float32) * inv, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def quantize(x, axis: int = -1) -> FP8Tensor:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a floating-point array, got dtype {x.dtype}")
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
    amax = jnp.where(amax > 0, amax, E4M3_MAX)  # an all-zero slice: scale 1
    return FP8Tensor(values=_round(x, E4M3_MAX / amax), scale=amax / E4M3_MAX)


def fake_quant(x, axis: int = -1):
    """quantize-dequantize in x's dtype with a straight-through gradient."""
    xs = jax.lax.stop_gradient(x)
    y = quantize(xs, axis).dequantize(x.dtype)
    return x + jax.lax.stop_gradient(y - x)
