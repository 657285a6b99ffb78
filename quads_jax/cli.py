"""The ``quads`` command: thin wrappers that parse a config and call the library.

    quads train --config configs/tiny_cpu.yaml --out runs/tiny     # SFT warm start + GRPO (the main job)
    quads sft   --config configs/tiny_cpu.yaml --out runs/base
    quads gap   --config configs/tiny_cpu.yaml --out runs/gap        # log-prob gap of every recipe
    quads compare --config configs/tiny_cpu.yaml --out runs/cmp --recipes bf16,nvfp4_naive,quads
    quads train --config configs/tiny_cpu.yaml --config configs/recipes/bf16.yaml --out runs/bf16   # layered
    quads plot  runs/a runs/b --out runs/compare.png
    quads demo                                                       # NVFP4 error table
    quads serve --config configs/tiny_cpu.yaml --recipe quads --port 30000   # SGLang-API rollout server
    quads export --config configs/tiny_cpu.yaml --checkpoint runs/tiny/base --out exports/x [--nvfp4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _overrides(pairs):
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise SystemExit(f"--set {p!r}: expected KEY=VALUE, e.g. rl.recipe=bf16")
        k, v = p.split("=", 1)
        import yaml
        val = yaml.safe_load(v)
        if isinstance(val, str):  # YAML 1.1 reads "2e-3" as a string
            try:
                val = float(val)
            except ValueError:
                pass
        out[k] = val
    return out


def _table(rows: list[dict], cols: list[str]) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |\n" for r in rows)


SUMMARY_COLS = ["recipe", "pass_at_1_first", "pass_at_1_last", "pass_at_1_bf16_first", "pass_at_1_bf16_last",
                "pass_at_1_bf16_rise_se", "reward_first", "reward_last", "gap_max_peak", "gap_mean_avg", "k3_kl_avg", "tokens_per_s"]
LEGEND = ("pass_at_1: held-out greedy pass@1 through the recipe's rollout engine; pass_at_1_bf16: the same weights decoded "
          "in BF16; rise_se: the standard error of its rise, paired over the same held-out problems.\nreward_first/last: mean training reward over the first / last quarter of the steps; gap: |logp_rollout - "
          "logp_trainer| per response token (peak of the max, mean of the mean); k3_kl: KL(rollout || trainer).")


def _base(cfg, a):
    """The SFT base policy: reused from --base (a run directory, or its base/), else made or
    reused in OUT/base."""
    from quads_jax.rl.loop import base_policy

    root = _base_root(a)
    return base_policy(cfg, root or a.out)


def _base_root(a) -> str | None:
    """The run directory whose base/ --base names (it may name base/ itself), checked."""
    src = getattr(a, "base", None)
    if not src:
        return None
    root = os.path.dirname(os.path.normpath(src)) if os.path.basename(os.path.normpath(src)) == "base" else src
    if not os.path.isdir(os.path.join(root, "base")):
        raise FileNotFoundError(f"--base {src}: no base/ policy there (run `quads sft --out {src}` first)")
    return root


def cmd_train(a):
    from quads_jax.rl import loop
    from quads_jax.plot import plot_runs

    cfg = loop.JobConfig.load(a.config, _overrides(a.set))
    os.makedirs(a.out, exist_ok=True)
    graphdef, params, mcfg = _base(cfg, a)
    _, hist = loop.run_grpo(cfg, graphdef, params, mcfg, a.out, checkpoint_every=a.checkpoint_every)
    s = loop.summarize(hist)
    s["recipe"] = cfg.rl.recipe
    json.dump(s, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    png = plot_runs([a.out], os.path.join(a.out, "curves.png"), labels=[cfg.rl.recipe])
    print("\n" + _table([s], SUMMARY_COLS) + LEGEND)
    print(f"\n[quads train] wrote {a.out}: metrics.csv, summary.json, {os.path.basename(png)}, checkpoints/ (the RL policy)")


def cmd_sft(a):
    from quads_jax.rl.loop import base_policy
    from quads_jax.rl import loop

    cfg = loop.JobConfig.load(a.config, _overrides(a.set))
    base_policy(cfg, a.out)
    print(f"[quads sft] wrote {os.path.join(a.out, 'base')} (the SFT base policy) and {os.path.join(a.out, 'sft_metrics.csv')}")


def cmd_compare(a):
    from quads_jax.rl import loop
    from quads_jax.plot import plot_runs

    recipes = a.recipes.split(",")
    cfg0 = loop.JobConfig.load(a.config, _overrides(a.set))
    for r in recipes:
        if r not in loop.RECIPES:
            raise ValueError(f"--recipes: {r!r} is not a recipe; expected some of {list(loop.RECIPES)}")
    os.makedirs(a.out, exist_ok=True)
    graphdef, params, mcfg = _base(cfg0, a)
    rows, dirs = [], []
    for r in recipes:
        cfg = loop.JobConfig.load(a.config, {**_overrides(a.set), "rl.recipe": r})
        d = os.path.join(a.out, r)
        _, hist = loop.run_grpo(cfg, graphdef, params, mcfg, d)
        rows.append({"recipe": r, **loop.summarize(hist)})
        dirs.append(d)
    png = plot_runs(dirs, os.path.join(a.out, "compare.png"), labels=recipes)
    json.dump(rows, open(os.path.join(a.out, "compare.json"), "w"), indent=1)
    print("\n" + _table(rows, SUMMARY_COLS) + LEGEND + "\n\n" + story(rows))
    print(f"\n[quads compare] wrote {a.out}: compare.json, {os.path.basename(png)}, and one run directory per recipe "
          f"({', '.join(recipes)}) with metrics.csv and checkpoints/")


def story(rows: list[dict]) -> str:
    """Two sentences on what a comparison's numbers say, from the numbers themselves."""
    by = {r["recipe"]: r for r in rows}
    def rise(r):
        d, se = by[r]["pass_at_1_bf16_last"] - by[r]["pass_at_1_bf16_first"], by[r].get("pass_at_1_bf16_rise_se", float("nan"))
        return f" ({d / se:+.1f} paired SE)" if se and se == se and se > 0 else ""

    parts = [f"{r}: {by[r]['pass_at_1_bf16_first']:.2f} -> {by[r]['pass_at_1_bf16_last']:.2f}{rise(r)}" for r in by]
    s1 = "Held-out pass@1 of the trained policy (BF16 decoding), from the shared SFT base to the last step: " + "; ".join(parts) + "."
    if "bf16" in by and len(by) > 1:
        ref = by["bf16"]["gap_mean_avg"]
        gaps = [f"{r} {by[r]['gap_mean_avg']:.4f} ({by[r]['gap_mean_avg'] / max(ref, 1e-12):.1f}x bf16)" for r in by if r != "bf16"]
        s2 = (f"The mean rollout-vs-trainer log-prob gap, the mismatch QUADS removes, was bf16 {ref:.4f}, " + ", ".join(gaps)
              + "; a smaller gap keeps RL's importance ratios near 1.")
    else:
        s2 = "Add bf16 to --recipes to compare the log-prob gap against the BF16 floor."
    return s1 + "\n" + s2


