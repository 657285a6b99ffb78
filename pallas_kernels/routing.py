"""MoE routing and dispatch for the decode step: top-k experts, their weights, and the sorted
order of the (token, expert) assignments, in one kernel.

    ids, w, order, inv, token, group_sizes = topk_dispatch(logits, k, normalize=True)

For router logits [T, E]: ``ids`` / ``w`` [T, k] the top-k experts of each token (ties to the
lower index, as ``lax.top_k``) and their weights (``normalize``: the softmax of the k chosen
logits; else the softmax over all E, taken at the chosen); the T*k assignments t*k + j sorted
stably by expert: ``order`` [T*k] the assignment at each sorted place, ``inv`` [T*k] its
inverse (each assignment's place), ``token`` [T*k] the token of each sorted place (order // k)
and ``group_sizes`` [E] the assignments per expert. ``topk_dispatch_xla`` is the reference:
``lax.top_k``, then comparison reductions (``sort_by_expert``).

Why a kernel: in XLA the same work is about seven small kernels a MoE layer (the top-k sort,
the softmax of the chosen, three comparison reductions, a division and a compare), each a
launch in the decode step's critical path. The kernel is one program over a [tokens, experts]
tile in registers: k rounds of a row max and its lowest index give the top-k; since a token's
k experts are distinct, the place of assignment (t, e) is the assignments of the experts
before e plus the tokens before t that chose e (two cumulative sums over the tile), and
``order`` and ``token`` are scattered to those places. One program is serial work on one SM,
so it takes the decode batches only (up to KERNEL_MAX_ENTRIES entries: 128 tokens of 64
experts); larger batches run the reference, whose kernels spread over the chip. The weights'
gradient is the reference's (a custom VJP), so a trainer may run it too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.config import interpret_mode, resolve_backend
from pallas_kernels.tile_math import pad_axis

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


def topk_weights(logits, ids, normalize: bool):
    """The weights [T, k] of the chosen experts ``ids``: the softmax of their logits
    (``normalize``) or the softmax over all experts, taken at them. Float32."""
    lf = logits.astype(jnp.float32)
    if normalize:
        return jax.nn.softmax(jnp.take_along_axis(lf, ids, axis=-1), axis=-1)
    return jnp.take_along_axis(jax.nn.softmax(lf, axis=-1), ids, axis=-1)


def _check(logits, k: int):
    if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits: expected a float array [T, E], got {logits.dtype}{tuple(logits.shape)}")
    if not isinstance(k, int) or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k: expected an integer in [1, E={logits.shape[1]}], got {k!r}")


def topk_dispatch_xla(logits, k: int, *, normalize: bool):
    """The reference: see the module docstring."""
    _check(logits, k)
    _, ids = jax.lax.top_k(logits.astype(jnp.float32), k)
    ids = ids.astype(jnp.int32)
    return ids, topk_weights(logits, ids, normalize), *sort_by_expert(ids, logits.shape[1])


# ----------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """``num_warps`` of the kernel's one program."""
    num_warps: int = 4

    def __post_init__(self):
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"RoutingConfig.num_warps={self.num_warps!r}: expected 1, 2, 4, 8 or 16")


