"""Model-level GPU benchmark: ~1B-parameter MoE forward/backward (BF16 vs the nvfp4_w QAT
policy), and rollout decode throughput of every recipe, side by side.

    PYTHONPATH=. python benchmarks/bench_model.py --out DIR [--decode-steps 128]

Timing: wall clock around ``block_until_ready`` of whole steps of 10-100+ ms, where the
~100 us host overhead is negligible. Writes DIR/model.json and DIR/model.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import numpy as np

RES: dict = {"errors": {}}

BIG = dict(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, n_experts=64,
           experts_per_token=8, expert_ffn=512, dense_ffn=2048, max_seq_len=2048, compute_dtype="bfloat16")


def timed(fn, *args, n=5):
    """Median wall seconds of ``fn(*args)`` after a compiling call (bench_train.median_s)."""
    import jax

    from benchmarks.bench_train import median_s
    jax.block_until_ready(fn(*args))
    return median_s(fn, *args, n=n)


def fwd_bwd(cfg, batch, seq):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from quads_jax import precision as P
    from quads_jax.model import Transformer
    from quads_jax.train.losses import sft_loss
    from quads_jax.train.state import OptimConfig, init_state, make_optimizer, make_train_step, split_params

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    g, params, _ = split_params(model)
    del model
    counts = cfg.param_counts()
    tok = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size)
    b = {"tokens": tok, "attn": jnp.ones((batch, seq), bool), "loss_mask": jnp.ones((batch, seq), bool)}
    out = {"total_params": counts["total"], "active_params": counts["active"], "tokens_per_step": batch * seq}
    tx = make_optimizer(OptimConfig())
    for name in ("bf16", "nvfp4_w"):
        step = make_train_step(g, tx, sft_loss(P.train_policy(name)), donate=False)
        state = init_state(params, tx)
        dt = timed(lambda s, step=step: step(s, b)[1]["loss"], state)
        flops = 6 * counts["active"] * batch * seq
        out[name] = {"step_s": dt, "tokens_per_s": batch * seq / dt, "MFU_vs_989TF": flops / dt / 989e12}
        del state, step
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_bytes_in_use_GiB"] = stats.get("peak_bytes_in_use", 0) / 2**30
    out["nvfp4_w_overhead"] = out["nvfp4_w"]["step_s"] / out["bf16"]["step_s"] - 1
    return out, params


def step_profile(eng, batch, max_len, steps=4, top=14):
    """CUPTI kernel times of one decode step (a burst of ``steps`` at a cache length of 320,
    not donated so it can repeat), summed by kernel name: where a recipe's step goes (us)."""
    import collections

    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import profiler
    from quads_jax.model.layers import init_kv_cache

    cache = init_kv_cache(eng.cfg, batch, max_len + 64)
    cache["lengths"] = jnp.full((batch,), 320, jnp.int32)
    b = batch
    args = (eng._state, np.ones(b, np.int32), np.ones(b, bool), cache, np.ones(b, np.float32), np.ones(b, np.float32),
            np.zeros(b, np.int32), np.arange(b, dtype=np.uint32), np.full(b, 256, np.int32), np.full(b, 100, np.int32),
            np.full((b, 1), -1, np.int32), np.int32(steps), np.zeros(b, bool))
    f = jax.jit(eng._burst_impl)
    jax.block_until_ready(f(*args))
    _, per_iter = profiler.measure(f, aggregate=False, iterations=3)(*args)
    agg = collections.Counter()
    for name, ms in per_iter[-1]:
        agg[name.split(".")[0][:48]] += ms * 1e3 / steps
    out = dict(agg.most_common(top))
    out["total"] = sum(agg.values())
    return out


def agreement(ref, res):
    """Per-request agreement of two generations from the same seeds: the fraction of tokens
    equal up to the first difference, and the largest |logprob difference| over that prefix."""
    same, total, gap = 0, 0, 0.0
    for a, b in zip(ref, res):
        n = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), min(len(a.output_ids), len(b.output_ids)))
        same, total = same + n, total + len(a.output_ids)
        if n:
            gap = max(gap, float(np.max(np.abs(np.asarray(a.logprobs[:n]) - np.asarray(b.logprobs[:n])))))
    return {"tokens_before_first_difference": same / max(total, 1), "max_abs_logprob_diff": gap}


