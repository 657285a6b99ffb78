"""Building a config dataclass from a dict, with unknown keys named in the error."""

from __future__ import annotations

import dataclasses


def build(cls, d, name: str):
    """``cls(**d)`` after checking every key of ``d`` is a field of ``cls``."""
    d = dict(d or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{name}: unknown keys {sorted(unknown)}; expected some of {sorted(names)}")
    return cls(**d)