def routing_config(t: int, e: int) -> RoutingConfig:
    """About 32 tile entries a thread (4 warps for 64 tokens of 64 experts, 8 for 128): with 4
    warps the 8192-entry tiles spill registers (compiled for sm_90, benchmarks/sass_offline.py)."""
    entries = max(16, pl.next_power_of_2(t)) * pl.next_power_of_2(e)
    return RoutingConfig(num_warps=max(4, min(16, entries // 1024)))


# the largest [tokens, experts] tile (both padded to powers of two) the one-program kernel
# takes: 128 tokens of 64 experts, 64 of 128; beyond, topk_dispatch runs the reference, whose
# kernels spread over the chip (one program walking more tokens is serial work on one SM)
KERNEL_MAX_ENTRIES = 8192


def _dispatch_kernel(l_ref, ids_ref, w_ref, order_ref, inv_ref, token_ref, gs_ref, *, t, e, k, normalize):
    tp, ep, kp = max(16, pl.next_power_of_2(t)), pl.next_power_of_2(e), pl.next_power_of_2(k)
    rows, cols, slots = jnp.arange(tp), jnp.arange(ep), jnp.arange(kp)[None, :]
    row_ok, slot_ok = rows < t, slots < k
    x = plgpu.load(l_ref.at[pl.ds(0, tp), pl.ds(0, ep)], mask=row_ok[:, None] & (cols < e)[None, :], other=-jnp.inf)
    x = x.astype(jnp.float32)
    # top-k: k rounds of (the row's max, its lowest index); ``choice`` the slot of each chosen
    choice = jnp.full((tp, ep), -1, jnp.int32)
    vals = jnp.zeros((tp, kp), jnp.float32)
    ids = jnp.zeros((tp, kp), jnp.int32)
    for j in range(k):
        m = jnp.max(x, axis=1)
        idx = jnp.min(jnp.where(x == m[:, None], cols[None, :], ep), axis=1)
        hit = cols[None, :] == idx[:, None]
        choice = jnp.where(hit, j, choice)
        x = jnp.where(hit, -jnp.inf, x)
        vals = jnp.where(slots == j, m[:, None], vals)
        ids = jnp.where(slots == j, idx[:, None], ids)
    # weights: exp against the row's max (slot 0), over the chosen or over all experts (x
    # now holds -inf at the chosen and at the padding)
    top = jnp.max(jnp.where(slot_ok, vals, -jnp.inf), axis=1)[:, None]
    num = jnp.where(slot_ok, jnp.exp(vals - top), 0.0)
    den = jnp.sum(num, axis=1)
    if not normalize:
        den = den + jnp.sum(jnp.exp(x - top), axis=1)
    out, mask = (pl.ds(0, tp), pl.ds(0, kp)), row_ok[:, None] & slot_ok
    plgpu.store(ids_ref.at[out], ids, mask=mask)
    plgpu.store(w_ref.at[out], num / den[:, None], mask=mask)
    # places: the assignments of the experts before e, then the tokens before t that chose e
    chosen = ((choice >= 0) & row_ok[:, None]).astype(jnp.int32)
    counts = jnp.sum(chosen, axis=0)
    plgpu.store(gs_ref.at[pl.ds(0, ep)], counts, mask=cols < e)
    place = (jnp.cumsum(counts) - counts)[None, :] + jnp.cumsum(chosen, axis=0) - chosen
    inv = jnp.zeros((tp, kp), jnp.int32)
    for j in range(k):
        p = jnp.sum(jnp.where(choice == j, place, 0), axis=1)
        inv = jnp.where(slots == j, p[:, None], inv)
        # rows past T aim at slot T*k: the GPU masks their stores; interpret mode, whose masked
        # scatter writes old values back, has a spare slot there
        p = jnp.where(row_ok, p, t * k)
        plgpu.store(order_ref.at[p], rows * k + j, mask=row_ok)
        plgpu.store(token_ref.at[p], rows, mask=row_ok)
    plgpu.store(inv_ref.at[out], inv, mask=mask)


@functools.partial(jax.jit, static_argnames=("k", "normalize", "cfg", "interpret"))
def _dispatch_call(logits, *, k, normalize, cfg, interpret):
    t, e = logits.shape
    tp, ep, kp = max(16, pl.next_power_of_2(t)), pl.next_power_of_2(e), pl.next_power_of_2(k)
    pad = int(interpret)  # interpret mode clamps out-of-range slices instead of masking them: padded buffers
    if pad:
        logits = pad_axis(pad_axis(logits, 0, tp), 1, ep)
    tk = (tp, kp) if pad else (t, k)
    i32 = jnp.int32
    ids, w, order, inv, token, gs = pl.pallas_call(
        functools.partial(_dispatch_kernel, t=t, e=e, k=k, normalize=normalize),
        out_shape=(jax.ShapeDtypeStruct(tk, i32), jax.ShapeDtypeStruct(tk, jnp.float32), jax.ShapeDtypeStruct((t * k + pad,), i32),
                   jax.ShapeDtypeStruct(tk, i32), jax.ShapeDtypeStruct((t * k + pad,), i32), jax.ShapeDtypeStruct((ep if pad else e,), i32)),
        grid=(1,),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="moe_topk_dispatch",
    )(logits)
    return ids[:t, :k], w[:t, :k], order[:t * k], inv[:t, :k].reshape(-1), token[:t * k], gs[:e]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _dispatch(logits, k, normalize, cfg, interpret):
    return _dispatch_call(logits, k=k, normalize=normalize, cfg=cfg, interpret=interpret)


def _dispatch_fwd(logits, k, normalize, cfg, interpret):
    out = _dispatch_call(logits, k=k, normalize=normalize, cfg=cfg, interpret=interpret)
    return out, (logits, out[0])


def _dispatch_bwd(k, normalize, cfg, interpret, res, ct):
    logits, ids = res
    _, vjp = jax.vjp(lambda lg: topk_weights(lg, ids, normalize), logits)
    return vjp(ct[1])


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def kernel_fits(t: int, e: int) -> bool:
    """Whether ``topk_dispatch`` runs the kernel for T tokens of E experts (the decode regime)."""
    return max(16, pl.next_power_of_2(t)) * pl.next_power_of_2(e) <= KERNEL_MAX_ENTRIES


def topk_dispatch(logits, k: int, *, normalize: bool, backend=None, config: RoutingConfig | None = None):
    """See the module docstring. ``backend``: "pallas", "xla" or None / "auto" (pallas on a
    GPU); the kernel runs up to KERNEL_MAX_ENTRIES [token, expert] entries, the reference beyond."""
    _check(logits, k)
    t, e = logits.shape
    if resolve_backend(backend) == "xla" or not kernel_fits(t, e):
        return topk_dispatch_xla(logits, k, normalize=normalize)
    cfg = config or routing_config(t, e)
    if not isinstance(cfg, RoutingConfig):
        raise ValueError(f"config: expected a RoutingConfig, got {cfg!r}")
    return _dispatch(logits, k, bool(normalize), cfg, interpret_mode())