def cmd_gap(a):
    from quads_jax.rl import gap

    rows = gap.run_gap(a.config, a.out, overrides=_overrides(a.set), base=_base_root(a))
    print(_table(rows, ["recipe", "rac_ratio", "gap_max", "gap_mean", "k3_kl"]))
    print(f"[quads gap] wrote {a.out}: gap.json, gap.png")


def cmd_plot(a):
    from quads_jax.plot import plot_runs

    print(f"[quads plot] wrote {plot_runs(a.runs, a.out)}")


def cmd_demo(a):
    import jax.numpy as jnp
    import numpy as np
    from quads_jax import nvfp4

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 1024)).astype(np.float32) * np.exp(rng.standard_normal((1, 1024)))
    rows = []
    for name, kw in [("nvfp4 1x16", {}), ("nvfp4 16x16", {"block_shape": (16, 16)}), ("nvfp4 4-over-6", {"four_over_six": True})]:
        t = nvfp4.quantize(jnp.asarray(x), **kw)
        dq = np.asarray(nvfp4.dequantize(t))
        rel = float(np.linalg.norm(dq - x) / np.linalg.norm(x))
        rows.append({"format": name, "rel_l2_err": rel, "bits_per_elem": 8 * t.nbytes / x.size})
    print(_table(rows, ["format", "rel_l2_err", "bits_per_elem"]))


def cmd_serve(a):
    from rollout.server import serve

    serve(a.config, host=a.host, port=a.port, checkpoint=a.checkpoint and checkpoint_dir(a.checkpoint), recipe=a.recipe,
          max_batch=a.max_batch,
          max_len=a.max_len, overrides=_overrides(a.set), weights_dirs=a.weights_dir, api_key=a.api_key)


