"""Decode attention over the live part of a KV cache: one new query token per row.

    o = decode_attention(q, k_cache, v_cache, lengths)   # q [B, H, D]; caches [B, S, Hkv, D]; lengths [B]

Row b attends to its keys 0 .. lengths[b] - 1 (a row of length 0 gets zeros). The cache
stays in the engine's layout [B, S, Hkv, D], so nothing is copied or transposed per step.
One program per (row, KV head, split) loops over the key blocks below the row's length
only: the bytes a step reads grow with the live tokens, not with the cache's size (the
XLA reference reads, scores and masks the whole cache). The G query heads that share a
KV head (GQA) form one MMA operand, padded to 16 rows.

``DecodeAttentionConfig.splits`` > 1 cuts each row's live keys into that many parts, whose
partial softmax results (unnormalised output, max, sum) are merged afterwards
(flash-decoding): more programs when batch x KV heads is small against the SM count.
``splits=None`` picks it from the batch (``splits_for``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.config import interpret_mode
from pallas_kernels.tiling import device_sms

_MIN_ROWS = 16  # the smallest MMA operand: the G query heads of a KV head are padded to it
_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """``block_k`` keys a loop step; ``splits`` parts of each row's live keys (None: from the
    batch); ``num_warps`` / ``num_stages`` of the Triton program."""
    block_k: int = 64
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not isinstance(self.block_k, int) or self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"decode attention block_k={self.block_k!r}: expected a power of two >= 16")
        if self.splits is not None and (not isinstance(self.splits, int) or self.splits < 1):
            raise ValueError(f"decode attention splits={self.splits!r}: expected None or an integer >= 1")


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


def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_k, splits, scale, seq):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n = len_ref[b]
    chunk = pl.cdiv(pl.cdiv(n, splits), block_k) * block_k  # this row's keys per split, whole blocks
    lo = s * chunk
    hi = jnp.minimum(lo + chunk, n)
    q = q_ref[...]  # [Gp, D]
    gp, d = q.shape
    cols = jnp.arange(block_k)

    def body(i, carry):
        acc, m, l = carry
        start = lo + i * block_k
        idx = start + cols
        live = idx < hi
        ok = jnp.broadcast_to((idx < seq)[:, None], (block_k, d))
        kt = plgpu.load(k_ref.at[b, pl.ds(start, block_k), h, :], mask=ok, other=0.0)  # [bk, D]
        vt = plgpu.load(v_ref.at[b, pl.ds(start, block_k), h, :], mask=ok, other=0.0)
        sc = _dot(q, kt.astype(q.dtype), 1) * scale  # [Gp, bk] FP32
        sc = jnp.where(live[None, :], sc, _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        p = jnp.exp(sc - m_new[:, None]) * live[None, :].astype(jnp.float32)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[:, None] + _dot(p.astype(vt.dtype), vt, 0)
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
    if interpret:  # interpret mode clamps a slice that runs past the end instead of masking it
        pad = ((0, 0), (0, -seq % config.block_k), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    one = splits == 1
    part = (b, hkv, splits, gp)
    out_shape = [jax.ShapeDtypeStruct(part + (d,), q.dtype if one else jnp.float32),
                 jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    row = lambda i, j, s: (i, j, s, 0)
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k, splits=splits, scale=d**-0.5, seq=seq),
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
    if not one:  # merge the splits' partial softmax results
        mx = jnp.max(m, axis=2, keepdims=True)
        w = jnp.exp(m - mx)  # [B, Hkv, splits, Gp]
        den = jnp.sum(w * l, axis=2)
        o = jnp.sum(o * w[..., None], axis=2) / jnp.maximum(den, 1e-30)[..., None]
    else:
        o = o[:, :, 0]
    return o[:, :, :g].reshape(b, h, d).astype(q.dtype)


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
    return _call(q, k, v, lengths, config=config or DecodeAttentionConfig(), interpret=interpret_mode())
