"""Orbax checkpoints of the train state: async saves, retention, latest-good restore, resharding.

A step directory holds two items, ``params`` (what the rollout bridge needs alone) and
``train`` (optimizer state, step counters, RNG). Orbax writes each step to a temporary
directory and renames it when complete, so a crash mid-save leaves the previous steps
restorable; ``latest_step`` only ever reports finalized steps.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from quads_jax.train.state import TrainState


def _train_item(state: TrainState) -> dict:
    return {"opt_state": state.opt_state, "step": state.step, "skipped": state.skipped, "rng": state.rng}


def _as_restore_target(tree):
    """Abstract arrays (shape, dtype, sharding) to restore into; shardings pick the layout."""
    def f(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(f, tree)


class Checkpointer:
    def __init__(self, directory: str, *, save_every: int = 100, max_to_keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        opts = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=max_to_keep,
                                            enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=("params", "train"))

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        step = int(state.step)
        return self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(_train_item(state))), force=force)

    def save_params(self, params: dict, step: int) -> bool:
        """A params-only step (no optimizer state): for weight sync and exported policies."""
        import jax.numpy as jnp

        st = TrainState(params=params, opt_state={}, step=jnp.int32(step), skipped=jnp.int32(0),
                        rng=jnp.zeros((2,), jnp.uint32))
        return self.save(st, force=True)

    def wait(self):
        self.manager.wait_until_finished()

    def latest_step(self):
        return self.manager.latest_step()

    def all_steps(self):
        return list(self.manager.all_steps())

    def restore(self, like: TrainState, step: int | None = None) -> TrainState:
        """Restore into the structure, dtypes and shardings of ``like`` (concrete or abstract),
        so a checkpoint written on one mesh restores onto another."""
        step = self.resolve_step(step)
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_as_restore_target(like.params)),
            train=ocp.args.StandardRestore(_as_restore_target(_train_item(like)))))
        t = out["train"]
        return TrainState(params=out["params"], opt_state=t["opt_state"], step=t["step"], skipped=t["skipped"], rng=t["rng"])

    def restore_params(self, like_params: dict | None = None, step: int | None = None) -> dict:
        """Only the parameters (no optimizer state is read)."""
        step = self.resolve_step(step)
        arg = ocp.args.StandardRestore(None if like_params is None else _as_restore_target(like_params))
        return self.manager.restore(step, args=ocp.args.Composite(params=arg))["params"]

    def resolve_step(self, step: int | None = None) -> int:
        """``step``, or the latest finalized one; FileNotFoundError if there is none."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finalized checkpoint in {self.directory}")
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"checkpoint step {step} not found in {self.directory} (have {self.all_steps()})")
        return step

    def close(self):
        self.manager.close()
