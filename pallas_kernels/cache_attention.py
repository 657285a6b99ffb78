"""Decode attention over the live part of a KV cache: one new query token per row.

    o = decode_attention(q, k_cache, v_cache, lengths)   # q [B, H, D]; caches [B, S, Hkv, D]; lengths [B]

Row b attends to its keys 0 .. lengths[b] - 1 (a row of length 0 gets zeros). The cache
stays in the engine's layout [B, S, Hkv, D], so nothing is copied or transposed per step.
One program per (row, KV head, split) loops over the key blocks below the row's length
only: the bytes a step reads grow with the live tokens, not with the cache's size (the
XLA reference reads, scores and masks the whole cache). The G query heads that share a
KV head (GQA) form one MMA operand, padded to 16 rows (an XLA pad before the kernel and a
slice after it). ``DecodeAttentionConfig.heads="row"`` instead runs one program per (row,
split) over all H query heads as one operand (H >= 16: no padding, q and the output in
their own layout): each key block's scores are H x block_k products against every KV head,
each query row keeping its own head's (Hkv MMAs a block, as many as the padded per-head
programs do together when H = 16).

``DecodeAttentionConfig.splits`` > 1 cuts each row's live keys into that many parts, whose
partial softmax results (unnormalised output, max, sum) are merged afterwards
(flash-decoding): more programs when batch x KV heads is small against the SM count.
``splits=None`` picks it from the batch (``splits_for``): about two waves of the SMs for
the per-head programs, one wave for the per-row ones (at B=256 one split a row, the fastest
measured).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.config import DecodeAttentionConfig, interpret_mode
from pallas_kernels.tiling import device_sms

_MIN_ROWS = 16  # the smallest MMA operand: the G query heads of a KV head are padded to it
_NEG = -1e30


def splits_for(batch: int, kv_heads: int, programs: int | None = None, most: int = 8) -> int:
    """Splits that give about ``programs`` programs (default: two waves of the device's SMs),
    at most ``most``."""
    programs = programs or 2 * device_sms()
    return max(1, min(most, -(-programs // max(1, batch * kv_heads))))


def decode_attention_xla(q, k, v, lengths):
    """The reference: FP32 scores over the whole cache, masked to the live keys."""
    b, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, h // hkv, d)
    s = jnp.einsum("bkgd,bskd->bkgs", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * (d**-0.5)
    live = jnp.arange(k.shape[1])[None, :] < lengths[:, None]  # [B, S]
    s = jnp.where(live[:, None, None], s, _NEG)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)) * live[:, None, None]
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bkgs,bskd->bkgd", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
    return o.reshape(b, h, d).astype(q.dtype)


def _dot(a, b, b_axis):
    """a [m, k] times b ([n, k] for b_axis 1, [k, n] for 0), FP32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (b_axis,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_k, splits, scale, seq, kv_heads):
    """One program: row b, split s, and KV head ``program_id(1)`` (``kv_heads`` None: q_ref
    holds that head's padded group) or every KV head (``kv_heads`` = Hkv: q_ref holds all H
    query heads, head j's G rows at j G ...)."""
    if kv_heads is None:
        b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        heads = (h,)
    else:
        b, s = pl.program_id(0), pl.program_id(1)
        heads = tuple(jnp.int32(j) for j in range(kv_heads))  # arrays, as program ids are (interpret mode's loads)
    n = len_ref[b]
    chunk = pl.cdiv(pl.cdiv(n, splits), block_k) * block_k  # this row's keys per split, whole blocks
    lo = s * chunk
    hi = jnp.minimum(lo + chunk, n)
    q = q_ref[...]  # [Gp, D] or [H, D]
    gp, d = q.shape
    cols = jnp.arange(block_k)
    group = jnp.arange(gp) // (gp // len(heads))  # each query row's KV head (among ``heads``)

    def body(i, carry):
        acc, m, l = carry
        start = lo + i * block_k
        idx = start + cols
        live = idx < hi
        ok = jnp.broadcast_to((idx < seq)[:, None], (block_k, d))
        kv = [(plgpu.load(k_ref.at[b, pl.ds(start, block_k), h, :], mask=ok, other=0.0),  # [bk, D] each
               plgpu.load(v_ref.at[b, pl.ds(start, block_k), h, :], mask=ok, other=0.0)) for h in heads]
        mine = lambda j: (group == j)[:, None]
        sc = None
        for j, (kt, _) in enumerate(kv):
            sj = _dot(q, kt.astype(q.dtype), 1)  # [rows, bk] FP32
            sc = sj if len(kv) == 1 else jnp.where(mine(j), sj, 0.0 if sc is None else sc)
        sc = jnp.where(live[None, :], sc * scale, _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        p = jnp.exp(sc - m_new[:, None]) * live[None, :].astype(jnp.float32)
        corr = jnp.exp(m - m_new)
        for j, (_, vt) in enumerate(kv):
            pj = p if len(kv) == 1 else jnp.where(mine(j), p, 0.0)
            acc = (acc * corr[:, None] if j == 0 else acc) + _dot(pj.astype(vt.dtype), vt, 0)
        return acc, m_new, l * corr + jnp.sum(p, axis=1)

    steps = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)
    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), _NEG, jnp.float32), jnp.zeros((gp,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, steps, body, init)
    if splits == 1:  # the whole row here: normalise and write the output
        o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
    else:
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _call(q, k, v, lengths, *, config: DecodeAttentionConfig, interpret: bool):
    b, h, d = q.shape
    seq, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    gp = max(_MIN_ROWS, pl.next_power_of_2(g))
    splits = config.splits or splits_for(b, hkv)
    qg = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    if interpret:
        k, v = _pad_keys(k, v, config.block_k)
    one = splits == 1
    part = (b, hkv, splits, gp)
    out_shape = [jax.ShapeDtypeStruct(part + (d,), q.dtype if one else jnp.float32),
                 jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    row = lambda i, j, s: (i, j, s, 0)
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k, splits=splits, scale=d**-0.5, seq=seq, kv_heads=None),
        out_shape=out_shape,
        grid=(b, hkv, splits),
        in_specs=[pl.no_block_spec, pl.BlockSpec((None, None, gp, d), lambda i, j, s: (i, j, 0, 0)), pl.no_block_spec,
                  pl.no_block_spec],
        out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, j, s: (i, j, s, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), row), pl.BlockSpec((None, None, None, gp), row)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(lengths, qg, k, v)
    o = _merge_splits(o, m, l, axis=2) if not one else o[:, :, 0]
    return o[:, :, :g].reshape(b, h, d).astype(q.dtype)


