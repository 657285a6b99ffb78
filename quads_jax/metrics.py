"""Metrics a user can plot: one CSV row a step (fixed columns) plus TensorBoard events."""

from __future__ import annotations

import csv
import math
import os


class MetricsWriter:
    def __init__(self, out_dir: str, columns, *, filename: str = "metrics.csv", tensorboard: bool = True):
        os.makedirs(out_dir, exist_ok=True)
        self.columns = list(columns)
        self.path = os.path.join(out_dir, filename)
        self._f = open(self.path, "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=self.columns, extrasaction="ignore")
        self._w.writeheader()
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
                self._tb = SummaryWriter(os.path.join(out_dir, "tb", os.path.splitext(filename)[0]))
            except ImportError:  # optional
                self._tb = None

    def write(self, step: int, row: dict):
        clean = {k: _num(v) for k, v in row.items()}
        clean["step"] = step
        self._w.writerow({k: ("" if clean.get(k) is None else clean[k]) for k in self.columns})
        self._f.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self):
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def _num(v):
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def read_csv(path: str) -> dict[str, list]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    cols = rows[0].keys() if rows else []
    return {c: [float(r[c]) if r[c] not in ("", None) else float("nan") for r in rows] for c in cols}
