"""The kernel benchmark: a registry of op x shape x implementation, each entry checked against
its XLA reference, then timed on the device, written as JSON and a markdown table.

    PYTHONPATH=. python benchmarks/bench_kernels.py --out DIR [--regimes quant,dense,grouped,train_grouped,attention,routing]
        [--budget SECONDS] [--tiny]

Regimes (``--regimes``), each a list of ``Case``s built by one function below:

    quant          the activation quantizer (per-token scales, RAC rho 0, 0.5 and 1) at the rollout's
                   T x K: the default tiles against other tiles and selections; bit-exact
    weight_quant   the trainer's QAT weight (FP32 -> BF16 NVFP4 fake quant) at the bench model's
                   expert shapes: the kernel (default and other tiles) against XLA; bit-exact
    dense          the NVFP4 linear (W4A4 + RAC, and W4A4) at decode (T <= 64), mid-batch (the
                   RL rollout's 256) and prefill (4096) sizes: the default plan, the other path
                   (fused kernel / decode once + BF16 dot) and the XLA reference; BF16 and FP8
                   dots as peers
    grouped        the MoE expert GEMM at decode sizes (the bench model's and Qwen3-30B-A3B's
                   experts): ours (W4A4 + RAC, W4A4, W4A16; tokens quantized once, as the model
                   does) against tokamax's BF16, FP8 and int4 kernels and lax.ragged_dot; at
                   the bench model's shapes W4A4 also with other tiles
    train_grouped  the trainer's expert GEMM, forward + backward (dx, dW): tokamax with our
                   tiles and dW kernel against its heuristic tiles, its Triton kernel and XLA;
                   and our dW kernel alone in both program orders
    attention      decode attention over a KV cache (the rollout's): Pallas against XLA
    routing        the MoE's placement of routed assignments in expert order at decode sizes:
                   counted by comparison against XLA's argsort

Every case reports us (CUPTI), its time over its byte limit (bytes it must move over the copy
bandwidth measured in this run) and its fraction of the measured BF16 matmul peak. "kept" marks
the implementation the library runs by default; the table says whether it was the fastest of
its op at each shape. Benchmarks use the public API only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402



@dataclasses.dataclass
class Case:
    regime: str
    shape: str
    op: str          # implementations of one op compute the same numbers; peers are other ops
    impl: str
    fn: Callable
    args: tuple
    ref: Callable | None = None   # the XLA reference, same signature: checked before timing
    exact: bool = False           # bits must equal the reference's, run on the CPU (else relative error < tol)
    tol: float = 5e-3
    truth: Any = None             # FP32 products of the unquantized operands: error reported
    bytes: float = 0.0
    flops: float = 0.0
    kept: bool = False


def _bits_equal(a, b) -> bool:
    import jax
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
                                      for x, y in zip(la, lb))


def _nbytes(*trees) -> float:
    """Bytes the arrays occupy on the device: sub-byte types (int4, E2M1) packed two a byte,
    as XLA stores them (their ``nbytes`` counts one byte an element)."""
    import jax
    import ml_dtypes

    def size(leaf):
        narrow = leaf.dtype in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float4_e2m1fn)
        return leaf.size / 2 if narrow else leaf.nbytes
    return float(sum(size(leaf) for t in trees for leaf in jax.tree.leaves(t)))


def fwd_bwd(fn, n_diff: int):
    """(*args, ct) -> (fn(*args), the gradients of its first ``n_diff`` arguments for the
    cotangent ct): a train step's forward and backward products, with no loss around them
    whose elementwise passes would count as the op's time."""
    import jax

    def f(*args):
        diff, rest, ct = args[:n_diff], args[n_diff:-1], args[-1]
        y, vjp = jax.vjp(lambda *d: fn(*d, *rest), *diff)
        return (y, *vjp(ct))
    return f


# ----------------------------------------------------------------------------- the registry


