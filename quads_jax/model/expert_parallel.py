"""Expert parallelism: the MoE FFN under ``jax.shard_map`` with ``all_to_all`` dispatch.

Tokens are split over the mesh's batch axes (data, fsdp, expert); expert weights are split
over ``expert``. On each device, every (token, expert) assignment is packed into a send
buffer [ep, C, d] by destination device (the one holding that expert), exchanged with
``lax.all_to_all`` over ``expert``, run through the local experts with the same dropless
grouped FFN as the single-device layer, sent back and combined. ``C`` is the per-device
capacity: ``capacity_factor=None`` makes it the worst case (n * k, dropless, exact); a
factor gives ``ceil(factor * n * k / ep)`` and assignments beyond it are dropped and
counted. Plain ``all_to_all`` runs on every backend (XLA:CPU included), unlike
``ragged_all_to_all``.

    fn = expert_parallel_fn(mesh)                       # plug into MoE(expert_fn=...)
    logits, aux, _ = model.forward(tokens, expert_fn=fn)
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as PS

from quads_jax import sharding as S
from quads_jax.model.routing import expert_positions, group_sizes_of
from quads_jax.model.moe import expert_ffn


def _pack(ids, ep: int, e_local: int, cap: int):
    """Slot of every flat assignment in the send buffer: (dest [A], slot [A], kept [A])."""
    flat = ids.reshape(-1)
    dest = flat // e_local
    onehot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    return dest, slot, slot < cap


def _local(x, ids, weights, w_gate, w_up, w_down, *, prec, dtype, ep, cap):
    n, d = x.shape
    k = ids.shape[1]
    e_local = w_gate.shape[0]
    dest, slot, kept = _pack(ids, ep, e_local, cap)
    tok = jnp.arange(n * k) // k
    # send buffers; dropped assignments write out of range (mode="drop")
    s_slot = jnp.where(kept, slot, cap)
    send_x = jnp.zeros((ep, cap, d), x.dtype).at[dest, s_slot].set(x[tok], mode="drop")
    send_e = jnp.full((ep, cap), e_local, jnp.int32).at[dest, s_slot].set(ids.reshape(-1) % e_local, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, "expert", 0, 0, tiled=True)
    rx, re = recv_x.reshape(ep * cap, d), recv_e.reshape(ep * cap)
    # local dropless FFN; empty slots carry expert id e_local and sort last, outside every group
    order, inv = expert_positions(re)
    sizes = group_sizes_of(re, e_local)  # the empty slots' id e_local counts for no expert
    ys = expert_ffn(rx[order], w_gate, w_up, w_down, sizes, prec, dtype)
    y = ys.at[inv].get(unique_indices=True).reshape(ep, cap, -1)
    back = jax.lax.all_to_all(y, "expert", 0, 0, tiled=True)  # [ep, cap, d] for our own assignments
    got = back[dest, jnp.minimum(slot, cap - 1)]
    wts = jnp.where(kept, weights.reshape(-1), 0.0)
    out = jnp.zeros((n, got.shape[-1]), jnp.float32).at[tok].add(got.astype(jnp.float32) * wts[:, None])
    dropped = jax.lax.psum(jnp.sum(~kept), S.BATCH_AXES)
    return out.astype(dtype), dropped


def expert_parallel_moe(mesh, x, ids, weights, w_gate, w_up, w_down, prec, dtype, capacity_factor=None):
    """(y [N, d], dropped assignments) for tokens x [N, d] sharded over the batch axes."""
    ep = mesh.shape["expert"]
    e = w_gate.shape[0]
    if e % ep:
        raise ValueError(f"expert parallelism: n_experts={e} is not divisible by the mesh's expert axis ({ep})")
    shards = math.prod(mesh.shape[a] for a in S.BATCH_AXES)
    n, k = ids.shape
    if n % shards:
        raise ValueError(f"expert parallelism: {n} tokens do not split over {shards} batch shards")
    n_local = n // shards
    cap = n_local * k if capacity_factor is None else max(1, math.ceil(capacity_factor * n_local * k / ep))
    tok_spec = PS(S.BATCH_AXES, None)
    w_spec = PS("expert", None, None)
    fn = jax.shard_map(partial(_local, prec=prec, dtype=dtype, ep=ep, cap=cap), mesh=mesh,
                       in_specs=(tok_spec, tok_spec, tok_spec, w_spec, w_spec, w_spec), out_specs=(tok_spec, PS()),
                       check_vma=False)
    return fn(x, ids, weights, w_gate, w_up, w_down)


def expert_parallel_fn(mesh, capacity_factor=None):
    """An ``expert_fn`` for ``MoE`` / ``Transformer.forward`` that runs expert-parallel."""

    def fn(x, ids, weights, w_gate, w_up, w_down, prec, dtype):
        return expert_parallel_moe(mesh, x, ids, weights, w_gate, w_up, w_down, prec, dtype, capacity_factor)[0]

    return fn
