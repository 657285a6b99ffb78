"""Which implementation an operation runs: the Pallas kernel or its XLA reference.

Every public op takes ``backend=None | "pallas" | "xla"``; None means the process-wide
default, set with ``set_backend``, the ``use_backend`` context manager, a config's
``kernels.backend`` key, or the ``QUADS_KERNEL_BACKEND`` environment variable.
On a machine without a GPU the Pallas path runs in interpret mode (same kernel body,
evaluated by XLA on the CPU): that proves the kernel's arithmetic, not that it compiles.
"""

from __future__ import annotations

import contextlib
import os

import jax

BACKENDS = ("pallas", "xla")
_default = os.environ.get("QUADS_KERNEL_BACKEND", "xla")


def _check(name: str, arg: str = "backend") -> str:
    if name not in BACKENDS:
        raise ValueError(f"{arg}={name!r}: expected one of {BACKENDS}")
    return name


_check(_default, "QUADS_KERNEL_BACKEND")


def set_backend(name: str) -> None:
    global _default
    _default = _check(name)


def get_backend() -> str:
    return _default


def resolve(backend: str | None) -> str:
    return _default if backend is None else _check(backend)


@contextlib.contextmanager
def use_backend(name: str):
    global _default
    prev, _default = _default, _check(name)
    try:
        yield
    finally:
        _default = prev


def interpret_mode() -> bool:
    """True when Pallas kernels must be interpreted (no GPU backend present)."""
    return jax.default_backend() != "gpu"