def _pad_keys(k, v, block_k):
    """Caches padded to whole key blocks: interpret mode clamps a slice that runs past the end
    instead of masking it."""
    pad = ((0, 0), (0, -k.shape[1] % block_k), (0, 0), (0, 0))
    return jnp.pad(k, pad), jnp.pad(v, pad)


def _merge_splits(o, m, l, axis):
    """The splits' partial softmax results (unnormalised outputs, maxima, sums along ``axis``)
    merged into the normalised output."""
    w = jnp.exp(m - jnp.max(m, axis=axis, keepdims=True))
    den = jnp.sum(w * l, axis=axis)
    return jnp.sum(o * w[..., None], axis=axis) / jnp.maximum(den, 1e-30)[..., None]


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _call_rows(q, k, v, lengths, *, config: DecodeAttentionConfig, interpret: bool):
    """``heads="row"``: one program per (row, split) over all H query heads."""
    b, h, d = q.shape
    seq, hkv = k.shape[1], k.shape[2]
    splits = config.splits or splits_for(b, 1, programs=device_sms())
    if interpret:
        k, v = _pad_keys(k, v, config.block_k)
    one = splits == 1
    part = (b, splits, h)
    out_shape = [jax.ShapeDtypeStruct(part + (d,), q.dtype if one else jnp.float32),
                 jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    row = lambda i, s: (i, s, 0)
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k, splits=splits, scale=d**-0.5, seq=seq, kv_heads=hkv),
        out_shape=out_shape,
        grid=(b, splits),
        in_specs=[pl.no_block_spec, pl.BlockSpec((None, h, d), lambda i, s: (i, 0, 0)), pl.no_block_spec, pl.no_block_spec],
        out_specs=[pl.BlockSpec((None, None, h, d), lambda i, s: (i, s, 0, 0)), pl.BlockSpec((None, None, h), row),
                   pl.BlockSpec((None, None, h), row)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(lengths, q, k, v)
    return (_merge_splits(o, m, l, axis=1) if not one else o[:, 0]).astype(q.dtype)


def heads_layout(config: DecodeAttentionConfig, h: int) -> str:
    """The programs' layout for H query heads: "row" or "kv" (``config.heads``; "auto" takes
    "row" where H is a power of two >= 16)."""
    rows_fit = h >= _MIN_ROWS and not h & (h - 1)
    if config.heads == "row" and not rows_fit:
        raise ValueError(f"config: DecodeAttentionConfig.heads='row' needs a power-of-two H >= {_MIN_ROWS} query heads, got {h}")
    return "row" if config.heads == "row" or (config.heads == "auto" and rows_fit) else "kv"


def decode_attention(q, k, v, lengths, *, impl: str = "pallas", config: DecodeAttentionConfig | None = None):
    """Attention of one query token per row, q [B, H, D], over the first ``lengths[b]`` keys of
    the caches k, v [B, S, Hkv, D]. ``impl``: "pallas" (interpreted off a GPU) or "xla"."""
    if q.ndim != 3 or k.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[2] \
            or q.shape[1] % k.shape[2]:
        raise ValueError(f"q, k, v: expected [B, H, D] and [B, S, Hkv, D] with H % Hkv == 0, got {q.shape}, {k.shape}, {v.shape}")
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"lengths: expected shape ({q.shape[0]},), got {lengths.shape}")
    lengths = jnp.minimum(lengths.astype(jnp.int32), k.shape[1])
    if impl == "xla":
        return decode_attention_xla(q, k, v, lengths)
    if impl != "pallas":
        raise ValueError(f"impl={impl!r}: expected 'pallas' or 'xla'")
    config = config or DecodeAttentionConfig()
    if heads_layout(config, q.shape[1]) == "row":
        return _call_rows(q, k, v, lengths, config=config, interpret=interpret_mode())
    return _call(q, k, v, lengths, config=config, interpret=interpret_mode())
