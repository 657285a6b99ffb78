"""Residual activation compensation (RAC): which part of the residual gets a second pass.

For activations x [T, K] quantized to NVFP4 with global scale gx, the residual is
``r = x - dq(q(x))``. The criterion (all modes pick by residual *energy*, sum of r**2):

- ``"token"`` (default, the paper's online per-token selection): for each token, the
  fraction ``rac_ratio`` of its 16-channel blocks with the largest energy;
- ``"tensor"``: one set of blocks shared by all tokens (energies summed over tokens), so
  the selected columns can be gathered into one dense side GEMM;
- ``"channel"``: per token, individual channels by r**2 (finer, but each selected channel's
  16-block still gets one scale).

A block is selected when its energy is >= the n-th largest (n = ceil(rac_ratio * count)),
so exact ties can select a few more than n; rac_ratio 1 selects everything, 0 nothing.
The selected residual is quantized to NVFP4 a second time with its own block scales and
the global scale ``gx / 4``: the residual of a block never exceeds one E2M1 step of its
block scale (<= 448 * gx), so gx / 4 keeps every residual block scale in E4M3 range, and
it needs no second pass over the tensor (it is what a dynamic amax of r would give, up to
a factor < 2). The compensated product is ``dq(q(x)) @ W.T + dq(q(r_sel)) @ W.T``.

How the GEMMs add the two products (``rac_sum``):

- ``"fp16"`` (default): one operand, the compensated activation ``Xq + Rq / 4`` (block
  values; gr / gx = 1/4) rounded once to FP16, times the weight decoded to FP16 (exact):
  one MMA, so RAC costs the naive W4A4 GEMM's time. FP16's 11 significant bits hold the sum
  exactly in ~99.5% of entries (heavy-tailed activations, rho 0.5 and 1); elsewhere the
  rounding is <= 2**-11 relative, ~100x below the residual's own quantization error and
  below the BF16 output's rounding (2**-9). BF16 could not: 6-14% of sums would round.
- ``"exact"``: the two products accumulated in FP32, a native NVFP4 GEMM's numerics up to
  accumulation order (what the SGLang plugin computes); the XLA reference's, for parity
  checks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from quads_jax import nvfp4

RAC_MODES = ("token", "tensor", "channel")
RAC_SUMS = ("fp16", "exact")
RESIDUAL_SCALE_FACTOR = 0.25  # gr = gx * 0.25 (exact)


def check_rac(rac_ratio: float, rac_mode: str, rac_sum: str = "fp16") -> None:
    if not (isinstance(rac_ratio, (int, float)) and 0.0 <= rac_ratio <= 1.0):
        raise ValueError(f"rac_ratio={rac_ratio!r}: expected a number in [0, 1]")
    if rac_mode not in RAC_MODES:
        raise ValueError(f"rac_mode={rac_mode!r}: expected one of {RAC_MODES}")
    if rac_sum not in RAC_SUMS:
        raise ValueError(f"rac_sum={rac_sum!r}: expected one of {RAC_SUMS}")


def compensated_values(xq: nvfp4.NVFP4Tensor, rq: nvfp4.NVFP4Tensor, values=nvfp4.block_values):
    """``rac_sum="fp16"``'s operand: Xq + Rq * gr / gx (block values, summed in float32, then
    rounded once to FP16), [T, K] float16; times gx it is dq(q(x)) + dq(q(r_sel)).
    ``values`` maps an NVFP4Tensor to its (exact) block values."""
    a = values(xq).astype(jnp.float32)
    r = values(rq).astype(jnp.float32)
    return (a + r * RESIDUAL_SCALE_FACTOR).astype(jnp.float16)


def token_operand(xq: nvfp4.NVFP4Tensor, rq: nvfp4.NVFP4Tensor | None):
    """The FP16 token operand of the GEMMs (times gx it is the activation side): the block
    values of ``xq`` (exact in FP16), or RAC's ``compensated_values`` with a residual."""
    return nvfp4.block_values(xq, jnp.float16) if rq is None else compensated_values(xq, rq)


def num_selected(rac_ratio: float, count: int) -> int:
    return min(count, max(0, math.ceil(rac_ratio * count - 1e-9)))


def activation_global_scale(x, act_scale: str = "tensor"):
    """[T, 1] float32 global scales: one per tensor (broadcast) or one per token."""
    if act_scale not in ("tensor", "token"):
        raise ValueError(f"act_scale={act_scale!r}: expected 'tensor' or 'token'")
    keep = (0,) if act_scale == "token" else ()
    gs = nvfp4.global_scale_for(x, keep_axes=keep)
    return jnp.broadcast_to(jnp.reshape(gs, (-1, 1)) if gs.ndim else gs, (x.shape[0], 1))


def residual(x, gx):
    """r = x - dq(q(x)) in float32, with ``gx`` [T, 1]."""
    xf = x.astype(jnp.float32)
    q = nvfp4.quantize(xf, global_scale=gx)
    return xf - nvfp4.XLA_ARITH.mul(nvfp4.block_values(q, jnp.float32), gx)


def block_energy(r):
    """[T, K] -> [T, K/16] sums of squares."""
    t, k = r.shape
    return jnp.sum(jnp.square(r).reshape(t, k // nvfp4.BLOCK, nvfp4.BLOCK), axis=-1)


def nth_largest(e, n: int):
    """The n-th largest value of each row of ``e`` (n >= 1), shape [rows, 1]."""
    return jax.lax.top_k(e, n)[0][:, n - 1 : n]


def selection_mask(r, rac_ratio: float, rac_mode: str = "token"):
    """Boolean mask [T, K] of the residual entries to compensate."""
    check_rac(rac_ratio, rac_mode)
    t, k = r.shape
    if rac_mode == "channel":
        e = jnp.square(r)
        n = num_selected(rac_ratio, k)
        if n == 0:
            return jnp.zeros(r.shape, bool)
        return e >= nth_largest(e, n)
    e = block_energy(r)
    n = num_selected(rac_ratio, e.shape[1])
    if n == 0:
        return jnp.zeros(r.shape, bool)
    if rac_mode == "tensor":
        e = jnp.sum(e, axis=0, keepdims=True)
    m = e >= nth_largest(e, n)
    return jnp.repeat(jnp.broadcast_to(m, (t, e.shape[1])), nvfp4.BLOCK, axis=1)


def residual_global_scale(gx):
    return gx * RESIDUAL_SCALE_FACTOR


def quantize_residual(x, gx, rac_ratio: float, rac_mode: str = "token") -> nvfp4.NVFP4Tensor:
    """The second-pass NVFP4 tensor of the selected residual (zeros elsewhere)."""
    r = residual(x, gx)
    r_sel = jnp.where(selection_mask(r, rac_ratio, rac_mode), r, 0.0)
    return nvfp4.quantize(r_sel, global_scale=residual_global_scale(gx))
