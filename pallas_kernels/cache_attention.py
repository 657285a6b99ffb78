"""Decode attention over the live part of a KV cache: one new query token per row.

    o = decode_attention(q, k_cache, v_cache, lengths)   # q [B, H, D]; caches [B, S, Hkv, D]; lengths [B]
    o, k_cache, v_cache = decode_attention(q, k_cache, v_cache, lengths, new=(k, v, active))

Row b attends to its keys 0 .. lengths[b] - 1 (a row of length 0 gets zeros). With ``new``
(the step's keys and values k, v [B, Hkv, D] and ``active`` [B]) an active row also attends
to its new key, and the kernel writes it to the caches at ``lengths[b]`` (the caches are
aliased to the outputs: updated in place, no separate scatter launch a cache): a row's
programs read only its keys below ``lengths[b]``, and the new key comes from the inputs, so
the write races with no read. The caches stay in the engine's layout [B, S, Hkv, D], so
nothing is copied or transposed per step.
One program per (row, split) loops over the key blocks below the row's length only: the
bytes a step reads grow with the live tokens, not with the cache's size (the XLA reference
reads, scores and masks the whole cache). All H query heads of the row are one MMA operand
(padded to a power of two >= 16 rows where H is not one): each key block's scores are
H x block_k products against every KV head, each query row keeping its own head's (GQA).
This measured faster than a program per KV head, whose G query heads pad to 16 MMA rows
(the registry's attention regime; benchmarks/results).

``DecodeAttentionConfig.splits`` > 1 cuts each row's live keys into that many parts, whose
partial softmax results (unnormalised output, max, sum) are merged afterwards
(flash-decoding): more programs when the batch is small against the SM count.
``splits=None`` picks it from the batch (``splits_for``: about one wave of the SMs; at
B=256 one split a row, the fastest measured).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.config import DecodeAttentionConfig, interpret_mode
from pallas_kernels.tiling import device_sms

_MIN_ROWS = 16  # the smallest MMA operand: a row's query heads are padded to it
_NEG = -1e30


def splits_for(batch: int, programs: int | None = None, most: int = 8) -> int:
    """Splits that give about ``programs`` programs (default: one wave of the device's SMs),
    at most ``most``."""
    programs = programs or device_sms()
    return max(1, min(most, -(-programs // max(1, batch))))


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


def _kernel(len_ref, q_ref, k_ref, v_ref, new_refs, o_ref, m_ref, l_ref, *cache_out, block_k, splits, scale, seq, group):
    """One program: row b, split s, every KV head; q_ref holds the row's query heads, head j's
    ``group`` rows at j * group (rows past H are padding). ``new_refs``: None, or the new
    keys, values [B, Hkv, D] and active flags [B], then ``cache_out`` are the caches (aliased):
    the last split attends to the new key too, the first writes it."""
    b, s = pl.program_id(0), pl.program_id(1)
    heads = tuple(jnp.int32(j) for j in range(k_ref.shape[2]))  # arrays, as program ids are (interpret mode's loads)
    n = len_ref[b]
    chunk = pl.cdiv(pl.cdiv(n, splits), block_k) * block_k  # this row's keys per split, whole blocks
    lo = s * chunk
    hi = jnp.minimum(lo + chunk, n)
    q = q_ref[...]  # [Hp, D]
    hp, d = q.shape
    cols = jnp.arange(block_k)
    head_of = jnp.arange(hp) // group  # each query row's KV head (padding rows: none of them)
    mine = [(head_of == j)[:, None] for j in range(len(heads))]  # the rows of KV head j, once a program

    def body(i, carry):
        acc, m, l = carry
        start = lo + i * block_k
        idx = start + cols
        live = idx < hi
        ok = jnp.broadcast_to((idx < seq)[:, None], (block_k, d))
        kv = [(plgpu.load(k_ref.at[b, pl.ds(start, block_k), h, :], mask=ok, other=0.0),  # [bk, D] each
               plgpu.load(v_ref.at[b, pl.ds(start, block_k), h, :], mask=ok, other=0.0)) for h in heads]
        sc = None
        for j, (kt, _) in enumerate(kv):
            sj = _dot(q, kt.astype(q.dtype), 1)  # [rows, bk] FP32
            sc = sj if len(kv) == 1 else jnp.where(mine[j], sj, 0.0 if sc is None else sc)
        sc = jnp.where(live[None, :], sc * scale, _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        p = jnp.exp(sc - m_new[:, None]) * live[None, :].astype(jnp.float32)
        corr = jnp.exp(m - m_new)
        for j, (_, vt) in enumerate(kv):
            pj = p if len(kv) == 1 else jnp.where(mine[j], p, 0.0)
            acc = (acc * corr[:, None] if j == 0 else acc) + _dot(pj.astype(vt.dtype), vt, 0)
        return acc, m_new, l * corr + jnp.sum(p, axis=1)

    steps = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)
    init = (jnp.zeros((hp, d), jnp.float32), jnp.full((hp,), _NEG, jnp.float32), jnp.zeros((hp,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, steps, body, init)
    if new_refs is not None:
        kn_ref, vn_ref, act_ref = new_refs
        act = (act_ref[b] != 0) & (n < seq)  # a full row's cache takes no write, so no new key
        # each query row's KV head's new key and value ([Hp, D]; padding rows read head 0, unused)
        at = lambda ref: ref.at[b, jnp.minimum(head_of, len(heads) - 1)[:, None], jnp.arange(d)[None, :]]
        kq = plgpu.load(at(kn_ref)).astype(jnp.float32)
        vq = plgpu.load(at(vn_ref)).astype(jnp.float32)
        take = act & (s == splits - 1)
        sc = jnp.sum(q.astype(jnp.float32) * kq, axis=1) * scale
        m_new = jnp.where(take, jnp.maximum(m, sc), m)
        p = jnp.where(take, jnp.exp(sc - m_new), 0.0)
        corr = jnp.exp(m - m_new)
        pv = p.astype(vn_ref.dtype).astype(jnp.float32)[:, None] * vq  # p rounded as the key loop's MMA operand
        acc, m, l = acc * corr[:, None] + pv, m_new, l * corr + p
        k_out, v_out = cache_out

        @pl.when(act & (s == 0))
        def _():
            for j, h in enumerate(heads):
                k_out[b, n, h, :] = kn_ref[b, h, :]
                v_out[b, n, h, :] = vn_ref[b, h, :]
    if splits == 1:  # the whole row here: normalise and write the output
        o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
    else:
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


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
def _call(q, k, v, lengths, new, *, config: DecodeAttentionConfig, interpret: bool):
    b, h, d = q.shape
    seq, hkv = k.shape[1], k.shape[2]
    hp = max(_MIN_ROWS, pl.next_power_of_2(h))
    splits = config.splits or splits_for(b)
    if hp != h:  # MMA operands of a power of two >= 16 rows
        q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
    if interpret:
        k, v = _pad_keys(k, v, config.block_k)
    one = splits == 1
    part = (b, splits, hp)
    out_shape = [jax.ShapeDtypeStruct(part + (d,), q.dtype if one else jnp.float32),
                 jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    row = lambda i, s: (i, s, 0)
    out_specs = [pl.BlockSpec((None, None, hp, d), lambda i, s: (i, s, 0, 0)), pl.BlockSpec((None, None, hp), row),
                 pl.BlockSpec((None, None, hp), row)]
    aliases = {}
    if new is not None:  # the caches come back as outputs 3 and 4, written in place (inputs 2 and 3)
        out_shape += [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
        out_specs += [pl.no_block_spec, pl.no_block_spec]
        aliases = {2: 3, 3: 4}
        new = (new[0], new[1], new[2].astype(jnp.int32))
    outs = pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k, splits=splits, scale=d**-0.5, seq=seq, group=h // hkv),
        out_shape=out_shape,
        grid=(b, splits),
        in_specs=[pl.no_block_spec, pl.BlockSpec((None, hp, d), lambda i, s: (i, 0, 0)), pl.no_block_spec, pl.no_block_spec,
                  None if new is None else (pl.no_block_spec,) * 3],
        out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(lengths, q, k, v, new)
    o, m, l = outs[:3]
    o = _merge_splits(o, m, l, axis=1) if not one else o[:, 0]
    o = o[:, :h].astype(q.dtype)
    if new is None:
        return o
    return o, outs[3][:, :seq], outs[4][:, :seq]


def write_rows(buf, new, start, active):
    """buf [B, S, ...] <- new [B, T, ...] at per-row offsets start [B], for the rows where
    ``active``; the other rows are left exactly as they were (no write past their end, which
    a slice clamped at the cache's end would turn into a write over their real entries). The
    caches' write outside the decode kernel: prefill, and the XLA reference's decode step."""
    def one(b, n, s, a):
        s = jnp.where(a, s, 0)
        n = jnp.where(a, n, jax.lax.dynamic_slice_in_dim(b, 0, n.shape[0], axis=0))
        return jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0)
    return jax.vmap(one)(buf, new, start, active)


def decode_attention(q, k, v, lengths, *, new=None, impl: str = "pallas", config: DecodeAttentionConfig | None = None):
    """Attention of one query token per row, q [B, H, D], over the first ``lengths[b]`` keys of
    the caches k, v [B, S, Hkv, D]. ``new``: None, or (k_new, v_new [B, Hkv, D], active [B]):
    the step's keys, written at ``lengths[b]`` for the active rows and attended to; then the
    return is (o, k, v) with the updated caches. ``impl``: "pallas" (interpreted off a GPU)
    or "xla"."""
    if q.ndim != 3 or k.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[2] \
            or q.shape[1] % k.shape[2]:
        raise ValueError(f"q, k, v: expected [B, H, D] and [B, S, Hkv, D] with H % Hkv == 0, got {q.shape}, {k.shape}, {v.shape}")
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"lengths: expected shape ({q.shape[0]},), got {lengths.shape}")
    if new is not None:
        kn, vn, active = new
        want = (k.shape[0], k.shape[2], k.shape[3])
        if kn.shape != want or vn.shape != want or active.shape != (k.shape[0],):
            raise ValueError(f"new: expected keys and values {want} and active ({k.shape[0]},), got {kn.shape}, {vn.shape}, "
                             f"{active.shape}")
        new = (kn.astype(k.dtype), vn.astype(v.dtype), active.astype(bool))
    lengths = jnp.minimum(lengths.astype(jnp.int32), k.shape[1])
    if impl == "xla":
        if new is None:
            return decode_attention_xla(q, k, v, lengths)
        kn, vn, active = new
        ok = active & (lengths < k.shape[1])  # as the kernel: a full row takes no write and no new key
        k, v = write_rows(k, kn[:, None], lengths, ok), write_rows(v, vn[:, None], lengths, ok)
        return decode_attention_xla(q, k, v, lengths + ok.astype(jnp.int32)), k, v
    if impl != "pallas":
        raise ValueError(f"impl={impl!r}: expected 'pallas' or 'xla'")
    return _call(q, k, v, lengths, new, config=config or DecodeAttentionConfig(), interpret=interpret_mode())
