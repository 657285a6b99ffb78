"""One command that checks and times every kernel variant on the GPU.

    PYTHONPATH=. python benchmarks/bench_kernels.py --out DIR [--quick]

Sections (each reports its own errors and never stops the others):
  env        device, versions
  ceilings   copy bandwidth and the BF16 matmul rate, measured in this run
  numerics   NVFP4 codes eager vs jit vs a numpy/ml_dtypes reference ON THE GPU, the
             float4 round-trip folding trap, Pallas quantizer codes vs the XLA reference,
             Pallas GEMMs vs the XLA reference
  decode     T in {1, 16, 64} x (K, N) shapes: BF16 dot, FP8 dot, NVFP4 Pallas (rho 0,
             rho 0.5, w4a16), NVFP4 XLA reference; weight TB/s
  prefill    T = 4096: TFLOP/s
  grouped    MoE decode with 64 experts: ragged_dot BF16 vs grouped NVFP4
  torch      cuBLAS BF16 and FP8 _scaled_mm through torch, event-timed (do_bench)
  sass       tensor-core instructions in the Pallas GEMM's machine code
Timing is device-side: CUPTI kernel time via jax.experimental.mosaic.gpu.profiler.measure
(median of many iterations, fresh inputs per shape); host clocks add ~100 us per call here.
Writes DIR/kernels.json and DIR/kernels.md.
"""

from __future__ import annotations

import argparse
import functools
import datetime
import glob
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

import numpy as np

os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/triton_cache")  # the default under $HOME may not be writable

RESULTS: dict = {"sections": {}, "errors": {}}
OUT_DIR = ""


def section(name):
    def wrap(fn):
        @functools.wraps(fn)  # fn stays reachable as run.__wrapped__
        def run(*a, **k):
            t0 = time.time()
            try:
                RESULTS["sections"][name] = fn(*a, **k)
            except Exception as e:  # keep going: one broken kernel must not hide the others
                RESULTS["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
            if OUT_DIR:  # keep what is measured even if a later section is killed
                with open(os.path.join(OUT_DIR, "kernels.json"), "w") as f:
                    json.dump(RESULTS, f, indent=1, default=str)

        return run

    return wrap


def timer():
    import jax
    from jax.experimental.mosaic.gpu import profiler

    def measure(f, *args, iterations=50):
        jf = jax.jit(f)
        jax.block_until_ready(jf(*args))  # compile + warm
        try:
            _, times = profiler.measure(jf, iterations=iterations)(*args)
            times = [t for t in (times or []) if t is not None]
        except Exception:
            times = []
        measure.source = "cupti" if times else "wall"
        if times:
            return float(np.median(times)) * 1e3  # us, CUPTI kernel time
        # CUPTI gave nothing (seen for some ops): many back-to-back async launches, one sync,
        # so the host overhead overlaps the device work.
        n = max(iterations, 20)
        jax.block_until_ready(jf(*args))
        t0 = time.perf_counter()
        for _ in range(n):
            r = jf(*args)
        jax.block_until_ready(r)
        return (time.perf_counter() - t0) / n * 1e6

    return measure


def breakdown(f, *args, iterations=20):
    """Per-kernel CUPTI medians (us) of one call of ``f``: where the time goes."""
    import jax
    from jax.experimental.mosaic.gpu import profiler

    jf = jax.jit(f)
    jax.block_until_ready(jf(*args))
    _, per_iter = profiler.measure(jf, aggregate=False, iterations=iterations)(*args)
    if not per_iter:
        return {}
    names = [n for n, _ in per_iter[0]]
    out = {}
    for i, name in enumerate(names):
        key = f"{i}:{name[:60]}"
        out[key] = float(np.median([it[i][1] for it in per_iter])) * 1e3
    return out


@section("env")
def env():
    import jax

    d = jax.devices()[0]
    info = {"device": d.device_kind, "platform": d.platform, "jax": jax.__version__, "date": datetime.date.today().isoformat()}
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,memory.total", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except Exception:
        pass
    return info


@section("ceilings")
def ceilings(measure):
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (1024, 1024 * 1024), jnp.float32).astype(jnp.bfloat16)  # 2 GiB
    us = measure(lambda a: a * jnp.bfloat16(1.0009765625), x, iterations=20)
    copy_tbs = 2 * x.size * 2 / us / 1e6
    del x
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    us_mm = measure(lambda a, b: a @ b, a, b, iterations=20)
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": 2 * 8192**3 / us_mm / 1e6}


def heavy(rng, shape):
    return (rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape[:-1] + (1,)))).astype(np.float32)


