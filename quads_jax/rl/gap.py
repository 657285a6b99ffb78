"""The log-prob gap experiment: for the same weights and prompts, how far the rollout
engine's log-probs are from the trainer's, for every recipe and RAC ratio."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax import precision as P
from quads_jax.model import token_logprobs
from quads_jax.rl import data as D
from quads_jax.rl import grpo as G
from quads_jax.train.state import split_params, to_model
from rollout.engine import Engine, Request

RHOS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)


def measure_gaps(cfg, params, *, prompts=None, n_prompts=32, max_new_tokens=32, recipes=None, rac_ratios=RHOS,
                 seed=0, max_batch=64, graphdef=None, kernels=None):
    """Rows {recipe, rac_ratio, gap_max, gap_mean, k3_kl} measured on sampled responses."""
    from quads_jax.rl.loop import RECIPES
    from flax import nnx
    from quads_jax.model import Transformer

    if graphdef is None:
        graphdef = split_params(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
    rng = np.random.default_rng(seed)
    if prompts is None:
        prompts = [rng.integers(3, cfg.vocab_size, int(rng.integers(3, 9))).tolist() for _ in range(n_prompts)]
    seq_len = max(len(p) for p in prompts) + max_new_tokens
    runs = [(r, None) for r in (recipes or RECIPES)] + [("quads", rho) for rho in rac_ratios]
    rows = []
    for name, rho in runs:
        train_name, roll_name = RECIPES[name]
        tp = P.train_policy_with(train_name, kernels)
        eng = Engine(cfg, recipe=P.rollout_recipe(roll_name, rho, kernels=kernels), max_batch=max_batch, max_len=seq_len)
        eng.load(params)
        res = eng.generate([Request(prompt=p, max_new_tokens=max_new_tokens, seed=i) for i, p in enumerate(prompts)])
        b = D.rl_batch(prompts, [r.output_ids for r in res], [r.logprobs for r in res], seq_len)
        lp = jax.jit(lambda p, t, a: token_logprobs(to_model(graphdef, p), t, a, precision=tp))(
            params, jnp.asarray(b["tokens"]), jnp.asarray(b["attn"]))
        g = jax.device_get(G.gap_metrics(lp, jnp.asarray(b["rollout_logp"]), jnp.asarray(b["resp_mask"])))
        rows.append({"recipe": name, "sweep": rho is not None, "rac_ratio": eng.recipe.rac_ratio if rho is not None or name == "quads" else "-",
                     **{k: float(v) for k, v in g.items()}})
    return rows


def run_gap(config_path: str, out_dir: str, overrides=None, base: str | None = None):
    """``quads gap``: the base policy of the config (SFT'd, cached in OUT/base, or reused from
    the run directory ``base``) on task prompts."""
    from quads_jax.rl import loop
    from quads_jax.rl.tokenizer import CharTokenizer

    cfg = loop.JobConfig.load(config_path, overrides)
    os.makedirs(out_dir, exist_ok=True)
    graphdef, params, mcfg = loop.base_policy(cfg, base or out_dir)
    tok = CharTokenizer()
    probs = loop.make_task(cfg).split("test", cfg.rl.eval_n, cfg.seed)
    prompts = [D.prompt_ids(tok, p.prompt) for p in probs]
    rows = measure_gaps(mcfg, params, prompts=prompts, max_new_tokens=cfg.rl.max_new_tokens, graphdef=graphdef,
                        kernels=cfg.kernels)
    with open(os.path.join(out_dir, "gap.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot_gaps(rows, os.path.join(out_dir, "gap.png"))
    return rows


def plot_gaps(rows, out_png: str) -> str:
    """Two panels: max/mean gap per recipe (bars) and against the RAC ratio (quads rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = [r for r in rows if not r.get("sweep")]
    sweep = sorted((r for r in rows if r.get("sweep")), key=lambda r: r["rac_ratio"])
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(13 if sweep else 9, 3.4))
    xs = np.arange(len(named))
    for ax, col, title in ((axes[0], "gap_max", "max |logp_rollout - logp_train|"),
                           (axes[1], "gap_mean", "mean |logp_rollout - logp_train|")):
        ax.bar(xs, [r[col] for r in named], 0.6)
        ax.set_xticks(xs, [r["recipe"] for r in named], rotation=30, fontsize=8)
        ax.set_title(title, fontsize=9)
    if sweep:
        c = axes[2]
        rho = [r["rac_ratio"] for r in sweep]
        c.plot(rho, [r["gap_mean"] for r in sweep], marker="o", color="C0", label="mean |gap|")
        c.set_xlabel("RAC ratio rho")
        c.set_ylabel("mean |gap|", color="C0")
        c2 = c.twinx()
        c2.plot(rho, [r["k3_kl"] for r in sweep], marker="s", color="C1", label="k3 KL")
        c2.set_ylabel("k3 KL", color="C1")
        c.set_title("quads: gap against the RAC ratio", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
