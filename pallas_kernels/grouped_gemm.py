"""Grouped NVFP4 W4A4 (+RAC) GEMM for MoE experts: dropless, tokens sorted by expert.

x [M, K] holds the rows of expert 0, then expert 1, ... (``group_sizes`` [E], summing to
at most M; the output's rows past the sum are zero), w [E, N, K] is quantized along K
with per-expert global scales ([E, 1, 1]). out[rows of e] = x[rows of e] @ W_e.T.

Work is cut into (expert, row tile) items: item i covers rows [start_i, end_i) of one
expert, at most ``block_m`` of them; there are at most cdiv(M, block_m) + E items. The
programs past the real count zero the output's trailing rows (past sum(group_sizes); there
are always enough of them), then exit at once. Each program finds its item from ``group_sizes``
itself (``work_item``: a cumulative sum over the E experts and a few reductions, in
registers), so the decode step runs no XLA kernels to build an item table. Each
program streams one N tile of its expert's weight (decoded once per tile) with the same
main loop as the dense kernel. Empty experts produce no items. Several expert
weights that read the same rows (gate and up) share one launch, as in the dense kernel.
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
from pallas_kernels.tile_math import pad_axis
from pallas_kernels.gemm import (
    GemmConfig,
    _bits,
    _check_args,
    as_weights,
    code_form,
    following,
    for_each_weight,
    gemm_config,
    in_kernel_regime,
    operand_order,
    out_shapes,
    output_tile,
    reduce_split,
    reference_product,
    token_operand,
)
from pallas_kernels.quantizer import QuantizedRows


def check_group_sizes(group_sizes, m: int, e: int):
    gs = jnp.asarray(group_sizes)
    if gs.shape != (e,) or not jnp.issubdtype(gs.dtype, jnp.integer):
        raise ValueError(f"group_sizes: expected an integer array of shape ({e},), got {gs.dtype}{tuple(gs.shape)}")
    return gs.astype(jnp.int32)


def expert_of_rows(group_sizes, m: int):
    """[M] expert index of each row (rows past sum(group_sizes) get E, out of range). By
    comparison of every row against every expert's end, one fusion: the default scan
    method of ``searchsorted`` is a device loop of several kernels an iteration."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right", method="compare_all").astype(jnp.int32)


