"""Rollout-scale benchmark: decode throughput of every recipe across batch sizes, each decode
step against its byte limit, and the expert GEMMs against tokamax's, in one process.

    PYTHONPATH=. python benchmarks/bench_rollout.py --out DIR [--sections ceilings,quant,peer,sweep]
        [--batches 16,64,256,512] [--recipes bf16,fp8,nvfp4_naive,quads] [--prompts 256] [--new-tokens 512]

Sections (each one's results are written as soon as it ends; a time-out keeps them):

    ceilings  copy bandwidth (read + write of 2 GiB) and the BF16 matmul rate, this process
    quant     the RAC activation quantizer at the rollout's sizes (T tokens of K = d_model, and the
              T x top-k routed rows of the expert down projection): the default config, one
              program a row, 2 and 4 a row, rank, bisection and radix selections, rho 0 and 0.5, each
              bit-checked against the XLA reference and timed (CUPTI, or "wall" where it gave none)
    peer      the MoE expert GEMM at decode sizes, at the bench model's shapes and Qwen3-30B-A3B's
              (2048 -> 768, 128 experts, top-8): ours (W4A4 + RAC, W4A4, W4A16; quantizing the
              tokens once, as the model does) against tokamax's BF16 ragged_dot, its FP8 and
              int4 weight-only kernels, and lax.ragged_dot; each checked against FP32 products
    sweep     bench_model.BIG through the rollout engine (``--profile-batches``: a per-kernel
              CUPTI breakdown of one decode step at those batches): for each recipe and batch, output
              tok/s over ``--prompts`` prompts x ``--new-tokens`` tokens (64-token prompts; timed
              after one untimed full wave of ``batch`` requests, so no compilation counts), the
              time of one decode step (a donated 16-step burst at the run's mean cache length,
              divided by 16), and the step's byte limit: the weight bytes a step reads (every
              non-expert weight, the experts its tokens are routed to, in expectation under
              uniform routing) plus the live KV read, over the measured copy bandwidth

Writes DIR/rollout.json, DIR/rollout.md and DIR/rollout.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as BK  # noqa: E402  (the CUPTI timer, the quantizer sweep, the ceilings)
from bench_model import BIG  # noqa: E402

RES: dict = {"sections": {}, "errors": {}}
QWEN3_30B_A3B = dict(d_model=2048, expert_ffn=768, n_experts=128, experts_per_token=8)


def save(out):
    json.dump(RES, open(os.path.join(out, "rollout.json"), "w"), indent=1, default=str)
    open(os.path.join(out, "rollout.md"), "w").write(markdown(RES))


# ----------------------------------------------------------------------------- peer GEMMs


def _routing(rng, tokens, e, k):
    """Sorted rows of uniform top-k routing: (token of each row, group_sizes)."""
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)])
    order = np.argsort(ids.reshape(-1), kind="stable")
    return order // k, np.bincount(ids.reshape(-1), minlength=e).astype(np.int32)


def peer(measure, copy_tbps, tokens=(64, 256), tiny=False):
    """Expert GEMMs x_e @ W_e at decode sizes: us, ratio to the weight bytes' limit, error."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from quads_jax import precision as P

    shapes = {"bench_gate_up": (BIG["n_experts"], BIG["d_model"], 2 * BIG["expert_ffn"], BIG["experts_per_token"]),
              "bench_down": (BIG["n_experts"], BIG["expert_ffn"], BIG["d_model"], BIG["experts_per_token"]),
              "qwen3_30b_a3b_gate": (QWEN3_30B_A3B["n_experts"], QWEN3_30B_A3B["d_model"], QWEN3_30B_A3B["expert_ffn"], 8),
              "qwen3_30b_a3b_down": (QWEN3_30B_A3B["n_experts"], QWEN3_30B_A3B["expert_ffn"], QWEN3_30B_A3B["d_model"], 8)}
    if tiny:
        shapes = {"tiny": (4, 64, 64, 2)}
        tokens = (8,)
    out = {}
    rng = np.random.default_rng(0)
    for name, (e, k, n, topk) in shapes.items():
        wf = jnp.asarray(rng.standard_normal((e, n, k)) * k**-0.5, jnp.float32)
        w4 = P.prepare_weight(wf, "w4a4")
        wbf = pk.ExpertsKN.from_enk(wf, jnp.bfloat16)
        w8 = P.prepare_weight(wf, "fp8")
        wq_int4 = _int4_qarray(wf)
        for t in tokens:
            tok, gs_np = _routing(rng, t, e, topk)
            x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
            rows, gs = jnp.asarray(tok, jnp.int32), jnp.asarray(gs_np)
            xs = x[rows]
            ex = np.repeat(np.arange(e), gs_np)
            ref = np.einsum("mk,mnk->mn", np.asarray(xs, np.float32), np.asarray(wf)[ex])  # FP32 products of the float weight

            def ours(rho, mode="w4a4"):
                def f(x, rows, gs, w):
                    xin = x if mode == "w4a16" else pk.quantize_rows(x, rac_ratio=rho)
                    return pk.nvfp4_grouped_matmul(P.take_rows(xin, rows), w, gs, rac_ratio=rho, act_scale="token", mode=mode)
                return f, (x, rows, gs, w4)

            cands = {
                "ours_w4a4_rac0.5": ours(0.5), "ours_w4a4": ours(0.0), "ours_w4a16": ours(0.0, "w4a16"),
                "tokamax_bf16": (lambda xs, gs, w: pk.grouped_dot_kn(xs, w, gs, impl="tokamax"), (xs, gs, wbf)),
                "tokamax_bf16_64x128": (lambda xs, gs, w: pk.grouped_dot_kn(xs, w, gs, impl="tokamax", tiles=pk.Tiles(64, 128, 64, 4)),
                                        (xs, gs, wbf)),
                "tokamax_bf16_64x64_k128_s4": (lambda xs, gs, w: pk.grouped_dot_kn(xs, w, gs, impl="tokamax", tiles=pk.Tiles(64, 64, 128, 4)),
                                               (xs, gs, wbf)),
                "tokamax_fp8_w8a8": (lambda xs, gs, w: pk.fp8_grouped_matmul(xs, w, gs, grouped="tokamax"), (xs, gs, w8)),
                "tokamax_int4_w4a16": (lambda xs, gs, w: _tokamax_quant(xs, w, gs), (xs, gs, wq_int4)),
                "xla_ragged_dot_bf16": (lambda xs, gs, w: pk.grouped_dot_kn(xs, w, gs, impl="xla"), (xs, gs, wbf)),
            }
            limit_bytes = {"ours_w4a4_rac0.5": w4, "ours_w4a4": w4, "ours_w4a16": w4, "tokamax_bf16": wbf, "tokamax_bf16_64x128": wbf,
                           "tokamax_bf16_64x64_k128_s4": wbf, "tokamax_fp8_w8a8": w8,
                           "tokamax_int4_w4a16": wq_int4, "xla_ragged_dot_bf16": wbf}
            row = {}
            for c, (f, args) in cands.items():
                try:
                    y = np.asarray(jax.jit(f)(*args), np.float32)
                    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    us = measure(f, *args)
                    nbytes = sum(a.nbytes for a in jax.tree.leaves(limit_bytes[c]))
                    row[c] = {"us": us, "rel_err_vs_fp32": err, "weight_MB": nbytes / 1e6,
                              "x_byte_limit": us / (nbytes / copy_tbps / 1e6) if copy_tbps else None}
                except Exception as ex_:
                    row[c] = {"error": f"{type(ex_).__name__}: {ex_}"[:400]}
                print(f"peer {name} T={t} {c}: {row[c]}", flush=True)
            out[f"{name}/T{t}"] = row
    return out


