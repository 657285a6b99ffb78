"""The MoE router's dispatch: the (token, expert) assignments sorted by expert, in XLA.

    order, inv, token, group_sizes = sort_by_expert(ids, n_experts)

For top-k ids [T, k]: ``order`` [T*k] the assignment t*k + j at each place of the stable
sort by expert, ``inv`` its inverse (each assignment's place), ``token`` the token of each
sorted place and ``group_sizes`` [E] the assignments per expert. At the decode steps' sizes
these are comparison reductions that XLA fuses into a few kernels spread over the chip; a
one-program Pallas kernel for the top-k and this dispatch measured slower inside the decode
step (benchmarks/results/2026-12-07-h100-routing) and left the package.
"""

from __future__ import annotations

import jax.numpy as jnp

# assignments (tokens x k) up to which expert_positions counts by comparison: the rollout's
# decode steps (batch 512 at top-8); the [M, M] comparison grows with the square
RANK_BY_COMPARISON_MAX = 4096


def expert_positions(flat, max_compare: int = RANK_BY_COMPARISON_MAX):
    """(order, inv) of flat expert ids [M]: the stable sort by expert and its inverse (each
    assignment's place in it). Up to ``max_compare`` assignments both are counted, with no
    sort and no scatter: inv[i] = the assignments before i in (expert, index) order, order[p]
    = the i with inv[i] = p, each one comparison reduction that XLA fuses (XLA's sort is
    several kernels; a scatter of the order into a fresh buffer costs a copy and a scatter
    kernel). Beyond, an argsort and the inverse scattered from it."""
    m = flat.shape[0]
    idx = jnp.arange(m, dtype=jnp.int32)
    if m <= max_compare:
        a, b = flat[:, None], flat[None, :]
        inv = ((b < a) | ((b == a) & (idx[None, :] < idx[:, None]))).sum(1, dtype=jnp.int32)
        order = jnp.where(inv[None, :] == idx[:, None], idx[None, :], 0).sum(1, dtype=jnp.int32)
        return order, inv
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    return order, jnp.zeros_like(order).at[order].set(idx, unique_indices=True)


def group_sizes_of(flat, n_experts: int):
    """Assignments per expert 0 .. n_experts - 1 of flat expert ids [M] (ids outside that range
    count for none): a comparison reduction over [M, E] that XLA fuses, where a bincount is a
    copy of zeros and a scatter-add."""
    return (flat[:, None] == jnp.arange(n_experts, dtype=flat.dtype)[None, :]).sum(0, dtype=jnp.int32)


def sort_by_expert(ids, n_experts: int):
    """The dispatch of given assignments ids [N, k]: (order [N*k], inv (its inverse), token of
    each sorted row, group_sizes [E])."""
    flat = ids.reshape(-1)
    order, inv = expert_positions(flat)
    return order, inv, order // ids.shape[-1], group_sizes_of(flat, n_experts)