def work_item(group_sizes, i, block_m: int, n_experts: int, m: int):
    """(expert, row_start, row_end, tail) of work item ``i`` (a scalar) from ``group_sizes``
    (the ``n_experts`` sizes, then any zero padding) for ``m`` rows: items run over the
    experts in order, each expert's rows in tiles of ``block_m``. The items past the last
    (``i`` >= the total tile count; ``tail`` true) cover the trailing rows past
    sum(group_sizes) in tiles of ``block_m`` (for the kernel to zero), then no rows. Plain
    jnp on one vector, so it runs inside the kernel as in XLA; ``v[ex]`` is a masked sum (a
    reduction, not a gather)."""
    n = group_sizes.shape[0]
    tiles = (group_sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    row_end = jnp.cumsum(group_sizes)
    n_items, n_rows = jnp.sum(tiles), jnp.sum(group_sizes)
    # the item's expert: the experts whose tiles all end at or before it (empty ones included)
    ex = jnp.minimum(jnp.sum((tile_end <= i).astype(jnp.int32)), n_experts - 1)
    is_ex = jnp.arange(n) == ex
    at = lambda v: jnp.sum(jnp.where(is_ex, v, 0))
    start = at(row_end) - at(group_sizes) + (i - at(tile_end) + at(tiles)) * block_m
    end = jnp.minimum(start + block_m, at(row_end))
    tail = i >= n_items
    tail_start = n_rows + (i - n_items) * block_m
    tail_end = jnp.maximum(jnp.minimum(tail_start + block_m, m), tail_start)
    return ex, jnp.where(tail, tail_start, start), jnp.where(tail, tail_end, end), tail


def _grouped_kernel(gs_ref, src_ref, x_ref, gx_ref, w_refs, *out_refs, m, ns, k, n_experts, cfg, interpret):
    """``gs_ref``: the ``n_experts`` group sizes, zero-padded to a power of two (the program's
    work item is ``work_item`` of them and ``program_id(0)``; ``m`` the real rows, past the
    interpret mode's padding); ``src_ref`` [M]: the row of
    ``x_ref`` each sorted row reads (None: x's rows are sorted already); the rest as
    ``_gemm_kernel``."""
    it, jn_all, sk = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # read outside conditionals (interpret mode)
    ex, start, end, tail = work_item(gs_ref[...], it, cfg.block_m, n_experts, m)
    src = None
    if src_ref is not None:
        src = plgpu.load(src_ref.at[pl.ds(start, cfg.block_m)], mask=start + jnp.arange(cfg.block_m) < end, other=0)

    def tile(i, jn):
        output_tile(x_ref=x_ref, gx_ref=gx_ref, w_refs=w_refs[i], out_ref=out_refs[i], n=ns[i], jn=jn, row_start=start,
                    row_end=end, sk=sk, k=k, cfg=cfg, interpret=interpret, expert=ex, src_rows=src)

    def zero_tile(i, jn):  # the rows past sum(group_sizes) are defined as zero
        bm, bn = cfg.block_m, cfg.block_n
        mask = (start + jnp.arange(bm) < end)[:, None] & (jn * bn + jnp.arange(bn) < ns[i])[None, :]
        at = (pl.ds(start, bm), pl.ds(jn * bn, bn)) if cfg.split_k == 1 else (sk, pl.ds(start, bm), pl.ds(jn * bn, bn))
        plgpu.store(out_refs[i].at[at], jnp.zeros((bm, bn), out_refs[i].dtype), mask=mask)

    @pl.when((end > start) & ~tail)
    def _():
        for_each_weight(jn_all, ns, cfg.block_n, tile)

    @pl.when((end > start) & tail)
    def _():
        for_each_weight(jn_all, ns, cfg.block_n, zero_tile)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret"))
def _grouped_call(a, gx, src, wc, ws, gw, group_sizes, *, cfg, out_dtype, interpret):
    """One launch for the expert weights (tuples ``wc``, ``ws``, ``gw``, one entry a weight
    [E, N_i, K]) that share the rows of the token operand ``a`` (sorted by expert, or read
    through ``src`` [M], the token row of each sorted row): a tuple of [M, N_i] outputs."""
    m_real = a.shape[0] if src is None else src.shape[0]
    k = ws[0].shape[-1] * 16
    ns = tuple(c.shape[1] for c in wc)
    wc = code_form(wc, cfg)
    e = group_sizes.shape[0]
    cap = pl.cdiv(m_real, cfg.block_m) + e  # work items at most: one a row tile, plus one an expert
    gs = pad_axis(group_sizes, 0, pl.next_power_of_2(e))  # Triton loads power-of-two vectors
    if interpret:  # interpret mode clamps out-of-range slices instead of masking them
        m_pad = m_real + cfg.block_m
        if src is None:
            a, gx = pad_axis(a, 0, m_pad), None if gx is None else pad_axis(gx, 0, m_pad)
        else:
            src = pad_axis(src, 0, m_pad)
        pad_n = lambda v: pad_axis(v, 1, pl.cdiv(v.shape[1], cfg.block_n) * cfg.block_n)
        wc, ws = tuple(map(pad_n, wc)), tuple(map(pad_n, ws))
    outs = pl.pallas_call(
        functools.partial(_grouped_kernel, m=m_real, ns=ns, k=k, n_experts=e, cfg=cfg, interpret=interpret),
        out_shape=out_shapes(a.shape[0] if src is None else src.shape[0], ns, cfg, out_dtype),
        grid=(cap, sum(pl.cdiv(n, cfg.block_n) for n in ns), cfg.split_k),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nvfp4_grouped_matmul",
    )(gs, src, a, gx, tuple(zip(wc, ws, gw)))
    return tuple(reduce_split(o, cfg, out_dtype)[:m_real, :n] for o, n in zip(outs, ns))


def _per_expert_gw(w):
    e = w.shape[0]
    return jnp.broadcast_to(jnp.asarray(w.global_scale, jnp.float32).reshape(-1), (e,))


def _checked(x, w, group_sizes, mode, rac_ratio, rac_mode, rac_sum, act_scale):
    ws, many = as_weights(w)
    for wi in ws:
        _check_args(x, wi, mode, rac_ratio, rac_mode, ndim=3, rac_sum=rac_sum, act_scale=act_scale)
    e = ws[0].shape[0]
    if any(wi.shape[0] != e for wi in ws):
        raise ValueError(f"w: the weights of one grouped launch need the same expert count, got {[wi.shape for wi in ws]}")
    return ws, many, check_group_sizes(group_sizes, x.shape[0], e)


def nvfp4_grouped_matmul_xla(x, w, group_sizes, *, rac_ratio=0.0, rac_mode="token", rac_sum="fp16", act_scale="tensor", mode="w4a4", out_dtype=jnp.bfloat16):
    """The XLA reference: ``gemm.reference_product`` with ``lax.ragged_dot`` over the experts'
    block values, times each row's expert's global scale."""
    ws, many, group_sizes = _checked(x, w, group_sizes, mode, rac_ratio, rac_mode, rac_sum, act_scale)
    ex = expert_of_rows(group_sizes, x.shape[0])

    def one(wi):
        wv = jnp.swapaxes(nvfp4.block_values(wi, jnp.bfloat16), 1, 2)  # [E, K, N]
        dot = lambda a, b: jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32)
        gw = jnp.concatenate([_per_expert_gw(wi), jnp.zeros((1,), jnp.float32)])[ex][:, None]
        out = reference_product(dot, x, wv, mode=mode, rac_ratio=rac_ratio, rac_mode=rac_mode, rac_sum=rac_sum, act_scale=act_scale)
        return (out * gw).astype(out_dtype)

    outs = tuple(one(wi) for wi in ws)
    return outs if many else outs[0]