def _int4_qarray(wf):
    """tokamax's int4 weight-only operand: int4 values stored [E, N, K] (the layout its sm90
    quantized kernel reads: passed with the transposed dimension numbers, no transpose a
    call), one BF16 scale per 128 input channels and output channel (symmetric, absmax / 7)."""
    import jax.numpy as jnp
    import qwix

    e, n, k = wf.shape
    g = 128 if k % 128 == 0 else k
    blocks = wf.reshape(e, n, k // g, g)
    scale = jnp.max(jnp.abs(blocks), axis=3, keepdims=True) / 7.0
    q = jnp.clip(jnp.round(blocks / jnp.maximum(scale, 1e-12)), -8, 7).astype(jnp.int4).reshape(e, n, k)
    return qwix.QArray(qvalue=q, scale=scale[..., 0].astype(jnp.bfloat16), qtype=jnp.int4)


def _tokamax_quant(xs, w, gs):
    import jax
    import jax.numpy as jnp
    import tokamax

    from pallas_kernels.config import GroupedTiles
    from pallas_kernels.float_grouped import DIMS, quantized_weight_tiles, tokamax_op

    # tokamax's heuristic misreads the K tile of an [E, N, K] weight: its own choice, given explicitly
    impl = [tokamax_op(GroupedTiles(fwd=quantized_weight_tiles(xs.shape[1], 128)), "fwd")] if jax.default_backend() == "gpu" else "xla"
    return tokamax.ragged_dot_general(xs, w, gs, DIMS, preferred_element_type=jnp.bfloat16, implementation=impl)


# ----------------------------------------------------------------------------- quantizer


def quant(measure, shapes=((64, 1024), (256, 1024), (256, 2048), (2048, 512)), out=None, on_shape=lambda: None):
    """The activation quantizer's layouts at rollout sizes: us per call, and whether its bits
    equal the XLA reference's. Rows go into ``out`` as they are measured (``on_shape`` after
    each shape: a time-out keeps what was done)."""
    import jax.numpy as jnp

    import pallas_kernels as pk
    from pallas_kernels.quantizer import quant_config

    out = {} if out is None else out
    rng = np.random.default_rng(3)
    for t, k in shapes:
        # heavy-tailed channels, as activations are: per-channel magnitudes spread over e^(+-2)
        x = jnp.asarray(rng.standard_normal((t, k)) * np.exp(rng.standard_normal(k)), jnp.bfloat16)
        default = quant_config(t, k)
        cfgs = {"default": default, "one_row": quant_config(t, k, split=False)}
        for parts in (2, 4):
            if k % (parts * 256) == 0:
                c = min(1024, k // parts)
                cfgs[f"p{parts}_c{c}"] = pk.QuantConfig(block_rows=default.block_rows, chunk=c, num_warps=8 if c >= 512 else 4, parts=parts)
        for rho in (0.0, 0.5):
            ref = pk.quantize_activations_rac(x, rac_ratio=rho, act_scale="token", backend="xla")
            row = {}
            for name, cfg in cfgs.items():
                for select in (("auto",) if rho == 0 else ("rank", "bisect", "radix")):
                    c = dataclasses.replace(cfg, select=select)
                    f = lambda v, c=c: pk.quantize_activations_rac(v, rac_ratio=rho, act_scale="token", backend="pallas", config=c)
                    key = name if rho == 0 else f"{name}_{select}"
                    try:
                        got = f(x)
                        same = all(np.array_equal(np.asarray(a.codes), np.asarray(b.codes)) and
                                   np.array_equal(np.asarray(a.scales).view(np.uint8), np.asarray(b.scales).view(np.uint8))
                                   for a, b in zip(ref, got) if a is not None)
                        row[key] = {"us": measure(f, x), "timer": getattr(measure, "source", "?"), "bit_identical": bool(same),
                                    "config": dataclasses.asdict(c)}
                    except Exception as e:
                        row[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    print(f"quant T={t} K={k} rho={rho} {key}: {row[key].get('us', row[key].get('error'))}", flush=True)
            out[f"T{t}_K{k}_rho{rho}"] = row
            on_shape()
    return out


# ----------------------------------------------------------------------------- the engine sweep


def weight_bytes_per_step(state, cfg, batch):
    """Bytes of weights one decode step reads: every leaf but the embedding table (of which it
    reads ``batch`` rows), and of the stacked expert weights the share of experts hit by
    batch x top-k uniform routings, E (1 - (1 - k/E)^batch)."""
    import jax

    e, k = cfg.n_experts, cfg.experts_per_token
    hit = 1.0 - (1.0 - k / e) ** batch
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        p = jax.tree_util.keystr(path)
        nb = leaf.nbytes
        if "embed" in p and "layers" not in p:
            nb = nb * batch / cfg.vocab_size
        elif any(s in p for s in ("w_gate", "w_up", "w_down")):
            nb = nb * hit
        total += nb
    return total


def kv_bytes_per_step(cfg, batch, live, dtype_bytes=2):
    """The live keys and values a decode step reads, plus the one token a row it writes."""
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    return batch * (live + 1) * per_token


def _burst_args(eng, batch, live):
    """Arguments of the engine's decode burst for ``batch`` rows of about ``live`` cached
    tokens (a fresh cache; every row alive, temperature 1, no filtering)."""
    import jax.numpy as jnp

    from quads_jax.model.layers import init_kv_cache

    b = batch
    cache = init_kv_cache(eng.cfg, b, eng.cache_len)
    cache["lengths"] = jnp.full((b,), live, jnp.int32)
    return [eng._state, np.ones(b, np.int32), np.ones(b, bool), cache, np.ones(b, np.float32), np.ones(b, np.float32),
            np.zeros(b, np.int32), np.arange(b, dtype=np.uint32), np.full(b, live, np.int32), np.full(b, 10**6, np.int32),
            np.full((b, eng.max_stop_ids), -1, np.int32), np.int32(eng.decode_burst), np.zeros(b, bool)]


def step_seconds(eng, batch, live, bursts=6):
    """Seconds of one decode step at a cache length of about ``live``: donated 16-step bursts
    (the engine's own jitted loop), timed after a first one, divided by the steps."""
    import jax
    import jax.numpy as jnp

    start = max(1, live - eng.decode_burst * bursts // 2)
    args = _burst_args(eng, batch, start)
    out, args[3] = eng._burst(*args)
    jax.block_until_ready(out)
    args[3]["lengths"] = jnp.full((batch,), start, jnp.int32)
    t0 = time.perf_counter()
    for _ in range(bursts):
        out, args[3] = eng._burst(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / (bursts * eng.decode_burst)


def kernels_per_step(eng, batch, live, top=14):
    """CUPTI time of each kernel (us, summed over its launches) in one decode step: a 16-step
    burst (the engine's loop, not donated here) profiled, divided by 16; the ``top`` largest
    names, the rest as "other", and "total"."""
    per = {}
    for key, us in BK.breakdown(eng._burst_impl, *_burst_args(eng, batch, live), iterations=5).items():
        name = key.split(":", 1)[1]
        per[name] = per.get(name, 0.0) + us / eng.decode_burst
    ranked = sorted(per.items(), key=lambda kv: -kv[1])
    out = dict(ranked[:top])
    out["other"] = sum(v for _, v in ranked[top:])
    out["total"] = sum(per.values())
    return out


def sweep(cfg, params, recipes, batches, prompts, new_tokens, copy_tbps, out_dir, deadline, prompt_len=64, profile=()):
    from quads_jax import precision as P
    from rollout.engine import Engine, Request

    rng = np.random.default_rng(0)
    out = RES["sections"].setdefault("sweep", {})
    live = prompt_len + new_tokens // 2  # the mean cache length over a request's decode
    for batch in batches:
        n_req = max(prompts, batch)
        reqs = [Request(prompt=rng.integers(3, cfg.vocab_size, prompt_len).tolist(), max_new_tokens=new_tokens, seed=i,
                        ignore_eos=True) for i in range(n_req)]
        for recipe in recipes:
            key = f"{recipe}/B{batch}"
            if time.time() > deadline:
                out[key] = {"skipped": "time budget"}
                continue
            try:
                t0 = time.time()
                eng = Engine(cfg, recipe=P.rollout_recipe(recipe), max_batch=batch, max_len=prompt_len + new_tokens)
                eng.load(params)
                eng.generate([dataclasses.replace(r, max_new_tokens=min(new_tokens, eng.decode_burst + 1)) for r in reqs[:batch]])  # compile
                compile_s = time.time() - t0
                step = step_seconds(eng, batch, live)
                wb = weight_bytes_per_step(eng._state, cfg, batch)
                kv = kv_bytes_per_step(cfg, batch, live)
                limit = (wb + kv) / (copy_tbps * 1e12)
                row = {"step_ms": step * 1e3, "byte_limit_ms": limit * 1e3, "x_byte_limit": step / limit,
                       "weight_MB_per_step": wb / 1e6, "kv_MB_per_step": kv / 1e6, "compile_s": compile_s}
                if time.time() + (n_req + batch) * new_tokens / batch * step * 1.5 < deadline:
                    eng.generate(reqs[:batch])  # one full wave untimed: every burst and prefill shape compiled
                    t0 = time.perf_counter()
                    res = eng.generate(reqs)
                    dt = time.perf_counter() - t0
                    row.update(output_tok_per_s=sum(len(r.output_ids) for r in res) / dt, wall_s=dt, requests=n_req)
                else:
                    row["output_tok_per_s_skipped"] = "time budget"
                if batch in profile:
                    try:
                        row["kernels_us_per_step"] = kernels_per_step(eng, batch, live)
                    except Exception as e:
                        row["kernels_error"] = f"{type(e).__name__}: {e}"[:300]
                out[key] = row
                del eng
            except Exception as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"[:600]}
                traceback.print_exc()
            print(key, out[key], flush=True)
            save(out_dir)
    return out


# ----------------------------------------------------------------------------- report


def markdown(res):
    s = res["sections"]
    lines = [f"# Rollout benchmark ({res.get('date')}, {res.get('device')}, jax {res.get('jax')})", "",
             f"Command: `{res.get('command', '')}`", ""]
    c = s.get("ceilings") or {}
    if c:
        lines += [f"Ceilings measured in this process: copy {c.get('copy_TBps', 0):.2f} TB/s, BF16 matmul "
                  f"{c.get('bf16_matmul_TFLOPs', 0):.0f} TFLOP/s.", ""]
    sw = s.get("sweep") or {}
    if sw:
        lines += ["## Decode across batch sizes (bench model, 64-token prompts)", "",
                  "| recipe | batch | output tok/s | step ms | byte limit ms | x limit | weights MB/step | KV MB/step |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, v in sw.items():
            r, b = k.split("/")
            if "step_ms" not in v:
                lines.append(f"| {r} | {b[1:]} | {v.get('error', v.get('skipped', ''))[:100]} | | | | | |")
                continue
            tps = v.get("output_tok_per_s")
            lines.append(f"| {r} | {b[1:]} | {'-' if tps is None else f'{tps:,.0f}'} | {v['step_ms']:.3f} | {v['byte_limit_ms']:.3f} | "
                         f"{v['x_byte_limit']:.1f} | {v['weight_MB_per_step']:.0f} | {v['kv_MB_per_step']:.0f} |")
        lines.append("")
        for k, v in sw.items():
            ker = v.get("kernels_us_per_step")
            if ker:
                lines += [f"### Kernels of one decode step: {k} (CUPTI us, summed over launches)", "", "| kernel | us |", "|---|---|"]
                lines += [f"| {n[:70]} | {us:.1f} |" for n, us in ker.items()] + [""]
    pe = s.get("peer") or {}
    if pe:
        cands = sorted({c for row in pe.values() for c in row})
        lines += ["## Expert GEMMs at decode sizes (us; x limit = time over weight bytes / copy bandwidth; error vs FP32)", "",
                  "| shape / tokens | " + " | ".join(cands) + " |", "|---|" + "---|" * len(cands)]
        for k, row in pe.items():
            cells = []
            for c in cands:
                v = row.get(c, {})
                cells.append(f"{v['us']:.1f} ({v['x_byte_limit']:.1f}x, {v['rel_err_vs_fp32']:.1e})" if "us" in v and v.get("x_byte_limit")
                             else f"{v['us']:.1f}" if "us" in v else ("fails: " + v.get("error", "")[:60] if v else ""))
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")
    q = s.get("quant") or {}
    if q:
        lines += ["## Activation quantizer (per-token scales; us a call, * = bits differ from XLA, (w) = wall clock)", ""]
        for k, row in q.items():
            cells = [f"{n} {v['us']:.1f}{'' if v['bit_identical'] else '*'}{'' if v.get('timer') == 'cupti' else ' (w)'}" if "us" in v
                     else f"{n} fails" for n, v in row.items()]
            lines.append(f"- {k}: " + ", ".join(cells))
        lines.append("")
    if res["errors"]:
        lines += ["## Errors", ""] + [f"- {k}: {v[:300]}" for k, v in res["errors"].items()]
    return "\n".join(lines) + "\n"


def plot(res, path):
    sw = res["sections"].get("sweep") or {}
    if not sw:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for recipe in dict.fromkeys(k.split("/")[0] for k in sw):
        pts = [(int(k.split("/B")[1]), v) for k, v in sw.items() if k.startswith(recipe + "/") and "step_ms" in v]
        if not pts:
            continue
        bs = [b for b, _ in pts]
        a1.plot(bs, [v.get("output_tok_per_s", np.nan) for _, v in pts], "o-", label=recipe)
        a2.plot(bs, [v["x_byte_limit"] for _, v in pts], "o-", label=recipe)
    for a, t in ((a1, "output tok/s"), (a2, "decode step / byte limit")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch")
        a.set_title(t)
        a.grid(alpha=0.3)
    a2.axhline(2.0, color="gray", ls="--", lw=1)
    a1.legend()
    fig.suptitle(f"{res.get('device')} {res.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    import jax

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/rollout"))
    ap.add_argument("--sections", default="ceilings,quant,peer,sweep")
    ap.add_argument("--batches", default="16,64,256,512")
    ap.add_argument("--recipes", default="bf16,fp8,nvfp4_naive,quads")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; later sweep entries are skipped past it")
    ap.add_argument("--quant-shapes", default="64x1024,256x1024,256x2048,2048x512", help="TxK of the quant section")
    ap.add_argument("--profile-batches", default="256", help="batches whose decode step gets a per-kernel breakdown ('' for none)")
    ap.add_argument("--tiny", action="store_true", help="a small model and sizes: checks the harness on a CPU")
    a = ap.parse_args()
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    RES.update(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, jax=jax.__version__,
               command="python benchmarks/bench_rollout.py " + " ".join(sys.argv[1:]))
    sections = a.sections.split(",")
    measure = BK.timer()
    if "ceilings" in sections:
        try:
            RES["sections"]["ceilings"] = BK.ceilings.__wrapped__(measure) if not a.tiny else {"copy_TBps": 0.01, "bf16_matmul_TFLOPs": 0.1}
        except Exception as e:
            RES["errors"]["ceilings"] = f"{type(e).__name__}: {e}"[:600]
        save(a.out)
    copy = (RES["sections"].get("ceilings") or {}).get("copy_TBps")
    for name, fn in (("quant", lambda: quant(measure, shapes=((8, 256),) if a.tiny else [tuple(map(int, v.split("x"))) for v in a.quant_shapes.split(",")],
                                            out=RES["sections"].setdefault("quant", {}), on_shape=lambda: save(a.out))),
                     ("peer", lambda: peer(measure, copy, tiny=a.tiny))):
        if name in sections:
            try:
                RES["sections"][name] = fn()
            except Exception as e:
                RES["errors"][name] = f"{type(e).__name__}: {e}"[:600]
                traceback.print_exc()
            save(a.out)
    if "sweep" in sections:
        from flax import nnx

        from quads_jax.model import ModelConfig, Transformer
        from quads_jax.train.state import split_params

        big = dict(BIG, vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
                   experts_per_token=2, expert_ffn=64, dense_ffn=64, max_seq_len=256) if a.tiny else BIG
        cfg = ModelConfig(**big)
        params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
        try:
            sweep(cfg, params, a.recipes.split(","), [int(b) for b in a.batches.split(",")], a.prompts, a.new_tokens,
                  copy or 1.0, a.out, t_start + a.budget, prompt_len=16 if a.tiny else 64,
                  profile=[int(b) for b in a.profile_batches.split(",") if b])
        except Exception as e:
            RES["errors"]["sweep"] = f"{type(e).__name__}: {e}"[:600]
            traceback.print_exc()
    save(a.out)
    try:
        plot(RES, os.path.join(a.out, "rollout.png"))
    except Exception as e:
        RES["errors"]["plot"] = f"{type(e).__name__}: {e}"[:300]
        save(a.out)
    print(markdown(RES))


if __name__ == "__main__":
    main()