@section("numerics")
def numerics():
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from quads_jax import nvfp4 as F

    out = {}
    rng = np.random.default_rng(0)
    x = heavy(rng, (1024, 4096))
    # numpy + ml_dtypes reference (cast-based, eager, on the host)
    gs = np.float32(np.abs(x).max() / np.float32(2688))
    xb = x.reshape(1024, 256, 16)
    s = np.clip((np.abs(xb).max(-1) / np.float32(6)) / gs, np.float32(2**-6), np.float32(448)).astype(ml_dtypes.float8_e4m3fn)
    v = np.clip(xb * ((np.float32(1) / gs) / s.astype(np.float32))[..., None], -6, 6)
    c = (v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF).reshape(x.shape)
    ref_codes = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
    xd = jnp.asarray(x)
    eager = F.quantize(xd)
    jitted = jax.jit(F.quantize)(xd)
    out["nvfp4_gpu_codes_eager_mismatch"] = int((np.asarray(eager.codes) != ref_codes).sum())
    out["nvfp4_gpu_codes_jit_mismatch"] = int((np.asarray(jitted.codes) != ref_codes).sum())
    out["nvfp4_gpu_scales_jit_mismatch"] = int((np.asarray(jitted.scales).view(np.uint8) != s.view(np.uint8)).sum())
    out["nvfp4_gpu_global_scale_bits_equal"] = bool(np.float32(jitted.global_scale).view(np.uint32) == gs.view(np.uint32))
    out["nvfp4_gpu_jit_vs_eager_codes_equal"] = bool(np.array_equal(np.asarray(eager.codes), np.asarray(jitted.codes)))
    fq = jax.jit(F.fake_quant)(xd)
    out["nvfp4_gpu_fake_quant_jit_changes_values"] = bool(np.mean(np.asarray(fq) != x) > 0.5)
    we = jnp.asarray(heavy(rng, (8, 64, 256)))  # per-expert global scales, 2D blocks
    for name, kw in {"per_expert": {"keep_axes": (0,)}, "blocks_16x16": {"block_shape": (16, 16)}}.items():
        ea, ja = F.quantize(we, **kw), jax.jit(lambda v: F.quantize(v, **kw))(we)
        out[f"nvfp4_gpu_{name}_jit_vs_eager_codes_equal"] = bool(np.array_equal(np.asarray(ea.codes), np.asarray(ja.codes)))
    fe, fj = F.fake_quant(xd), jax.jit(F.fake_quant)(xd)
    out["nvfp4_gpu_fake_quant_jit_vs_eager_bits_equal"] = bool(np.array_equal(np.asarray(fe).view(np.uint32), np.asarray(fj).view(np.uint32)))
    # Is XLA's own float32 division correctly rounded on this device? (If so, the long
    # division could give way to it here.) Quotients in the recipe's range [2**-9, 2**30].
    na = np.exp(rng.uniform(-8, 12, 1 << 20)).astype(np.float32)
    nb = np.exp(rng.uniform(-8, 12, 1 << 20)).astype(np.float32)
    want = (na / nb).view(np.uint32)
    out["xla_gpu_long_div_mismatch_of_1M"] = int((np.asarray(jax.jit(F.long_div)(na, nb)).view(np.uint32) != want).sum())
    out["xla_gpu_plain_div_mismatch_of_1M"] = int((np.asarray(jax.jit(lambda u, v: u / v)(na, nb)).view(np.uint32) != want).sum())
    out["xla_gpu_ieee_div_mismatch_of_1M"] = int((np.asarray(jax.jit(F.ieee_div)(na, nb)).view(np.uint32) != want).sum())
    trap = jax.jit(lambda a: a.astype(jnp.float4_e2m1fn).astype(jnp.float32))(jnp.float32(0.3))
    out["float4_cast_roundtrip_under_jit_gives"] = float(trap)  # 0.3 means folded away; 0.5 means quantized
    return out


def stamp(t0, what):
    print(f"  {what}: {time.time() - t0:.1f}s", flush=True)


@section("numerics_pallas")
def numerics_pallas():
    import jax.numpy as jnp

    from quads_jax import nvfp4 as F
    from pallas_kernels import nvfp4_grouped_matmul, nvfp4_matmul, quantize_activations_rac

    out = {}
    t0 = time.time()
    rng = np.random.default_rng(0)
    # Pallas quantizer vs XLA reference, exact
    xa = jnp.asarray(heavy(rng, (64, 4096))).astype(jnp.bfloat16)
    for rho, mode in [(0.0, "token"), (0.5, "token"), (0.125, "tensor"), (0.25, "channel"), (1.0, "token")]:
        a = quantize_activations_rac(xa, rac_ratio=rho, rac_mode=mode, backend="xla")
        b = quantize_activations_rac(xa, rac_ratio=rho, rac_mode=mode, backend="pallas")
        key = f"quant_pallas_vs_xla_rho{rho}_{mode}"
        out[key + "_x_code_mismatch"] = int((np.asarray(a[0].codes) != np.asarray(b[0].codes)).sum())
        out[key + "_x_scale_mismatch"] = int((np.asarray(a[0].scales).view(np.uint8) != np.asarray(b[0].scales).view(np.uint8)).sum())
        ca, cb = np.asarray(a[0].codes), np.asarray(b[0].codes)
        bad = ca != cb
        if bad.any():  # where do they differ: rows, nibbles, and the decoded values
            rows = np.nonzero(bad.any(1))[0]
            lo = ((ca ^ cb) & 0xF) != 0
            hi = ((ca ^ cb) >> 4) != 0
            r0, c0 = np.argwhere(bad)[0]
            out[key + "_diag"] = {"rows_with_mismatch": int(rows.size), "first_rows": rows[:8].tolist(),
                                  "low_nibble": int(lo.sum()), "high_nibble": int(hi.sum()),
                                  "first": [int(r0), int(c0), int(ca[r0, c0]), int(cb[r0, c0])],
                                  "x_at_first": [float(v) for v in np.asarray(xa[r0, 2 * c0:2 * c0 + 2], np.float32)],
                                  "gs_xla": np.asarray(a[0].global_scale).reshape(-1)[:2].tolist(),
                                  "gs_pallas": np.asarray(b[0].global_scale).reshape(-1)[:2].tolist()}
        if a[1] is not None:
            out[key + "_r_code_mismatch_frac"] = float((np.asarray(a[1].codes) != np.asarray(b[1].codes)).mean())
        stamp(t0, key)

    rel = lambda u, v: float(np.linalg.norm(np.asarray(u, np.float32) - np.asarray(v, np.float32)) / np.linalg.norm(np.asarray(v, np.float32)))
    for t in (1, 37, 300):
        xw = jnp.asarray(rng.standard_normal((t, 2048)).astype(np.float32)).astype(jnp.bfloat16)
        wf = rng.standard_normal((768, 2048)).astype(np.float32)
        w = F.quantize(jnp.asarray(wf))
        f32 = np.asarray(xw.astype(jnp.float32)) @ wf.T
        for rho in (0.0, 0.5):
            a = nvfp4_matmul(xw, w, rac_ratio=rho, backend="xla")
            b = nvfp4_matmul(xw, w, rac_ratio=rho, backend="pallas")
            out[f"gemm_T{t}_rho{rho}_pallas_vs_xla_rel"] = rel(b, a)
            out[f"gemm_T{t}_rho{rho}_err_vs_f32"] = rel(a, f32)
        b = nvfp4_matmul(xw, w, mode="w4a16", backend="pallas")
        out[f"gemm_T{t}_w4a16_pallas_vs_xla_rel"] = rel(b, nvfp4_matmul(xw, w, mode="w4a16", backend="xla"))
        stamp(t0, f"gemm T={t}")
    e, m = 16, 200
    sizes = jnp.asarray(np.bincount(rng.integers(0, e - 3, m), minlength=e).astype(np.int32))
    we = F.quantize(jnp.asarray(rng.standard_normal((e, 512, 1024)).astype(np.float32)), keep_axes=(0,))
    xg = jnp.asarray(rng.standard_normal((m, 1024)).astype(np.float32)).astype(jnp.bfloat16)
    for rho in (0.0, 0.5):
        a = nvfp4_grouped_matmul(xg, we, sizes, rac_ratio=rho, backend="xla")
        b = nvfp4_grouped_matmul(xg, we, sizes, rac_ratio=rho, backend="pallas")
        out[f"grouped_rho{rho}_pallas_vs_xla_rel"] = rel(b, a)
        stamp(t0, f"grouped rho={rho}")
    return out