def nvfp4_grouped_matmul(x, w, group_sizes, *, rac_ratio=0.0, rac_mode="token", rac_sum="fp16", act_scale="tensor", mode="w4a4", backend=None, out_dtype=jnp.bfloat16, config: GemmConfig | None = None, quant_config=None):
    """Per-expert x_e @ W_e.T for rows sorted by expert; see the module docstring. ``w`` may be
    a sequence of expert weights with the same E and K (gate and up): one launch, a tuple of
    outputs. ``x`` may be QuantizedRows (the MoE dispatch gathers the T tokens' rows). The
    arguments as in ``nvfp4_matmul``; outside ``gemm.in_kernel_regime`` the reference runs."""
    kw = dict(rac_ratio=rac_ratio, rac_mode=rac_mode, rac_sum=rac_sum, act_scale=act_scale, mode=mode)
    if resolve_backend(backend) == "xla" or not in_kernel_regime(mode, rac_ratio, rac_mode, act_scale, rac_sum):
        return nvfp4_grouped_matmul_xla(x, w, group_sizes, out_dtype=out_dtype, **kw)
    ws, many, group_sizes = _checked(x, w, group_sizes, mode, rac_ratio, rac_mode, rac_sum, act_scale)
    m, k = x.shape
    if k % 32:
        raise ValueError(f"x: the Pallas GEMM needs K % 32 == 0 (got K={k}); use backend='xla'")
    # tiles sized for the rows an expert gets on average (decode: a few), not for all rows
    e = ws[0].shape[0]
    cfg = config or gemm_config(-(-m // e), sum(wi.shape[1] for wi in ws), k, programs_per_row_tile=e)
    if cfg.path != "fused":
        raise ValueError(f"config: GemmConfig.path={cfg.path!r} is for the dense GEMM; the grouped GEMM is fused only "
                         "(backend='xla' runs lax.ragged_dot on the decoded values)")
    src = None
    if isinstance(x, QuantizedRows):
        cfg = following(cfg, x.order, k)
        src, x = x.rows, dataclasses.replace(x, rows=None)  # the kernel applies the rows' gather in its loads
    a, gx = token_operand(x, operand_order(cfg), mode=mode, rac_ratio=rac_ratio, quant_config=quant_config)
    outs = _grouped_call(a, gx, src, tuple(wi.codes for wi in ws), tuple(_bits(wi.scales) for wi in ws),
                         tuple(_per_expert_gw(wi) for wi in ws), group_sizes, cfg=cfg, out_dtype=out_dtype,
                         interpret=interpret_mode())
    return outs if many else outs[0]
