"""Train state as plain pytrees, the optimizer, and a jitted, sharded train step.

Parameters live in a flat dict ``{"layers/0/attn/q/w": array}`` (strings all the way, so
optax, orbax and shardings treat them alike); ``to_model(graphdef, params)`` rebuilds the
nnx model (its metadata, e.g. logical axes, comes from the graphdef).

    graphdef, params, axes = split_params(model)
    tx = make_optimizer(OptimConfig(lr=3e-4, total_steps=1000))
    state = init_state(params, tx, seed=0)
    step = make_train_step(graphdef, tx, loss_fn, mesh=mesh, axes=axes)
    state, metrics = step(state, batch)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from quads_jax import sharding as S
from quads_jax.config_util import build


# ----------------------------------------------------------------------------- params


def _key(path) -> str:
    return "/".join(str(p) for p in path)


def split_params(model: nnx.Module):
    """(graphdef, flat params {name: array}, logical axes {name: tuple})."""
    graphdef, state = nnx.split(model)
    params, axes = {}, {}
    for path, var in nnx.to_flat_state(state):
        k = _key(path)
        params[k] = var.get_value()
        axes[k] = tuple(getattr(var, "logical_axes", (None,) * jnp.ndim(var.get_value())))
    return graphdef, params, axes


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for k, v in flat.items():
        parts = [int(p) if p.isdigit() else p for p in k.split("/")]
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out


def to_model(graphdef, params: dict[str, Any]) -> nnx.Module:
    return nnx.merge(graphdef, _nest(params))


# ----------------------------------------------------------------------------- optimizer


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    warmup_steps: int = 10
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    grad_accum: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            try:
                object.__setattr__(self, f.name, int(v) if f.type == "int" else float(v))
            except (TypeError, ValueError):
                raise ValueError(f"optim.{f.name}={v!r}: expected a number") from None

    @classmethod
    def from_dict(cls, d):
        return build(cls, d, "optim")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on a warmup + cosine schedule (no decay on norms)."""
    sched = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(1, cfg.warmup_steps), max(cfg.total_steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio)
    decay_mask = lambda p: {k: v.ndim >= 2 for k, v in p.items()}
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(sched, cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask))


# ----------------------------------------------------------------------------- state


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: dict
    opt_state: Any
    step: jax.Array
    skipped: jax.Array  # steps not applied because the loss or a gradient was not finite
    rng: jax.Array


def init_state(params: dict, tx: optax.GradientTransformation, seed: int = 0) -> TrainState:
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.int32(0), skipped=jnp.int32(0),
                      rng=jax.random.key_data(jax.random.key(seed)))


def state_shardings(state: TrainState, mesh, axes: dict[str, tuple]):
    """NamedShardings for every leaf: params and their optimizer moments by logical axes."""
    pspecs = S.param_specs(axes, {k: v.shape for k, v in state.params.items()}, mesh)

    def for_leaf(path, leaf):
        name = next((getattr(p, "key", None) for p in reversed(path) if getattr(p, "key", None) in pspecs), None)
        if name is not None and hasattr(leaf, "shape") and tuple(leaf.shape) == tuple(state.params[name].shape):
            return S.named(mesh, pspecs[name])
        return S.replicated(mesh)

    return jax.tree_util.tree_map_with_path(for_leaf, state)


# ----------------------------------------------------------------------------- step


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def make_train_step(graphdef, tx: optax.GradientTransformation, loss_fn: Callable, *, mesh=None, axes=None,
                    grad_accum: int = 1, donate: bool = True):
    """A jitted ``step(state, batch) -> (state, metrics)``.

    ``loss_fn(model, batch, rng) -> (loss, metrics dict)``. With ``grad_accum > 1`` every
    batch array has a leading micro-batch axis of that size and gradients are averaged
    over it (``lax.scan``). A step whose loss or gradients are not finite leaves params
    and optimizer state unchanged and increments ``state.skipped``."""

    def grads_of(params, batch, rng):
        def f(p):
            loss, metrics = loss_fn(to_model(graphdef, p), batch, rng)
            return loss, metrics
        (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(params)
        return loss, metrics, g

    def step(state: TrainState, batch):
        rng = jax.random.wrap_key_data(state.rng)
        rng, sub = jax.random.split(rng)
        if grad_accum == 1:
            loss, metrics, grads = grads_of(state.params, batch, sub)
        else:
            def body(acc, mb):
                i, mbatch = mb
                loss, metrics, g = grads_of(state.params, mbatch, jax.random.fold_in(sub, i))
                return jax.tree.map(jnp.add, acc, (loss, metrics, g)), None
            zeros = jax.eval_shape(lambda: grads_of(state.params, jax.tree.map(lambda x: x[0], batch), sub))
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
            tot, _ = jax.lax.scan(body, zeros, (jnp.arange(grad_accum), batch))
            loss, metrics, grads = jax.tree.map(lambda x: x / grad_accum, tot)
        ok = jnp.isfinite(loss) & _all_finite(grads)
        safe = jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)
        updates, new_opt = tx.update(safe, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        new_state = TrainState(params=keep(new_params, state.params), opt_state=keep(new_opt, state.opt_state),
                               step=state.step + ok.astype(jnp.int32), skipped=state.skipped + (~ok).astype(jnp.int32),
                               rng=jax.random.key_data(rng))
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), skipped=(~ok).astype(jnp.int32))
        return new_state, metrics

    kw = {"donate_argnums": (0,)} if donate else {}
    if mesh is None:
        return jax.jit(step, **kw)
    cache: dict = {}

    def sharded(state, batch):
        if "fn" not in cache:
            ss = state_shardings(state, mesh, axes)
            bs = jax.tree.map(lambda x: S.batch_sharding(mesh, x.ndim, 1 if grad_accum > 1 else 0), batch)
            cache["fn"] = jax.jit(step, in_shardings=(ss, bs), out_shardings=(ss, S.replicated(mesh)), **kw)
            cache["ss"], cache["bs"] = ss, bs
        return cache["fn"](state, S.global_batch(batch, cache["bs"]))

    sharded.shardings = lambda state: state_shardings(state, mesh, axes)
    return sharded


def sharded_init(make_model: Callable[[], nnx.Module], tx, mesh, *, seed: int = 0):
    """Initialise model parameters and optimizer state directly sharded on ``mesh`` (the
    full model is never materialised on one device). Returns (graphdef, axes, state)."""
    abstract = nnx.eval_shape(make_model)
    graphdef, aparams, axes = split_params(abstract)

    def init():
        _, params, _ = split_params(make_model())
        return init_state(params, tx, seed)

    ashape = jax.eval_shape(init)
    ss = state_shardings(ashape, mesh, axes)
    state = jax.jit(init, out_shardings=ss)()
    return graphdef, axes, state