def cmd_export(a):
    from rollout import bridge
    from rollout.server import job_model

    cfg, _ = job_model(a.config, _overrides(a.set))
    if not a.checkpoint:
        raise ValueError("--checkpoint: required (a run directory, an orbax checkpoint or an HF directory)")
    params, _ = bridge.read_params(checkpoint_dir(a.checkpoint), cfg)
    out = (bridge.export_modelopt_nvfp4(cfg, params, a.out, recipe=a.recipe) if a.nvfp4
           else bridge.export_hf(cfg, params, a.out))
    print(f"[quads export] wrote {out}")


def checkpoint_dir(path: str, flag: str = "--checkpoint") -> str:
    """A checkpoint given as a run directory: its RL policy (checkpoints/), else its SFT base
    (base/); any other directory as it is. A missing one is an error naming ``flag``."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag} {path}: no such directory (expected a run directory, an orbax checkpoint "
                                "or a Hugging Face directory)")
    for sub in ("checkpoints", "base"):
        if os.path.isdir(os.path.join(path, sub)):
            return os.path.join(path, sub)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quads", description="RL of MoE LMs with NVFP4 rollouts (QUADS)")
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, out_default):
        p.add_argument("--config", action="append", default=None, help="job config YAML; repeat to layer files "
                       "(later ones override), e.g. --config configs/tiny_cpu.yaml --config configs/recipes/bf16.yaml")
        p.add_argument("--out", default=out_default)
        p.add_argument("--set", nargs="+", action="extend", default=[], help="config overrides KEY=VALUE, repeatable (e.g. --set rl.steps=5 rl.recipe=bf16)")

    p = sub.add_parser("train", help="SFT warm start + GRPO in the configured recipe (the main job)")
    common(p, "runs/tiny")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save the policy every N steps (the final one always is)")
    p.add_argument("--base", default=None, help="reuse the SFT base policy of this run directory")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("sft", help="supervised base policy")
    common(p, "runs/base")
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("compare", help="RL runs of several recipes from one base policy (the main job)")
    common(p, "runs/compare")
    p.add_argument("--recipes", default="bf16,nvfp4_naive,quads")
    p.add_argument("--base", default=None, help="reuse the SFT base policy of this run directory")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("gap", help="trainer-vs-rollout log-prob gap of every recipe and RAC ratio")
    common(p, "runs/gap")
    p.add_argument("--base", default=None, help="reuse the SFT base policy of this run directory")
    p.set_defaults(fn=cmd_gap)
    p = sub.add_parser("plot", help="overlay the curves of run directories")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="runs/plot.png")
    p.set_defaults(fn=cmd_plot)
    p = sub.add_parser("serve", help="rollout server with SGLang's HTTP API")
    p.add_argument("--config", action="append", default=None, help="job config YAML (repeatable, layered)")
    p.add_argument("--checkpoint", default=None, help="a run directory, an orbax checkpoint or an HF directory (default: random init)")
    p.add_argument("--recipe", default="quads", help="a job recipe (bf16, fp8, nvfp4_naive, quads, w4a16_qat, "
                                                     "quads_symmetric_qat; its rollout side is served) or w4a16 (weight-only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--weights-dir", action="append", default=[],
                   help="a directory that /update_weights_from_disk may load from (repeatable; the checkpoint's own "
                        "directory is always allowed; none: updates are refused)")
    p.add_argument("--api-key", default=None, help="as SGLang's --api-key: every endpoint but /health* then needs "
                                                   "'Authorization: Bearer KEY' (401 otherwise)")
    p.add_argument("--set", nargs="+", action="extend", default=[], help="config overrides KEY=VALUE, repeatable")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("export", help="export a checkpoint as HF safetensors (BF16, or NVFP4 ModelOpt layout)")
    common(p, "exports/model")
    p.add_argument("--checkpoint", default=None, help="a run directory, an orbax checkpoint or an HF directory")
    p.add_argument("--nvfp4", action="store_true")
    p.add_argument("--recipe", default="quads")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("demo", help="quantize a tensor to NVFP4 and print the error table")
    p.set_defaults(fn=cmd_demo)
    return ap


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def _config_path(p: str) -> str:
    """A config path as given, else relative to the project (``configs/x.yaml`` from anywhere)."""
    return p if os.path.exists(p) or os.path.isabs(p) else (os.path.join(ROOT, p) if os.path.exists(os.path.join(ROOT, p)) else p)


def main(argv=None):
    a = build_parser().parse_args(argv)
    if hasattr(a, "config"):
        a.config = [_config_path(c) for c in (a.config or [DEFAULT_CONFIG])]
    try:
        a.fn(a)
    except (ValueError, FileNotFoundError, KeyError, NotADirectoryError) as e:
        if a.debug:
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"quads {a.cmd}: error: {msg}  (--debug for the traceback)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
