"""Trainer-scale benchmark: one MoE train step (fwd + bwd + AdamW) per config, on one GPU.

    PYTHONPATH=. python benchmarks/bench_train.py --out DIR [--configs policy:grouped:attention:remat:BxT,...]
        [--breakdown CONFIGS] [--tune SECONDS] [--tiny]

Model: harness.BENCH_MODEL (0.89B total, 64 experts, top-8, 8 layers, vocab 32000). Each config
(policy x grouped GEMM x attention x remat x tokens) is checked for a finite loss, compiled once,
and timed over several donated steps (wall clock around whole steps of tens to hundreds of ms).
MFU counts 6 * active params * tokens + attention (quads_jax.train.flops) against the BF16
peak an 8192^3 matmul reaches in the same process. Memory: XLA's compiled estimate of the step
(arguments + temporaries + outputs - aliased) and the process peak. ``--tune``: a tile sweep of
tokamax's three expert-GEMM kernels first (the expert GEMM alone against its references is in
bench_kernels.py, regime train_grouped). Writes DIR/train.json and DIR/train.md after every
config (partial results survive a time-out).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402

def median_s(fn, *args, n=10):
    """Median wall seconds of ``fn(*args)`` to ready, over ``n`` calls (after a compiled one)."""
    import jax
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


# tokamax: (block_m, block_n, block_k, num_stages, persistent); the first is its sm90 heuristic
TILE_CANDIDATES = [(64, 64, 128, 2, False), (128, 64, 128, 4, False), (128, 128, 64, 4, False), (128, 128, 128, 2, False),
                   (64, 128, 128, 4, False), (128, 64, 64, 4, False), (128, 128, 64, 4, True),
                   (128, 64, 128, 4, True), (64, 128, 128, 4, True), (128, 128, 64, 3, True)]
# ours (pallas_kernels.grouped_weight_grad), dW only: (block_k, block_n, block_r, num_warps, num_stages)
DW_CANDIDATES = [(128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 64, 4, 3),
                 (256, 128, 64, 8, 3), (128, 64, 64, 4, 4)]


def _tile_obj(kernel, cand):
    import pallas_kernels as pk
    return pk.DwTiles(*cand[1:]) if cand[0] == "pallas" else pk.Tiles(*cand[1:])


def tune_tiles(peak, tokens, cfg, budget_s, kernels=None, candidates=None):
    """tokamax's three expert-GEMM kernels (fwd, dx, dW) timed alone over TILE_CANDIDATES at the
    bench model's two expert shapes. Each output is checked against FP32 products of three
    experts' slices (first, middle, last; rel. error < 1e-2, BF16 outputs give ~2e-3), and
    against the heuristic tiles' output. The tiles with the least time summed over both shapes
    win, per kernel, among those that pass."""
    import jax
    import jax.numpy as jnp
    from tokamax._src.ops.ragged_dot import base

    import pallas_kernels as pk
    from pallas_kernels.float_grouped import tokamax_op
    t0 = time.time()
    e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_ffn
    m = tokens * cfg.experts_per_token
    rng = np.random.default_rng(0)
    gs_np = rng.multinomial(m, rng.dirichlet(np.full(e, 2.0)))
    gs = jnp.asarray(gs_np, jnp.int32)
    ends = np.cumsum(gs_np)
    probe = [int(i) for i in (np.flatnonzero(gs_np)[[0, len(np.flatnonzero(gs_np)) // 2, -1]])]
    f32 = lambda v: v.astype(jnp.float32)

    def true_rel(kernel, y, a, b):
        errs = []
        for ex in probe:
            s0, s1 = int(ends[ex] - gs_np[ex]), int(ends[ex])
            if kernel == "fwd":
                got, ref = y[s0:s1], f32(a[s0:s1]) @ f32(b[ex])
            elif kernel == "dx":
                got, ref = y[s0:s1], f32(a[s0:s1]) @ f32(b[ex]).T
            else:
                got, ref = y[ex], f32(a[s0:s1]).T @ f32(b[s0:s1])
            errs.append(float(jnp.linalg.norm(f32(got) - ref) / jnp.linalg.norm(ref)))
        return max(errs)

    rows, total = [], collections.defaultdict(float)
    for shape, (k, n) in {"gate_up": (d, 2 * f), "down": (f, d)}.items():
        x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16)
        dy = jax.random.normal(jax.random.key(5), (m, n), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(4), (e, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        calls = {"fwd": (x, w, base.DEFAULT_RAGGED_DOT_DIM_NUMS), "dx": (dy, w, base.TRANS_RHS_RAGGED_DOT_DIM_NUMS),
                 "dw": (x, dy, base.RAGGED_CONTRACTING_DOT_DIM_NUMS)}
        for kernel, (a, b, dims) in calls.items():
            if kernels and kernel not in kernels:
                continue
            ref = None
            cands = [("tokamax",) + c for c in (candidates or TILE_CANDIDATES) if not (kernel == "dw" and c[4])]
            if kernel == "dw":
                cands += [("pallas",) + c for c in DW_CANDIDATES]
            for cand in cands:
                key = (kernel, cand)
                if time.time() - t0 > budget_s:
                    rows.append({"shape": shape, "kernel": kernel, "tiles": cand, "error": "skipped: tuning budget"})
                    total[key] = float("inf")
                    continue
                tiles = pk.GroupedTiles(**{kernel: _tile_obj(kernel, cand)})
                op = tokamax_op(tiles, kernel)
                fn = jax.jit(lambda a, b, op=op, dims=dims: op(a, b, group_sizes=gs, ragged_dot_dimension_numbers=dims,
                                                               preferred_element_type=jnp.bfloat16))
                try:
                    y = jax.block_until_ready(fn(a, b))
                    if ref is None:
                        ref = y
                    rel = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
                    rel_true = true_rel(kernel, y, a, b)
                    dt = median_s(fn, a, b, n=7)
                    ok = rel_true < 1e-2
                    rows.append({"shape": shape, "kernel": kernel, "tiles": cand, "ms": dt * 1e3, "rel_vs_heuristic": rel,
                                 "rel_vs_fp32": rel_true,
                                 "frac_of_peak": 2 * m * k * n / dt / peak})
                    total[key] += dt if ok else float("inf")
                except Exception as ex:
                    rows.append({"shape": shape, "kernel": kernel, "tiles": cand, "error": f"{type(ex).__name__}: {ex}"[:300]})
                    total[key] = float("inf")
                print("tiles", rows[-1], flush=True)
    best = {}
    for kernel in ("fwd", "dx", "dw"):
        cands = [(t, c) for (kk, c), t in total.items() if kk == kernel and np.isfinite(t)]
        if cands:
            best[kernel] = min(cands)[1]
    return {"rows": rows, "best": best, "M": m}


def train_config(cfg_big, policy, grouped, attention, remat, batch, seq, peak, steps=6, breakdown=False, tiles=None):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import pallas_kernels as pk
    from quads_jax import precision as P
    from quads_jax.model import ModelConfig, Transformer
    from quads_jax.train.flops import flops_per_token
    from quads_jax.train.losses import sft_loss
    from quads_jax.train.state import OptimConfig, init_state, make_optimizer, make_train_step, split_params

    cfg = ModelConfig(**{**cfg_big, "remat": remat, "max_seq_len": max(seq, cfg_big["max_seq_len"])})
    kc = pk.KernelConfig(grouped=grouped, attention=attention, **({} if tiles is None else {"grouped_tiles": tiles}))
    prec = P.train_policy_with(policy, kc)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    g, params, _ = split_params(model)
    del model
    tx = make_optimizer(OptimConfig(lr=1e-4, warmup_steps=1))
    state = init_state(params, tx)
    del params
    tok = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size)
    b = {"tokens": tok, "attn": jnp.ones((batch, seq), bool), "loss_mask": jnp.ones((batch, seq), bool)}
    step = make_train_step(g, tx, sft_loss(prec))
    t0 = time.perf_counter()
    compiled = step.lower(state, b).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    est = None
    if ma is not None:
        est = (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes) / 2**30
    state, m = compiled(state, b)
    loss0 = float(m["loss"])
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = compiled(state, b)
        jax.block_until_ready(m["loss"])
        ts.append(time.perf_counter() - t0)
    dt = float(np.median(ts))
    tokens = batch * seq
    flops = flops_per_token(cfg, seq) * tokens
    counts = cfg.param_counts()
    row = {"policy": policy, "grouped": grouped, "attention": attention, "remat": remat, "batch": batch, "seq": seq,
           "tokens": tokens, "step_s": dt, "tokens_per_s": tokens / dt, "MFU": flops / dt / peak,
           "MFU_6N": 6 * counts["active"] * tokens / dt / peak, "compile_s": compile_s, "mem_estimate_GiB": est,
           "loss_first": loss0, "loss_last": float(m["loss"]), "finite": bool(np.isfinite(float(m["loss"])))}
    if breakdown:
        try:
            # not donated, so it can repeat: the same program as the timed one
            nd = make_train_step(g, tx, sft_loss(prec), donate=False)
            kb = H.top_kernels(H.breakdown(lambda s, bb: nd(s, bb), state, b, iterations=2), 30, scale=1e-3)
            row["kernels_ms"] = kb
            row["kernel_sum_over_step"] = kb["total"] / 1e3 / dt
        except Exception as ex:
            row["breakdown_error"] = f"{type(ex).__name__}: {ex}"[:400]
    del state, compiled, step
    stats = jax.devices()[0].memory_stats() or {}
    row["process_peak_GiB"] = stats.get("peak_bytes_in_use", 0) / 2**30
    return row


def markdown(res):
    s = res["sections"]
    lines = H.header(res, "Train step benchmark") + [f"Model: {res.get('model')}.", "",
             "| policy | grouped (tiles) | attention | remat | tokens (B x T) | step ms | tokens/s | MFU | MFU (6N) | mem est GiB | peak GiB | loss first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s.get("configs", []):
        if "error" in r:
            lines.append(f"| {r['policy']} | {r['grouped']} | {r['attention']} | {r['remat']} | {r['batch']}x{r['seq']} | "
                         f"error: {r['error'][:120]} | | | | | | |")
            continue
        est = "-" if r.get("mem_estimate_GiB") is None else f"{r['mem_estimate_GiB']:.1f}"
        lines.append(f"| {r['policy']} | {r['grouped']} ({r.get('tiles', '-')}) | {r['attention']} | {r['remat']} | {r['tokens']} ({r['batch']}x{r['seq']}) | "
                     f"{1e3 * r['step_s']:.1f} | {r['tokens_per_s']:.0f} | {100 * r['MFU']:.1f}% | {100 * r['MFU_6N']:.1f}% | {est} | "
                     f"{r.get('process_peak_GiB', 0):.1f} | "
                     f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    tt = s.get("tiles")
    if tt:
        lines += ["", f"## tokamax tiles, each kernel alone ({tt['M']} rows), against the measured peak", "",
                  f"Chosen (least time over both shapes, per kernel): {tt.get('chosen')}", "",
                  "| shape | kernel | tiles: tokamax (bm, bn, bk, stages, persistent) or pallas (bk, bn, br, warps, stages) | ms | of peak | rel vs heuristic | rel vs FP32 |",
                  "|---|---|---|---|---|---|---|"]
        for r in tt["rows"]:
            if "error" in r:
                lines.append(f"| {r['shape']} | {r['kernel']} | {tuple(r['tiles'])} | {r['error'][:80]} | | | |")
            else:
                lines.append(f"| {r['shape']} | {r['kernel']} | {tuple(r['tiles'])} | {r['ms']:.2f} | {100 * r['frac_of_peak']:.0f}% | "
                             f"{r['rel_vs_heuristic']:.1e} | {r.get('rel_vs_fp32', float('nan')):.1e} |")
    for r in s.get("configs", []):
        if r.get("kernels_ms"):
            lines += ["", f"## Kernel breakdown: {r['policy']} {r['grouped']} {r['attention']} remat={r['remat']} "
                      f"{r['tokens']} tokens (kernel sum / step wall = {r.get('kernel_sum_over_step', float('nan')):.2f})", "",
                      "| kernel | ms |", "|---|---|"]
            lines += [f"| {k} | {v:.2f} |" if k != "launches" else f"| (launches a step) | {v:.0f} |"
                      for k, v in r["kernels_ms"].items()]
    return "\n".join(lines + [""] + H.errors_md(res)) + "\n"


def parse_configs(spec: str):
    """'policy:grouped:attention:remat:BxT,...'"""
    out = []
    for item in spec.split(","):
        p, g, a, r, bt = item.split(":")
        b, t = bt.split("x")
        out.append((p, g, a, r, int(b), int(t)))
    return out


DEFAULT = ",".join([
    "bf16:tokamax:cudnn:none:8x4096",    # 32k tokens: the target config
    "nvfp4_w:tokamax:cudnn:none:8x4096",
    "bf16:tokamax:cudnn:none:2x4096",    # 8k tokens
    "nvfp4_w:tokamax:cudnn:none:2x4096",
    "bf16:xla:xla:none:1x1024",          # the old path (ragged_dot expanded densely), for the ratio
    "bf16:tokamax:cudnn:none:1x1024",
    "bf16:tokamax:cudnn:full:16x4096",   # 64k
    "bf16:tokamax:tokamax:none:8x4096",
    "bf16:tokamax:cudnn:full:32x4096",   # 128k
])


def main():
    import jax

    import pallas_kernels as pk
    from quads_jax.model import ModelConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--configs", default=DEFAULT, help="policy:grouped:attention:remat:BxT, comma-separated")
    ap.add_argument("--breakdown", default="bf16:tokamax:cudnn:none:8x4096", help="configs to profile per kernel")
    ap.add_argument("--tune", type=float, default=0, help="seconds of the tile sweep of the expert GEMMs (0: none, the default tiles)")
    ap.add_argument("--tune-tokens", type=int, default=32768, help="tokens of the tile sweep")
    ap.add_argument("--budget", type=float, default=540, help="seconds: no new config starts after this")
    ap.add_argument("--tiny", action="store_true", help="a small model, to check the harness on a CPU")
    a = ap.parse_args()
    t_start = time.time()
    cfg = ModelConfig(**(H.BENCH_MODEL if not a.tiny else dict(H.BENCH_MODEL, vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                                          head_dim=16, n_experts=8, experts_per_token=2, expert_ffn=32)))
    counts = cfg.param_counts()
    res = H.Results(a.out, "train", markdown)
    res.data["model"] = (f"{counts['total'] / 1e9:.2f}B total / {counts['active'] / 1e9:.2f}B active, {cfg.n_experts} experts top-"
                         f"{cfg.experts_per_token}, {cfg.n_layers} layers")
    ceil = res.section("ceilings", H.ceilings, H.timer(), a.tiny) or {}
    peak = ceil.get("bf16_matmul_TFLOPs", float("nan")) * 1e12
    tiles = None
    if a.tune and jax.default_backend() == "gpu":
        tt = res.section("tiles", tune_tiles, peak, a.tune_tokens, cfg, a.tune)
        if tt and tt["best"]:
            tiles = pk.GroupedTiles(**{k: _tile_obj(k, v) for k, v in tt["best"].items()})
            tt["chosen"] = repr(tiles)
    prof = set(a.breakdown.split(",")) if a.breakdown else set()
    rows = res.sections.setdefault("configs", [])
    for spec in parse_configs(a.configs):
        if time.time() - t_start > a.budget:
            res.data["errors"][":".join(map(str, spec))] = "skipped: out of time budget"
            continue
        p, g, at, r, b, t = spec
        key = f"{p}:{g}:{at}:{r}:{b}x{t}"
        try:
            row = train_config(dataclasses.asdict(cfg), p, g, at, r, b, t, peak, breakdown=key in prof, tiles=tiles)
            row["tiles"] = "tuned" if tiles is not None else "default"
        except Exception as e:
            row = {"policy": p, "grouped": g, "attention": at, "remat": r, "batch": b, "seq": t,
                   "error": f"{type(e).__name__}: {e}"[:600]}
            traceback.print_exc()
        rows.append(row)
        print("config", json.dumps(row, default=str), flush=True)
        res.save()
    print(markdown(res.data))


if __name__ == "__main__":
    main()