DECODE_SHAPES = [(2048, 768), (2048, 6144), (4096, 14336)]


@section("decode")
def decode(measure, ceil, quick):
    import dataclasses

    import jax
    import jax.numpy as jnp

    from quads_jax import fp8, nvfp4 as F
    from pallas_kernels import fp8_matmul, nvfp4_matmul
    from pallas_kernels.quantizer import quant_config
    from quads_jax.precision import prepare_weight

    fused = lambda a: dataclasses.replace(quant_config(*a.shape), fused_amax=True)
    rows = []
    rng = np.random.default_rng(1)
    copy = ceil.get("copy_TBps") if ceil else None
    for k, n in DECODE_SHAPES:
        wf = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
        wb = wf.astype(jnp.bfloat16)
        w4 = F.quantize(wf)
        w4p = prepare_weight(wf, "w4a4")
        w8 = fp8.quantize(wf)
        wbytes4 = w4.codes.size + w4.scales.size
        for t in (1, 16, 64) if not quick else (16,):
            x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32)).astype(jnp.bfloat16)
            r = {"T": t, "K": k, "N": n}
            dot_nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            variants = {
                "bf16_dot": (dot_nt, (x, wb)),
                "fp8_dot": (lambda a, w: fp8_matmul(a, w), (x, w8)),
                # act_scale="token": what the rollout's linears use (precision.linear); weights
                # as the engine stores them (prepared: code words for the word decode)
                "nvfp4_rho0": (lambda a, w: nvfp4_matmul(a, w, act_scale="token", backend="pallas"), (x, w4p)),
                "nvfp4_rho0.5": (lambda a, w: nvfp4_matmul(a, w, rac_ratio=0.5, act_scale="token", backend="pallas"), (x, w4p)),
                "nvfp4_rho0.5_exact": (lambda a, w: nvfp4_matmul(a, w, rac_ratio=0.5, rac_sum="exact", act_scale="token", backend="pallas"), (x, w4p)),
                "nvfp4_w4a16": (lambda a, w: nvfp4_matmul(a, w, mode="w4a16", backend="pallas"), (x, w4p)),
            }
            if t == 16 and not quick:  # at one T: the fused-amax quantizer, the XLA references
                variants.update({
                    "nvfp4_rho0.5_fused_amax": (lambda a, w: nvfp4_matmul(a, w, rac_ratio=0.5, act_scale="token", backend="pallas", quant_config=fused(a)), (x, w4p)),
                    "fp8_xla_dot": (lambda a, w: fp8_matmul(a, w, backend="xla"), (x, w8)),
                    "nvfp4_xla_rho0": (lambda a, w: nvfp4_matmul(a, w, backend="xla"), (x, w4)),
                })
            for name, (f, args) in variants.items():
                try:
                    r[name + "_us"] = measure(f, *args)
                except Exception as e:
                    r[name + "_us"] = None
                    RESULTS["errors"][f"decode_{name}_{t}_{k}_{n}"] = f"{type(e).__name__}: {e}"[:600]
            if t == 16:
                for name in ("nvfp4_rho0.5",):
                    try:
                        f_, args_ = variants[name]
                        r[name + "_kernels_us"] = breakdown(f_, *args_)
                    except Exception as e:
                        RESULTS["errors"][f"breakdown_{name}_{k}_{n}"] = f"{type(e).__name__}: {e}"[:300]
            us = r.get("nvfp4_rho0_us")
            if us:
                r["nvfp4_weight_TBps"] = wbytes4 / us / 1e6
                if copy:
                    r["nvfp4_frac_of_copy_bw"] = r["nvfp4_weight_TBps"] / copy
                if r.get("bf16_dot_us"):
                    r["speedup_vs_bf16"] = r["bf16_dot_us"] / us
                if r.get("fp8_dot_us"):
                    r["speedup_vs_fp8"] = r["fp8_dot_us"] / us
                if r.get("nvfp4_rho0.5_us"):
                    r["rac_overhead"] = r["nvfp4_rho0.5_us"] / us - 1
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


