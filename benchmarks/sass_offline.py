"""SASS of the Pallas GEMMs without a GPU: per-iteration instruction counts of the main loop.

The NVFP4 GEMMs are bound by instruction issue (Nsight Compute, H200 run 11), so the number
of instructions in the compiled main loop per weight value is the figure to lower. This tool
gets it on a CPU-only machine:

1. lower each kernel with the project's JAX, with the GPU's compute capability given as 90
   (Pallas' Triton lowering only asks for it), and keep the Triton IR (TTIR) it builds;
2. compile the TTIR for sm_90 with a Triton installation (pip ``triton==3.6.0``, the GPU
   image's version, in any Python: ``--triton-python``), which bundles ptxas and nvdisasm;
3. find the steady-state loop (the longest backward branch) in the SASS and count it.

XLA compiles Pallas kernels with its own copy of Triton, so the counts are a close proxy
(run 11: 877 here against ~15.5 instructions a value measured on the device for the same
kernel), not the device's exact code. Usage:

    PYTHONPATH=. python benchmarks/sass_offline.py --triton-python /path/to/python [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import types

COMPILE = r'''
import os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
path, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns})
f = path + ".cubin"
open(f, "wb").write(k.asm["cubin"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
open(path + ".sass", "w").write(subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", f], capture_output=True, text=True).stdout)
print(subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f], capture_output=True, text=True).stdout)
'''


# opcodes that stall a warp in the main loop: wgmma arrive / wait (WARPGROUP), memory barriers
# and proxy fences, and synchronous global loads (LDG; the pipelined copies are LDGSTS)
WAITS = ("WARPGROUP", "MEMBAR", "FENCE", "LDG")


def main_loop(sass: str):
    """(loop instruction count, opcode counts) of the longest backward-branch span."""
    labels, instr = {}, []
    for ln in sass.splitlines():
        lm = re.match(r"\s*(\.L_x_\d+):", ln)
        if lm:
            labels[lm.group(1)] = len(instr)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", ln)
        if m:
            instr.append((m.group(2).split(".")[0], m.group(3)))
    best = (0, -1)
    for i, (op, rest) in enumerate(instr):
        t = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" else None
        if t and labels.get(t.group(1), i + 1) <= i and i - labels[t.group(1)] > best[1] - best[0]:
            best = (labels[t.group(1)], i)
    body = collections.Counter(op for op, _ in instr[best[0]:best[1] + 1])
    return best[1] - best[0] + 1, body


def capture_ttir():
    """Patch the Pallas Triton lowering: a fixed compute capability, and keep each TTIR."""
    from jax._src.pallas.triton import pallas_call_registration as R

    R.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    captured = []
    orig = R.lowering.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        res = orig(*a, **k)
        captured.append(res.module.operation.get_asm())
        return res

    R.lowering.lower_jaxpr_to_triton_module = keep
    return captured


def cases(override=None):
    """(name, lower(), cfg, weight values per loop iteration per thread) of the decode GEMMs;
    ``override`` replaces GemmConfig fields of the heuristic's tiles (e.g. decode="words")."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from quads_jax import nvfp4

    NM = sys.modules["pallas_kernels.gemm"]
    NG = sys.modules["pallas_kernels.grouped_gemm"]
    gw1 = (jnp.ones((1,), jnp.float32),)

    def operand(x, rho, cfg):  # rho None: W4A16 (BF16 activations, no scales)
        if rho is None:
            return NM.token_operand(x, NM.operand_order(cfg), mode="w4a16", rac_ratio=0.0, quant_config=None)
        return pk.quantize_operand(x, rac_ratio=rho, order=NM.operand_order(cfg), backend="xla")

    def dense(t, n, k, rho):
        w = nvfp4.quantize(jnp.ones((n, k), jnp.float32))
        x = jnp.ones((t, k), jnp.bfloat16)
        cfg = dataclasses.replace(NM.gemm_config(t, n, k), **(override or {}))
        a, gx = operand(x, rho, cfg)

        def f(a, gx):
            return NM._gemm_call(a, gx, (w.codes,), (NM._bits(w.scales),), gw1, cfg=cfg, out_dtype=jnp.float32, interpret=False)

        return (lambda: jax.jit(f).trace(a, gx).lower(lowering_platforms=("cuda",))), cfg

    def grouped(tokens, n, k, rho, e=64, topk=8, gather=False):
        """``gather``: the MoE dispatch's form, the tokens' rows read through the sorted rows' index."""
        m = tokens * topk
        w = nvfp4.quantize(jnp.ones((e, n, k), jnp.float32), keep_axes=(0,))
        x = jnp.ones((tokens if gather else m, k), jnp.bfloat16)
        src = jnp.arange(m, dtype=jnp.int32) // topk if gather else None
        sizes = jnp.asarray(np.full(e, m // e), jnp.int32)
        cfg = dataclasses.replace(NM.gemm_config(-(-m // e), n, k, programs_per_row_tile=e), **(override or {}))  # RAC: FP16 sum
        a, gx = operand(x, rho, cfg)
        gw = (jnp.ones((e,), jnp.float32),)

        def f(a, gx, src):
            return NG._grouped_call(a, gx, src, (w.codes,), (NM._bits(w.scales),), gw, sizes, cfg=cfg, out_dtype=jnp.float32,
                                    interpret=False)

        return (lambda: jax.jit(f).trace(a, gx, src).lower(lowering_platforms=("cuda",))), cfg

    for name, (fn, cfg) in (
        ("dense T16 4096x14336 rho0", dense(16, 14336, 4096, 0.0)),
        ("dense T16 4096x14336 rho0.5", dense(16, 14336, 4096, 0.5)),
        ("dense T64 4096x14336 rho0", dense(64, 14336, 4096, 0.0)),
        ("dense T64 4096x14336 rho0.5", dense(64, 14336, 4096, 0.5)),
        ("dense T256 1024x1536 rho0", dense(256, 1536, 1024, 0.0)),
        ("dense T256 1024x1536 rho0.5", dense(256, 1536, 1024, 0.5)),
        ("grouped 64 tok 1024x512 rho0", grouped(64, 512, 1024, 0.0)),
        ("grouped 256 tok 1024x512 rho0.5", grouped(256, 512, 1024, 0.5)),
        ("grouped 64 tok 1024x512 rho0.5", grouped(64, 512, 1024, 0.5)),
        ("grouped 64 tok 1024x1024 rho0.5, rows gathered", grouped(64, 1024, 1024, 0.5, gather=True)),
        ("grouped 256 tok 1024x1024 rho0.5, rows gathered", grouped(256, 1024, 1024, 0.5, gather=True)),
        ("dense T64 4096x14336 w4a16", dense(64, 14336, 4096, None)),
        ("grouped 64 tok 1024x1024 w4a16, rows gathered", grouped(64, 1024, 1024, None, gather=True)),
    ):
        values = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
        yield name, fn, cfg, values


def quant_cases(shapes=((16, 1024), (64, 1024), (512, 512), (256, 2048), (2048, 512), (64, 4096)), selects=("energies", "rank")):
    """(name, lower(), QuantConfig) of the activation quantizer (per-token scales, the FP16
    GEMM operand in the word-part order) at the rollout's sizes (batches 16 and 64, the
    batch-64 experts' down projection, batch 256, prefill, an 8B-class up projection's 256-block
    rows at batch 64), RAC 0 and 0.5: the heuristic's
    tiles and one program per row (parts=1), with each RAC selection of ``selects``."""
    import dataclasses as dc

    import jax
    import jax.numpy as jnp

    QA = importlib.import_module("pallas_kernels.quantizer")

    for t, k in shapes:
        x = jnp.ones((t, k), jnp.bfloat16)
        for rho in (0.0, 0.5):
            n_sel = QA.rac.num_selected(rho, k // 16)
            default = QA.quant_config(t, k)
            for layout, base in (("default", default), ("one_row", dc.replace(default, parts=1))):
                for select in selects if rho else (default.select,):
                    cfg = dc.replace(base, select=select)
                    fn = lambda cfg=cfg, n_sel=n_sel, x=x: jax.jit(
                        lambda v: QA._quant_call(v, n_sel=n_sel, cfg=cfg, interpret=False, order=("words", 128), rows=v.shape[0])
                    ).trace(x).lower(lowering_platforms=("cuda",))
                    yield f"quant T{t} K{k} rho{rho} {layout} parts{cfg.parts} chunk{cfg.chunk} w{cfg.num_warps} {select}", fn, cfg


def weight_quant_cases(shapes=((64 * 1024, 1024), (1024, 1024))):
    """(name, lower(), FakeQuantConfig) of the trainer's weight fake-quant kernel at the bench
    model's expert and attention weights, its default tiles."""
    import jax
    import jax.numpy as jnp

    WQ = importlib.import_module("pallas_kernels.weight_quant")
    for r, k in shapes:
        cfg = WQ.fake_quant_config(r, k)
        w, amax = jnp.ones((r, k), jnp.float32), jnp.ones((r, 1), jnp.float32)
        fn = lambda cfg=cfg, w=w, amax=amax: jax.jit(
            lambda a, b: WQ._call(a, b, dtype=jnp.bfloat16, cfg=cfg, interpret=False)).trace(w, amax).lower(lowering_platforms=("cuda",))
        yield f"weight fake-quant R{r} K{k} {cfg.block_rows}x{cfg.block_k} w{cfg.num_warps}", fn, cfg


def compile_ttir(triton_python, ttir, path, num_warps, num_stages):
    """Compile captured TTIR for sm_90: (error or None, registers, stack bytes, SASS text)."""
    open(path, "w").write(ttir)
    r = subprocess.run([triton_python, "-c", COMPILE, path, str(num_warps), str(num_stages)], capture_output=True, text=True)
    if r.returncode:
        return r.stderr[-800:], None, None, ""
    res = re.search(r"REG:(\d+)\s+STACK:(\d+)", r.stdout)
    return None, int(res.group(1)) if res else None, int(res.group(2)) if res else None, open(path + ".sass").read()


def decode_attention_cases():
    """(name, lower(), DecodeAttentionConfig) of the live-KV decode attention at the bench
    model's heads (16 query heads, 4 KV heads, head_dim 64) and rollout batches."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import cache_attention as CA

    out = []
    for b, s, splits, bk in ((64, 576, 3, 64), (256, 576, 1, 64), (16, 2048, 8, 64), (256, 576, 1, 32)):
        cfg = CA.DecodeAttentionConfig(block_k=bk, splits=splits)
        q = jax.ShapeDtypeStruct((b, 16, 64), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((b, s, 4, 64), jnp.bfloat16)
        lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
        # the rollout's form: the step's keys and values appended by the kernel
        new = (jax.ShapeDtypeStruct((b, 4, 64), jnp.bfloat16),) * 2 + (jax.ShapeDtypeStruct((b,), jnp.bool_),)
        f = lambda q, k, v, n, new, cfg=cfg: CA._call(q, k, v, n, new, config=cfg, interpret=False)
        out.append((f"B{b}_S{s}_splits{splits}_bk{bk}_append",
                    lambda f=f, q=q, kv=kv, n=lengths, new=new: jax.jit(f).trace(q, kv, kv, n, new).lower(lowering_platforms=("cuda",)), cfg))
    return out


def quant_main(a, captured, tmp, cases=None, stem="sass_offline_quant"):
    """Whole-kernel instruction counts of the quantizer (it has no main loop: its chunks and
    rank counts are unrolled, so the static count is about each thread's serial work), or of
    another kernel's ``cases``; a row for each kernel a case launches (the quantizer's energy
    pass, then the quantizer)."""
    import jax

    rows = []
    for i, (name, lower, cfg) in enumerate(cases or quant_cases()):
        jax.clear_caches()
        first = len(captured)
        lower()
        launched = captured[first:]
        for j, ttir in enumerate(launched):
            err, regs, stack, sass = compile_ttir(a.triton_python, ttir, os.path.join(tmp, f"q{i}_{j}.ttir"), cfg.num_warps,
                                                    getattr(cfg, "num_stages", 1))
            ops = [m.group(2).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
            row = {"kernel": name if len(launched) == 1 else f"{name} [{j + 1}/{len(launched)}]", "config": dataclasses.asdict(cfg)}
            if err:
                row["error"] = err
            else:
                row.update(registers=regs, stack_bytes=stack, instructions=len(ops), spill_ops=ops.count("LDL") + ops.count("STL"),
                           barriers=ops.count("BAR"), shuffles=ops.count("SHFL"), global_loads=ops.count("LDG"),
                           global_stores=ops.count("STG"), opcodes=dict(collections.Counter(ops).most_common(8)))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("config", "opcodes")}), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        json.dump(rows, open(os.path.join(a.out, f"{stem}.json"), "w"), indent=1)
        lines = ["| kernel | registers | instructions a thread (whole kernel) | warp instructions a scheduler | barriers | shuffles | "
                 "global loads / stores | spill ops |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r.get('registers')} | {r.get('instructions')} | "
                  f"{r['instructions'] * max(1, r['config']['num_warps'] // 4) if r.get('instructions') else None} | "
                  f"{r.get('barriers')} | {r.get('shuffles')} | {r.get('global_loads')} / {r.get('global_stores')} | {r.get('spill_ops')} |"
                  for r in rows]
        open(os.path.join(a.out, f"{stem}.md"), "w").write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton-python", required=True, help="a Python with triton==3.6.0 installed (no GPU needed)")
    ap.add_argument("--out", default=None, help="write sass_offline.json and .md here")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="GemmConfig fields to override in every case, e.g. --set decode=words")
    ap.add_argument("--kernels", default="gemm", choices=("gemm", "quant", "decode_attention", "weight_quant"),
                    help="the GEMMs' main loops, the activation quantizer, or the live-KV decode attention")
    ap.add_argument("--match", default="", help="only the GEMM cases whose name matches this regular expression")
    a = ap.parse_args()
    captured = capture_ttir()
    import jax

    tmp = tempfile.mkdtemp()
    if a.kernels == "quant":
        return quant_main(a, captured, tmp)
    if a.kernels == "weight_quant":
        return quant_main(a, captured, tmp, weight_quant_cases(), "sass_offline_weight_quant")
    if a.kernels == "decode_attention":
        return quant_main(a, captured, tmp, decode_attention_cases(), "sass_offline_decode_attention")
    rows = []
    override = {}
    for kv in a.set:
        f, v = kv.split("=", 1)
        override[f] = int(v) if v.isdigit() else (v == "True" if v in ("True", "False") else v)
    for i, (name, lower, cfg, values) in enumerate(cases(override)):
        if not re.search(a.match, name):
            continue
        jax.clear_caches()
        lower()
        err, regs, stack, sass = compile_ttir(a.triton_python, captured[-1], os.path.join(tmp, f"k{i}.ttir"), cfg.num_warps, cfg.num_stages)
        row = {"kernel": name, "config": dataclasses.asdict(cfg), "values_per_thread_per_iteration": values}
        if err:
            row["error"] = err
        else:
            n, body = main_loop(sass)
            row.update(registers=regs, stack_bytes=stack, loop_instructions=n, instructions_per_value=round(n / values, 2), loop_spill_ops=body["LDL"] + body["STL"],
                       loop_waits={k: body[k] for k in WAITS}, loop_opcodes=dict(body.most_common(12)))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        json.dump(rows, open(os.path.join(a.out, "sass_offline.json"), "w"), indent=1)
        lines = ["| kernel | registers | loop instructions | per weight value | spill ops in loop | " + " / ".join(WAITS) + " in loop | top opcodes |",
                 "|---|---|---|---|---|---|---|"]
        for r in rows:
            top = ", ".join(f"{k} {v}" for k, v in list(r.get("loop_opcodes", {}).items())[:6])
            waits = " / ".join(str(r.get("loop_waits", {}).get(k)) for k in WAITS)
            lines.append(f"| {r['kernel']} | {r.get('registers')} | {r.get('loop_instructions')} | {r.get('instructions_per_value')} | "
                         f"{r.get('loop_spill_ops')} | {waits} | {top} |")
        open(os.path.join(a.out, "sass_offline.md"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
