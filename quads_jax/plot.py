"""Plots of run directories: reward, held-out pass@1 and the trainer-vs-rollout gap."""

from __future__ import annotations

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from quads_jax.metrics import read_csv  # noqa: E402

PANELS = (("reward_mean", "reward (train prompts)"), ("pass_at_1", "held-out pass@1 (rollout engine)"),
          ("pass_at_1_bf16", "held-out pass@1 (BF16 decoding)"),
          ("gap_max", "max |logp_rollout - logp_train|"), ("k3_kl", "k3 KL(rollout || train)"))


def run_dirs_of(paths) -> list[str]:
    """Run directories (holding metrics.csv) among ``paths``; a directory of runs (``quads
    compare``'s output) stands for its runs. FileNotFoundError naming a path with none."""
    out = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "metrics.csv")):
            out.append(p)
            continue
        subs = sorted(os.path.join(p, d) for d in (os.listdir(p) if os.path.isdir(p) else [])
                      if os.path.isfile(os.path.join(p, d, "metrics.csv")))
        if not subs:
            raise FileNotFoundError(f"{p}: no metrics.csv in it or in its subdirectories (a run or compare directory)")
        out += subs
    return out


def plot_runs(run_dirs, out_png: str, labels=None) -> str:
    if labels is None:
        run_dirs = run_dirs_of(run_dirs)
    metrics = [read_csv(os.path.join(d, "metrics.csv")) for d in run_dirs]
    panels = [p for p in PANELS if any(p[0] in m for m in metrics)] or list(PANELS)  # only columns some run has
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    axes = axes[0]
    for j, (d, m) in enumerate(zip(run_dirs, metrics)):
        label = (labels[j] if labels else None) or os.path.basename(os.path.normpath(d))
        for ax, (col, title) in zip(axes, panels):
            if col not in m:
                continue
            pts = [(s, v) for s, v in zip(m["step"], m[col]) if not math.isnan(v)]
            if pts:
                ax.plot(*zip(*pts), marker="o" if col.startswith("pass_at_1") else None, ms=3, label=label)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
