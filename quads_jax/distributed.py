"""Multi-host start-up: ``jax.distributed`` from a config or the environment.

    from quads_jax import distributed
    distributed.initialize()          # reads QUADS_COORDINATOR / QUADS_NUM_PROCESSES / QUADS_PROCESS_ID
    mesh = sharding.make_mesh({"data": -1})   # now spans the devices of every process

With a single process (nothing configured) this is a no-op, so the same script runs on a
laptop and on a pod. On CPU the cross-process collectives go through gloo. On GPU and TPU
clusters whose scheduler JAX detects (SLURM, Open MPI, Cloud TPU) ``jax.distributed``'s own
auto-detection is used when ``auto=True``.
"""

from __future__ import annotations

import os

import jax

ENV = {"coordinator": "QUADS_COORDINATOR", "num_processes": "QUADS_NUM_PROCESSES", "process_id": "QUADS_PROCESS_ID"}


def settings_from_env(env=None) -> dict:
    env = os.environ if env is None else env
    out = {}
    if env.get(ENV["coordinator"]):
        out["coordinator"] = env[ENV["coordinator"]]
    for k in ("num_processes", "process_id"):
        if env.get(ENV[k]):
            try:
                out[k] = int(env[ENV[k]])
            except ValueError:
                raise ValueError(f"{ENV[k]}={env[ENV[k]]!r}: expected an integer") from None
    return out


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
               auto: bool = False) -> bool:
    """Join the process group; returns True when running multi-process. Arguments override
    the environment; a missing piece is an error naming it."""
    s = {**settings_from_env(), **{k: v for k, v in dict(coordinator=coordinator, num_processes=num_processes,
                                                           process_id=process_id).items() if v is not None}}
    if auto and not s:
        jax.distributed.initialize()
        return jax.process_count() > 1
    if not s or s.get("num_processes", 1) == 1:
        return False
    missing = [k for k in ("coordinator", "num_processes", "process_id") if k not in s]
    if missing:
        raise ValueError(f"distributed: missing {missing} (arguments or {[ENV[k] for k in missing]})")
    if not 0 <= s["process_id"] < s["num_processes"]:
        raise ValueError(f"distributed: process_id={s['process_id']} outside [0, {s['num_processes']})")
    if jax.config.jax_platforms in ("cpu",) or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=s["coordinator"], num_processes=s["num_processes"],
                               process_id=s["process_id"])
    return True


def is_coordinator() -> bool:
    return jax.process_index() == 0
