"""The Qwen3-MoE decoder: embeddings, blocks (attention + MoE or dense MLP), final norm, head.

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits = model(tokens)                                   # [B, T, vocab]
    logits, aux, cache = model.forward(tokens, mask=mask, cache=cache, precision=prec)

``precision`` defaults to ``model.precision`` (BF16 unless set); the trainer passes its QAT
policy, the rollout engine its recipe over weights prepared by ``prepare_for_rollout``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from quads_jax import precision as P
from quads_jax.model.config import ModelConfig
from quads_jax.model.layers import MLP, Attention, Linear, RMSNorm, init_kv_cache, param, value
from quads_jax.model.moe import MoE


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, rngs=rngs)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            self.moe = MoE(cfg, rngs=rngs)
            self.mlp = None
        else:
            self.moe = None
            self.mlp = MLP(cfg.d_model, cfg.dense_ffn, "dense", cfg, rngs=rngs)

    def __call__(self, x, positions, key_valid, prec, *, mask=None, cache=None, forced=None, expert_fn=None, lengths=None):
        h, cache = self.attn(self.attn_norm(x), positions, key_valid, prec, cache, lengths=lengths)
        x = x + h
        y = self.mlp_norm(x)
        if self.is_moe:
            y, aux = self.moe(y, prec, mask=mask, forced=forced, expert_fn=expert_fn)
        else:
            y, aux = self.mlp(y, prec, x.dtype), None
        return x + y, cache, aux


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, precision: P.Precision | None = None):
        self.cfg = cfg
        self.precision = precision or P.Precision()
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), scale=1.0, dtype=cfg.pdtype)
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.rms_eps, rngs=rngs)
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.d_model, cfg.vocab_size, "lm_head", ("vocab", "embed"), rngs=rngs, dtype=cfg.pdtype)

    def __call__(self, tokens, **kw):
        return self.forward(tokens, **kw)[0]

    def init_cache(self, batch: int, max_len: int | None = None):
        return init_kv_cache(self.cfg, batch, max_len)

    def head_weight(self):
        """The output projection [V, d]: the lm_head, or the tied embedding."""
        return value(self.embed) if self.lm_head is None else value(self.lm_head.w)

    def head(self, x, prec: P.Precision, w=None):
        """Logits in float32 for hidden states x [..., d] (after the final norm), through the
        head weight ``w`` (default ``head_weight()``): compute-dtype operands, FP32 accumulation."""
        return P.linear(x, self.head_weight() if w is None else w, prec.mode("lm_head"), dtype=jnp.float32,
                        backend=prec.backend, operand_dtype=self.cfg.dtype)

    def forward(self, tokens, *, mask=None, positions=None, cache=None, precision=None, forced_experts=None, expert_fn=None,
                head=True):
        """tokens [B, T] -> (logits [B, T, V] float32, aux, cache); with ``head=False`` the
        final hidden states [B, T, d] instead of the logits.

        mask [B, T]: 1 for real tokens (padding keys are never attended to).
        cache: from ``init_cache``; the T new tokens are written after each row's
        ``lengths`` (``mask`` gives how many of them are real) and attention covers the cache.
        aux: ``aux_loss`` and ``z_loss`` (summed over MoE layers) and, per MoE layer,
        ``experts`` [B, T, k] and ``router_logits``; ``forced_experts`` [L_moe, B, T, k]
        replays a routing.

        Without a cache and without explicit positions, rows are taken as right-padded
        (``mask`` a prefix of each row): attention then runs through ``precision.kernels``'
        attention (flash attention on a GPU), and each block is rematerialized as
        ``cfg.remat`` says."""
        cfg = self.cfg
        prec = precision or self.precision
        b, t = tokens.shape
        if mask is None:
            mask = jnp.ones((b, t), bool)
        mask = mask.astype(bool)
        if cache is not None:
            start = cache["lengths"]
            n_new = mask.sum(1).astype(jnp.int32)
            if positions is None:
                positions = start[:, None] + jnp.arange(t)[None, :]
            s = cache["layers"][0]["k"].shape[1]
            key_valid = jnp.arange(s)[None, :] < (start + n_new)[:, None]
            lengths = None
        else:
            lengths = None  # set only for the right-padded rows that flash attention takes
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
                lengths = mask.sum(1).astype(jnp.int32)
            key_valid = mask
        x = jnp.take(value(self.embed), tokens, axis=0).astype(cfg.dtype)
        new_layers, experts, logits_r = [], [], []
        aux_loss = jnp.float32(0.0)
        zl = jnp.float32(0.0)
        mi = 0
        for i, block in enumerate(self.layers):
            lc = None if cache is None else dict(cache["layers"][i], start=cache["lengths"], active=mask.any(1))
            forced = None
            if block.is_moe and forced_experts is not None:
                forced = forced_experts[mi]
            def run(blk, x, lc=lc, forced=forced):
                return blk(x, positions, key_valid, prec, mask=mask, cache=lc, forced=forced, expert_fn=expert_fn,
                           lengths=lengths)
            if cache is None and cfg.remat != "none":
                run = nnx.remat(run, policy=_REMAT[cfg.remat])
            x, lc, aux = run(block, x)
            if cache is not None:
                new_layers.append(lc)
            if aux is not None:
                mi += 1
                experts.append(aux["experts"])
                logits_r.append(aux["router_logits"])
                aux_loss = aux_loss + aux["aux_loss"]
                zl = zl + aux["z_loss"]
        x = self.final_norm(x)
        new_cache = None
        if cache is not None:
            new_cache = {"layers": new_layers, "lengths": cache["lengths"] + mask.sum(1).astype(jnp.int32)}
        aux = {"aux_loss": aux_loss, "z_loss": zl,
               "experts": jnp.stack(experts) if experts else None,
               "router_logits": logits_r}
        if not head:
            return x, aux, new_cache
        return self.head(x, prec).astype(jnp.float32), aux, new_cache


_REMAT = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def chunked_logprobs(hidden, w, targets, head_fn, chunk: int):
    """log_softmax(head_fn(hidden, w))[targets] for hidden [N, d], targets [N], computed
    ``chunk`` rows at a time: only [chunk, V] FP32 logits are live, in the forward and (each
    chunk rematerialized) in the backward pass. ``chunk`` 0 computes all rows at once."""
    n = hidden.shape[0]

    def one(w, h, tg):
        logits = head_fn(h, w).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.take_along_axis(logits, tg[:, None], axis=-1)[:, 0] - lse

    if not chunk or chunk >= n:
        return one(w, hidden, targets)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    hp = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n_chunks, chunk, hidden.shape[-1])
    tp = jnp.pad(targets, (0, pad)).reshape(n_chunks, chunk)
    body = jax.checkpoint(one)
    _, lp = jax.lax.scan(lambda c, xs: (c, body(w, *xs)), None, (hp, tp))
    return lp.reshape(-1)[:n]


def token_logprobs(model: Transformer, tokens, mask=None, *, precision=None, forced_experts=None, return_aux=False,
                   chunk: int | None = None):
    """log p(tokens[:, t] | tokens[:, :t]) in float32, shape [B, T] (position 0 gets 0).

    ``mask`` [B, T] marks real tokens; positions outside it get 0. The head runs ``chunk``
    tokens at a time (default ``model.cfg.logits_chunk``), so [B*T, V] FP32 logits never
    exist at once."""
    prec = precision or model.precision
    h, aux, _ = model.forward(tokens, mask=mask, precision=prec, forced_experts=forced_experts, head=False)
    b, t, d = h.shape
    head_fn = lambda hc, w: model.head(hc, prec, w)
    tok = chunked_logprobs(h[:, :-1].reshape(-1, d), model.head_weight(), tokens[:, 1:].reshape(-1), head_fn,
                           model.cfg.logits_chunk if chunk is None else chunk).reshape(b, t - 1)
    out = jnp.concatenate([jnp.zeros_like(tok[:, :1]), tok], axis=1)
    if mask is not None:
        out = jnp.where(mask.astype(bool), out, 0.0)
    return (out, aux) if return_aux else out


def _linear_modules(model: nnx.Module):
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            yield path, node


def prepare_for_rollout(model: Transformer, recipe: P.Precision) -> Transformer:
    """A copy of ``model`` whose weights are converted once for ``recipe`` (NVFP4 / FP8
    tensors for the quantized kinds; the others cast to the compute dtype their products read,
    expert weights in their GEMM's [E, K, N] layout) and whose default precision is ``recipe``.
    The router keeps its weight's type: it computes in FP32, as in training."""
    m = nnx.clone(model)
    dt = model.cfg.dtype
    for _, lin in _linear_modules(m):
        lin.w.set_value(P.prepare_weight(value(lin.w), recipe.mode(lin.kind), None if lin.kind == "router" else dt))
    for _, node in nnx.iter_graph(m):
        if isinstance(node, MoE):
            mode = recipe.mode("experts")
            for name in ("w_gate", "w_up", "w_down"):
                p = getattr(node, name)
                p.set_value(P.prepare_weight(value(p), mode, dt))
    m.precision = recipe
    return m
