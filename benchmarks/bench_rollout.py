"""Rollout-scale benchmark: every recipe's decode through the rollout engine across batch
sizes, each decode step against its byte limit, in one process.

    PYTHONPATH=. python benchmarks/bench_rollout.py --out DIR [--batches 16,64,256,512]
        [--recipes bf16,fp8,nvfp4_naive,quads] [--prompts 256] [--new-tokens 512] [--profile-batches 256]

harness.BENCH_MODEL runs through the rollout engine. For each recipe and batch: output tok/s over
``--prompts`` prompts x ``--new-tokens`` tokens (64-token prompts; timed after one untimed
full wave of ``batch`` requests, so no compilation counts); the time of one decode step (a
donated 16-step burst at the run's mean cache length, divided by 16); and the step's byte
limit: the weight bytes a step reads (every non-expert weight, and the experts its tokens
are routed to, in expectation under uniform routing) plus the live KV read, over the copy
bandwidth measured in this process. ``--profile-batches``: a per-kernel CUPTI breakdown of
one decode step at those batches. The kernels alone (the expert GEMMs against tokamax, the
activation quantizer) are in bench_kernels.py.

Writes DIR/rollout.json, DIR/rollout.md and DIR/rollout.png.
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402


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
            np.full((b, eng.max_stop_ids), -1, np.int32)]


STATIC = dict(want_top=False, filtered=False)  # the burst's static flags: no top log-probs, no top-k / top-p


def step_seconds(eng, batch, live, bursts=6):
    """Seconds of one decode step at a cache length of about ``live``: donated 16-step bursts
    (the engine's own jitted loop), timed after a first one, divided by the steps."""
    import jax
    import jax.numpy as jnp

    start = max(1, live - eng.decode_burst * bursts // 2)
    args = _burst_args(eng, batch, start)
    call = functools.partial(eng._burst, **STATIC)
    out, args[3] = call(*args)
    jax.block_until_ready(out)
    args[3]["lengths"] = jnp.full((batch,), start, jnp.int32)
    t0 = time.perf_counter()
    for _ in range(bursts):
        out, args[3] = call(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / (bursts * eng.decode_burst)


def prefill_seconds(eng, batch, prompt_len, calls=3):
    """Seconds of one prefill of ``batch`` prompts of ``prompt_len`` tokens (the engine's jitted
    prefill, every row real, no prompt log-probs), timed after a first call."""
    import jax
    import jax.numpy as jnp

    from quads_jax.model.layers import init_kv_cache

    b, n = batch, -(-prompt_len // eng.bucket) * eng.bucket
    cache = init_kv_cache(eng.cfg, b, eng.cache_len)
    toks = np.ones((b, n), np.int32)
    mask = np.zeros((b, n), bool)
    mask[:, :prompt_len] = True
    rest = (np.full(b, prompt_len - 1, np.int32), np.ones(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.int32),
            np.arange(b, dtype=np.uint32), np.zeros(b, np.int32), np.zeros(b, bool), np.zeros(b, bool))
    out = eng._step(eng._state, toks, mask, cache, *rest, filtered=False)
    jax.block_until_ready(out[0])
    cache = out[2]
    t0 = time.perf_counter()
    for _ in range(calls):
        cache["lengths"] = jnp.zeros((b,), jnp.int32)  # a fresh array: the cache is donated
        out = eng._step(eng._state, toks, mask, cache, *rest, filtered=False)
        cache = out[2]
    jax.block_until_ready(out[0])
    return (time.perf_counter() - t0) / calls


def kernels_per_step(eng, batch, live, top=80, hlo_path=None):
    """(CUPTI time of each kernel (us, summed over its launches) in one decode step, where in
    the project each XLA kernel comes from): a 16-step burst (the engine's loop, not donated
    here) profiled, divided by 16. The JSON keeps the ``top`` largest; the markdown shows the
    first 24. ``hlo_path``: the burst's optimized HLO (gzip), which maps XLA's fusion names to
    the model's source lines (``harness.kernel_sources``) and counts KV-cache copies."""
    args = _burst_args(eng, batch, live)
    per = H.breakdown(functools.partial(eng._burst_impl, **STATIC), *args, iterations=5, hlo_path=hlo_path)
    out = H.top_kernels(per, top, steps=eng.decode_burst)
    sources = {}
    if hlo_path:
        import gzip

        with gzip.open(hlo_path, "rt") as fh:
            hlo = fh.read()
        k = args[3]["layers"][0]["k"]
        out["cache_copies_in_loop"] = cache_copies(hlo, f"{k.dtype}[{','.join(map(str, k.shape))}]")
        sources = H.kernel_sources(hlo, out)
    return out, sources


def cache_copies(hlo_text: str, shape: str) -> int:
    """How many ``copy`` instructions of a KV-cache-shaped buffer (``shape`` as HLO writes it,
    e.g. "bfloat16[64,576,4,64]" or "bf16[...]") sit outside the entry computation, i.e. in
    the decode loop: each would copy a whole cache every step (the decode attention updates
    the caches in place through aliasing, so the right number is 0)."""
    shape = shape.replace("bfloat16", "bf16")
    n, entry = 0, False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            entry = line.startswith("ENTRY")
        elif not entry and f"= {shape}" in line and " copy(" in line:
            n += 1
    return n


def recipe_of(spec: str):
    """A rollout recipe from ``name`` or ``name@field=value@...`` (KernelConfig fields: e.g.
    ``nvfp4_naive@decode_attention=xla`` times the decode step with the XLA attention beside the default)."""
    import pallas_kernels as pk
    from quads_jax import precision as P

    name, *fields = spec.split("@")
    if not fields:
        return P.rollout_recipe(name)
    try:
        kernels = dict(f.split("=", 1) for f in fields)
    except ValueError:
        raise ValueError(f"--recipes: expected name@field=value, got {spec!r}") from None
    return P.rollout_recipe(name, kernels=pk.KernelConfig.from_dict(kernels))


def sweep(res, cfg, params, recipes, batches, prompts, new_tokens, copy_tbps, deadline, prompt_len=64, profile=(), hlo_dir=None,
          recipes_for=None):
    """``recipes_for`` {batch: recipes}: the recipes of those batches (default ``recipes``)."""
    from rollout.engine import Engine, Request

    rng = np.random.default_rng(0)
    out = res.sections.setdefault("sweep", {})
    live = prompt_len + new_tokens // 2  # the mean cache length over a request's decode
    for batch in batches:
        n_req = max(prompts, batch)
        reqs = [Request(prompt=rng.integers(3, cfg.vocab_size, prompt_len).tolist(), max_new_tokens=new_tokens, seed=i,
                        ignore_eos=True) for i in range(n_req)]
        for recipe in (recipes_for or {}).get(batch, recipes):
            key = f"{recipe}/B{batch}"
            if time.time() > deadline:
                out[key] = {"skipped": "time budget"}
                continue
            try:
                t0 = time.time()
                prec = recipe_of(recipe)
                eng = Engine(cfg, recipe=prec, max_batch=batch, max_len=prompt_len + new_tokens)
                eng.load(params)
                eng.generate([dataclasses.replace(r, max_new_tokens=min(new_tokens, eng.decode_burst + 1)) for r in reqs[:batch]])  # compile
                compile_s = time.time() - t0
                step = step_seconds(eng, batch, live)
                wb = weight_bytes_per_step(eng._state, cfg, batch)
                kv = kv_bytes_per_step(cfg, batch, live)
                limit = (wb + kv) / (copy_tbps * 1e12)
                row = {"step_ms": step * 1e3, "prefill_ms": prefill_seconds(eng, batch, prompt_len) * 1e3,
                       "byte_limit_ms": limit * 1e3, "x_byte_limit": step / limit,
                       "weight_MB_per_step": wb / 1e6, "kv_MB_per_step": kv / 1e6, "compile_s": compile_s}
                if time.time() + (n_req + batch) * new_tokens / batch * step * 1.5 < deadline:
                    eng.generate(reqs[:batch])  # one full wave untimed: every burst and prefill shape compiled
                    t0 = time.perf_counter()
                    outs = eng.generate(reqs)
                    dt = time.perf_counter() - t0
                    row.update(output_tok_per_s=sum(len(r.output_ids) for r in outs) / dt, wall_s=dt, requests=n_req)
                else:
                    row["output_tok_per_s_skipped"] = "time budget"
                if batch in profile:
                    try:
                        hlo = os.path.join(hlo_dir, f"decode_step_{recipe}_B{batch}.hlo.txt.gz") if hlo_dir else None
                        row["kernels_us_per_step"], row["kernel_sources"] = kernels_per_step(eng, batch, live, hlo_path=hlo)
                    except Exception as e:
                        row["kernels_error"] = f"{type(e).__name__}: {e}"[:300]
                out[key] = row
                del eng
            except Exception as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"[:600]}
                traceback.print_exc()
            print(key, out[key], flush=True)
            res.save()
    return out


# ----------------------------------------------------------------------------- report


def speed_ratios(sw: dict) -> list[tuple]:
    """(batch, quads recipe, other recipe, quads's step-time ratio, quads's tok/s ratio or
    None) for each recipe measured beside a quads recipe at one batch with the same
    ``@field=value`` settings: the issue's targets (quads >= 0.9x nvfp4_naive, >= 1.3x fp8,
    >= 2x bf16) read off directly."""
    out = []
    for key, q in sw.items():
        name, batch = key.split("/")
        base, _, fields = name.partition("@")
        if base != "quads" or "step_ms" not in q:
            continue
        for key2, o in sw.items():
            name2, batch2 = key2.split("/")
            base2, _, fields2 = name2.partition("@")
            if batch2 != batch or base2 == "quads" or fields2 != fields or "step_ms" not in o:
                continue
            tq, to = q.get("output_tok_per_s"), o.get("output_tok_per_s")
            out.append((int(batch[1:]), name, name2, o["step_ms"] / q["step_ms"], tq / to if tq and to else None))
    return out


def markdown(res):
    lines = H.header(res, "Rollout benchmark")
    sw = res["sections"].get("sweep") or {}
    if sw:
        lines += ["## Decode across batch sizes (bench model, 64-token prompts)", "",
                  "| recipe | batch | output tok/s | step ms | byte limit ms | x limit | prefill ms | weights MB/step | KV MB/step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k, v in sw.items():
            r, b = k.split("/")
            if "step_ms" not in v:
                lines.append(f"| {r} | {b[1:]} | {v.get('error', v.get('skipped', ''))[:100]} | | | | | | |")
                continue
            tps = v.get("output_tok_per_s")
            lines.append(f"| {r} | {b[1:]} | {'-' if tps is None else f'{tps:,.0f}'} | {v['step_ms']:.3f} | {v['byte_limit_ms']:.3f} | "
                         f"{v['x_byte_limit']:.1f} | {v.get('prefill_ms', float('nan')):.1f} | {v['weight_MB_per_step']:.0f} | {v['kv_MB_per_step']:.0f} |")
        lines.append("")
        rat = speed_ratios(sw)
        if rat:
            lines += ["quads's speed over each other recipe's at the same batch and kernel settings (above 1: quads faster):", "",
                      "| batch | quads | vs | by step time | by output tok/s |", "|---|---|---|---|---|"]
            lines += [f"| {b} | {q} | {other} | {st:.3f} | {'-' if tp is None else f'{tp:.3f}'} |" for b, q, other, st, tp in rat] + [""]
        for k, v in sw.items():
            ker = v.get("kernels_us_per_step")
            if ker:
                src = v.get("kernel_sources") or {}
                lines += [f"### Kernels of one decode step: {k} (CUPTI us, summed over launches)", "",
                          "| kernel | us | from (XLA kernels: innermost project frame < its caller) |", "|---|---|---|"]
                named = [(n, us) for n, us in ker.items() if n not in ("other", "total", "launches", "cache_copies_in_loop")]
                rest = sum(us for _, us in named[24:]) + ker.get("other", 0.0)
                lines += [f"| {n[:70]} | {us:.1f} | {src.get(n, '')} |"
                          for n, us in named[:24] + [("other", rest), ("total", ker.get("total", 0.0))]]
                lines += [f"| (launches a step) | {ker['launches']:.0f} | |"] if "launches" in ker else []
                lines += [f"| (KV-cache copies in the decode loop) | {ker['cache_copies_in_loop']} | |"] if "cache_copies_in_loop" in ker else []
                lines.append("")
    return "\n".join(lines + H.errors_md(res)) + "\n"


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
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/rollout"))
    ap.add_argument("--batches", default="16,64,256,512")
    ap.add_argument("--recipes", default="bf16,fp8,nvfp4_naive,quads",
                    help="comma-separated rollout recipes, each a name or name@field=value@... (KernelConfig fields)")
    ap.add_argument("--recipes-for", action="append", default=[], metavar="BATCH=R1,R2",
                    help="other recipes at one batch (repeatable), e.g. 16=quads,nvfp4_naive")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; later sweep entries are skipped past it")
    ap.add_argument("--profile-batches", default="256", help="batches whose decode step gets a per-kernel breakdown ('' for none)")
    ap.add_argument("--tiny", action="store_true", help="a small model and sizes: checks the harness on a CPU")
    a = ap.parse_args()
    try:
        recipes_for = {int(b): r.split(",") for b, r in (x.split("=", 1) for x in a.recipes_for)}
    except ValueError:
        ap.error(f"--recipes-for: expected BATCH=R1,R2, got {a.recipes_for}")
    t_start = time.time()
    from flax import nnx

    from quads_jax.model import ModelConfig, Transformer
    from quads_jax.train.state import split_params

    res = H.Results(a.out, "rollout", markdown)
    ceil = res.section("ceilings", H.ceilings, H.timer(), a.tiny) or {}
    big = dict(H.BENCH_MODEL, vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
               experts_per_token=2, expert_ffn=64, dense_ffn=64, max_seq_len=256) if a.tiny else H.BENCH_MODEL
    cfg = ModelConfig(**big)
    params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
    try:
        sweep(res, cfg, params, a.recipes.split(","), [int(b) for b in a.batches.split(",")], a.prompts, a.new_tokens,
              ceil.get("copy_TBps") or 1.0, t_start + a.budget, prompt_len=16 if a.tiny else 64,
              profile=[int(b) for b in a.profile_batches.split(",") if b], hlo_dir=a.out, recipes_for=recipes_for)
    except Exception as e:
        res.data["errors"]["sweep"] = f"{type(e).__name__}: {e}"[:600]
        traceback.print_exc()
    try:
        plot(res.data, os.path.join(a.out, "rollout.png"))
    except Exception as e:
        res.data["errors"]["plot"] = f"{type(e).__name__}: {e}"[:300]
    res.save()
    print(markdown(res.data))


if __name__ == "__main__":
    main()