def quant_cases(tiny: bool):
    """The rollout's activation quantizer (``quantize_operand``: BF16 x -> the GEMMs' FP16 token
    operand in the word decode's channel order, per-token scales, RAC) at the rollout's shapes,
    with other tiles and selections, against the XLA reference's bits."""
    import jax.numpy as jnp

    import pallas_kernels as pk
    rng = np.random.default_rng(3)
    cases = []
    # (256, 14336): rows of 896 blocks (an 8B-class MLP's down projection), past PAIRS_MAX_BLOCKS:
    # the bitwise count only (the all-pairs count grows with the square of the blocks).
    # (64 / 256, 4096): its up projection's 256-block rows, where the all-pairs count measured
    # 15-38x slower than the bitwise one (2026-12-07-h100-bits-count-batches)
    # (64 / 512, 768): Qwen3-30B-A3B's expert down projection, 48 blocks a row (energies pads them
    # to 64); 512 rows: its batch-64 decode step (64 tokens x top-8), where the grouped registry's
    # RAC GEMM took 1.5x the W4A4 one (2026-12-06-h100-rows)
    # (512, 512): the bench model's down projection in a batch-64 decode step (64 tokens x top-8)
    for t, k in ((8, 256),) if tiny else ((64, 4096), (256, 4096), (256, 1024), (256, 2048), (64, 1024), (2048, 512), (512, 512),
                                          (256, 14336), (64, 768), (512, 768)):
        # heavy-tailed channels, as activations are: per-channel magnitudes spread over e^(+-2)
        x = jnp.asarray(rng.standard_normal((t, k)) * np.exp(rng.standard_normal(k)), jnp.bfloat16)
        base = pk.quant_config(t, k)
        order = pk.default_order(k)
        # rho 1 selects every block without ranking: against rho 0.5 it isolates the selection's cost
        for rho in (0.0, 0.5, 1.0):
            ref = lambda v, rho=rho: pk.quantize_operand(v, rac_ratio=rho, order=order, backend="xla")
            shape = f"T{t} K{k} rho{rho}"
            nbytes = t * k * 4  # read BF16, write FP16
            variants = {"default": base}
            pairs = k // 16 <= pk.PAIRS_MAX_BLOCKS
            # the one-launch form for RAC: a program owns its row in 256-channel chunks and
            # ranks its own energies. With whole-row 512- and 1024-channel chunks one program a
            # row measured 7-50x slower, and the in-kernel rank at larger chunks 2-68x slower
            # (2026-12-07-h100-command-buffers): those forms left the registry
            if rho < 1 and pairs and (base.parts > 1 or base.chunk > 256):
                variants["one program a row, chunk 256"] = dataclasses.replace(base, parts=1, chunk=256, num_warps=8, select="rank")
            # other chunks at the default layout (warps as quant_config gives them)
            for c in (256, 512):
                if c != base.chunk and (k // base.parts) % c == 0 and rho < 1:
                    variants[f"chunk {c}"] = dataclasses.replace(base, chunk=c, num_warps=8 if c >= 512 or base.parts == 1 else 4)
            if rho == 0.5 and pairs:  # the other selection and count (longer rows: the bitwise count over the energies only)
                variants.update({f"select {s}": dataclasses.replace(base, select=s) for s in pk.RAC_SELECTS if s != base.select})
                variants.update({f"count {c}": dataclasses.replace(base, count=c) for c in pk.RANK_COUNTS if c != base.count})
            if rho == 0.5 or (rho == 0 and base.chunk <= 256):  # 256-channel chunks: warps mattered 4.8x (T64 K768)
                variants.update({f"{w} warps": dataclasses.replace(base, num_warps=w) for w in (4, 8, 16) if w != base.num_warps})
            for name, c in variants.items():
                fn = lambda v, c=c, rho=rho: pk.quantize_operand(v, rac_ratio=rho, order=order, backend="pallas", config=c)
                cases.append(Case("quant", shape, "operand", f"pallas {name}", fn, (x,), ref=ref, exact=True,
                                  bytes=nbytes, kept=name == "default"))
            cases.append(Case("quant", shape, "operand", "xla", ref, (x,), bytes=nbytes))
    return cases


def dense_cases(tiny: bool):
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from quads_jax import fp8
    from quads_jax.precision import prepare_weight

    rng = np.random.default_rng(1)
    # (t, 1024, 1536): the bench model's fused QKV projection at rollout batches; (t, 4096, 14336):
    # an 8B-class MLP's up projection at decode and mid-batch sizes; (4096, 1024, 2048): prefill
    shapes = [(8, 64, 128)] if tiny else ([(t, 1024, 1536) for t in (64, 256)] + [(t, 4096, 14336) for t in (16, 64, 256)]
                                          + [(4096, 1024, 2048)])
    dot_nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    cases = []
    for t, k, n in shapes:
        wf = jnp.asarray(rng.standard_normal((n, k)) * k**-0.5, jnp.float32)
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
        truth = np.asarray(x, np.float32) @ np.asarray(wf).T
        w4, w8, wb = prepare_weight(wf, "w4a4"), fp8.quantize(wf), wf.astype(jnp.bfloat16)
        io = 2 * t * (k + n)
        plan = pk.gemm_config(t, n, k)
        shape = f"{'decode' if t <= 64 else 'mid' if plan.path == 'fused' else 'prefill'} T{t} K{k} N{n}"
        other = dataclasses.replace(plan, path="dequant" if plan.path == "fused" else "fused")
        common = dict(truth=truth, bytes=_nbytes(w4) + io, flops=2 * t * k * n)
        for op, kw in (("w4a4+rac0.5", dict(rac_ratio=0.5, act_scale="token")), ("w4a4", dict(act_scale="token"))):
            ref = lambda x, w, kw=kw: pk.nvfp4_matmul(x, w, backend="xla", **kw)
            cases += [Case("dense", shape, op, f"pallas {plan.path}", lambda x, w, kw=kw: pk.nvfp4_matmul(x, w, backend="pallas", **kw),
                           (x, w4), ref=ref, kept=True, **common),
                      Case("dense", shape, op, f"pallas {other.path}",
                           lambda x, w, kw=kw: pk.nvfp4_matmul(x, w, backend="pallas", config=other, **kw), (x, w4), ref=ref, **common),
                      Case("dense", shape, op, "xla", ref, (x, w4), **common)]
        # split-K's other depths (the FP32 partials it writes, and XLA's sum of them, are timed
        # too), and at decode sizes 64-wide N tiles (twice the programs, half the decode each)
        if plan.path == "fused" and not tiny:
            ksteps = k // plan.block_k
            variants = [(f"split_k {sk}", dataclasses.replace(plan, split_k=sk))
                        for sk in sorted({1, plan.split_k // 2, plan.split_k * 2} - {0, plan.split_k}) if ksteps % sk == 0]
            if t <= 64 and plan.block_n > 64:
                variants.append(("bn 64", dataclasses.replace(plan, block_n=64)))
            for name, c in variants:
                cases.append(Case("dense", shape, "w4a4+rac0.5", f"pallas fused {name}",
                                  lambda x, w, c=c: pk.nvfp4_matmul(x, w, backend="pallas", config=c, rac_ratio=0.5, act_scale="token"),
                                  (x, w4), ref=lambda x, w: pk.nvfp4_matmul(x, w, backend="xla", rac_ratio=0.5, act_scale="token"),
                                  **common))
        cases += [Case("dense", shape, "bf16", "xla dot", dot_nt, (x, wb), truth=truth, bytes=_nbytes(wb) + io, flops=2 * t * k * n),
                  Case("dense", shape, "fp8", "xla dot", lambda x, w: pk.fp8_matmul(x, w), (x, w8), truth=truth,
                       bytes=_nbytes(w8) + io, flops=2 * t * k * n)]
    return cases


def _routing(rng, tokens, e, k):
    """Sorted rows of uniform top-k routing: (token of each row, group_sizes)."""
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)])
    order = np.argsort(ids.reshape(-1), kind="stable")
    return order // k, np.bincount(ids.reshape(-1), minlength=e).astype(np.int32)


def _int4_qarray(wf):
    """tokamax's int4 weight-only operand: int4 values stored [E, N, K] (its sm90 quantized
    kernel's layout), one BF16 scale per 128 input channels and output channel (absmax / 7)."""
    import jax.numpy as jnp
    import qwix

    e, n, k = wf.shape
    g = 128 if k % 128 == 0 else k
    blocks = wf.reshape(e, n, k // g, g)
    scale = jnp.max(jnp.abs(blocks), axis=3, keepdims=True) / 7.0
    q = jnp.clip(jnp.round(blocks / jnp.maximum(scale, 1e-12)), -8, 7).astype(jnp.int4).reshape(e, n, k)
    return qwix.QArray(qvalue=q, scale=scale[..., 0].astype(jnp.bfloat16), qtype=jnp.int4)


def _tokamax_int4(xs, gs, w):
    import jax
    import jax.numpy as jnp
    import tokamax

    import pallas_kernels as pk
    from pallas_kernels.float_grouped import DIMS, quantized_weight_tiles, tokamax_op

    # tokamax's heuristic misreads the K tile of an [E, N, K] weight: its own choice, given explicitly
    impl = [tokamax_op(pk.GroupedTiles(fwd=quantized_weight_tiles(xs.shape[1], 128)), "fwd")] if jax.default_backend() == "gpu" else "xla"
    return tokamax.ragged_dot_general(xs, w, gs, DIMS, preferred_element_type=jnp.bfloat16, implementation=impl)


def grouped_cases(tiny: bool):
    import jax.numpy as jnp

    import pallas_kernels as pk
    from quads_jax import precision as P

    b, q = H.BENCH_MODEL, H.QWEN3_30B_A3B
    shapes = {"bench gate_up": (b["n_experts"], b["d_model"], 2 * b["expert_ffn"], b["experts_per_token"]),
              "bench down": (b["n_experts"], b["expert_ffn"], b["d_model"], b["experts_per_token"]),
              "qwen3-30b-a3b gate": (q["n_experts"], q["d_model"], q["expert_ffn"], 8),
              "qwen3-30b-a3b down": (q["n_experts"], q["expert_ffn"], q["d_model"], 8)}
    if tiny:
        shapes = {"tiny": (4, 64, 64, 2)}
    rng = np.random.default_rng(0)
    cases = []
    for name, (e, k, n, topk) in shapes.items():
        wf = jnp.asarray(rng.standard_normal((e, n, k)) * k**-0.5, jnp.float32)
        w4, w8 = P.prepare_weight(wf, "w4a4"), P.prepare_weight(wf, "fp8")
        wbf, wi4 = pk.ExpertsKN.from_enk(wf, jnp.bfloat16), _int4_qarray(wf)
        for t in (8,) if tiny else (64, 256) if name.startswith("bench") else (64,):
            tok, gs_np = _routing(rng, t, e, topk)
            x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
            rows, gs = jnp.asarray(tok, jnp.int32), jnp.asarray(gs_np)
            xs = x[rows]
            truth = np.einsum("mk,mnk->mn", np.asarray(xs, np.float32), np.asarray(wf)[np.repeat(np.arange(e), gs_np)])
            shape = f"{name} T{t} ({e}x{k}->{n}, top-{topk})"
            io = 2 * t * k + 2 * t * topk * n

            def ours(rho, mode="w4a4", backend="pallas", config=None):
                def f(x, rows, gs, w):
                    xin = x if mode == "w4a16" else pk.quantize_rows(x, rac_ratio=rho, backend=backend)
                    return pk.nvfp4_grouped_matmul(P.take_rows(xin, rows), w, gs, rac_ratio=rho, act_scale="token", mode=mode,
                                                   backend=backend, config=config)
                return f

            common = dict(truth=truth, flops=2 * t * topk * k * n)
            # other tiles of the W4A4 kernel (the default: gemm_config's at T x top-k / E rows an
            # expert): 64-wide N tiles re-read the FP16 token rows twice as often, M tiles of the
            # mean rows read an expert's weight tile twice where its rows exceed the mean
            base = pk.gemm_config(-(-t * topk // e), n, k, programs_per_row_tile=e)
            # K tiles of 256 (half the loop steps, twice the bytes a load): whether the
            # decode-size items are latency-bound. At the rollout's batch 64 only; 64-wide N
            # tiles and split K, slower at every shape (2026-12-07-h100-tail), left the registry
            tiles = {} if tiny or not name.startswith("bench") or t != 64 else {
                f"bm{bm} bn{bn} bk{bk} w{w} s{st}": dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
                for bm, bn, bk, w, st in ((max(16, base.block_m // 2), 128, base.block_k, 4, 4), (base.block_m, 128, base.block_k, 4, 4),
                                          (base.block_m, 256, base.block_k, 8, 3), (base.block_m, 128, base.block_k, 4, 2),
                                          (base.block_m, 128, base.block_k, 8, 4), (base.block_m, 128, 256, 4, 3))}
            tiles = {k: c for k, c in tiles.items() if c != base}
            for op, rho, mode in (("w4a4+rac0.5", 0.5, "w4a4"), ("w4a4", 0.0, "w4a4"), ("w4a16", 0.0, "w4a16")):
                ref = ours(rho, mode, "xla")
                cases += [Case("grouped", shape, op, "pallas", ours(rho, mode), (x, rows, gs, w4), ref=ref, kept=True,
                               bytes=_nbytes(w4) + io, **common),
                          Case("grouped", shape, op, "xla", ref, (x, rows, gs, w4), bytes=_nbytes(w4) + io, **common)]
                cases += [Case("grouped", shape, op, f"pallas {name}", ours(rho, mode, config=c), (x, rows, gs, w4), ref=ref,
                               bytes=_nbytes(w4) + io, **common) for name, c in tiles.items() if op == "w4a4"]
            cases += [
                Case("grouped", shape, "bf16", "tokamax", lambda xs, gs, w: pk.grouped_dot_kn(xs, w, gs, impl="tokamax"),
                     (xs, gs, wbf), bytes=_nbytes(wbf) + io, **common),
                Case("grouped", shape, "bf16", "xla ragged_dot", lambda xs, gs, w: pk.grouped_dot_kn(xs, w, gs, impl="xla"),
                     (xs, gs, wbf), bytes=_nbytes(wbf) + io, **common),
                Case("grouped", shape, "fp8 w8a8", "tokamax", lambda xs, gs, w: pk.fp8_grouped_matmul(xs, w, gs, grouped="tokamax"),
                     (xs, gs, w8), bytes=_nbytes(w8) + io, **common),
                Case("grouped", shape, "int4 w4a16", "tokamax", _tokamax_int4, (xs, gs, wi4), bytes=_nbytes(wi4) + io, **common)]
            # the baselines' other tiles (the engine's bf16 and fp8 MoE take the defaults above):
            # a careful engineer tunes them too; at the rollout's batch 64 only
            if not tiny and name.startswith("bench") and t == 64:
                tile = lambda bm, bn, bk, st, pe: pk.Tiles(block_m=bm, block_n=bn, block_k=bk, num_stages=st, persistent=pe)
                label = lambda c: f"tokamax bn{c.block_n} bk{c.block_k} s{c.num_stages}{' persistent' if c.persistent else ''}"
                for c in (tile(64, 128, 64, 4, False), tile(64, 64, 128, 4, True), tile(64, 128, 128, 3, True)):
                    cases.append(Case("grouped", shape, "bf16", label(c), lambda xs, gs, w, c=c: pk.grouped_dot_kn(xs, w, gs, impl="tokamax", tiles=c),
                                      (xs, gs, wbf), bytes=_nbytes(wbf) + io, **common))
                for c in (tile(64, 128, 256, 2, True), tile(64, 64, 256, 4, True), tile(64, 64, 128, 2, True)):
                    cases.append(Case("grouped", shape, "fp8 w8a8", label(c),
                                      lambda xs, gs, w, c=c: pk.fp8_grouped_matmul(xs, w, gs, grouped="tokamax", tiles=c),
                                      (xs, gs, w8), bytes=_nbytes(w8) + io, **common))
    return cases


def _chunked_xla_grouped_dot(x, w, group_sizes, chunk: int):
    """``grouped_dot(impl="xla")`` over rows [i, i + chunk) at a time, each with the group sizes
    of its rows (host-side: the registry's group sizes are concrete), concatenated: the same
    products, with XLA's dense expansion bounded by the chunk instead of all the rows."""
    import jax.numpy as jnp

    import pallas_kernels as pk
    ends = np.cumsum(np.asarray(group_sizes))
    starts = ends - np.asarray(group_sizes)
    parts = []
    for a in range(0, x.shape[0], chunk):
        b = min(a + chunk, x.shape[0])
        gs = np.clip(np.minimum(ends, b) - np.maximum(starts, a), 0, None).astype(np.int32)
        parts.append(pk.grouped_dot(x[a:b], w, jnp.asarray(gs), impl="xla"))
    return jnp.concatenate(parts)


def train_grouped_cases(tiny: bool):
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk

    m = H.BENCH_MODEL
    e, d, f, topk = (8, 64, 32, 2) if tiny else (m["n_experts"], m["d_model"], m["expert_ffn"], m["experts_per_token"])
    rng = np.random.default_rng(0)
    cases = []
    for tokens in (64,) if tiny else (8192, 32768):
        m = tokens * topk
        gs = jnp.asarray(rng.multinomial(m, rng.dirichlet(np.full(e, 2.0))), jnp.int32)
        for name, (k, n) in {"gate_up": (d, 2 * f), "down": (f, d)}.items():
            x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16)
            w = (jax.random.normal(jax.random.key(4), (e, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)

            # the three products a train step runs, y = x W^T, dx = ct W, dW = ct^T x (per expert)
            grad = lambda dot: fwd_bwd(dot, 2)

            impls = {"tokamax (default tiles)": lambda x, w: pk.grouped_dot(x, w, gs, impl="tokamax"),
                     "tokamax (its heuristic tiles)": lambda x, w: pk.grouped_dot(x, w, gs, impl="tokamax", tiles=pk.GroupedTiles()),
                     "tokamax triton": lambda x, w: __import__("tokamax").ragged_dot(
                         x, jnp.swapaxes(w, 1, 2), gs, preferred_element_type=x.dtype, implementation="triton")}
            # XLA's ragged_dot expands densely over the experts: its memory grows with rows x experts
            # (at 65536 rows one call asked for 40 GiB), so the reference runs in 8192-row chunks
            ref = grad(lambda x, w: _chunked_xla_grouped_dot(x, w, gs, 8192)) if m <= 65536 or tiny else None
            shape = f"{name} M{m} ({e}x{k}->{n})"
            common = dict(bytes=float(3 * (m * k + m * n) * 2 + 3 * e * k * n * 2), flops=6.0 * m * k * n, tol=1e-2)
            dy = jax.random.normal(jax.random.key(5), (m, n), jnp.bfloat16)
            for impl, dot in impls.items():
                cases.append(Case("train_grouped", shape, "fwd+bwd", impl, grad(dot), (x, w, dy), ref=ref,
                                  kept=impl.startswith("tokamax (default"), **common))
            if ref is not None:
                cases.append(Case("train_grouped", shape, "fwd+bwd", "xla (8192-row chunks)", ref, (x, w, dy), **common))
            # the dW product alone (x_e.T @ dy_e, our kernel): its programs' launch order
            dw_tiles = pk.DwTiles(block_k=16, block_n=16, block_r=16) if tiny else pk.KernelConfig().grouped_tiles.dw
            dw_ref = (lambda x, dy: pk.grouped_dw_xla(x, dy, gs)) if m <= 65536 or tiny else None
            dw_common = dict(bytes=float((m * k + m * n + e * k * n) * 2), flops=2.0 * m * k * n, tol=1e-2)
            for outer in (True, False):
                c = dataclasses.replace(dw_tiles, expert_outer=outer)
                cases.append(Case("train_grouped", shape, "dw", f"pallas ({'expert outermost' if outer else 'expert fastest'})",
                                  lambda x, dy, c=c: pk.grouped_dw(x, dy, gs, config=c), (x, dy), ref=dw_ref,
                                  kept=outer == dw_tiles.expert_outer, **dw_common))
    return cases


def attention_cases(tiny: bool):
    import jax.numpy as jnp

    import pallas_kernels as pk

    m = H.BENCH_MODEL
    h, hkv, dh = (4, 2, 16) if tiny else (m["n_heads"], m["n_kv_heads"], m["head_dim"])
    rng = np.random.default_rng(2)
    cases = []
    for b, s in ((4, 64),) if tiny else ((64, 576), (256, 576)):
        q = jnp.asarray(rng.standard_normal((b, h, dh)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((b, s, hkv, dh)), jnp.bfloat16) for _ in range(2))
        lengths = jnp.asarray(rng.integers(s // 4, s, b), jnp.int32)
        live = float(np.asarray(lengths).sum())
        common = dict(bytes=2 * live * hkv * dh * 2, flops=4 * live * h * dh, tol=1e-2)
        ref = lambda q, k, v, n: pk.decode_attention(q, k, v, n, impl="xla")
        shape = f"B{b} cache {s} ({h} heads / {hkv} kv, d {dh})"
        # the default config, then other key blocks, pipeline depths, warps and splits
        variants = {"default": pk.DecodeAttentionConfig()}
        for f, vals in (("block_k", (32, 128)), ("num_stages", (3,)), ("num_warps", (2, 8)), ("splits", (1, 2, 3, 4, 8))):
            variants.update({f"{f} {x}": dataclasses.replace(variants["default"], **{f: x}) for x in vals})
        for name, c in variants.items():
            cases.append(Case("attention", shape, "decode attention", f"pallas {name}",
                              lambda q, k, v, n, c=c: pk.decode_attention(q, k, v, n, config=c), (q, k, v, lengths), ref=ref,
                              kept=name == "default", **common))
        cases.append(Case("attention", shape, "decode attention", "xla", ref, (q, k, v, lengths), **common))
    # training attention (no cache): forward and both backward products for a given cotangent,
    # at the trainer bench's rows of 4096 tokens; the XLA reference only where its [B, H, T, T]
    # FP32 scores fit
    for b, t in ((2, 64),) if tiny else ((2, 4096), (8, 4096)):
        q = jnp.asarray(rng.standard_normal((b, t, h, dh)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((b, t, hkv, dh)), jnp.bfloat16) for _ in range(2))
        lengths = jnp.full((b,), t, jnp.int32)  # whole rows: outputs at padded positions are unspecified
        ct = jnp.asarray(rng.standard_normal((b, t, h, dh)), jnp.bfloat16)

        grad = lambda impl: fwd_bwd(lambda q, k, v, n: pk.causal_attention(q, k, v, n, impl=impl), 3)

        pairs = b * t * (t + 1) / 2  # causal (query, key) pairs
        # fwd 2 matmuls, bwd 5 (the recomputed scores among them): 7 x 2 x pairs x heads x d
        common = dict(bytes=float(2 * (2 * q.size + 2 * k.size + 2 * v.size)), flops=14.0 * pairs * h * dh, tol=2e-2)
        shape = f"train B{b} T{t} ({h} heads / {hkv} kv, d {dh})"
        ref = grad("xla") if tiny or b * h * t * t * 4 <= 2**32 else None
        for impl in ("cudnn", "tokamax"):
            cases.append(Case("attention", shape, "fwd+bwd", impl, grad(impl), (q, k, v, lengths, ct), ref=ref,
                              kept=impl == "cudnn", **common))
        if ref is not None:
            cases.append(Case("attention", shape, "fwd+bwd", "xla", ref, (q, k, v, lengths, ct), **common))
    return cases


def weight_quant_cases(tiny: bool):
    """The trainer's QAT weight (``nvfp4_w``: FP32 master weights -> their BF16 NVFP4 fake
    quantization, every step): the kernel against ``nvfp4.fake_quant`` in XLA, bits checked.
    Bytes: read FP32 twice (the global amax, the kernel), write BF16."""
    import jax.numpy as jnp

    import pallas_kernels as pk
    rng = np.random.default_rng(4)
    cases = []
    for shape in [(2, 32, 64)] if tiny else [(64, 1024, 1024), (64, 2048, 1024), (2048, 1024)]:
        w = jnp.asarray(rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[-1])), jnp.float32)
        ref = lambda v: pk.weight_fake_quant(v, dtype=jnp.bfloat16, backend="xla")
        common = dict(ref=ref, exact=True, bytes=w.size * 10.0)
        name = "x".join(map(str, shape))
        cases += [Case("weight_quant", name, "fake quant", "pallas",
                       lambda v: pk.weight_fake_quant(v, dtype=jnp.bfloat16, backend="pallas"), (w,), kept=True, **common),
                  Case("weight_quant", name, "fake quant", "xla", ref, (w,), **common),
                  Case("weight_quant", name, "cast (the bf16 policy's)", "xla", lambda v: v.astype(jnp.bfloat16), (w,),
                       bytes=w.size * 6.0)]
        for br, bk, nw in () if tiny else ((16, 512, 8), (4, 1024, 4), (8, 512, 4), (8, 128, 4)):
            cfg = pk.FakeQuantConfig(block_rows=br, block_k=bk, num_warps=nw)
            cases.append(Case("weight_quant", name, "fake quant", f"pallas {br}x{bk} w{nw}",
                              lambda v, cfg=cfg: pk.weight_fake_quant(v, dtype=jnp.bfloat16, backend="pallas", config=cfg),
                              (w,), **common))
    return cases


def routing_cases(tiny: bool):
    """The MoE dispatch at decode sizes: the placement of the (token, slot) assignments in
    expert order, counted by comparison (the default up to RANK_BY_COMPARISON_MAX) against
    XLA's stable argsort."""
    import jax.numpy as jnp

    from quads_jax.model import routing as RT

    rng = np.random.default_rng(5)
    cases = []
    for m in (64,) if tiny else (512, 2048, 4096):
        flat = jnp.asarray(rng.integers(0, 64, m), jnp.int32)
        ref = lambda f: RT.expert_positions(f, max_compare=0)
        common = dict(ref=ref, exact=True, bytes=m * 12.0)
        cases += [Case("routing", f"M{m} (64 experts)", "expert positions", "by comparison", RT.expert_positions, (flat,),
                       kept=m <= RT.RANK_BY_COMPARISON_MAX, **common),
                  Case("routing", f"M{m} (64 experts)", "expert positions", "argsort", ref, (flat,),
                       kept=m > RT.RANK_BY_COMPARISON_MAX, **common)]
    return cases


REGIMES = {"quant": quant_cases, "weight_quant": weight_quant_cases, "dense": dense_cases, "grouped": grouped_cases, "train_grouped": train_grouped_cases,
           "attention": attention_cases, "routing": routing_cases}


# ----------------------------------------------------------------------------- the runner


def run_case(c: Case, measure, ceil: dict, refs: dict) -> dict:
    import jax

    row: dict = {"shape": c.shape, "op": c.op, "impl": c.impl, "kept": c.kept}
    try:
        y = jax.jit(c.fn)(*c.args)
        if c.ref is not None:
            key = (c.shape, id(c.ref))
            if key not in refs and c.exact:
                # the format's bits: the XLA reference run on the CPU. Jitted for the GPU it
                # departs from them in rare blocks (one E4M3 scale step; tests/test_gpu.py), where
                # the Pallas kernels agree with the CPU
                cpu = jax.devices("cpu")[0]
                with jax.default_device(cpu):
                    refs[key] = jax.device_get(jax.jit(c.ref)(*jax.device_put(c.args, cpu)))
            elif key not in refs:
                refs[key] = jax.block_until_ready(jax.jit(c.ref)(*c.args))
            if c.exact:
                row["check"] = "bit-exact" if _bits_equal(y, refs[key]) else "BITS DIFFER"
            else:
                err = max(H.rel(a, b) for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(refs[key])))
                row["rel_vs_ref"] = err
                row["check"] = f"{err:.1e}" + ("" if err < c.tol else " FAILS")
        if c.truth is not None:
            row["rel_vs_fp32"] = H.rel(jax.tree.leaves(y)[0], c.truth)
        del y
        us = measure(c.fn, *c.args)
        row.update(us=us, timer=measure.source)
        if c.bytes and ceil.get("copy_TBps"):
            row["x_byte_limit"] = us / (c.bytes / ceil["copy_TBps"] / 1e6)
        if c.flops and ceil.get("bf16_matmul_TFLOPs"):
            row["frac_of_peak"] = c.flops / us / 1e6 / ceil["bf16_matmul_TFLOPs"]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    return row


def precompile(cases: list[Case], workers: int, deadline: float) -> None:
    """Compile the cases (and, for the bit checks, their CPU references) on ``workers``
    threads before any is timed: jit's caches keep the executables, so the serial runs that
    follow skip those compiles, and no compile runs while CUPTI times a case. A GPU program
    with an XLA dot is left to compile alone in its run: XLA times candidate GEMM kernels on
    the GPU while it compiles, and concurrent compiles would skew the baselines' choices.
    Cases not started by ``deadline`` compile in their run; a failing compile is left for its
    run to report."""
    import concurrent.futures as cf

    import jax

    cpu = jax.devices("cpu")[0]
    # one job a function: the cases of a shape share their reference (run_case's key)
    jobs = {}
    for c in cases:
        jobs.setdefault((c.shape, id(c.fn)), (c.fn, False, c.args))
        if c.ref is not None:
            jobs.setdefault((c.shape, id(c.ref)), (c.ref, c.exact, c.args))

    def one(job):
        fn, on_cpu, args = job
        if time.time() > deadline:
            return
        try:  # under the device context run_case uses: it is part of jit's cache key
            with jax.default_device(cpu if on_cpu else None):
                lowered = jax.jit(fn).lower(*(jax.device_put(args, cpu) if on_cpu else args))
                if on_cpu or not re.search(r"stablehlo\.(dot_general|ragged_dot)|chlo\.ragged_dot", lowered.as_text()):
                    lowered.compile()
        except Exception:
            pass

    with cf.ThreadPoolExecutor(max(1, workers)) as pool:
        list(pool.map(one, jobs.values()))


def mark_fastest(rows: list[dict]) -> None:
    """For each kept row: whether it was the fastest implementation of its op at its shape."""
    for r in rows:
        if r.get("kept") and "us" in r:
            rivals = [o for o in rows if o["shape"] == r["shape"] and o["op"] == r["op"] and "us" in o]
            best = min(rivals, key=lambda o: o["us"])
            r["fastest"] = best is r or best["us"] >= r["us"]
            if not r["fastest"]:
                r["faster"] = f"{best['impl']} {best['us']:.1f} us"


def markdown(data: dict) -> str:
    lines = H.header(data, "Kernel benchmark")
    lines += ["x limit: time over the bytes the op must move at the measured copy bandwidth; peak: FLOPs over the measured "
              "BF16 matmul rate; check: against the XLA reference (bit checks: run on the CPU); fp32: error against FP32 products of the unquantized "
              "operands; **bold**: the implementation the library runs by default.", ""]
    for regime, rows in data["sections"].items():
        if regime == "ceilings" or not isinstance(rows, list):
            continue
        kept = [r for r in rows if r.get("kept") and "fastest" in r]
        lines += [f"## {regime}", "", f"Default implementation fastest of its op at {sum(r['fastest'] for r in kept)} of "
                  f"{len(kept)} shapes measured." if kept else "", "",
                  "| shape | op | implementation | us | x limit | peak | check | fp32 | note |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            impl = f"**{r['impl']}**" if r.get("kept") else r["impl"]
            if "error" in r:
                lines.append(f"| {r['shape']} | {r['op']} | {impl} | fails: {r['error'][:120]} | | | | | |")
                continue
            f = lambda key, fmt: format(r[key], fmt) if r.get(key) is not None else "-"
            note = "" if r.get("fastest", True) else f"slower than {r['faster']}"
            lines.append(f"| {r['shape']} | {r['op']} | {impl} | {r['us']:.1f}{'' if r.get('timer') == 'cupti' else ' (wall)'} | "
                         f"{f('x_byte_limit', '.1f')} | {'-' if r.get('frac_of_peak') is None else f'{100 * r['frac_of_peak']:.0f}%'} | "
                         f"{r.get('check', '-')} | {f('rel_vs_fp32', '.1e')} | {note} |")
        lines.append("")
    return "\n".join(lines + H.errors_md(data)) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/kernels"))
    ap.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated, among {','.join(REGIMES)}")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: no case starts after this")
    ap.add_argument("--tiny", action="store_true", help="small sizes: checks the harness on a CPU")
    ap.add_argument("--match", default="", help="a regular expression: only cases whose 'shape | op | implementation' it finds run")
    ap.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="threads compiling a regime's cases before they are timed (1: compile each in its run)")
    a = ap.parse_args()
    unknown = set(a.regimes.split(",")) - set(REGIMES)
    if unknown:
        ap.error(f"--regimes: unknown {sorted(unknown)}; expected some of {list(REGIMES)}")
    t_end = time.time() + a.budget
    res = H.Results(a.out, "kernels", markdown)
    measure = H.timer()
    ceil = res.section("ceilings", H.ceilings, measure, a.tiny) or {}
    for regime in a.regimes.split(","):
        rows = res.sections.setdefault(regime, [])
        try:
            cases = REGIMES[regime](a.tiny)
        except Exception as e:
            res.data["errors"][regime] = f"{type(e).__name__}: {e}"[:600]
            continue
        refs: dict = {}
        cases = [c for c in cases if re.search(a.match, f"{c.shape} | {c.op} | {c.impl}")]
        if a.compile_workers > 1:
            t0 = time.time()
            precompile(cases, a.compile_workers, t_end)
            print(f"[{regime}] {len(cases)} cases compiled on {a.compile_workers} threads in {time.time() - t0:.0f}s", flush=True)
        for c in cases:
            if time.time() > t_end:
                rows.append({"shape": c.shape, "op": c.op, "impl": c.impl, "error": "skipped: time budget"})
                continue
            rows.append(run_case(c, measure, ceil, refs))
            print(regime, rows[-1], flush=True)
            mark_fastest(rows)
            res.save()
        del cases, refs
    print(markdown(res.data))


if __name__ == "__main__":
    main()
