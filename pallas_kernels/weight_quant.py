"""The QAT weight: dq(q(W)) of the trainer's FP32 master weights, in the product's type, in one pass.

QUADS' trainer (``nvfp4_w``) multiplies by the NVFP4 fake quantization of every linear weight,
recomputed each step from the FP32 master weights: W [N, K] or stacked experts [E, N, K],
quantized along K (16-blocks, E4M3 block scales) with one dynamic global scale per matrix
(per expert), exactly as the rollout quantizes the synced weights. XLA computes it in several
passes over the weight (the block amax, the elements up to an optimization barrier, the
products after it), ~18 bytes moved per weight value. This kernel reads each FP32 value once
and writes the BF16 result, after one XLA reduction for each matrix's amax: 10 bytes a value.

The kernel's numbers are ``nvfp4.fake_quant``'s bit for bit (the block math is
``nvfp4.quantize_blocks``, run with the kernels' correctly rounded division). The gradient is
the straight-through identity (``nvfp4.straight_through``): the dynamic global scale puts
every element inside the representable range.

Layout: the weight as rows [R = E N, K]; program (i, j) owns ``block_rows`` rows and
``block_k`` channels, and reads the rows' matrix amax [R, 1], which it turns into the global
scale with the kernels' correctly rounded division.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from quads_jax import nvfp4
from pallas_kernels.config import interpret_mode, resolve_backend
from pallas_kernels.tile_math import kernel_arith


@dataclasses.dataclass(frozen=True)
class FakeQuantConfig:
    """Tiles of the weight fake-quant kernel: ``block_rows`` x ``block_k`` values a program
    (``block_k`` a multiple of 16 dividing K; ``block_rows`` dividing the rows)."""

    block_rows: int = 8
    block_k: int = 256
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_rows", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"FakeQuantConfig.{name}={v!r}: expected a positive integer")
        if self.block_k % nvfp4.BLOCK:
            raise ValueError(f"FakeQuantConfig.block_k={self.block_k}: expected a multiple of {nvfp4.BLOCK}")

    def check(self, rows: int, k: int) -> None:
        if rows % self.block_rows or k % self.block_k:
            raise ValueError(f"config: FakeQuantConfig tiles ({self.block_rows}, {self.block_k}) must divide the "
                             f"weight's rows {rows} and K={k}")


def fake_quant_config(rows: int, k: int) -> FakeQuantConfig:
    """The default tiles for a weight of ``rows`` rows (E N) and K channels: up to 8 x 256, the
    fastest of the kernel registry's tiles at the bench model's weights."""
    bk = 256
    while k % bk:
        bk //= 2
    br = 8
    while rows % br:
        br //= 2
    return FakeQuantConfig(block_rows=br, block_k=bk)


def _kernel(w_ref, amax_ref, y_ref, *, arith):
    br, bk = w_ref.shape
    nb = bk // nvfp4.BLOCK
    xb = w_ref[...].astype(jnp.float32).reshape(br, nb, 1, nvfp4.BLOCK)  # blocks of one on axis 2
    gs = nvfp4.global_scale_from_amax(amax_ref[...], arith=arith)  # [br, 1], with the kernel's division
    amax = jnp.abs(xb).max(-1)  # [br, nb, 1]
    q, s = nvfp4.quantize_blocks(xb, amax, gs[:, :, None], arith=arith)
    y = (q[:, :, 0, :] * s).reshape(br, bk) * gs  # block values exact, times gs rounded once
    y_ref[...] = y.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dtype", "cfg", "interpret"))
def _call(w2, amax_rows, *, dtype, cfg, interpret):
    r, k = w2.shape
    spec = pl.BlockSpec((cfg.block_rows, cfg.block_k), lambda i, j: (i, j))
    return pl.pallas_call(
        functools.partial(_kernel, arith=kernel_arith(interpret)),
        out_shape=jax.ShapeDtypeStruct((r, k), dtype),
        grid=(r // cfg.block_rows, k // cfg.block_k),
        in_specs=[spec, pl.BlockSpec((cfg.block_rows, 1), lambda i, j: (i, 0))],
        out_specs=spec,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="nvfp4_fake_quant_weight",
    )(w2, amax_rows)


def weight_fake_quant(w, *, dtype=None, backend=None, config: FakeQuantConfig | None = None):
    """dq(q(W)) in ``dtype`` (default W's) with a straight-through gradient in W's dtype, for W
    [N, K] (one global scale) or stacked experts [E, N, K] (one per expert), quantized along K.
    The same numbers as ``nvfp4.fake_quant(w, dtype=dtype, axis=-1, keep_axes=(0,) for 3-D)``,
    which ``backend="xla"`` runs."""
    if not hasattr(w, "ndim") or w.ndim not in (2, 3):
        raise ValueError(f"w: expected a weight [N, K] or stacked experts [E, N, K], got shape {getattr(w, 'shape', None)}")
    if w.shape[-1] % nvfp4.BLOCK:
        raise ValueError(f"w: K={w.shape[-1]} must be a multiple of {nvfp4.BLOCK} (NVFP4 blocks)")
    dtype = jnp.dtype(dtype or w.dtype)
    keep = (0,) if w.ndim == 3 else ()
    if resolve_backend(backend) == "xla":
        return nvfp4.fake_quant(w, dtype=dtype, axis=-1, keep_axes=keep)
    wc = jax.lax.stop_gradient(w)
    k = w.shape[-1]
    rows = w.size // k
    config = config or fake_quant_config(rows, k)
    config.check(rows, k)
    # the amax per matrix (an exact XLA reduction); the kernel divides it into the global
    # scale itself, so no XLA division runs on the step's path (on a GPU, ``nvfp4.ieee_div``
    # is an integer loop)
    amax = jnp.max(jnp.abs(wc.astype(jnp.float32)), axis=(-2, -1), keepdims=True)  # [E, 1, 1] or [1, 1]
    amax_rows = jnp.broadcast_to(amax, (*w.shape[:-1], 1)).reshape(rows, 1)
    y = _call(wc.reshape(rows, k), amax_rows, dtype=dtype, cfg=config, interpret=interpret_mode())
    return nvfp4.straight_through(w, y.reshape(w.shape))
