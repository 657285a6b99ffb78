"""The rollout's activation quantizer: x [T, K] -> the FP16 token operand of the NVFP4 GEMMs.

One kernel quantizes BF16 activations to NVFP4 with a dynamic global scale per token
(computed in the kernel), takes RAC's residual, selects its highest-energy blocks per token
(``rac.py``), quantizes them a second time, and writes the GEMMs' token operand: the block
values of q(x), or with RAC the compensated ``dq(q(x)) + dq(q(r_sel))`` over gx rounded once
to FP16 (``rac.compensated_values``), each channel in the column order the consuming GEMM
reads (``tile_math.operand_columns``), and the global scales. The NVFP4 codes themselves
(``quantize_activations_rac``: per-tensor or per-token scales, any RAC selection) come from
the XLA reference, ``nvfp4.quantize`` and ``rac.quantize_residual``, whose bits the kernel's
operand reproduces exactly.

Kernel layout: the grid is (token rows / ``block_rows``, ``parts``). Program (i, p) owns
the channels [p K / parts, (p + 1) K / parts) of its tokens: it quantizes and stores only
those. What needs the whole row (the per-token amax, RAC's residual energies for the
selection) it computes from the whole row, loaded again by each of the row's programs (a
few KB from L2), so the bits do not depend on ``parts``; with ``select="energies"`` a first
kernel computes the residual energies and the global scales, and the quantizer loads those
instead of its whole row. At decode sizes ``parts`` is what keeps
the chip busy: 16 tokens are 16 programs, one a row, and RAC's selection is the longest
serial work in them; ``parts`` spreads each row's selection and stores over several programs.
Rows are walked in chunks of ``chunk`` channels (a power of two dividing K / parts), each
loaded as its even and odd channels (stride-2 loads). RAC's top fraction is exact, ties
included, ranked inside the quantizer (``_top_blocks``): with ``select="rank"`` over the
energies it computes from the whole row itself (one launch), with "energies" over the first
kernel's (no whole-row pass in the quantizer). ``QuantConfig.count`` picks how a row's top
blocks are found, the same set: an all-pairs count (one reduction, quadratic in the blocks)
or the threshold's bits one at a time (31 reductions, linear); ``quant_config`` picks both
by shape. The first kernel writes each row's energies padded to a power-of-two width with
-1.0 (Triton loads power-of-two tensors; a negative energy's bits are below every real one's,
so the padding is never counted as larger), so any block count works.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from quads_jax import nvfp4
from pallas_kernels.config import interpret_mode, resolve_backend
from pallas_kernels.tiling import device_sms
from pallas_kernels import rac
from pallas_kernels.tile_math import kernel_arith, load_even_odd, operand_columns


# ----------------------------------------------------------------------------- tuning


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    block_rows: int = 1
    chunk: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    # where RAC's top fraction is ranked from, the same selection either way: "rank" (the
    # quantizer computes the whole row's residual energies itself: one launch) or "energies"
    # (a first kernel writes them with the global scales: no whole-row pass in the quantizer).
    # quant_config picks by shape
    select: str = "energies"
    # programs per token row, each owning K / parts channels (a power of two; the same bits
    # for any value: see the module docstring)
    parts: int = 1
    # how a row's top blocks are found, the same set: "pairs" (an all-pairs count of larger
    # energies, one reduction; quadratic in the blocks) or "bits" (the n-th largest energy's
    # bit pattern, one bit at a time: 31 counts of the row, linear in the blocks)
    count: str = "pairs"

    def __post_init__(self):
        if self.select not in RAC_SELECTS:
            raise ValueError(f"QuantConfig.select={self.select!r}: expected one of {RAC_SELECTS}")
        if self.chunk < 16 or self.chunk & (self.chunk - 1):
            raise ValueError(f"QuantConfig.chunk={self.chunk}: expected a power of two >= 16")
        if not isinstance(self.parts, int) or self.parts < 1 or self.parts & (self.parts - 1):
            raise ValueError(f"QuantConfig.parts={self.parts!r}: expected a power of two >= 1")
        if self.count not in RANK_COUNTS:
            raise ValueError(f"QuantConfig.count={self.count!r}: expected one of {RANK_COUNTS}")

    def check(self, k: int) -> None:
        """Raise a ValueError naming the field unless this config can quantize rows of K channels."""
        if k % (self.parts * 16):
            raise ValueError(f"config: QuantConfig.parts={self.parts} must divide K={k} into whole 16-blocks")
        if (k // self.parts) % self.chunk:
            raise ValueError(f"config: QuantConfig.chunk={self.chunk} must divide K={k} / parts={self.parts}")


RAC_SELECTS = ("rank", "energies")  # QuantConfig.select
RANK_COUNTS = ("pairs", "bits")  # QuantConfig.count


MIN_PART = 256  # channels a program owns at the least (one 16-block of RAC selection work a warp)
PAIRS_MAX_BLOCKS = 128  # the longest rows (in 16-blocks) that quant_config ranks by the all-pairs count


def quant_config(t: int, k: int, num_sms: int | None = None) -> QuantConfig:
    """The quantizer's tiles for T rows of K channels, the fastest measured at the rollout's
    shapes (the kernel registry's "quant" regime; benchmarks/results).
    Rows of K >= 512 channels take at least two programs each (``parts``), and decode sizes
    (few tokens) split further until about one wave runs (T=16: 8 parts, T=64: 2); 1024 tokens
    and more take two rows a program, and whole rows in 256-channel chunks where K <= 512.
    RAC's selection: rows of up to PAIRS_MAX_BLOCKS blocks are ranked by the all-pairs count,
    in the quantizer's own pass (``select="rank"``: one launch) from 1024 tokens and wherever a
    program owns its whole row (K = 768, which does not split into 256-channel parts), else
    over the first kernel's energies. Longer rows take the first kernel's energies and the
    bitwise count at any size: at 256 blocks (K = 4096) the all-pairs count measured 15-38x
    slower on an H100, and the bitwise count in the one-launch rank 4-10x slower than over
    the first kernel's energies (benchmarks/results/2026-12-07-h100-bits-count-batches)."""
    num_sms = num_sms or device_sms()
    block_rows = 1 if t < 1024 else 2
    programs = -(-t // block_rows)
    parts = 1
    while (k % (parts * 2 * MIN_PART) == 0 and (parts == 1 or programs * parts * 2 <= num_sms)
           and not (block_rows > 1 and k <= 2 * MIN_PART)):
        parts *= 2
    # two whole rows of K <= 512 a program (prefill's expert down projections): 256-channel
    # chunks measured 7-9% faster than one 512-channel chunk at 2048 x 512
    chunk = 256 if block_rows > 1 and k <= 2 * MIN_PART else 1024
    while (k // parts) % chunk:
        chunk //= 2
    # 8 warps from 512-channel chunks (a parity half of 256 values: one a thread), and where a
    # program owns a whole row of 256-channel chunks (K = 768: Qwen3-30B-A3B's down projection),
    # where 4 warps measured several times slower with RAC; 16 warps on the half rows of
    # K = 512 slowed the rollout's down projection
    blocks = k // 16
    pairs = blocks <= PAIRS_MAX_BLOCKS
    select = "rank" if pairs and (t >= 1024 or parts == 1) else "energies"
    warps = 8 if chunk >= 512 or (chunk == 256 and parts == 1) else 4
    return QuantConfig(block_rows=block_rows, chunk=chunk, num_warps=warps, parts=parts, select=select,
                       count="pairs" if pairs else "bits")


# ----------------------------------------------------------------------------- kernel


def _split_blocks(v, rows, chunk):
    return v.reshape(rows, chunk // 16, 8)


def _row_global_scale(chunks, arith):
    """Per-row ``amax(|x|) / (6 * 448)`` (1.0 for an all-zero row), as ``nvfp4.global_scale_for``,
    from the row's loaded (even, odd) chunks: elementwise maxima, then one reduction."""
    m = None
    for xe, xo in chunks:
        mj = jnp.maximum(jnp.abs(xe.astype(jnp.float32)), jnp.abs(xo.astype(jnp.float32)))
        m = mj if m is None else jnp.maximum(m, mj)
    return nvfp4.global_scale_from_amax(m.max(1, keepdims=True), arith=arith)


def _top_blocks(own, energies, n_sel, count="pairs"):
    """Per row, which of the blocks ``own`` (energies, [rows, blocks] per chunk) have an energy
    >= the n_sel-th largest of the row's ``energies`` (all its chunks; ``rac.selection_mask``):
    a list of boolean masks, one per owned chunk.

    Energies are non-negative, so their int32 bit patterns order as the values do (the
    "energies" padding, -1.0, is a negative pattern, never counted as larger). ``count``:
    "pairs": a block is selected iff fewer than n_sel blocks of its row are strictly larger
    (the same set as ``>=`` the n-th largest, ties included): one all-pairs count of the
    owned blocks against the row's, one reduction (the work grows with the square of the
    blocks). "bits": the n_sel-th largest pattern is the largest p with at least n_sel
    patterns >= p, found one bit at a time from bit 30 down (31 counts of the row, each a
    reduction: linear in the blocks); a block is selected iff its pattern is >= p."""
    bits = lambda es: [jax.lax.bitcast_convert_type(e, jnp.int32) for e in es]
    obits, ebits = bits(own), bits(energies)
    if count == "bits":
        p = jnp.zeros((ebits[0].shape[0], 1), jnp.int32)
        for b in range(30, -1, -1):
            cand = p | (1 << b)
            n = _count_by_width([(e >= cand).astype(jnp.int32) for e in ebits], axis=1, keepdims=True)
            p = jnp.where(n >= n_sel, cand, p)
        return [o >= p for o in obits]
    return [_count_by_width([(ej[:, None, :] > ei[:, :, None]).astype(jnp.int32) for ej in ebits], axis=2) < n_sel
            for ei in obits]


def _count_by_width(terms, axis, keepdims=False):
    """The sum over ``axis`` of int32 ``terms`` (one per chunk of a row): terms of equal shape
    are added elementwise, in registers, and reduced once (one cross-thread sum a width, not
    one a chunk)."""
    wide = {}
    for v in terms:
        wide[v.shape] = v if v.shape not in wide else wide[v.shape] + v
    return sum(jnp.sum(v, axis=axis, keepdims=keepdims) for v in wide.values())


def _quantize_pair(ve, vo, g, arith):
    """The even and odd channels of blocks ([rows, nb, 8] float32 each) with global scale g
    [rows, 1] -> (their E2M1 values, the block scales [rows, nb, 1]). The block math runs on
    keepdims shapes, in the layout of the values: compiled, the per-block amax, scale and
    reciprocal then need no layout conversion through shared memory (barriers, in the
    offline SASS of benchmarks/results/2026-12-05-offline-sass-quant)."""
    amax = jnp.maximum(jnp.abs(ve).max(-1, keepdims=True), jnp.abs(vo).max(-1, keepdims=True))  # [rows, nb, 1]
    g3 = g[:, :, None]
    qe, s = nvfp4.quantize_blocks(ve[:, :, None, :], amax, g3, arith=arith)  # blocks of one: axis 2
    qo, _ = nvfp4.quantize_blocks(vo[:, :, None, :], amax, g3, arith=arith)
    return qe[:, :, 0, :], qo[:, :, 0, :], s


def _quantize_chunk(xe, xo, gx, rows, c, arith):
    """One chunk's even and odd channels -> (E2M1 values of each, block scales [rows, nb, 1],
    the chunk's float32 channels of each), blocks on axis 1."""
    xe = _split_blocks(xe.astype(jnp.float32), rows, c)
    xo = _split_blocks(xo.astype(jnp.float32), rows, c)
    return (*_quantize_pair(xe, xo, gx, arith), xe, xo)


def _residual(quantized, gx, arith):
    """A quantized chunk -> its residual's even and odd channels and block energies."""
    qe, qo, s3, xe, xo = quantized
    g3 = gx[:, :, None]
    re = xe - arith.mul(qe * s3, g3)
    ro = xo - arith.mul(qo * s3, g3)
    return re, ro, jnp.sum(re * re, -1) + jnp.sum(ro * ro, -1)


def _store_operand(a_ref, rows_idx, rows_ok, start, quantized, residual, rows, c, order):
    """The chunk's FP16 token operand (``rac.compensated_values``, or the block values without
    a residual: the same float32 sum, rounded once), scattered to its columns in ``order``."""
    for par in (0, 1):  # even, odd channels
        v = quantized[par] * quantized[2]  # E2M1 value x block scale: exact
        if residual is not None:
            v = v + residual[par] * residual[2] * rac.RESIDUAL_SCALE_FACTOR
        cols = operand_columns(start + par + 2 * jnp.arange(c // 2, dtype=jnp.int32), order)[None, :]
        plgpu.store(a_ref.at[rows_idx, cols], v.reshape(rows, c // 2).astype(jnp.float16), mask=rows_ok)


def _program_rows(x_ref, *, t, k, cfg, arith, interpret, g_ref=None):
    """What every quantizer program starts from: its rows (slice, in-range mask), its j-th
    owned chunk's start channel and its blocks' slice of a [T, K/16] array, the chunks loaded,
    the whole row's chunks (parts > 1: for the amax and the residual energies; None
    otherwise) and the global scales [bm, 1]. ``g_ref``: the global scales the energy pass
    wrote (the same bits: a max is exact in any order); then no program loads its whole row."""
    bm, c, own = cfg.block_rows, cfg.chunk, k // cfg.parts
    i, p = pl.program_id(0), pl.program_id(1)
    row_sl = pl.ds(i * bm, bm)
    row_ok = (i * bm + jnp.arange(bm) < t)[:, None]
    load = lambda start: load_even_odd(x_ref, row_sl, start, c, row_ok, interpret, other=0.0)
    # the owned chunks start at channel p * own + j * c (the program index times a constant,
    # never a division: see gemm_tile_loop); with parts > 1 the whole row is loaded too, for
    # the amax and the residual energies, and kept in registers (K / (32 num_warps) a thread)
    at = lambda j: p * own + j * c
    row = [load(j * c) for j in range(k // c)] if cfg.parts > 1 and g_ref is None else None
    chunks = [load(at(j)) for j in range(own // c)]
    blocks = lambda j: pl.ds(p * (own // 16) + j * (c // 16), c // 16)
    gx = _row_global_scale(row or chunks, arith) if g_ref is None else plgpu.load(g_ref.at[row_sl, :], mask=row_ok, other=1.0)
    return row_sl, row_ok, at, blocks, chunks, row, gx


def _energy_kernel(x_ref, e_ref, g_ref, *, t, k, cfg, arith, interpret):
    """The first pass of ``select="energies"``: the residual energies of the owned
    blocks, e_ref [T, W] with W = K/16 rounded up to a power of two, the columns from K/16 on
    written -1.0 by each row's first program; and the global scales g_ref [T, 1], which the
    quantizer reads instead of loading its whole row again."""
    row_sl, row_ok, _, blocks, chunks, _, gx = _program_rows(x_ref, t=t, k=k, cfg=cfg, arith=arith, interpret=interpret)
    plgpu.store(g_ref.at[row_sl, :], gx, mask=row_ok & (pl.program_id(1) == 0))
    for j, (xe, xo) in enumerate(chunks):
        e = _residual(_quantize_chunk(xe, xo, gx, cfg.block_rows, cfg.chunk, arith), gx, arith)[-1]  # [bm, c / 16]
        plgpu.store(e_ref.at[row_sl, blocks(j)], e, mask=row_ok)
    width = e_ref.shape[1]
    if width > k // 16:
        pad = (jnp.arange(width) >= k // 16)[None, :]
        plgpu.store(e_ref.at[row_sl, pl.ds(0, width)], jnp.full((cfg.block_rows, width), -1.0, jnp.float32),
                    mask=row_ok & pad & (pl.program_id(1) == 0))


def _quant_kernel(x_ref, e_ref, g_ref, a_ref, gx_ref, *, t, k, cfg, n_sel, arith, interpret, order):
    """One program: ``block_rows`` token rows x the channels of part ``program_id(1)``.
    Inputs: x [T, K] and, from the first kernel (``select="energies"``), ``e_ref`` [T, W] the
    residual energies padded to W and ``g_ref`` [T, 1] the global scales (else None). Outputs: the FP16 operand ``a_ref``
    [rows, K] in the column ``order`` (rows from T on written as zeros) and the per-token
    global scales ``gx_ref`` [T, 1]."""
    bm, c = cfg.block_rows, cfg.chunk
    i, p = pl.program_id(0), pl.program_id(1)
    row_sl, row_ok, at, blocks, chunks, row, gx = _program_rows(x_ref, t=t, k=k, cfg=cfg, arith=arith, interpret=interpret,
                                                                 g_ref=g_ref)
    plgpu.store(gx_ref.at[row_sl, :], gx, mask=row_ok & (p == 0))
    owned = [_quantize_chunk(xe, xo, gx, bm, c, arith) for xe, xo in chunks]
    second = [None] * len(owned)
    if n_sel > 0:
        residuals = [_residual(q, gx, arith) for q in owned]
        own_energy = [e for _, _, e in residuals]
        if n_sel == k // 16:  # rho 1: every block (a NaN energy is unselected, as in the reference's comparison)
            selected = [e == e for e in own_energy]
        elif cfg.select == "energies":
            # the first kernel's energies: the owned blocks' (loaded, not recomputed, so both
            # sides of each comparison have the same bits) ranked against the whole row's
            # (its padding, -1.0, is never larger than a real energy)
            load_e = lambda sl: plgpu.load(e_ref.at[row_sl, sl], mask=row_ok, other=0.0)
            selected = _top_blocks([load_e(blocks(j)) for j in range(len(owned))], [load_e(pl.ds(0, e_ref.shape[1]))], n_sel,
                                   cfg.count)
        else:
            # with parts > 1 the row's energies come from its whole, quantized once more here
            # (the owned chunks' share again: their index is the program's, not a constant)
            row_energy = own_energy if row is None else [_residual(_quantize_chunk(xe, xo, gx, bm, c, arith), gx, arith)[-1]
                                                        for xe, xo in row]
            selected = _top_blocks(own_energy, row_energy, n_sel, cfg.count)
        gr = gx * rac.RESIDUAL_SCALE_FACTOR
        for j, (re, ro, _) in enumerate(residuals):
            m = selected[j][:, :, None]
            second[j] = _quantize_pair(jnp.where(m, re, 0.0), jnp.where(m, ro, 0.0), gr, arith)
    rows_idx = (i * bm + jnp.arange(bm))[:, None]  # every row of the (padded) operand is written
    for j, (q, r) in enumerate(zip(owned, second)):
        _store_operand(a_ref, rows_idx, rows_idx < a_ref.shape[0], at(j), q, r, bm, c, order)


@functools.partial(jax.jit, static_argnames=("n_sel", "cfg", "interpret", "order", "rows"))
def _quant_call(x, *, n_sel, cfg, interpret, order, rows):
    """(the FP16 operand [rows, K] in ``order``, the global scales [T, 1]); x's rows from T to
    ``rows`` are zero (interpret mode pads x, which it loads clamped). With ``select="energies"``
    and 0 < n_sel < K/16 a first kernel writes the blocks' residual energies and the global
    scales, which the quantizer ranks and reads."""
    t, k = x.shape
    arith = kernel_arith(interpret)
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    e = g = None
    if cfg.select == "energies" and 0 < n_sel < k // 16:
        width = pl.next_power_of_2(k // 16)
        e, g = pl.pallas_call(
            functools.partial(_energy_kernel, t=t, k=k, cfg=cfg, arith=arith, interpret=interpret),
            out_shape=(jax.ShapeDtypeStruct((x.shape[0], width), jnp.float32), jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32)),
            grid=(pl.cdiv(x.shape[0], cfg.block_rows), cfg.parts), compiler_params=params, interpret=interpret,
            name="nvfp4_residual_energies",
        )(x)
    return pl.pallas_call(
        functools.partial(_quant_kernel, t=t, k=k, cfg=cfg, n_sel=n_sel, arith=arith, interpret=interpret, order=order),
        out_shape=(jax.ShapeDtypeStruct((rows, k), jnp.float16), jax.ShapeDtypeStruct((t, 1), jnp.float32)),
        grid=(pl.cdiv(rows, cfg.block_rows), cfg.parts),
        compiler_params=params,
        interpret=interpret,
        name="nvfp4_quantize_activations",
    )(x, e, g)


# ----------------------------------------------------------------------------- public API


def _check_x(x, name="x"):
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array [T, K], got shape {getattr(x, 'shape', None)}")
    if x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        raise ValueError(f"{name}: expected bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[1] % 16:
        raise ValueError(f"{name}: K={x.shape[1]} must be a multiple of 16 (NVFP4 blocks)")


def quantize_activations_rac(x, *, rac_ratio: float = 0.0, rac_mode: str = "token", act_scale: str = "tensor"):
    """x [T, K] -> (q(x), q(r_sel) or None): the NVFP4 activations and RAC's residual tensor,
    both with global scales of shape [T, 1] (one per tensor, broadcast, or one per token).
    The XLA reference: the codes the rollout's kernel (``quantize_operand``) computes and
    turns into the GEMMs' operand, and the ablations' (per-tensor scales, the tensor and
    channel selections)."""
    _check_x(x)
    rac.check_rac(rac_ratio, rac_mode)
    gx = rac.activation_global_scale(x, act_scale)
    xq = nvfp4.quantize(x.astype(jnp.float32), global_scale=gx)
    rq = rac.quantize_residual(x, gx, rac_ratio, rac_mode) if rac_ratio > 0 else None
    return xq, rq


def quantize_activations(x, *, act_scale: str = "tensor") -> nvfp4.NVFP4Tensor:
    """x [T, K] -> NVFP4Tensor (global scale [T, 1]), identical to ``nvfp4.quantize``."""
    return quantize_activations_rac(x, act_scale=act_scale)[0]


def default_order(k: int):
    """The column order of a token operand quantized ahead of its GEMMs (``quantize_rows``):
    the word decode's with 128-channel K tiles where K allows it (the grouped GEMM's tiles
    below prefill sizes), else channel order."""
    return ("words", 128) if k % 128 == 0 else ("plain", 16)


def quantize_operand(x, *, rac_ratio: float = 0.0, order=("plain", 16), rows: int | None = None, backend=None,
                     config: QuantConfig | None = None):
    """x [T, K] -> (a, gx): the FP16 token operand of the NVFP4 GEMMs straight from BF16
    activations, per-token scales and RAC's per-token selection, in one kernel.

    ``a`` [rows, K] (rows >= T, default T; the extra rows are zero) holds the block values
    of q(x), or with ``rac_ratio > 0`` RAC's compensated ``dq(q(x)) + dq(q(r_sel))`` over gx
    (``rac.compensated_values``: summed in float32, rounded once to FP16), each channel in
    the column ``tile_math.operand_columns`` gives for ``order``; gx [T, 1] the global
    scales. ``config``: the kernel's tiles (None: ``quant_config``'s).
    ``backend="xla"``: the same bits from ``quantize_activations_rac``'s codes."""
    _check_x(x)
    rac.check_rac(rac_ratio, "token")
    t, k = x.shape
    rows = t if rows is None else rows
    if rows < t:
        raise ValueError(f"rows={rows}: expected at least T={t}")
    cols = operand_columns(np.arange(k), order)  # also checks order
    config = config or quant_config(t, k)
    if not isinstance(config, QuantConfig):
        raise ValueError(f"config: expected a QuantConfig or None, got {config!r}")
    config.check(k)  # checked whatever path runs
    if resolve_backend(backend) == "xla":
        xq, rq = quantize_activations_rac(x, rac_ratio=rac_ratio, act_scale="token")
        a = rac.token_operand(xq, rq)[:, np.argsort(cols)]
        return jnp.pad(a, ((0, rows - t), (0, 0))), xq.global_scale
    interpret = interpret_mode()
    xin = jnp.pad(x, ((0, rows - t), (0, 0))) if interpret else x  # interpret mode clamps out-of-range loads
    a, gx = _quant_call(xin, n_sel=rac.num_selected(rac_ratio, k // 16), cfg=config, interpret=interpret,
                        order=tuple(order), rows=rows)
    return a, gx[:t]


# ----------------------------------------------------------------------------- quantized rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """Per-token quantized activations, computed once and used by several GEMMs: the FP16 token
    operand ``a`` [T, K] in column ``order`` and the global scales ``gx`` [T, 1]
    (``quantize_operand``). The NVFP4 GEMMs take one in place of x. With per-token scales a
    row's quantization does not depend on the other rows, so ``take`` (a row gather, e.g. the
    MoE dispatch) commutes with quantization: quantize the T tokens, not their T x top-k
    copies. ``rows`` (None: a's rows in order) holds such a gather unapplied: the grouped GEMM
    reads its rows through the index inside the kernel, with no [T * top-k, K] copy; every
    other consumer applies it first (``gathered``)."""

    a: jax.Array
    gx: jax.Array
    rac_ratio: float = dataclasses.field(metadata=dict(static=True))
    order: tuple = dataclasses.field(metadata=dict(static=True))
    rows: jax.Array | None = None

    @property
    def shape(self):
        return (self.a.shape[0] if self.rows is None else self.rows.shape[0], self.a.shape[1])

    @property
    def ndim(self):
        return 2

    def take(self, rows):
        """The rows ``rows`` (an index array), gathered lazily (see the class docstring)."""
        rows = jnp.asarray(rows, jnp.int32)
        return dataclasses.replace(self, rows=rows if self.rows is None else self.rows[rows])

    def gathered(self):
        """The same rows with the gather applied: ``rows`` None."""
        if self.rows is None:
            return self
        return QuantizedRows(self.a[self.rows], self.gx[self.rows], self.rac_ratio, self.order)

    def plain(self):
        """The operand in channel order (the reference's product reads it so)."""
        a = self.gathered().a
        return a if self.order[0] == "plain" else a[:, operand_columns(np.arange(a.shape[1]), self.order)]


def quantize_rows(x, *, rac_ratio: float = 0.0, rac_mode: str = "token", order=None, backend=None,
                  config: QuantConfig | None = None) -> QuantizedRows:
    """x [T, K] -> QuantizedRows (the rollout's activations, per-token scales), in ``order``
    (default ``default_order(K)``)."""
    if rac_mode != "token":
        raise ValueError(f"rac_mode={rac_mode!r}: QuantizedRows needs the per-token selection ('token'), whose rows are independent")
    order = tuple(order or default_order(x.shape[-1]))
    a, gx = quantize_operand(x, rac_ratio=rac_ratio, order=order, backend=backend, config=config)
    return QuantizedRows(a, gx, float(rac_ratio), order)
