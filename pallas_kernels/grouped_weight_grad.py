"""Per-expert weight gradient of a grouped matmul: dW[e] = x_e.T @ dy_e (Pallas, Triton).

    dw = grouped_dw(x, dy, group_sizes)      # x [M, K], dy [M, N] sorted by expert -> [E, K, N]

The backward pass of ``grouped_dot`` needs this product, which contracts over the ragged
(row) axis. tokamax's kernel for it (``ragged_contracting_dim_dot``) runs far below its
forward and dx kernels at the bench model's shapes (benchmarks/results/2026-12-05-h100-train-
tiles). This kernel
gives each (expert, K tile, N tile) one program that walks its expert's rows in
``block_r``-row steps and accumulates x_tile.T @ dy_tile into FP32 registers: rows outside
the expert are masked at the load, so no transpose of x and no mask multiply per step.
Experts with no rows write zeros. ``grouped_dw_xla`` (``lax.ragged_dot_general`` with the
ragged contracting dimension) is the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.config import DwTiles, interpret_mode
from pallas_kernels.tile_math import mma_acc, pad_axis

DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                         rhs_group_dimensions=[])


def _check(x, dy, group_sizes):
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"x, dy: expected [M, K] and [M, N] with the same M, got {x.shape} and {dy.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes: expected a 1-D integer array, got {group_sizes.dtype}{group_sizes.shape}")


def grouped_dw_xla(x, dy, group_sizes, *, out_dtype=None):
    """The reference: ``lax.ragged_dot_general`` over the ragged contracting axis, FP32 accumulation."""
    _check(x, dy, group_sizes)
    y = jax.lax.ragged_dot_general(x, dy, group_sizes.astype(jnp.int32), DIMS, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def _dw_kernel(start_ref, size_ref, x_ref, dy_ref, o_ref, *, cfg):
    if cfg.expert_outer:  # the grid is (N tiles, K tiles, experts): N tiles launch fastest
        jn, ik, e = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:
        e, ik, jn = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = start_ref[e]
    size = size_ref[e]
    ks = pl.ds(ik * cfg.block_k, cfg.block_k)
    ns = pl.ds(jn * cfg.block_n, cfg.block_n)

    def body(i, acc):
        r = start + i * cfg.block_r
        ok = (i * cfg.block_r + jnp.arange(cfg.block_r)) < size
        a = plgpu.load(x_ref.at[pl.ds(r, cfg.block_r), ks], mask=ok[:, None], other=0)
        b = plgpu.load(dy_ref.at[pl.ds(r, cfg.block_r), ns], mask=ok[:, None], other=0)
        return mma_acc(acc, a.T, b.T)

    acc = jax.lax.fori_loop(0, pl.cdiv(size, cfg.block_r), body, jnp.zeros((cfg.block_k, cfg.block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret"))
def _dw_call(x, dy, group_sizes, *, cfg, out_dtype, interpret):
    m, k = x.shape
    n = dy.shape[1]
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    if interpret:  # interpret mode clamps out-of-range slices instead of masking them
        x, dy = pad_axis(x, 0, m + cfg.block_r), pad_axis(dy, 0, m + cfg.block_r)
    # Triton launches grid axis 0 fastest. Expert outermost, the programs running at once
    # cover a few experts' K x N tiles, which read the same rows of x (N tiles) and dy (K
    # tiles) at about the same time: L2 serves the repeats. Expert fastest, they each stream
    # a different expert's rows from HBM, N/block_n times over for x and K/block_k for dy.
    if cfg.expert_outer:
        grid, where = (n // cfg.block_n, k // cfg.block_k, e), lambda j, i, g: (g, i, j)
    else:
        grid, where = (e, k // cfg.block_k, n // cfg.block_n), lambda g, i, j: (g, i, j)
    return pl.pallas_call(
        functools.partial(_dw_kernel, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((e, k, n), out_dtype),
        grid=grid,
        out_specs=pl.BlockSpec((None, cfg.block_k, cfg.block_n), where),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="grouped_dw",
    )(starts, sizes, x, dy)


def grouped_dw(x, dy, group_sizes, *, out_dtype=None, config: DwTiles | None = None):
    """dW[e] = x_e.T @ dy_e for rows sorted by expert (``group_sizes`` [E] summing to at most M;
    rows past the sum are ignored): [E, K, N] in ``out_dtype`` (default x's), FP32 accumulation."""
    _check(x, dy, group_sizes)
    cfg = config or DwTiles()
    cfg.check(x.shape[1], dy.shape[1])
    if x.dtype != dy.dtype:
        raise ValueError(f"x, dy: expected one dtype, got {x.dtype} and {dy.dtype}")
    return _dw_call(x, dy, group_sizes, cfg=cfg, out_dtype=jnp.dtype(out_dtype or x.dtype), interpret=interpret_mode())