@section("prefill")
def prefill(measure, quick=False):
    """Prefill TFLOP/s of the dense GEMM, both paths (fused kernel; decode once + BF16 dot),
    at K = N = 4096 for a few token counts, against the BF16 dot."""
    import dataclasses as dc

    import jax
    import jax.numpy as jnp

    from quads_jax import nvfp4 as F
    from pallas_kernels import gemm_config, nvfp4_matmul

    k = n = 4096
    rng = np.random.default_rng(2)
    wf = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
    w4 = F.quantize(wf)
    dot_nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    rows = []
    for t in (4096,) if quick else (512, 1024, 4096):
        x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32)).astype(jnp.bfloat16)
        flops = 2 * t * k * n
        r = {"T": t, "K": k, "N": n, "default_path": gemm_config(t, n, k).path}
        r["bf16_dot_TFLOPs"] = flops / measure(dot_nt, x, wf.astype(jnp.bfloat16), iterations=20) / 1e6
        variants = {"nvfp4_rho0": {}, "nvfp4_rho0.5": {"rac_ratio": 0.5, "act_scale": "token"}, "nvfp4_w4a16": {"mode": "w4a16"}}
        for path in ("fused", "dequant"):
            cfg = dc.replace(gemm_config(t, n, k), path=path)
            for name, kw in (variants if t == 4096 else {"nvfp4_rho0": {}}).items():
                try:
                    r[f"{name}_{path}_TFLOPs"] = flops / measure(lambda a, w: nvfp4_matmul(a, w, backend="pallas", config=cfg, **kw), x, w4, iterations=20) / 1e6
                except Exception as e:
                    RESULTS["errors"][f"prefill_{t}_{name}_{path}"] = f"{type(e).__name__}: {e}"[:600]
        if t == 4096:  # where the dequant path's time goes, and the operand decode alone
            try:
                from pallas_kernels import nvfp4_block_values
                cfg = dc.replace(gemm_config(t, n, k), path="dequant")
                r["rho0_dequant_kernels_us"] = breakdown(lambda a, w: nvfp4_matmul(a, w, backend="pallas", config=cfg), x, w4)
                moved = w4.codes.size + w4.scales.size + 2 * w4.codes.size * 2  # read codes + scales, write BF16
                want = np.asarray(F.block_values(w4)).view(np.uint16)
                for be in ("pallas", "xla"):
                    f = lambda w, be=be: nvfp4_block_values(w, backend=be)
                    r[f"block_values_{be}_exact"] = bool((np.asarray(f(w4)).view(np.uint16) == want).all())
                    r[f"block_values_{be}_us"] = measure(f, w4, iterations=20)
                    r[f"block_values_{be}_TBps"] = moved / r[f"block_values_{be}_us"] / 1e6
            except Exception as e:
                RESULTS["errors"][f"prefill_{t}_breakdown"] = f"{type(e).__name__}: {e}"[:600]
        best = max([v for key, v in r.items() if key.startswith("nvfp4_rho0_") and key.endswith("TFLOPs")], default=None)
        if best:
            r["ratio_vs_bf16"] = best / r["bf16_dot_TFLOPs"]
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def grouped_candidates(base):
    """Grouped-GEMM variants around the heuristic's (words with activation values, run 12):
    activation codes, the prmt decode with codes (the run-11 default), 8 warps at 128-wide
    tiles."""
    import dataclasses as dc

    w8 = dc.replace(base, block_n=128, num_warps=8, num_stages=3)
    return [base, dc.replace(base, act_load="codes"), dc.replace(base, decode="prmt", act_load="codes"), w8]


