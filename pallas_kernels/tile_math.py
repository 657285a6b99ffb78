"""Arithmetic shared by the kernels: the float32 division and opacity they use.

The recipe needs correctly rounded float32 divisions and products that are rounded on
their own. Triton divides approximately (``div.full.f32``) and contracts ``x - a * b``
into an FMA, so compiled kernels emit PTX ``div.rn.f32`` (IEEE round-to-nearest-even, the
same bits as ``nvfp4.ieee_div``'s integer long division in the XLA reference) and
``mul.rn.f32``. In interpret mode the kernel body is run by XLA, which gets the
reference's arithmetic instead (``nvfp4.XLA_ARITH``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from quads_jax import nvfp4


def _ptx_binary(op: str):
    """A float32 binary op as one PTX instruction (``op`` like ``"mul.rn.f32"``)."""

    def f(a, b):
        a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
        [out] = plgpu.elementwise_inline_asm(
            f"{op} $0, $1, $2;",
            args=[a, b],
            constraints="=r,r,r",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
        )
        return out

    return f


TRITON_ARITH = nvfp4.Arith(div=_ptx_binary("div.rn.f32"), opaque=lambda x: x, mul=_ptx_binary("mul.rn.f32"))


def load_even_odd(ref, rows, start, width, mask, interpret, other=0):
    """The even and odd columns of ``ref[rows, start:start + width]`` ([r, width // 2]
    each): the low and high nibbles of packed codes. Compiled: two stride-2 loads.
    Interpret mode has no strided loads, so it de-interleaves a contiguous load."""
    if not interpret:
        even = plgpu.load(ref.at[rows, pl.ds(start, width // 2, stride=2)], mask=mask, other=other)
        odd = plgpu.load(ref.at[rows, pl.ds(start + 1, width // 2, stride=2)], mask=mask, other=other)
        return even, odd
    v = plgpu.load(ref.at[rows, pl.ds(start, width)], mask=mask, other=other)
    v = v.reshape(v.shape[0], width // 2, 2)
    return v[:, :, 0], v[:, :, 1]


def kernel_arith(interpret: bool) -> nvfp4.Arith:
    return nvfp4.XLA_ARITH if interpret else TRITON_ARITH


def pad_axis(x, axis: int, size: int):
    """Zero-pad ``x`` along ``axis`` up to ``size`` (no-op if already that size)."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)
