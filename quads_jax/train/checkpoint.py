"""Orbax checkpoints of the train state: async saves, retention, latest-intact restore,
resharding, and per-array fingerprints that catch corrupt or partial steps.

A step directory holds two items, ``params`` (what the rollout bridge needs alone) and
``train`` (optimizer state, step counters, RNG). Orbax writes each step to a temporary
directory and renames it when complete, so a crash mid-save leaves the previous steps
restorable.

Integrity: at save, each array's fingerprint (two position-weighted sums of its bits, computed
on the device, so one flipped bit changes it) is written atomically to
``fingerprints/<step>.json``; that file is the step's commit marker. At restore, a step
without it, one that fails to read (a truncated or corrupt file, an empty directory), or one
whose arrays do not match their fingerprints is skipped with a warning, and the newest intact
step is used; asking for such a step by number raises ``CorruptCheckpoint``.
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
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


class CorruptCheckpoint(ValueError):
    """A checkpoint step that is missing its commit marker, cannot be read, or does not match
    its fingerprints."""


def _words(x):
    """An array's bits as uint32 words (narrower types widened, one word per element)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    u = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, u).reshape(-1).astype(jnp.uint32)


@jax.jit
def _fingerprints(tree):
    def fp(x):
        w = _words(x)
        i = jnp.arange(w.shape[0], dtype=jnp.uint32)
        a = jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)  # odd weights: any single flipped bit changes the sum
        b = jnp.sum((w ^ (w >> 16)) * ((i * jnp.uint32(0x9E3779B1)) | 1), dtype=jnp.uint32)
        return jnp.stack([a, b])
    return jax.tree.map(fp, tree)


def fingerprint(tree) -> dict[str, list[int]]:
    """{leaf path: [two uint32 sums]} of a pytree of arrays (one device-to-host transfer)."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(_fingerprints(tree)))[0]
    return {jax.tree_util.keystr(p): [int(v) for v in np.asarray(x)] for p, x in leaves}


class Checkpointer:
    def __init__(self, directory: str, *, save_every: int = 100, max_to_keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        opts = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=max_to_keep,
                                            enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=("params", "train"))
        self._fp_dir = os.path.join(self.directory, "fingerprints")

    def _fp_path(self, step: int) -> str:
        return os.path.join(self._fp_dir, f"{int(step)}.json")

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        step = int(state.step)
        if not force and not self.manager.should_save(step):
            return False
        fps = {"params": fingerprint(state.params), "train": fingerprint(_train_item(state))}
        os.makedirs(self._fp_dir, exist_ok=True)
        tmp = self._fp_path(step) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(fps, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._fp_path(step))
        saved = self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(_train_item(state))), force=force)
        keep = set(self.manager.all_steps()) | {step}
        for f in os.listdir(self._fp_dir):  # fingerprints of steps that retention removed
            stem = f.split(".")[0]
            if stem.isdigit() and int(stem) not in keep and f.endswith(".json"):
                os.remove(os.path.join(self._fp_dir, f))
        return saved

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
        so a checkpoint written on one mesh restores onto another. ``step`` None: the newest
        intact step."""
        def read(st):
            out = self.manager.restore(st, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_as_restore_target(like.params)),
                train=ocp.args.StandardRestore(_as_restore_target(_train_item(like)))))
            t = out["train"]
            return TrainState(params=out["params"], opt_state=t["opt_state"], step=t["step"], skipped=t["skipped"], rng=t["rng"])

        return self._intact(step, read, lambda r: {"params": r.params, "train": _train_item(r)})

    def restore_params(self, like_params: dict | None = None, step: int | None = None) -> dict:
        """Only the parameters (no optimizer state is read); ``step`` None: the newest intact."""
        arg = ocp.args.StandardRestore(None if like_params is None else _as_restore_target(like_params))
        return self._intact(step, lambda st: self.manager.restore(st, args=ocp.args.Composite(params=arg))["params"],
                            lambda p: {"params": p})

    def _verified(self, st: int, read, parts):
        if not os.path.exists(self._fp_path(st)):
            raise CorruptCheckpoint(f"checkpoint step {st}: no commit marker (fingerprints/{st}.json)")
        with open(self._fp_path(st)) as f:
            want = json.load(f)
        try:
            got = read(st)
        except Exception as e:  # noqa: BLE001 - truncated, corrupt or partial: the step is not usable
            raise CorruptCheckpoint(f"checkpoint step {st}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
        for name, tree in parts(got).items():
            have = fingerprint(tree)
            bad = sorted(k for k in have if want.get(name, {}).get(k) != have[k])
            if bad:
                raise CorruptCheckpoint(f"checkpoint step {st}: {len(bad)} array(s) do not match their fingerprints "
                                        f"(first: {name}{bad[0]})")
        return got

    def _intact(self, step, read, parts):
        """``read`` the given step, or the newest intact one; ``restored_step`` says which."""
        steps = [self.resolve_step(step)] if step is not None else sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no finalized checkpoint in {self.directory}")
        errors = []
        for st in steps:
            try:
                out = self._verified(st, read, parts)
                self.restored_step = st
                return out
            except CorruptCheckpoint as e:
                if step is not None:
                    raise
                errors.append(str(e))
                warnings.warn(f"{e}; skipped, trying an older step", stacklevel=3)
        raise CorruptCheckpoint(f"no intact checkpoint in {self.directory}: " + "; ".join(errors))

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
