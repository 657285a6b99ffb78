"""Mesh, logical axis rules and parameter shardings (MaxText style).

    mesh = make_mesh({"data": 2, "fsdp": 2, "expert": 2, "tensor": 1})
    specs = param_specs(axes, shapes, mesh)     # logical axes -> PartitionSpec per parameter
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}

A logical axis maps to a mesh axis by ``DEFAULT_RULES``; a dimension that the mesh axis
does not divide, or a mesh axis already used by another dimension, stays replicated.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the batch is split over every non-model axis

DEFAULT_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "embed": "fsdp",
    "expert": "expert",
    "expert_router": None,
    "norm": None,
}


def make_mesh(shape: Mapping[str, int] | None = None, devices=None) -> Mesh:
    """A mesh with the four named axes; sizes default to 1, ``-1`` takes the remaining devices."""
    shape = dict(shape or {})
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axes {sorted(unknown)}; expected some of {MESH_AXES}")
    devices = list(devices if devices is not None else jax.devices())
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError("mesh: at most one axis may be -1")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = len(devices) // rest
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh: axis sizes {dict(zip(MESH_AXES, sizes))} need {math.prod(sizes)} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_spec(axes, shape, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES) -> PartitionSpec:
    used, out = set(), []
    for name, dim in zip(axes, shape):
        ax = rules.get(name)
        if ax is None or ax in used or mesh.shape[ax] == 1 or dim % mesh.shape[ax]:
            out.append(None)
        else:
            out.append(ax)
            used.add(ax)
    return PartitionSpec(*out)


def param_specs(axes: Mapping[str, tuple], shapes: Mapping[str, tuple], mesh: Mesh, rules=DEFAULT_RULES):
    return {k: logical_spec(axes[k], shapes[k], mesh, rules) for k in axes}


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, ndim: int = 2, leading: int = 0) -> NamedSharding:
    """Shard axis ``leading`` of a batch array over the batch axes of the mesh (arrays with no
    such axis, e.g. a scalar normalizer, are replicated)."""
    if ndim <= leading:
        return NamedSharding(mesh, PartitionSpec())
    spec = [None] * ndim
    spec[leading] = BATCH_AXES
    return NamedSharding(mesh, PartitionSpec(*spec))


def global_batch(batch, shardings):
    """Host batch arrays (the same full batch on every process) -> global jax.Arrays with
    ``shardings``: each process places only its addressable shards. Single-process input
    passes through unchanged (jit shards it)."""
    if jax.process_count() == 1:
        return batch

    def put(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(put, batch, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
