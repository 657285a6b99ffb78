"""The MoE layer: softmax top-k router, dropless sorted dispatch, grouped SwiGLU experts.

Dispatch: the T*k (token, expert) assignments are sorted by expert, the rows gathered,
one grouped matmul per expert weight runs over the contiguous groups (``group_sizes``),
and the outputs are weighted and scattered back. No token is dropped, no Python loop
over experts. The same ``moe_ffn`` runs inside the expert-parallel ``shard_map`` of
``quads_jax.sharding`` on each device's local experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from quads_jax import precision as P
from quads_jax.model.config import ModelConfig
from quads_jax.model.layers import MLP, Linear, param, value
from quads_jax.model.routing import sort_by_expert


def route(logits, k: int, normalize: bool, forced=None):
    """Softmax router in float32: (probs [N, E], top-k ids [N, k], weights [N, k]).

    ``forced`` [N, k] replays given experts (routing replay); weights are their probs. Rows
    whose forced ids are negative (-1) are not forced: they take their own top-k.
    The experts are the top-k logits (softmax is increasing); the weights are the chosen
    probs, or with ``normalize`` (top-k weights summing to one) the softmax of the k chosen
    logits, the same numbers as the chosen probs over their sum, so the decode step, which
    uses no probs, runs no softmax over all E experts."""
    lf = logits.astype(jnp.float32)
    chosen, ids = jax.lax.top_k(lf, k)  # the chosen logits come with the ids: no gather unless forced
    if forced is not None:
        f = forced.astype(jnp.int32)
        ids = jnp.where(jnp.all(f >= 0, axis=-1, keepdims=True), f, ids)
        chosen = jnp.take_along_axis(lf, ids, axis=-1)
    probs = jax.nn.softmax(lf, axis=-1)
    w = jax.nn.softmax(chosen, axis=-1) if normalize else jnp.take_along_axis(probs, ids, axis=-1)
    return probs, ids, w


def load_balance_loss(probs, ids, n_experts: int, mask=None):
    """Switch-style auxiliary loss E * sum_e f_e * P_e, with f_e the fraction of the
    top-k assignments that go to expert e and P_e the mean router probability. The counts
    are a scatter-add over the [N, k] ids (no [N, k, E] one-hot)."""
    m = jnp.ones(probs.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    denom = jnp.maximum(m.sum(), 1.0)
    counts = jnp.zeros((n_experts,), jnp.float32).at[ids].add(jnp.broadcast_to(m[:, None], ids.shape))
    f = counts / (denom * ids.shape[-1])
    p = (probs * m[:, None]).sum(0) / denom
    return n_experts * jnp.sum(f * p)


def z_loss(logits, mask=None):
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2
    if mask is None:
        return jnp.mean(z)
    m = mask.astype(jnp.float32)
    return jnp.sum(z * m) / jnp.maximum(m.sum(), 1.0)


def expert_ffn(xs, w_gate, w_up, w_down, group_sizes, prec: P.Precision, dtype):
    """SwiGLU over rows sorted by expert, through the grouped-matmul dispatch."""
    mode = prec.mode("experts")
    gl = lambda a, w: P.grouped_linear(a, w, group_sizes, mode, dtype=dtype, rac_ratio=prec.rac_ratio, rac_sum=prec.rac_sum,
                                       backend=prec.backend, grouped=prec.kernels.grouped,
                                       tiles=prec.kernels.grouped_tiles)
    g, u = gl(xs, [w_gate, w_up])  # one launch for both under an NVFP4 recipe
    h = jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
    return gl(h.astype(dtype), w_down)


def moe_ffn(x, ids, weights, w_gate, w_up, w_down, prec, dtype):
    """Dropless MoE FFN for tokens x [N, d] with top-k ids/weights [N, k].

    Rows move by permutations only: the N*k (token, slot) rows are permuted into expert order
    and back (gathers of unique indices, whose gradients are permutations too), and each
    token's k outputs are summed in slot order. No scatter-add, no [N*k, E] tensor."""
    n, k = ids.shape
    order, inv, token, group_sizes = sort_by_expert(ids, w_gate.shape[0])
    # NVFP4 rollouts quantize the N tokens once (per-token scales), not their N x k copies,
    # and the gate and up GEMMs share that: the same numbers as quantizing the sorted rows
    xin = P.quantize_rows_for(x, w_gate, prec.mode("experts"), rac_ratio=prec.rac_ratio, rac_sum=prec.rac_sum,
                              backend=prec.backend)
    if isinstance(xin, jax.Array):
        xs = jnp.repeat(xin, k, axis=0).at[order].get(unique_indices=True)  # == xin[token]
    else:
        xs = P.take_rows(xin, token)
    ys = expert_ffn(xs, w_gate, w_up, w_down, group_sizes, prec, dtype)
    y = ys.at[inv].get(unique_indices=True).reshape(n, k, -1).astype(jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(jnp.float32)).astype(dtype)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.expert_ffn, cfg.n_experts
        pd = cfg.pdtype
        self.cfg = cfg
        self.router = Linear(d, e, "router", ("expert_router", "embed"), rngs=rngs, dtype=pd)
        self.w_gate = param(rngs, (e, f, d), ("expert", "mlp", "embed"), dtype=pd)
        self.w_up = param(rngs, (e, f, d), ("expert", "mlp", "embed"), dtype=pd)
        self.w_down = param(rngs, (e, d, f), ("expert", "embed", "mlp"), dtype=pd, scale=(f * 2 * cfg.n_layers) ** -0.5)
        if cfg.shared_expert_ffn:
            self.shared = MLP(d, cfg.shared_expert_ffn, "shared", cfg, rngs=rngs)
            self.shared_gate = Linear(d, 1, "router", ("norm", "embed"), rngs=rngs, dtype=pd)
        else:
            self.shared = None
            self.shared_gate = None

    def __call__(self, x, prec: P.Precision, mask=None, forced=None, expert_fn=None):
        """x [B, T, d] -> (y, aux) where aux has the router logits, chosen experts and losses.

        ``expert_fn(x_flat, ids, weights, w_gate, w_up, w_down, prec, dtype)`` replaces the
        local dropless FFN (the expert-parallel shard_map plugs in here)."""
        cfg = self.cfg
        b, t, d = x.shape
        dt = cfg.dtype
        xf = x.reshape(b * t, d)
        logits = self.router(xf, prec, jnp.float32)
        k = cfg.experts_per_token
        ws = (value(self.w_gate), value(self.w_up), value(self.w_down))
        fflat = None if forced is None else forced.reshape(b * t, -1)
        probs, ids, w = route(logits, k, cfg.norm_topk_prob, fflat)  # probs: the auxiliary loss's (dead in a decode step)
        y = (expert_fn or moe_ffn)(xf, ids, w, *ws, prec, dt)
        if self.shared is not None:
            gate = jax.nn.sigmoid(self.shared_gate(xf, prec, jnp.float32))
            y = (y.astype(jnp.float32) + gate * self.shared(xf, prec, dt).astype(jnp.float32)).astype(dt)
        m = None if mask is None else mask.reshape(-1)
        aux = {
            "router_logits": logits.reshape(b, t, -1),
            "experts": ids.reshape(b, t, -1),
            "aux_loss": load_balance_loss(probs, ids, cfg.n_experts, m),
            "z_loss": z_loss(logits, m),
        }
        return y.reshape(b, t, d), aux