@section("grouped")
def grouped(measure, tune=True):
    """Grouped MoE decode GEMM against ``lax.ragged_dot`` (BF16), at the issue's shapes and the
    rollout benchmark model's expert shapes (d 1024, expert FFN 512); with ``tune`` the
    tile variants of ``grouped_candidates`` at two shapes, each checked against XLA."""
    import jax
    import jax.numpy as jnp

    from dataclasses import replace as dc_replace

    from quads_jax import nvfp4 as F
    from pallas_kernels.tiling import gemm_config
    from pallas_kernels import nvfp4_grouped_matmul

    rows = []
    rng = np.random.default_rng(3)
    e, topk = 64, 8
    for t, k, n in [(64, 1024, 512), (64, 512, 1024), (64, 2048, 768), (64, 768, 2048), (16, 2048, 768)]:
        m = t * topk
        sizes = jnp.asarray(np.bincount(rng.integers(0, e, m), minlength=e).astype(np.int32))
        wf = jnp.asarray(rng.standard_normal((e, n, k)).astype(np.float32) * 0.02)
        w4 = F.quantize(wf, keep_axes=(0,))
        wkn = jnp.swapaxes(wf, 1, 2).astype(jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)).astype(jnp.bfloat16)
        r = {"tokens": t, "rows": m, "experts": e, "K": k, "N": n}
        r["ragged_dot_bf16_us"] = measure(lambda a, w, g: jax.lax.ragged_dot(a, w, g), x, wkn, sizes)
        w4p = dc_replace(w4, codes=F.code_words(w4.codes)) if gemm_config(-(-m // e), n, k, programs_per_row_tile=e).decode == "words" else w4
        for name, kw in {"nvfp4_rho0": {}, "nvfp4_rho0.5": {"rac_ratio": 0.5}, "nvfp4_rho0.5_exact": {"rac_ratio": 0.5, "rac_sum": "exact"}}.items():
            try:  # weights as the engine prepares them (code words for the word decode)
                r[name + "_us"] = measure(lambda a, w, g: nvfp4_grouped_matmul(a, w, g, backend="pallas", **kw), x, w4p, sizes)
            except Exception as ex:
                RESULTS["errors"][f"grouped_{name}_{t}_{k}_{n}"] = f"{type(ex).__name__}: {ex}"[:600]
        if r.get("nvfp4_rho0_us"):
            r["speedup_vs_ragged_dot"] = r["ragged_dot_bf16_us"] / r["nvfp4_rho0_us"]
            r["weight_TBps"] = (w4.codes.size + w4.scales.size) / r["nvfp4_rho0_us"] / 1e6
        if (k, n) == (1024, 512):  # the rollout model's gate/up GEMM: where the time goes
            try:
                r["rho0.5_kernels_us"] = breakdown(lambda a, w, g: nvfp4_grouped_matmul(a, w, g, backend="pallas", rac_ratio=0.5,
                                                                                         act_scale="token"), x, w4, sizes)
            except Exception as ex:
                RESULTS["errors"][f"grouped_breakdown_{k}_{n}"] = f"{type(ex).__name__}: {ex}"[:600]
        if tune and (k, n) in ((2048, 768), (1024, 512)) and t == 64:
            ref = np.asarray(nvfp4_grouped_matmul(x, w4, sizes, backend="xla", rac_ratio=0.5, out_dtype=jnp.float32))
            r["variants"] = []
            for cfg in grouped_candidates(gemm_config(-(-m // e), n, k, programs_per_row_tile=e)):
                v = {f: getattr(cfg, f) for f in ("block_n", "block_k", "split_k", "num_warps", "num_stages", "decode", "act_load")}
                try:
                    # decode="words": the codes converted to uint32 words once, as prepared weights
                    # would be (the GEMM accepts words; otherwise it converts every call)
                    wv = dc_replace(w4, codes=F.code_words(w4.codes)) if cfg.decode == "words" else w4
                    f = lambda a, w, g, cfg=cfg: nvfp4_grouped_matmul(a, w, g, backend="pallas", rac_ratio=0.5, out_dtype=jnp.float32, config=cfg)
                    got = np.asarray(f(x, wv, sizes))
                    v["rho0.5_rel_vs_xla"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    v["rho0.5_us"] = measure(f, x, wv, sizes)
                    v["rho0_us"] = measure(lambda a, w, g, cfg=cfg: nvfp4_grouped_matmul(a, w, g, backend="pallas", config=cfg), x, wv, sizes)
                except Exception as ex:
                    v["error"] = f"{type(ex).__name__}: {ex}"[:300]
                r["variants"].append(v)
                print(json.dumps(v), flush=True)
        rows.append(r)
        print(json.dumps({k_: v_ for k_, v_ in r.items() if k_ != "variants"}), flush=True)
    return rows


def swap_candidates(base):
    """The heuristic's tiles (swapped, word decode at 128-wide tiles, activation values)
    against the other tile width, the prmt decode (the run-11 default) and 8 warps; all timed
    at rho 0 and at rho 0.5 with both RAC sums (FP16 compensated operand; exact, stacked rows)."""
    import dataclasses as dc

    other_n = dc.replace(base, block_n=128 if base.block_n == 64 else 64)
    prmt = dc.replace(base, decode="prmt", block_n=64 if base.block_m <= 16 else 128)
    return [base, other_n, prmt, dc.replace(base, num_warps=8)]


def tile_candidates(base):
    """Split-K, tile width, K tile and pipeline depth around the heuristic's decode tiles.
    Run 13's Nsight Compute (T=16, 4096 x 14336): 0.85 waves of 4-warp programs, 4 programs
    an SM (registers), 11 active warps an SM, issue slots 41% busy: latency-bound, so the
    candidates change how many programs run and how long each one is."""
    import dataclasses as dc

    out = [base]
    for bn, bk, split, stages in [(128, 128, 8, 4), (128, 128, 2, 4), (64, 128, 8, 4), (64, 128, 2, 4), (128, 128, 4, 3),
                                  (128, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 4, 3), (128, 256, 2, 3),
                                  (64, 128, 16, 4)]:
        c = dc.replace(base, block_n=bn, block_k=bk, split_k=split, num_stages=stages)
        if c != base:
            out.append(c)
    return out


def sweep_candidates(base):
    """Decode variants at the heuristic's tiles, then tile shapes with the variants."""
    import dataclasses as dc

    out = [dc.replace(base, decode=d) for d in ("bits", "prmt") if d != base.decode]
    for bn, bk, split, warps, stages in [(32, 256, None, 4, 4), (128, 256, None, 4, 4), (128, 256, None, 8, 3),
                                         (64, 512, None, 4, 3), (64, 128, None, 4, 4), (256, 128, None, 8, 3),
                                         (64, 256, 1, 4, 4), (64, 256, 8, 4, 4), (128, 128, 4, 4, 4), (32, 512, 2, 4, 3)]:
        for d in ("prmt", "words") if bk >= 128 else ("prmt",):
            out.append(dc.replace(base, block_n=bn, block_k=bk, split_k=base.split_k if split is None else split,
                                  num_warps=warps, num_stages=stages, decode=d))
    return out


@section("sweep")
def sweep(measure, copy_tbps=None, shapes=((16, 4096, 14336), (64, 2048, 768)), candidates=None, rac_configs=9):
    """GEMM-only kernel time (operands quantized beforehand) over tile configs and decode
    variants; every config is checked against the XLA reference first. The first
    ``rac_configs`` configs are timed at rho 0.5 too."""
    import jax.numpy as jnp

    from quads_jax import nvfp4 as F
    from pallas_kernels import backend as _backend
    NM = importlib.import_module("pallas_kernels.gemm")
    from pallas_kernels import quantize_activations_rac

    rows = []
    rng = np.random.default_rng(4)
    for t, k, n in shapes:
        w = F.quantize(jnp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.02))
        x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32)).astype(jnp.bfloat16)
        xq, rq = quantize_activations_rac(x, rac_ratio=0.5, act_scale="token", backend="pallas")
        refs = {rs: np.asarray(NM.nvfp4_matmul_xla(x, w, rac_ratio=0.5, rac_sum=rs, act_scale="token", out_dtype=jnp.float32))
                for rs in ("fp16", "exact")}
        gw = jnp.reshape(jnp.asarray(w.global_scale, jnp.float32), (1,))
        wbytes = w.codes.size + w.scales.size
        words = F.code_words(w.codes)
        base = NM.gemm_config(t, n, k)
        interp = _backend.interpret_mode()
        ref0 = np.asarray(NM.nvfp4_matmul_xla(x, w, act_scale="token", out_dtype=jnp.float32))
        for i, cfg in enumerate((candidates or sweep_candidates)(base)):
            if k % (cfg.block_k * cfg.split_k):
                continue
            row = {"T": t, "K": k, "N": n, **{f: getattr(cfg, f) for f in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "decode", "swap_ab", "act_load")}}
            try:
                # rho 0 for every config; rho 0.5 (both RAC sums) for the first rac_configs
                runs = (("rho0", None, ref0, "fp16"), ("rho0.5", rq, refs["fp16"], "fp16"), ("rho0.5_exact", rq, refs["exact"], "exact"))
                for name, res, want, rs in runs[: 3 if i < rac_configs else 1]:
                    def call(xq, res, wc, ws, cfg=cfg, rs=rs):  # timed with the activation operands' preparation
                        a, gx, r = NM.activation_operands(x, xq, res, cfg, rs)
                        return NM._gemm_call(a, gx, r, (wc,), (ws,), (gw,), cfg=cfg, out_dtype=jnp.float32, interpret=interp)[0]
                    wc = words if cfg.decode == "words" else w.codes  # words: converted once, as prepared weights
                    got = np.asarray(call(xq, res, wc, NM._bits(w.scales)))
                    row[name + "_rel_vs_xla"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                    row[name + "_us"] = measure(call, xq, res, wc, NM._bits(w.scales))
                row["weight_TBps"] = wbytes / row["rho0_us"] / 1e6
                if copy_tbps:
                    row["frac_of_copy"] = row["weight_TBps"] / copy_tbps
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


@section("triton")
def triton_parity(measure):
    """The SGLang plugin's Triton GEMM through jax-triton and through torch, against the
    Pallas kernel on the same quantized operands; GEMM-only times side by side."""
    import jax.numpy as jnp

    from quads_jax import nvfp4 as F
    from pallas_kernels import quantize_activations_rac
    from rollout.sglang_plugin.jax_launch import triton_nvfp4_matmul

    NM = importlib.import_module("pallas_kernels.gemm")

    rows = []
    rng = np.random.default_rng(5)
    for t, k, n in [(16, 4096, 14336), (64, 2048, 768)]:
        w = F.quantize(jnp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.02))
        x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32)).astype(jnp.bfloat16)
        row = {"T": t, "K": k, "N": n}
        for rho in (0.0, 0.5):
            xq, rq = quantize_activations_rac(x, rac_ratio=rho, act_scale="token", backend="pallas")
            gw = jnp.reshape(jnp.asarray(w.global_scale, jnp.float32), (1,))
            cfg = NM.gemm_config(t, n, k)
            # the plugin adds the two RAC products in FP32: the exact sum
            pallas = lambda xq, rq: NM._gemm_call(*NM.activation_operands(x, xq, rq, cfg, "exact"), (w.codes,), (NM._bits(w.scales),), (gw,), cfg=cfg, out_dtype=jnp.float32, interpret=False)[0]
            jt = lambda xq, rq: triton_nvfp4_matmul(xq, rq, w, out_dtype=jnp.float32)
            p_out = np.asarray(pallas(xq, rq))
            j_out = np.asarray(jt(xq, rq))
            row[f"rho{rho}_jax_triton_vs_pallas_rel"] = float(np.linalg.norm(j_out - p_out) / np.linalg.norm(p_out))
            row[f"rho{rho}_pallas_us"] = measure(pallas, xq, rq)
            row[f"rho{rho}_jax_triton_us"] = measure(jt, xq, rq)
            print(json.dumps(row), flush=True)  # keep the JAX half if the torch half fails
            try:
                torch_half(row, rho, x, w, xq, j_out)
            except Exception as e:
                row[f"rho{rho}_torch_error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def torch_half(row, rho, x, w, xq, j_out):
    """The plugin's own torch quantizer and the same Triton kernel launched from torch."""
    import jax.numpy as jnp
    import torch
    from triton.testing import do_bench

    from rollout.sglang_plugin import numerics as N
    from rollout.sglang_plugin import triton_gemm as TG

    NM = importlib.import_module("pallas_kernels.gemm")
    tw = torch.from_numpy(np.array(w.codes)).cuda()
    ts = torch.from_numpy(np.array(NM._bits(w.scales))).cuda()
    tgw = float(np.asarray(w.global_scale))
    tx = torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch.bfloat16).cuda()
    (xc, xs, gx), res = N.packed_operands(tx, rho)
    row[f"rho{rho}_torch_codes_equal_jax"] = bool(np.array_equal(xc.cpu().numpy(), np.asarray(xq.codes)))
    args = (xc, xs, gx, tw, ts, tgw) + ((res[0], res[1]) if res is not None else ())
    t_out = TG.w4a4_rac_gemm(*args, out_dtype=torch.float32).cpu().numpy()
    row[f"rho{rho}_torch_vs_jax_triton_max_abs"] = float(np.abs(t_out - j_out).max())
    row[f"rho{rho}_torch_triton_us"] = do_bench(lambda: TG.w4a4_rac_gemm(*args), warmup=25, rep=200, return_mode="median") * 1e3
    row[f"rho{rho}_torch_full_linear_us"] = do_bench(lambda: TG.quads_linear_triton(tx, tw, ts.view(torch.float8_e4m3fn), tgw, rac_ratio=rho), warmup=10, rep=100, return_mode="median") * 1e3


