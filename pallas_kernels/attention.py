"""Causal self-attention over right-padded sequences, without a KV cache (training, scoring).

    o = causal_attention(q, k, v, lengths, impl="cudnn")   # q [B, T, H, D], k/v [B, T, Hkv, D]

Query t of row b attends to keys s <= t with s < lengths[b] (grouped-query attention: H is a
multiple of Hkv). Rows are right-padded (a prefix of each row is real), which is how the
trainer lays out its batches. Outputs at padded query positions are unspecified: callers mask
them out.

Implementations, picked by ``impl`` (``KernelConfig.attention``):

    "cudnn"    cuDNN flash attention through ``jax.nn.dot_product_attention`` (fwd and bwd).
    "tokamax"  tokamax's flash attention (Mosaic GPU on sm90, with its VJP).
    "xla"      the reference: FP32 scores [B, Hkv, G, T, T], softmax, weighted sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.config import KernelConfig


def causal_attention_xla(q, k, v, lengths):
    """The reference (also the only path that takes a non-prefix mask, via ``attention_xla``)."""
    t = q.shape[1]
    pos = jnp.arange(t)
    key_valid = pos[None, :] < lengths[:, None]
    allowed = (pos[None, None, :] <= pos[None, :, None]) & key_valid[:, None, :]
    return attention_xla(q, k, v, allowed)


def attention_xla(q, k, v, allowed):
    """Softmax attention of q [B, T, H, D] over k, v [B, S, Hkv, D] where ``allowed`` [B, T, S];
    FP32 scores, output in q's dtype."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * (d**-0.5)
    s = jnp.where(allowed[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(q.dtype)


def causal_attention_cudnn(q, k, v, lengths):
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True,
                                        query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                        implementation="cudnn" if jax.default_backend() == "gpu" else "xla")


def causal_attention_tokamax(q, k, v, lengths):
    try:
        import tokamax
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("kernels.attention='tokamax' needs tokamax (pip install 'quads-jax[gpu]'), "
                          "or set kernels.attention='cudnn' or 'xla'") from e
    impl = None if jax.default_backend() == "gpu" else "xla"
    return tokamax.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True,
                                         key_value_seq_lengths=lengths, implementation=impl)


def causal_attention(q, k, v, lengths, *, impl: str = "auto"):
    """Causal attention of right-padded rows with ``lengths`` [B] real tokens each."""
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q, k, v: expected [B, T, H, D] and [B, T, Hkv, D] with H % Hkv == 0, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    which = KernelConfig(attention=impl).resolved_attention()
    fn = {"cudnn": causal_attention_cudnn, "tokamax": causal_attention_tokamax, "xla": causal_attention_xla}[which]
    return fn(q, k, v, lengths.astype(jnp.int32))
