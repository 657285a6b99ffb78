"""Device check and timing of the Mosaic GPU decode GEMM (pallas_kernels/nvfp4_matmul_mgpu.py).

For each decode shape and T: the kernel against the XLA product of the same FP16 operands
(FP32 accumulation: the difference is summation order), then device-side times (CUPTI) of
the kernel alone over split-K and pipeline depths, of the whole op (operand reorder + kernel
+ epilogue), and, in the same run, of the BF16 dot, the FP8 dot and the Triton NVFP4 GEMM.

    python benchmarks/mgpu_check.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import datetime
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

SHAPES = [(2048, 768), (2048, 6144), (4096, 14336)]


def ints(csv):
    return tuple(int(v) for v in csv.split(","))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pipelines", default="plain", help="comma list of MgpuConfig.pipeline values to sweep")
    ap.add_argument("--probe", default=None, help="run one small config of this pipeline, check it, exit (0: correct)")
    ap.add_argument("--op", action="store_true", help="time the whole nvfp4_matmul op (path mgpu vs fused) and the dots, then exit")
    ap.add_argument("--variants", action="store_true", help="with --op: also the op with the quantizer writing codes, and as run 15 had it")
    ap.add_argument("--shapes", default=None, help="K:N,K:N (default: the three decode shapes)")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later shapes are skipped past it")
    ap.add_argument("--frags", default="1,2,4", help="sweep: MgpuConfig.frags values")
    ap.add_argument("--splits", default="1,2,4,8,16", help="sweep: MgpuConfig.split_k values")
    ap.add_argument("--chunks", default="1,2", help="sweep: MgpuConfig.chunks values")
    ap.add_argument("--ts", default="16,1,64", help="token counts (the full sweep runs at 16, the others time its best few)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax
    import jax.numpy as jnp

    from bench_kernels import breakdown, timer
    globals()['breakdown'] = breakdown
    from pallas_kernels import fp8_matmul, nvfp4_matmul
    from pallas_kernels import nvfp4_matmul_mgpu as M
    from quads_jax import fp8, nvfp4
    from quads_jax.precision import prepare_weight

    t0 = time.time()
    if args.probe:  # a kernel that deadlocks hangs the process: probe it in its own, under a timeout
        k, n, t = 2048, 768, 16
        rng = np.random.default_rng(0)
        w4 = nvfp4.quantize(jnp.asarray(rng.standard_normal((n, k)).astype(np.float32)))
        xq = nvfp4.quantize(jnp.asarray(rng.standard_normal((t, k)).astype(np.float32)))
        a16 = nvfp4.block_values(xq, jnp.float16)
        ref = (a16.astype(jnp.float32) @ nvfp4.block_values(w4, jnp.float32).T) * w4.global_scale * xq.global_scale
        cfg = M.MgpuConfig(split_k=2, stages=2, frags=2, pipeline=args.probe)
        got = jax.block_until_ready(M.nvfp4_decode_gemm(a16, w4, gx=xq.global_scale, config=cfg, out_dtype=jnp.float32))
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        print(json.dumps({"probe": args.probe, "max_rel_err": err}), flush=True)
        sys.exit(0 if err < 1e-5 else 1)
    measure = timer()
    res = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "rows": [], "errors": {}}
    rng = np.random.default_rng(0)
    dot_nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def attempt(key, f):
        try:
            return f()
        except Exception as e:
            res["errors"][key] = f"{type(e).__name__}: {e}"[:1500]
            print(f"ERROR {key}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
            traceback.print_exc(limit=3)
            return None

    shapes = SHAPES if not args.quick else [(4096, 14336)]
    if args.shapes:
        shapes = [tuple(map(int, kn.split(":"))) for kn in args.shapes.split(",")]
    save = lambda: json.dump(res, open(os.path.join(args.out, "mgpu.json"), "w"), indent=1)
    if args.op:
        op_rows(args, res, save, shapes, measure, attempt, t0)
        return
    top = {}
    for k, n in shapes:
        if time.time() - t0 > args.budget:
            res["errors"][f"skipped_{k}x{n}"] = "time budget"
            continue
        wf = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
        w4 = nvfp4.quantize(wf)
        w4p = prepare_weight(wf, "w4a4")
        w8 = fp8.quantize(wf)
        wb = wf.astype(jnp.bfloat16)
        wq = nvfp4.block_values(w4, jnp.float32)  # [N, K] exact
        words = jax.lax.bitcast_convert_type(nvfp4.code_words(w4.codes), jnp.int32)
        sbits = jax.lax.bitcast_convert_type(w4.scales, jnp.uint8)
        wbytes = w4.codes.size * w4.codes.dtype.itemsize + w4.scales.size
        for t in ints(args.ts):
            x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32))
            xq = nvfp4.quantize(x)
            a16 = nvfp4.block_values(xq, jnp.float16)
            gx = xq.global_scale
            r = {"T": t, "K": k, "N": n}
            ref = (a16.astype(jnp.float32) @ wq.T) * w4.global_scale * gx
            got = attempt(f"run_{t}_{k}_{n}", lambda: jax.jit(lambda a, w: M.nvfp4_decode_gemm(a, w, gx=gx, out_dtype=jnp.float32))(a16, w4))
            if got is not None:
                err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                r["max_rel_err"] = err
                r["ok"] = bool(err < 1e-5)
            tp = -(-t // 8) * 8
            a_k = M.to_fragment_order(jnp.pad(a16, ((0, tp - t), (0, 0))))
            base = M.mgpu_config(t, n, k)
            r["config"] = dataclasses.asdict(base)
            ref_full = ref
            steps = k // M.TILE_K
            if t == 16:  # the full sweep at T=16; the other T try the shape's best few
                cands = {base}
                for pipe, frags, chunks, stages in itertools.product(args.pipelines.split(","), ints(args.frags), ints(args.chunks), (2, 4)):
                    tiles = n // (64 * frags)
                    if pipe == "ws" and (frags == 1 or frags > M.WS_MAX_FRAGS or chunks == 2):
                        continue
                    for s in ints(args.splits):
                        if tiles and n % (64 * frags) == 0 and steps % (s * chunks) == 0 and 24 <= tiles * s <= 4 * 132:
                            cands.add(M.MgpuConfig(split_k=s, stages=stages, frags=frags, chunks=chunks, pipeline=pipe))
            else:
                cands = {base, *top.get((k, n), [])}
            timed = []
            for cfg in sorted(cands, key=lambda c: dataclasses.astuple(c)):
                key = "{pipeline}_s{split_k}_st{stages}_f{frags}_c{chunks}".format(**dataclasses.asdict(cfg))
                kern = jax.jit(lambda a, w, sb: M.decode_gemm_partials(a, w, sb, cfg))
                parts = attempt(f"run_{t}_{k}_{n}_{key}", lambda: kern(a_k, words, sbits))
                if parts is None:
                    continue
                got = parts.sum(0).T[:t] * w4.global_scale * gx
                r[f"err_{key}"] = e = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                if not e < 1e-5:
                    res["errors"][f"wrong_{t}_{k}_{n}_{key}"] = e
                    continue
                us = attempt(f"time_{t}_{k}_{n}_{key}", lambda: measure(kern, a_k, words, sbits))
                print(key, us, e, flush=True)
                res["partial"] = r
                save()
                if us is not None:
                    r[f"kernel_{key}_us"] = us
                    timed.append((us, cfg, key))
                if time.time() - t0 > args.budget:
                    break
            timed.sort(key=lambda e: e[0])
            if t == 16:
                top[(k, n)] = [c for _, c, _ in timed[:4]]
            if timed:
                r["kernel_best_us"], r["best"] = timed[0][0], timed[0][2]
                r["kernel_weight_TBps"] = wbytes / timed[0][0] / 1e6
                best_cfg = timed[0][1]
            else:
                best_cfg = base
            got = attempt(f"run_best_{t}_{k}_{n}", lambda: jax.jit(lambda a, w: M.nvfp4_decode_gemm(a, w, gx=gx, config=best_cfg, out_dtype=jnp.float32))(a16, w4p))
            if got is not None:
                r["best_max_rel_err"] = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            op = lambda a, w: M.nvfp4_decode_gemm(a, w, gx=gx, config=best_cfg)
            r["mgpu_op_us"] = attempt(f"op_{t}_{k}_{n}", lambda: measure(op, a16, w4p))
            if t == 16:
                r["mgpu_op_kernels_us"] = attempt(f"breakdown_{t}_{k}_{n}", lambda: breakdown(op, a16, w4p))
            xb = x.astype(jnp.bfloat16)
            r["bf16_dot_us"] = attempt(f"bf16_{t}_{k}_{n}", lambda: measure(dot_nt, xb, wb))
            r["fp8_dot_us"] = attempt(f"fp8_{t}_{k}_{n}", lambda: measure(lambda a, w: fp8_matmul(a, w), xb, w8))
            r["triton_rho0_us"] = attempt(f"triton_{t}_{k}_{n}", lambda: measure(lambda a, w: nvfp4_matmul(a, w, act_scale="token", backend="pallas"), xb, w4p))
            for name in ("kernel_best_us", "mgpu_op_us"):
                if r.get(name) and r.get("bf16_dot_us"):
                    r[name.replace("_us", "_vs_bf16")] = r["bf16_dot_us"] / r[name]
                if r.get(name) and r.get("fp8_dot_us"):
                    r[name.replace("_us", "_vs_fp8")] = r["fp8_dot_us"] / r[name]
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(args.out, "mgpu.json"), "w") as f:
                json.dump(res, f, indent=1)
    print("done in", round(time.time() - t0), "s")


# --variants: beside the default op (the quantizer writes the GEMM's FP16 operand, rows split
# over programs), "_codes" (the quantizer writes codes, XLA builds the operand) and "_run15"
# (codes, one quantizer program a row: the op as run 15 measured it)
OP_VARIANTS = ("", "_codes", "_run15")


def with_operand_flag(on, fn):
    """fn() traced with ``nvfp4_matmul.OPERAND_FROM_QUANTIZER`` set to ``on``."""
    import importlib

    NM = importlib.import_module("pallas_kernels.nvfp4_matmul")
    old, NM.OPERAND_FROM_QUANTIZER = NM.OPERAND_FROM_QUANTIZER, on
    try:
        return fn()
    finally:
        NM.OPERAND_FROM_QUANTIZER = old


def op_rows(args, res, save, shapes, measure, attempt, t0):
    """The user-facing op: nvfp4_matmul from BF16 x (activation quantizer, RAC, GEMM, epilogue)
    with path="mgpu" against path="fused" (Triton), each checked against the XLA backend,
    and the BF16 and FP8 dots, T in (1, 16, 64), rho in (0, 0.5)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from pallas_kernels import fp8_matmul, nvfp4_matmul
    from quads_jax import fp8
    from pallas_kernels.quantize_activations import quant_config
    from quads_jax.precision import prepare_weight
    from quads_jax.tiling import gemm_config

    rng = np.random.default_rng(1)
    dot_nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    for k, n in shapes:
        wf = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
        w4p, w8, wb = prepare_weight(wf, "w4a4"), fp8.quantize(wf), wf.astype(jnp.bfloat16)
        wbytes = w4p.codes.size * w4p.codes.dtype.itemsize + w4p.scales.size
        for t in ints(args.ts):
            if time.time() - t0 > args.budget:
                res["errors"][f"op_skipped_{t}_{k}_{n}"] = "time budget"
                continue
            x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32)).astype(jnp.bfloat16)
            r = {"T": t, "K": k, "N": n}
            r["bf16_dot_us"] = attempt(f"bf16_{t}_{k}_{n}", lambda: measure(dot_nt, x, wb))
            r["fp8_dot_us"] = attempt(f"fp8_{t}_{k}_{n}", lambda: measure(lambda a, w: fp8_matmul(a, w), x, w8))
            for rho in (0.0, 0.5):
                ref = nvfp4_matmul(x, w4p, rac_ratio=rho, act_scale="token", backend="xla").astype(jnp.float32)
                for path, variant in itertools.product(("mgpu", "fused"), OP_VARIANTS if args.variants else ("",)):
                    cfg = dataclasses.replace(gemm_config(t, n, k), path=path)
                    quant = quant_config(t, k, split=False) if variant == "_run15" else None
                    # the flag is read when f is traced: jax.jit(f) below and measure's own jit
                    f = lambda a, w, cfg=cfg, quant=quant, on=variant == "": with_operand_flag(on, lambda: nvfp4_matmul(
                        a, w, rac_ratio=rho, act_scale="token", backend="pallas", config=cfg, quant_config=quant))
                    key = f"{path}_rho{rho}{variant}"
                    got = attempt(f"op_{key}_{t}_{k}_{n}", lambda: jax.jit(f)(x, w4p))
                    if got is None:
                        continue
                    # BF16 outputs of the same FP32 sums in another order: a few BF16 ulps
                    r[f"{key}_err"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
                    r[f"{key}_us"] = attempt(f"time_{key}_{t}_{k}_{n}", lambda: measure(f, x, w4p))
                    if t == 16 and path == "mgpu":
                        r[f"{key}_kernels_us"] = attempt(f"bd_{key}", lambda: breakdown(f, x, w4p))
            us = r.get("mgpu_rho0.0_us")
            if us:
                r["mgpu_vs_bf16"] = r["bf16_dot_us"] / us if r.get("bf16_dot_us") else None
                r["mgpu_vs_fp8"] = r["fp8_dot_us"] / us if r.get("fp8_dot_us") else None
                r["mgpu_weight_TBps"] = wbytes / us / 1e6
                if r.get("mgpu_rho0.5_us"):
                    r["mgpu_rac_overhead"] = r["mgpu_rho0.5_us"] / us - 1
            res["rows"].append(r)
            print(json.dumps({kk: v for kk, v in r.items() if not kk.endswith("kernels_us")}), flush=True)
            save()


if __name__ == "__main__":
    main()