@section("torch")
def torch_baselines():
    import torch
    from triton.testing import do_bench

    rows = []
    for k, n in DECODE_SHAPES:
        for t in (1, 16, 64):
            a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            r = {"T": t, "K": k, "N": n}
            r["cublas_bf16_us"] = do_bench(lambda: a @ b.t(), warmup=25, rep=200, return_mode="median") * 1e3
            try:
                a8 = a.to(torch.float8_e4m3fn)
                b8 = b.to(torch.float8_e4m3fn)
                sb = torch.ones(1, n, device="cuda")
                tp = max(16, t)
                a8p = torch.zeros(tp, k, device="cuda", dtype=torch.float8_e4m3fn)
                a8p[:t] = a8
                sap = torch.ones(tp, 1, device="cuda")
                r["cublas_fp8_scaled_mm_us"] = do_bench(lambda: torch._scaled_mm(a8p, b8.t(), scale_a=sap, scale_b=sb, out_dtype=torch.bfloat16), warmup=25, rep=200, return_mode="median") * 1e3
            except Exception as e:
                r["cublas_fp8_error"] = str(e)[:300]
            rows.append(r)
    return rows


@section("sass")
def sass(out_dir):
    """Tensor-core MMA instructions in the SASS of the Pallas GEMM (default config, unswapped,
    bits decode) as XLA compiled it, and of the SGLang plugin's Triton GEMM. (Run 9: an XLA
    dump holds no PTX for Pallas kernels, so the cubins come from the compilation cache.)"""
    code = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from quads_jax import nvfp4 as F\nfrom pallas_kernels import nvfp4_matmul\n"
        "x=jnp.ones((16,2048),jnp.bfloat16); w=F.quantize(jnp.asarray(np.random.randn(768,2048).astype(np.float32)))\n"
        "import dataclasses as dc\nfrom pallas_kernels import gemm_config\nb=gemm_config(16,768,2048)\n"
        "for c in (b, dc.replace(b, swap_ab=False), dc.replace(b, decode='bits')):\n"
        "    jax.block_until_ready(nvfp4_matmul(x,w,rac_ratio=0.5,backend='pallas',config=c))\n"
    )
    return {"pallas": pallas_sass_from_cache(code), "triton_plugin": triton_plugin_sass()}


