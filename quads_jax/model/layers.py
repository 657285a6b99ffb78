"""Building blocks: parameters with logical axes, linear, RMSNorm, RoPE, attention with KV cache.

Weights use the Hugging Face layout [out, in] (``y = x @ W.T``), the layout NVFP4 and FP8
checkpoints quantize along (the input axis), so the rollout can quantize them in place.
Every parameter carries ``logical_axes`` metadata that ``quads_jax.sharding`` maps to a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk
from quads_jax import precision as P
from quads_jax.model.config import ModelConfig


def param(rngs: nnx.Rngs, shape, axes, *, scale: float | None = None, dtype=jnp.float32, init="normal"):
    if init == "ones":
        v = jnp.ones(shape, dtype)
    else:
        fan_in = shape[-1]
        std = scale if scale is not None else fan_in**-0.5
        v = (std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)).astype(dtype)
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(v, logical_axes=tuple(axes))


def value(p):
    return p.get_value()


class Linear(nnx.Module):
    """``x @ W.T`` with W [out, in]; the precision mode is looked up by ``kind`` at call time."""

    def __init__(self, d_in: int, d_out: int, kind: str, axes, *, rngs: nnx.Rngs, dtype=jnp.float32, scale=None):
        self.kind = kind
        self.w = param(rngs, (d_out, d_in), axes, dtype=dtype, scale=scale)

    def __call__(self, x, prec: P.Precision, dtype):
        return P.linear(x, value(self.w), prec.mode(self.kind), dtype=dtype, rac_ratio=prec.rac_ratio, rac_sum=prec.rac_sum,
                        backend=prec.backend)


def linears(x, mods, prec: P.Precision, dtype):
    """The outputs of several linears of one kind that read the same x (q/k/v, gate/up): one
    kernel launch under an NVFP4 recipe."""
    return P.linear(x, [value(m.w) for m in mods], prec.mode(mods[0].kind), dtype=dtype, rac_ratio=prec.rac_ratio,
                    rac_sum=prec.rac_sum, backend=prec.backend)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, axis_name="norm"):
        self.eps = eps
        self.scale = param(rngs, (dim,), (axis_name,), init="ones")

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * value(self.scale)).astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotary embedding, rotate-half convention (Hugging Face Llama/Qwen): x [B, T, H, D]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    rot = jnp.concatenate([-x2, x1], -1)
    return (xf * cos + rot * sin).astype(x.dtype)


def init_kv_cache(cfg: ModelConfig, batch: int, max_len: int | None = None, dtype=None):
    """A KV cache: per layer k, v [B, S, kv_heads, head_dim]; ``lengths`` [B] tokens written."""
    s = max_len or cfg.max_seq_len
    dt = dtype or cfg.dtype
    shape = (batch, s, cfg.n_kv_heads, cfg.head_dim)
    return {
        "layers": [{"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)} for _ in range(cfg.n_layers)],
        "lengths": jnp.zeros((batch,), jnp.int32),
    }


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pd = cfg.pdtype
        self.cfg = cfg
        self.q = Linear(d, h * hd, "attn", ("heads", "embed"), rngs=rngs, dtype=pd)
        self.k = Linear(d, kv * hd, "attn", ("kv_heads", "embed"), rngs=rngs, dtype=pd)
        self.v = Linear(d, kv * hd, "attn", ("kv_heads", "embed"), rngs=rngs, dtype=pd)
        self.o = Linear(h * hd, d, "attn", ("embed", "heads"), rngs=rngs, dtype=pd, scale=(h * hd * 2 * cfg.n_layers) ** -0.5)
        self.q_norm = RMSNorm(hd, cfg.rms_eps, rngs=rngs)
        self.k_norm = RMSNorm(hd, cfg.rms_eps, rngs=rngs)

    def __call__(self, x, positions, key_valid, prec, cache=None, lengths=None):
        """x [B, T, d]; positions [B, T]; key_valid [B, S] (S = T, or the cache length).

        With ``cache`` ({k, v} of this layer, ``start`` [B] and ``active`` [B]) the new keys/values
        of the active rows are written at ``start`` and attention runs over the cache: for one new
        token a row (a decode step, at position ``start``) through ``prec.kernels.decode_attention``,
        whose kernel also does the write and reads only the live keys; else the reference over
        the whole cache, masked. Without one, ``lengths``
        [B] says the rows are right-padded with positions 0..T-1, and attention runs through
        ``prec.kernels.attention`` (flash attention on a GPU). Returns (y, cache)."""
        cfg = self.cfg
        b, t, _ = x.shape
        dt = cfg.dtype
        q, k, v = linears(x, (self.q, self.k, self.v), prec, dt)  # one launch under NVFP4: x quantized once
        q = q.reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        q = rope(self.q_norm(q), positions, cfg.rope_theta)
        k = rope(self.k_norm(k), positions, cfg.rope_theta)
        if cache is None and lengths is not None and prec.kernels.resolved_attention() != "xla":
            o = pk.causal_attention(q, k, v, lengths, impl=prec.kernels.attention)
        elif cache is None:
            o = pk.attention_xla(q, k, v, (positions[:, None, :] <= positions[:, :, None]) & key_valid[:, None, :])
        elif t == 1 and prec.kernels.resolved_decode_attention() == "pallas":
            # a decode step: the kernel writes the new key and value in place and reads the live keys only
            o, k_all, v_all = pk.decode_attention(q[:, 0], cache["k"], cache["v"], cache["start"],
                                                  new=(k[:, 0], v[:, 0], cache["active"]), impl="pallas",
                                                  config=prec.kernels.decode_attention_tiles)
            o, cache = o[:, None], {"k": k_all, "v": v_all}
        else:
            k_all = pk.write_rows(cache["k"], k.astype(cache["k"].dtype), cache["start"], cache["active"])
            v_all = pk.write_rows(cache["v"], v.astype(cache["v"].dtype), cache["start"], cache["active"])
            cache = {"k": k_all, "v": v_all}
            k_pos = jnp.arange(k_all.shape[1])[None, :]
            allowed = (k_pos[:, None, :] <= positions[:, :, None]) & key_valid[:, None, :]  # [B, T, S]
            o = pk.attention_xla(q, k_all, v_all, allowed)
        o = o.reshape(b, t, cfg.n_heads * cfg.head_dim).astype(dt)
        return self.o(o, prec, dt), cache


class MLP(nnx.Module):
    """SwiGLU MLP (dense layers and shared experts)."""

    def __init__(self, d: int, f: int, kind: str, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = cfg.pdtype
        self.gate = Linear(d, f, kind, ("mlp", "embed"), rngs=rngs, dtype=pd)
        self.up = Linear(d, f, kind, ("mlp", "embed"), rngs=rngs, dtype=pd)
        self.down = Linear(f, d, kind, ("embed", "mlp"), rngs=rngs, dtype=pd, scale=(f * 2 * cfg.n_layers) ** -0.5)

    def __call__(self, x, prec, dtype):
        g, u = linears(x, (self.gate, self.up), prec, dtype)
        h = jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
        h = h.reshape(*x.shape[:-1], h.shape[-1])
        return self.down(h.astype(dtype), prec, dtype)
