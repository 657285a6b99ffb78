"""NVFP4 W4A4 GEMM with fused residual activation compensation (RAC), for Hopper.

    out = gw * (gx * (Xq @ Wq.T) + gr * (Rq @ Wq.T))          (FP32 accumulation)
        = gw * gx * (Xq @ Wq.T + (Rq @ Wq.T) / 4)           (gr = gx / 4)

where Xq, Rq, Wq are the NVFP4 block values (E2M1 code times its E4M3 block scale, exact
in BF16) of the activations, the selected activation residual and the weight, and gx, gr,
gw their global scales. Hopper has no FP4 tensor cores: each weight tile is decoded once
in registers (codes -> E2M1 -> times the block scale -> BF16) and feeds one BF16 MMA
(``tile_math.mma_acc``: accumulating in place), the global scales applied in the epilogue.
That is a native NVFP4 GEMM's numerics up to accumulation order, while moving 4.5 bits per
weight. RAC (see ``pallas_kernels.rac``): the token operand is the compensated activation
Xq + Rq / 4 rounded once to FP16, the weight decoded to FP16 (exact; the word decode
scales it by ``tile_math.WORD_VALUE_SCALE``, undone in the epilogue), so RAC costs no extra
MMA. ``rac_sum="exact"`` (the two products summed in FP32, as the SGLang plugin computes
them; for parity checks) runs the dequantized dot below, not the fused kernel.

Packed codes hold channel 2j in the low and 2j+1 in the high nibble, so a K-tile splits
into its even and odd channels: ``A_even @ W_even.T + A_odd @ W_odd.T``, which needs no
interleave in registers. Block scales (one per 16 channels = 8 packed bytes) are decoded
to BF16 by integer bit operations and expanded along the packed axis with a broadcast +
reshape. ``decode="words"`` reads the codes as uint32 words of 8 instead and splits a K
tile into four parts of channel pairs (``tile_math.WORD_PAIRS``), the activations following
the same channel order.

Several weights that read the same activations (q/k/v, gate/up) go into one launch: their
N tiles lie side by side on the grid (``for_each_weight``), the activations are quantized
once, and the result is a tuple of outputs.

``mode="w4a16"`` keeps the activations in BF16 (weight-only quantization). Decode-size
problems (few tokens) use split-K so that enough programs stream the weight. Prefill-size
problems (``GemmConfig.path="dequant"``, the default from 512 tokens) decode both operands
to BF16 once and run the dense BF16 dot: the fused kernel would decode each weight tile
once per row tile, and the dense dot's MMA pipeline is far faster than decode + MMA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from quads_jax import nvfp4
from pallas_kernels.tiling import GemmConfig, gemm_config  # noqa: F401  (re-exported)
from pallas_kernels.config import interpret_mode, resolve_backend
from pallas_kernels import rac
from pallas_kernels.quantizer import QuantizedRows, quantize_activations_rac, quantize_operand
from pallas_kernels.tile_math import (WORD_PARTS, WORD_VALUE_SCALE, decode_tile, decode_words, load_even_odd, mma_acc,  # noqa: F401
                                      pad_axis, rows_at, to_word_parts_order)

MODES = ("w4a4", "w4a16")


# tiles: GemmConfig and the gemm_config heuristic live in pallas_kernels.tiling


def gemm_tile_loop(*, kt_start, steps, cfg, load_a, load_w):
    """The shared main loop: accumulates A @ W.T over ``steps`` K-tiles in FP32 for the
    ``block_m`` activation rows of the tile. Returns the [block_m, block_n] tile (with
    ``swap_ab`` accumulated as W @ A.T, [block_n, block_m], and transposed at the end).

    Loaders take the K-tile index ``kt`` and form their offsets as kt times a constant: no
    integer division in an index (a floor division hides the offsets' alignment from
    Triton, which then loads the codes byte by byte instead of 16 bytes at a time)."""
    bm, bn = cfg.block_m, cfg.block_n

    def body(i, acc):
        kt = kt_start + i
        for a, w in zip(load_a(kt), load_w(kt)):  # the tile's channels in parts (even/odd, or 8 word parts)
            acc = mma_acc(acc, w, a) if cfg.swap_ab else mma_acc(acc, a, w)
        return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, bm) if cfg.swap_ab else (bm, bn), jnp.float32))
    return acc.T if cfg.swap_ab else acc


def make_loaders(*, x_ref, wc_ref, ws_ref, act_sl, act_ok, col_sl, col_ok, cfg, interpret, w_index=()):
    """Tile loaders for the activation rows ``act_sl`` (a slice, or an index array: a gather)
    of ``x_ref`` (BF16 values, or RAC's
    FP16 compensated values) and the weight codes. Each returns the tile's channels in parts,
    the same parts for both operands: the even and odd channels, or with ``decode="words"``
    the four word parts (``tile_math.WORD_PAIRS``; activation values then come in that
    order, see ``token_operand``). Both come in the activations' type (the MMA operand
    type; the weight's block values are exact in BF16 and FP16)."""
    bn, bk = cfg.block_n, cfg.block_k
    words = cfg.decode == "words"
    dtype = x_ref.dtype

    def load_w(kt):
        if words:
            wc = plgpu.load(wc_ref.at[(*w_index, col_sl, pl.ds(kt * (bk // 8), bk // 8))], mask=col_ok, other=0)
            ws = plgpu.load(ws_ref.at[(*w_index, col_sl, pl.ds(kt * (bk // 16), bk // 16))], mask=col_ok, other=0)
            return decode_words(wc, ws, bn, bk, interpret, dtype)
        wc = plgpu.load(wc_ref.at[(*w_index, col_sl, pl.ds(kt * (bk // 2), bk // 2))], mask=col_ok, other=0)
        ws = plgpu.load(ws_ref.at[(*w_index, col_sl, pl.ds(kt * (bk // 16), bk // 16))], mask=col_ok, other=0)
        return decode_tile(wc, ws, bn, bk, dtype)

    def load_a(kt):
        if words:  # laid out in word-part order by token_operand: contiguous slices
            return tuple(plgpu.load(rows_at(x_ref, act_sl, pl.ds(kt * bk + q * (bk // WORD_PARTS), bk // WORD_PARTS)),
                                    mask=act_ok, other=0.0) for q in range(WORD_PARTS))
        return load_even_odd(x_ref, act_sl, kt * bk, bk, act_ok, interpret, other=0.0)

    return load_a, load_w


def operand_order(cfg):
    """The column order (``tile_math.operand_columns``) of the fused kernel's token operand:
    the word parts of each ``block_k`` tile with the word decode, else channel order."""
    return ("words", cfg.block_k) if cfg.decode == "words" else ("plain", 16)


def following(cfg, order, k):
    """``cfg`` with the decode that reads a token operand in ``order`` (rows quantized ahead of
    the GEMM, ``QuantizedRows``): the word decode with K tiles of the order's, or the bit
    decode."""
    kind, tile = order
    cfg = dataclasses.replace(cfg, decode="words", block_k=tile) if kind == "words" else dataclasses.replace(cfg, decode="bits")
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"x: QuantizedRows in order {order} need K={k} to be a multiple of block_k * split_k = "
                         f"{cfg.block_k * cfg.split_k}")
    return cfg


def token_operand(x, order, *, mode, rac_ratio, quant_config):
    """(a, gx): the token operand in column ``order`` and its global scales. w4a16: x in BF16
    and no scale; QuantizedRows: their operand (callers ask for the rows' own order, which the
    fused kernel's config follows, or for channel order); else the quantizer's FP16 operand
    (``quantize_operand``: q(x), or RAC's compensated activation), written in ``order`` by the
    quantizer itself."""
    if mode == "w4a16":
        v = x.astype(jnp.bfloat16)
        return (v if order[0] == "plain" else to_word_parts_order(v, order[1])), None
    if isinstance(x, QuantizedRows):
        x = x.gathered()
        return (x.a if x.order == tuple(order) else x.plain()), x.gx
    return quantize_operand(x, rac_ratio=rac_ratio, order=order, backend="pallas", config=quant_config)


# ----------------------------------------------------------------------------- kernel


def for_each_weight(jn, ns, bn, fn):
    """Run ``fn(i, local_jn)`` for the weight whose N tiles hold global tile ``jn``: the
    weights sharing one launch lie side by side along the grid's N axis."""
    off = 0
    for i, n in enumerate(ns):
        tiles = pl.cdiv(n, bn)
        if len(ns) == 1:
            fn(i, jn)
        else:
            pl.when((jn >= off) & (jn < off + tiles))(functools.partial(fn, i, jn - off))
        off += tiles


def _gemm_kernel(x_ref, gx_ref, w_refs, *out_refs, t, ns, k, cfg, interpret):
    """``w_refs``: (codes, scale bits, global scale) of each weight; one output a weight.
    ``gx_ref`` is None for w4a16."""
    im, sk = pl.program_id(0), pl.program_id(2)

    def tile(i, jn):
        output_tile(x_ref=x_ref, gx_ref=gx_ref, w_refs=w_refs[i], out_ref=out_refs[i], n=ns[i], jn=jn,
                    row_start=im * cfg.block_m, row_end=t, sk=sk, k=k, cfg=cfg, interpret=interpret)

    for_each_weight(pl.program_id(1), ns, cfg.block_n, tile)


def output_tile(*, x_ref, gx_ref, w_refs, out_ref, n, jn, row_start, row_end, sk, k, cfg, interpret, expert=None,
                src_rows=None):
    """One program's output tile: token rows [row_start, row_start + block_m) (those below
    ``row_end`` real) x N tile ``jn`` of one weight (``w_refs``: codes, scales, global
    scales; ``expert`` indexes stacked expert weights), over this program's share of K
    (split ``sk``), stored to ``out_ref`` (FP32 partials when split). ``src_rows`` [block_m]:
    the rows of ``x_ref`` and ``gx_ref`` that the output rows read (a gather in the loads),
    None: the output rows themselves."""
    wc_ref, ws_ref, gw_ref = w_refs
    bm, bn = cfg.block_m, cfg.block_n
    row_sl = pl.ds(row_start, bm)
    act_sl = row_sl if src_rows is None else src_rows
    row_ok = (row_start + jnp.arange(bm) < row_end)[:, None]
    col_sl = pl.ds(jn * bn, bn)
    col_ok = (jn * bn + jnp.arange(bn) < n)[:, None]
    load_a, load_w = make_loaders(x_ref=x_ref, wc_ref=wc_ref, ws_ref=ws_ref, act_sl=act_sl, act_ok=row_ok, col_sl=col_sl,
                                  col_ok=col_ok, cfg=cfg, interpret=interpret, w_index=() if expert is None else (expert,))
    steps = k // (cfg.block_k * cfg.split_k)
    acc = gemm_tile_loop(kt_start=sk * steps, steps=steps, cfg=cfg, load_a=load_a, load_w=load_w)
    if cfg.decode == "words":  # the word decode's values carry a power of two, exact to undo in FP32
        acc = acc * (1.0 / WORD_VALUE_SCALE)
    out = epilogue(acc, gx_ref, act_sl, row_ok, gw_ref[0 if expert is None else expert])
    out_mask = row_ok & (jn * bn + jnp.arange(bn) < n)[None, :]
    if cfg.split_k == 1:
        plgpu.store(out_ref.at[row_sl, col_sl], out.astype(out_ref.dtype), mask=out_mask)
    else:
        plgpu.store(out_ref.at[sk, row_sl, col_sl], out, mask=out_mask)


def epilogue(acc, gx_ref, act_sl, row_ok, gw):
    """gw * gx * acc (w4a16: gw * acc); RAC's residual share is in acc already."""
    if gx_ref is None:  # w4a16
        return acc * gw
    gx = plgpu.load(rows_at(gx_ref, act_sl, pl.ds(0, 1)), mask=row_ok, other=0.0)  # [bm, 1]
    return acc * gx * gw


def code_form(wc, cfg):
    """Weight codes in the form ``cfg.decode`` reads: uint32 words of 8 codes ("words") or
    bytes ("bits"). Prepared weights come in the default's form; the other is converted here
    (an XLA op that copies the codes)."""
    return tuple(map(nvfp4.code_words if cfg.decode == "words" else nvfp4.code_bytes, wc))


def out_shapes(rows, ns, cfg, out_dtype):
    """One output a weight: [rows, N_i], or FP32 partials [split_k, rows, N_i] when split."""
    if cfg.split_k == 1:
        return tuple(jax.ShapeDtypeStruct((rows, n), out_dtype) for n in ns)
    return tuple(jax.ShapeDtypeStruct((cfg.split_k, rows, n), jnp.float32) for n in ns)


def reduce_split(o, cfg, out_dtype):
    return o if cfg.split_k == 1 else o.sum(0).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret"))
def _gemm_call(a, gx, wc, ws, gw, *, cfg, out_dtype, interpret):
    """One launch for the weights (codes ``wc``, scale bits ``ws``, global scales ``gw``:
    tuples, one entry a weight) that share the token operand ``a`` [T, K] (and its global
    scales ``gx`` [T, 1], None for w4a16): a tuple of [T, N_i] outputs."""
    t_real = a.shape[0]
    k = ws[0].shape[-1] * 16
    ns = tuple(c.shape[0] for c in wc)
    wc = code_form(wc, cfg)
    if interpret:  # interpret mode clamps out-of-range slices instead of masking them
        t_pad = pl.cdiv(t_real, cfg.block_m) * cfg.block_m
        a, gx = pad_axis(a, 0, t_pad), None if gx is None else pad_axis(gx, 0, t_pad)
        pad_n = lambda v: pad_axis(v, 0, pl.cdiv(v.shape[0], cfg.block_n) * cfg.block_n)
        wc, ws = tuple(map(pad_n, wc)), tuple(map(pad_n, ws))
    t = a.shape[0]
    outs = pl.pallas_call(
        functools.partial(_gemm_kernel, t=t, ns=ns, k=k, cfg=cfg, interpret=interpret),
        out_shape=out_shapes(t, ns, cfg, out_dtype),
        grid=(pl.cdiv(t, cfg.block_m), sum(pl.cdiv(n, cfg.block_n) for n in ns), cfg.split_k),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nvfp4_matmul",
    )(a, gx, tuple(zip(wc, ws, gw)))
    return tuple(reduce_split(o, cfg, out_dtype)[:t_real, :n] for o, n in zip(outs, ns))


# ----------------------------------------------------------------------------- public API


def check_weight(w, name="w", ndim=2):
    if not isinstance(w, nvfp4.NVFP4Tensor):
        raise ValueError(f"{name}: expected an NVFP4Tensor (nvfp4.quantize of the [N, K] weight), got {type(w).__name__}")
    if w.ndim != ndim or w.axis != ndim - 1:
        raise ValueError(f"{name}: expected a rank-{ndim} weight quantized along its last axis (K), got shape {w.shape} axis {w.axis}")


def _check_args(x, w, mode, rac_ratio, rac_mode, ndim=2, rac_sum="fp16", act_scale="token"):
    check_weight(w, ndim=ndim)
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"x: expected a 2-D array [T, K], got shape {getattr(x, 'shape', None)}")
    if x.shape[1] != w.shape[-1]:
        raise ValueError(f"x: K={x.shape[1]} does not match the weight's K={w.shape[-1]} (w.shape={w.shape})")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    rac.check_rac(rac_ratio, rac_mode, rac_sum)
    if mode == "w4a16" and rac_ratio > 0:
        raise ValueError("rac_ratio: residual compensation needs mode='w4a4' (w4a16 has no activation error)")
    if isinstance(x, QuantizedRows) and (mode != "w4a4" or act_scale != "token" or rac_mode != "token" or x.rac_ratio != float(rac_ratio)
                                         or (rac_ratio > 0 and rac_sum != "fp16")):
        raise ValueError(f"x: QuantizedRows (rac_ratio={x.rac_ratio}, per-token scales and selection, the FP16 RAC sum) used by a "
                         f"GEMM with mode={mode!r}, rac_ratio={rac_ratio}, rac_mode={rac_mode!r}, act_scale={act_scale!r}, "
                         f"rac_sum={rac_sum!r}")


def in_kernel_regime(mode, rac_ratio, rac_mode, act_scale, rac_sum) -> bool:
    """Whether the Pallas kernels compute this product: BF16 activations (w4a16), or W4A4 with
    per-token scales, RAC's per-token selection and its FP16 sum: the rollout's quantization.
    The ablations (per-tensor scales, the tensor and channel selections) and ``rac_sum="exact"``
    (the SGLang plugin's FP32 sum of two products, for parity checks) run the XLA reference."""
    return mode == "w4a16" or (act_scale == "token" and (rac_ratio == 0 or (rac_mode == "token" and rac_sum == "fp16")))


def reference_product(dot, x, wv, *, mode, rac_ratio, rac_mode, rac_sum, act_scale):
    """The activation side times the weight's BF16 block values ``wv`` in float32, before the
    weight's global scale, for ``dot(a, b)`` (any contraction: dense or ragged): x in BF16
    (w4a16); QuantizedRows' FP16 operand times their gx; else the XLA quantizer's codes, their
    block values (exact), gx * (Xv @ Wv) + gr * (Rv @ Wv), with ``rac_sum="fp16"`` as one FP16
    product of ``rac.compensated_values``."""
    if mode == "w4a16":
        return dot(x.astype(jnp.bfloat16), wv)
    if isinstance(x, QuantizedRows):
        return dot(x.plain(), wv.astype(jnp.float16)) * x.gathered().gx
    xq, rq = quantize_activations_rac(x, rac_ratio=rac_ratio, rac_mode=rac_mode, act_scale=act_scale)
    if rq is not None and rac_sum == "fp16":
        return dot(rac.compensated_values(xq, rq), wv.astype(jnp.float16)) * xq.global_scale
    out = dot(nvfp4.block_values(xq), wv) * xq.global_scale
    if rq is not None:
        out = out + dot(nvfp4.block_values(rq), wv) * rq.global_scale
    return out


def as_weights(w):
    """(weights tuple, whether a sequence was given): GEMMs take one NVFP4 weight or several
    that share the activations (q/k/v, gate/up), computed in one launch."""
    if isinstance(w, (tuple, list)):
        if not w:
            raise ValueError("w: expected an NVFP4Tensor or a non-empty sequence of them")
        return tuple(w), True
    return (w,), False


def _dot_nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def nvfp4_matmul_xla(x, w, *, rac_ratio=0.0, rac_mode="token", rac_sum="fp16", act_scale="tensor", mode="w4a4", out_dtype=jnp.bfloat16):
    """The XLA reference: ``reference_product`` with ``jnp.dot`` (BF16 or FP16 in, FP32 out),
    times the weight's global scale."""
    ws, many = as_weights(w)
    for wi in ws:
        _check_args(x, wi, mode, rac_ratio, rac_mode, rac_sum=rac_sum, act_scale=act_scale)
    kw = dict(mode=mode, rac_ratio=rac_ratio, rac_mode=rac_mode, rac_sum=rac_sum, act_scale=act_scale)
    outs = tuple((reference_product(_dot_nt, x, nvfp4.block_values(wi), **kw) * jnp.asarray(wi.global_scale, jnp.float32))
                 .astype(out_dtype) for wi in ws)
    return outs if many else outs[0]


def _bits(scales):
    return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def nvfp4_matmul(x, w, *, rac_ratio=0.0, rac_mode="token", rac_sum="fp16", act_scale="tensor", mode="w4a4", backend=None, out_dtype=jnp.bfloat16, config: GemmConfig | None = None, quant_config=None):
    """x [T, K] @ W.T for an NVFP4 weight W [N, K] (checkpoint layout, quantized along K).

    mode "w4a4": activations quantized to NVFP4 on the fly (per-tensor or per-token global
    scale), plus RAC with ``rac_ratio`` (0 = naive W4A4), its two products added as ``rac_sum``
    says (``pallas_kernels.rac``: "fp16", one FP16 MMA of the compensated activation, or
    "exact", the two products summed in FP32); "w4a16": BF16 activations. ``x`` may be
    QuantizedRows (``quantize_rows``: quantized ahead, per-token).
    Returns [T, N] in ``out_dtype``. ``w`` may be a sequence of weights with the same K (the
    projections that read one input): then the activations are quantized once, one launch
    computes every product, and the result is the tuple of their outputs. ``backend`` None
    picks the Pallas kernels on a GPU; they cover the rollout's regime (``in_kernel_regime``),
    the rest runs the reference. ``config`` and ``quant_config`` (a QuantConfig) override the
    GEMM's and the activation quantizer's tiles (the GEMM's are chosen for the summed N)."""
    kw = dict(rac_ratio=rac_ratio, rac_mode=rac_mode, rac_sum=rac_sum, act_scale=act_scale, mode=mode)
    if resolve_backend(backend) == "xla" or not in_kernel_regime(mode, rac_ratio, rac_mode, act_scale, rac_sum):
        return nvfp4_matmul_xla(x, w, out_dtype=out_dtype, **kw)
    ws, many = as_weights(w)
    for wi in ws:
        _check_args(x, wi, mode, rac_ratio, rac_mode, rac_sum=rac_sum, act_scale=act_scale)
    t, k = x.shape
    if k % 32:
        raise ValueError(f"x: the Pallas GEMM needs K % 32 == 0 (got K={k}); use backend='xla'")
    cfg = config or gemm_config(t, sum(wi.shape[0] for wi in ws), k)
    if cfg.path == "dequant":  # the operand in channel order, one dense dot a weight
        a, gx = token_operand(x, ("plain", 16), mode=mode, rac_ratio=rac_ratio, quant_config=quant_config)
        dot = lambda wi: _dot_nt(a, nvfp4.block_values(wi, a.dtype)) * (1.0 if gx is None else gx)
        outs = tuple((dot(wi) * jnp.asarray(wi.global_scale, jnp.float32)).astype(out_dtype) for wi in ws)
    else:
        if isinstance(x, QuantizedRows):
            cfg = following(cfg, x.order, k)
        a, gx = token_operand(x, operand_order(cfg), mode=mode, rac_ratio=rac_ratio, quant_config=quant_config)
        gw = tuple(jnp.reshape(jnp.asarray(wi.global_scale, jnp.float32), (1,)) for wi in ws)
        outs = _gemm_call(a, gx, tuple(wi.codes for wi in ws), tuple(_bits(wi.scales) for wi in ws), gw, cfg=cfg,
                          out_dtype=out_dtype, interpret=interpret_mode())
    return outs if many else outs[0]