def elf_blobs(data: bytes):
    """The ELF images (cubins) embedded in a byte string: header to the end of the section table."""
    import struct

    out, i = [], data.find(b"\x7fELF")
    while i >= 0:
        if data[i + 4] == 2 and i + 64 <= len(data):  # ELFCLASS64
            shoff, = struct.unpack_from("<Q", data, i + 0x28)
            shentsize, shnum = struct.unpack_from("<HH", data, i + 0x3A)
            end = i + shoff + shentsize * shnum
            if shoff and end <= len(data):
                out.append(data[i:end])
        i = data.find(b"\x7fELF", i + 4)
    return out


def _unpack_cache_entry(raw: bytes) -> bytes:
    for mod, fn in (("zstandard", lambda m: m.ZstdDecompressor().decompress(raw, max_output_size=1 << 30)),
                    ("zlib", lambda m: m.decompress(raw))):
        try:
            return fn(importlib.import_module(mod))
        except Exception:
            continue
    return raw


def pallas_sass_from_cache(code):
    """SASS of the Pallas kernels as XLA compiled them: run ``code`` with the persistent
    compilation cache on, take the cubins out of the cached executables, and disassemble
    them (cuobjdump from the CUDA toolkit or Triton's copy). Counts tensor-core MMAs per kernel."""
    cache = "/tmp/quads_jax_cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    tool = shutil.which("cuobjdump")
    if tool is None:
        try:
            import triton
            tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        except Exception:
            pass
    entries = [f for f in glob.glob(f"{cache}/**/*", recursive=True) if os.path.isfile(f)]
    res = {"rc": r.returncode, "cache_entries": len(entries), "cuobjdump": tool, "kernels": {}}
    for n, f in enumerate(entries):
        for j, blob in enumerate(elf_blobs(_unpack_cache_entry(open(f, "rb").read()))):
            path = f"/tmp/quads_cubin_{n}_{j}.cubin"
            open(path, "wb").write(blob)
            out = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout if tool else ""
            for chunk in out.split("Function : ")[1:]:
                name = chunk.split()[0][:80]
                if "nvfp4" in name or "HMMA" in chunk or "HGMMA" in chunk:
                    res["kernels"][name] = {"HGMMA": chunk.count("HGMMA"), "HMMA": chunk.count("HMMA"), "FFMA": chunk.count("FFMA")}
    return res


