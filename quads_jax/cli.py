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


def cmd_train(a):
    from quads_jax.rl.loop import base_policy
    from quads_jax.rl import loop
    from quads_jax.plot import plot_runs

    cfg = loop.JobConfig.load(a.config, _overrides(a.set))
    os.makedirs(a.out, exist_ok=True)
    graphdef, params, mcfg = base_policy(cfg, a.out)
    _, hist = loop.run_grpo(cfg, graphdef, params, mcfg, a.out, checkpoint_every=a.checkpoint_every)
    s = loop.summarize(hist)
    s["recipe"] = cfg.rl.recipe
    json.dump(s, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    png = plot_runs([a.out], os.path.join(a.out, "curves.png"), labels=[cfg.rl.recipe])
    print("\n" + _table([s], ["recipe", "steps", "reward_first", "reward_last", "pass_at_1_first", "pass_at_1_last",
                              "gap_max_peak", "gap_mean_avg", "k3_kl_avg", "tokens_per_s"]))
    print(f"metrics: {os.path.join(a.out, 'metrics.csv')}\nplot:    {png}")


def cmd_sft(a):
    from quads_jax.rl.loop import base_policy
    from quads_jax.rl import loop

    cfg = loop.JobConfig.load(a.config, _overrides(a.set))
    base_policy(cfg, a.out)
    print(f"base policy in {os.path.join(a.out, 'base')}")


def cmd_compare(a):
    from quads_jax.rl.loop import base_policy
    from quads_jax.rl import loop
    from quads_jax.plot import plot_runs

    recipes = a.recipes.split(",")
    cfg0 = loop.JobConfig.load(a.config, _overrides(a.set))
    graphdef, params, mcfg = base_policy(cfg0, a.out)
    rows, dirs = [], []
    for r in recipes:
        cfg = loop.JobConfig.load(a.config, {**_overrides(a.set), "rl.recipe": r})
        d = os.path.join(a.out, r)
        _, hist = loop.run_grpo(cfg, graphdef, params, mcfg, d)
        rows.append({"recipe": r, **loop.summarize(hist)})
        dirs.append(d)
    plot_runs(dirs, os.path.join(a.out, "compare.png"), labels=recipes)
    json.dump(rows, open(os.path.join(a.out, "compare.json"), "w"), indent=1)
    print(_table(rows, ["recipe", "reward_last", "pass_at_1_first", "pass_at_1_last", "gap_max_peak", "gap_mean_avg", "k3_kl_avg"]))


def cmd_gap(a):
    from quads_jax.rl import gap

    rows = gap.run_gap(a.config, a.out, overrides=_overrides(a.set))
    print(_table(rows, ["recipe", "rac_ratio", "gap_max", "gap_mean", "k3_kl"]))


def cmd_plot(a):
    from quads_jax.plot import plot_runs

    print(plot_runs(a.runs, a.out))


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

    serve(a.config, host=a.host, port=a.port, checkpoint=a.checkpoint, recipe=a.recipe, max_batch=a.max_batch,
          max_len=a.max_len, overrides=_overrides(a.set), weights_dirs=a.weights_dir)


def cmd_export(a):
    from rollout import bridge
    from rollout.server import job_model

    cfg, _ = job_model(a.config, _overrides(a.set))
    if not a.checkpoint:
        raise SystemExit("export: --checkpoint DIR is required (an orbax checkpoint or an HF directory)")
    params, _ = bridge.read_params(a.checkpoint, cfg)
    out = (bridge.export_modelopt_nvfp4(cfg, params, a.out, recipe=a.recipe) if a.nvfp4
           else bridge.export_hf(cfg, params, a.out))
    print(f"[quads export] wrote {out}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quads", description="RL of MoE LMs with NVFP4 rollouts (QUADS)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, out_default):
        p.add_argument("--config", action="append", default=None, help="job config YAML; repeat to layer files "
                       "(later ones override), e.g. --config configs/tiny_cpu.yaml --config configs/recipes/bf16.yaml")
        p.add_argument("--out", default=out_default)
        p.add_argument("--set", nargs="+", action="extend", default=[], help="config overrides KEY=VALUE, repeatable (e.g. --set rl.steps=5 rl.recipe=bf16)")

    p = sub.add_parser("train", help="SFT warm start + GRPO in the configured recipe (the main job)")
    common(p, "runs/tiny")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("sft", help="supervised base policy")
    common(p, "runs/base")
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("compare", help="RL runs of several recipes from one base policy")
    common(p, "runs/compare")
    p.add_argument("--recipes", default="bf16,nvfp4_naive,quads")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("gap", help="trainer-vs-rollout log-prob gap of every recipe and RAC ratio")
    common(p, "runs/gap")
    p.set_defaults(fn=cmd_gap)
    p = sub.add_parser("plot", help="overlay the curves of run directories")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="runs/plot.png")
    p.set_defaults(fn=cmd_plot)
    p = sub.add_parser("serve", help="rollout server with SGLang's HTTP API")
    p.add_argument("--config", action="append", default=None, help="job config YAML (repeatable, layered)")
    p.add_argument("--checkpoint", default=None, help="orbax checkpoint or HF directory (default: random init)")
    p.add_argument("--recipe", default="quads", help="bf16 | fp8 | nvfp4 | quads | w4a16")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--weights-dir", action="append", default=[],
                   help="a directory that /update_weights_from_disk may load from (repeatable; the checkpoint's own "
                        "directory is always allowed; none: updates are refused)")
    p.add_argument("--set", nargs="+", action="extend", default=[], help="config overrides KEY=VALUE, repeatable")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("export", help="export a checkpoint as HF safetensors (BF16, or NVFP4 ModelOpt layout)")
    common(p, "exports/model")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--nvfp4", action="store_true")
    p.add_argument("--recipe", default="quads")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("demo", help="quantize a tensor to NVFP4 and print the error table")
    p.set_defaults(fn=cmd_demo)
    return ap


DEFAULT_CONFIG = "configs/tiny_cpu.yaml"


def main(argv=None):
    a = build_parser().parse_args(argv)
    if hasattr(a, "config"):
        a.config = a.config or [DEFAULT_CONFIG]
    a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