def rollout(cfg, params, prompts, new_tokens, batch, recipes, out_dir, backends=("pallas", "xla"), profile=True):
    """Output tok/s of each recipe and backend; each backend's first batch is compared with the
    first backend's (the same seeds)."""
    from quads_jax import precision as P
    from rollout.engine import Engine, Request

    rng = np.random.default_rng(0)
    reqs = [Request(prompt=rng.integers(3, cfg.vocab_size, 64).tolist(), max_new_tokens=new_tokens, seed=i, ignore_eos=True)
            for i in range(prompts)]
    out = RES.setdefault("rollout", {})
    for recipe in recipes:
        first = {}
        for backend in (("xla",) if recipe in ("bf16", "fp8") else backends):
            key = f"{recipe}/{backend}"
            try:
                eng = Engine(cfg, recipe=P.rollout_recipe(recipe, backend=backend), max_batch=batch, max_len=64 + new_tokens)
                eng.load(params)
                warm = eng.generate(reqs[:batch])  # compile + warm
                t0 = time.perf_counter()
                res = eng.generate(reqs)
                dt = time.perf_counter() - t0
                out[key] = {"output_tokens_per_s": sum(len(r.output_ids) for r in res) / dt, "wall_s": dt,
                            "decode_burst": eng.decode_burst}
                if first:
                    out[key]["agreement_with_" + first["key"]] = agreement(first["res"], warm)
                else:
                    first.update(key=key, res=warm)
                if profile:
                    try:
                        out[key]["step_kernels_us"] = step_profile(eng, batch, 64 + new_tokens)
                    except Exception as e:
                        out[key]["profile_error"] = f"{type(e).__name__}: {e}"[:400]
            except Exception as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"[:600]}
                traceback.print_exc()
            print(key, out[key], flush=True)
            json.dump(RES, open(os.path.join(out_dir, "model.json"), "w"), indent=1, default=str)  # keep partial results
    return out


def markdown(res):
    lines = [f"# Model benchmarks ({res['date']}, {res['device']}, jax {res['jax']})", ""]
    fb = res.get("fwd_bwd")
    if fb:
        lines += [f"## Train step (fwd+bwd+AdamW), {fb['total_params'] / 1e9:.2f}B total / {fb['active_params'] / 1e9:.2f}B active, "
                  f"{fb['tokens_per_step']} tokens", "", "| policy | step s | tokens/s | MFU (989 TF) |", "|---|---|---|---|"]
        for k in ("bf16", "nvfp4_w"):
            lines.append(f"| {k} | {fb[k]['step_s']:.3f} | {fb[k]['tokens_per_s']:.0f} | {fb[k]['MFU_vs_989TF']:.3f} |")
        lines += ["", f"nvfp4_w QAT overhead: {100 * fb['nvfp4_w_overhead']:+.1f}% (goal <= +10%); "
                  f"peak memory {fb['peak_bytes_in_use_GiB']:.1f} GiB", ""]
    ro = res.get("rollout")
    if ro:
        lines += [f"## Rollout decode ({res['rollout_setup']})", "", "| recipe/backend | output tok/s | step kernels us | agreement |", "|---|---|---|---|"]
        for k, v in ro.items():
            step = v.get("step_kernels_us", {}).get("total")
            agree = next((f"{a[len('agreement_with_'):]}: {g['tokens_before_first_difference']:.3f} equal, "
                          f"max logprob diff {g['max_abs_logprob_diff']:.3g}" for a, g in v.items() if a.startswith("agreement_with_")), "")
            lines.append(f"| {k} | {v.get('output_tokens_per_s', float('nan')):.0f} {v.get('error', '')[:120]} | "
                         f"{'-' if step is None else f'{step:.0f}'} | {agree} |")
    if res["errors"]:
        lines += ["", "## Errors", ""] + [f"- {k}: {v[:300]}" for k, v in res["errors"].items()]
    return "\n".join(lines) + "\n"


def main():
    import jax
    from quads_jax.model import ModelConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--skip-train", action="store_true", help="only the rollout section")
    ap.add_argument("--skip-rollout", action="store_true", help="only the train-step section")
    ap.add_argument("--recipes", default="bf16,fp8,nvfp4_naive,quads,w4a16")
    ap.add_argument("--backends", default="pallas,xla", help="kernel backends of the NVFP4 recipes")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    RES.update(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, jax=jax.__version__)
    cfg = ModelConfig(**BIG)
    params = None
    for bsz, seq in () if a.skip_train else ((a.batch, a.seq), (max(1, a.batch // 4), a.seq), (1, 256)):
        try:
            RES["fwd_bwd"], params = fwd_bwd(cfg, bsz, seq)
            break
        except Exception as e:
            RES["errors"][f"fwd_bwd_{bsz}x{seq}"] = f"{type(e).__name__}: {e}"[:600]
            traceback.print_exc()
    json.dump(RES, open(os.path.join(a.out, "model.json"), "w"), indent=1, default=str)
    if not a.skip_rollout:
        run_rollout_section(a, cfg, params)
    json.dump(RES, open(os.path.join(a.out, "model.json"), "w"), indent=1, default=str)
    open(os.path.join(a.out, "model.md"), "w").write(markdown(RES))
    print(markdown(RES))


def run_rollout_section(a, cfg, params):
    try:
        if params is None:
            from flax import nnx
            from quads_jax.model import Transformer
            from quads_jax.train.state import split_params
            params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
        RES["rollout_setup"] = f"{a.prompts} prompts x {a.new_tokens} new tokens, batch {a.decode_batch}, prompt 64"
        RES["rollout"] = rollout(cfg, params, a.prompts, a.new_tokens, a.decode_batch, a.recipes.split(","), a.out,
                                 backends=tuple(a.backends.split(",")))
    except Exception as e:
        RES["errors"]["rollout"] = f"{type(e).__name__}: {e}"[:2000]
        traceback.print_exc()


if __name__ == "__main__":
    main()