def triton_plugin_sass():
    """MMA instruction counts in the SASS of the SGLang plugin's Triton GEMM (torch launch)."""
    import dataclasses

    try:
        import torch

        from rollout.sglang_plugin import triton_gemm as TG
        from pallas_kernels.tiling import gemm_config

        t, n, k = 16, 768, 2048
        z = lambda *shape: torch.zeros(shape, dtype=torch.uint8, device="cuda")
        out = {}
        for name, cfg in (("default", gemm_config(t, n, k)), ("unswapped", dataclasses.replace(gemm_config(t, n, k), swap_ab=False))):
            o = torch.empty((cfg.split_k, t, n), dtype=torch.float32, device="cuda")
            g = torch.ones(t, device="cuda")
            kern = TG.w4a4_rac_gemm_kernel[(-(-t // cfg.block_m), -(-n // cfg.block_n), cfg.split_k)](
                z(t, k // 2), z(t, k // 16), g, z(t, k // 2), z(t, k // 16), z(n, k // 2), z(n, k // 16), g[:1], t, n, o, K=k,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, HAS_RAC=True,
                F32_OPERANDS=False, SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            sass = kern.asm["sass"]
            out[name] = {"sass_HMMA": sass.count("HMMA"), "sass_HGMMA": sass.count("HGMMA"), "ptx_wgmma": kern.asm["ptx"].count("wgmma"),
                         "ptx_mma_sync": kern.asm["ptx"].count("mma.sync")}
        return out
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:400]}


@section("swap")
def swap_sweep(measure, copy_tbps=None):
    """The sweep over swap_ab and prmt variants, at T = 16 and 64 on the largest decode shape."""
    return sweep.__wrapped__(measure, copy_tbps, shapes=((16, 4096, 14336), (64, 4096, 14336)),
                             candidates=swap_candidates, rac_configs=99)


@section("tiles")
def tile_sweep(measure, copy_tbps=None):
    """``tile_candidates`` at T = 16 and 64 on the largest decode shape."""
    return sweep.__wrapped__(measure, copy_tbps, shapes=((16, 4096, 14336), (64, 4096, 14336)),
                             candidates=tile_candidates, rac_configs=99)


def markdown(res) -> str:
    s = res["sections"]
    env = s.get("env", {})
    lines = [f"# Kernel benchmarks ({env.get('date', '?')}, {env.get('device', '?')}, jax {env.get('jax', '?')})", ""]
    c = s.get("ceilings", {})
    if c:
        lines += [f"Ceilings measured in this run: copy {c['copy_TBps']:.2f} TB/s, BF16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s.", ""]
    if s.get("decode"):
        lines += ["## Decode GEMM (us, CUPTI kernel time, median)", "", "| T | K x N | bf16 dot | fp8 dot | nvfp4 rho0 | nvfp4 rho0.5 | rho0.5 exact | w4a16 | W TB/s | x bf16 | x fp8 | RAC cost |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)
        for r in s["decode"]:
            lines.append(f"| {r['T']} | {r['K']}x{r['N']} | {f(r.get('bf16_dot_us'))} | {f(r.get('fp8_dot_us'))} | {f(r.get('nvfp4_rho0_us'))} | {f(r.get('nvfp4_rho0.5_us'))} | {f(r.get('nvfp4_rho0.5_exact_us'))} | {f(r.get('nvfp4_w4a16_us'))} | {f(r.get('nvfp4_weight_TBps'), '{:.2f}')} | {f(r.get('speedup_vs_bf16'), '{:.2f}')} | {f(r.get('speedup_vs_fp8'), '{:.2f}')} | {f(r.get('rac_overhead'), '{:+.0%}')} |")
        lines.append("")
    if s.get("prefill"):
        lines += ["## Prefill, K = N = 4096 (TFLOP/s; fused kernel vs decode once + BF16 dot)", "",
                  "| T | bf16 dot | rho0 fused | rho0 dequant | rho0.5 dequant | w4a16 dequant | best / bf16 |", "|---|---|---|---|---|---|---|"]
        g = lambda r, key: "-" if r.get(key) is None else f"{r[key]:.0f}"
        for r in (s["prefill"] if isinstance(s["prefill"], list) else [s["prefill"]]):
            lines.append(f"| {r['T']} | {g(r, 'bf16_dot_TFLOPs')} | {g(r, 'nvfp4_rho0_fused_TFLOPs')} | {g(r, 'nvfp4_rho0_dequant_TFLOPs')} | "
                         f"{g(r, 'nvfp4_rho0.5_dequant_TFLOPs')} | {g(r, 'nvfp4_w4a16_dequant_TFLOPs')} | {r.get('ratio_vs_bf16', 0):.2f} |")
        lines.append("")
    if s.get("grouped"):
        lines += ["## Grouped MoE decode (64 experts, top-8)", "", "| tokens | K x N | ragged_dot bf16 us | nvfp4 rho0 us | nvfp4 rho0.5 us | rho0.5 exact us | speedup | W TB/s |", "|---|---|---|---|---|---|---|---|"]
        for r in s["grouped"]:
            g = lambda key, fmt="{:.1f}": "-" if r.get(key) is None else fmt.format(r[key])
            lines.append(f"| {r['tokens']} | {r['K']}x{r['N']} | {r['ragged_dot_bf16_us']:.1f} | {g('nvfp4_rho0_us')} | {g('nvfp4_rho0.5_us')} | {g('nvfp4_rho0.5_exact_us')} | {g('speedup_vs_ragged_dot', '{:.2f}')} | {g('weight_TBps', '{:.2f}')} |")
        lines.append("")
    if s.get("torch"):
        lines += ["## cuBLAS through torch (us, do_bench median)", "", "| T | K x N | bf16 | fp8 _scaled_mm |", "|---|---|---|---|"]
        for r in s["torch"]:
            lines.append(f"| {r['T']} | {r['K']}x{r['N']} | {r['cublas_bf16_us']:.1f} | {r.get('cublas_fp8_scaled_mm_us', '-')} |")
        lines.append("")
    for key in ("numerics", "numerics_pallas", "sass"):
        if s.get(key):
            lines += [f"## {key}", "", "```", json.dumps(s[key], indent=1), "```", ""]
    if res["errors"]:
        lines += ["## errors", "", "```", json.dumps(res["errors"], indent=1)[:6000], "```"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated sections")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    want = lambda s: not only or s in only
    os.makedirs(args.out, exist_ok=True)
    global OUT_DIR
    OUT_DIR = args.out
    measure = timer()
    env()
    if want("numerics"):
        numerics()
    if want("numerics_pallas"):
        numerics_pallas()
    if want("ceilings"):
        ceilings(measure)
    ceil = RESULTS["sections"].get("ceilings")
    if want("decode"):
        decode(measure, ceil, args.quick)
    if want("sweep"):
        sweep(measure, (ceil or {}).get("copy_TBps"))
    if want("swap"):
        swap_sweep(measure, (ceil or {}).get("copy_TBps"))
    if want("tiles"):
        tile_sweep(measure, (ceil or {}).get("copy_TBps"))
    if want("triton"):
        triton_parity(measure)
    if want("prefill"):
        prefill(measure, args.quick)
    if want("grouped"):
        grouped(measure)
    if want("torch"):
        torch_baselines()
    if want("sass"):
        sass(args.out)
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    md = markdown(RESULTS)
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
