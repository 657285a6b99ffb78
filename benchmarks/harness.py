"""What the benchmarks share: device-side timing, per-kernel breakdowns, the ceilings every
ratio is taken against, and results written as they are measured.

Timing is device-side where it can be: CUPTI kernel time through
``jax.experimental.mosaic.gpu.profiler`` (median over many iterations). Where CUPTI gives
nothing (a CPU, some ops) the timer falls back to the wall clock of many back-to-back
launches and one sync, and says so (``measure.source``). A ratio counts only against a
ceiling measured in the same process: ``ceilings`` gives the copy bandwidth (2 GiB read and
written) and the rate of an 8192^3 BF16 matmul. ``BENCH_MODEL`` is the model every benchmark
runs (0.89B parameters, 0.19B active: 64 experts, top-8, 8 layers).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import numpy as np

BENCH_MODEL = dict(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, n_experts=64,
                   experts_per_token=8, expert_ffn=512, dense_ffn=2048, max_seq_len=2048, compute_dtype="bfloat16")
# Qwen3-30B-A3B's expert shapes (the second grouped-GEMM shape)
QWEN3_30B_A3B = dict(d_model=2048, expert_ffn=768, n_experts=128, experts_per_token=8)


def timer():
    """``measure(f, *args, iterations=50)``: microseconds of one call of ``jax.jit(f)``."""
    import jax
    from jax.experimental.mosaic.gpu import profiler

    def measure(f, *args, iterations=50):
        jf = jax.jit(f)
        jax.block_until_ready(jf(*args))  # compile and warm
        times = []
        if jax.default_backend() == "gpu":
            try:
                _, times = profiler.measure(jf, iterations=iterations)(*args)
                times = [t for t in (times or []) if t is not None]
            except Exception:
                times = []
        measure.source = "cupti" if times else "wall"
        if times:
            return float(np.median(times)) * 1e3
        n = max(iterations, 20)
        t0 = time.perf_counter()
        for _ in range(n):
            r = jf(*args)
        jax.block_until_ready(r)
        return (time.perf_counter() - t0) / n * 1e6

    measure.source = "?"
    return measure


def breakdown(f, *args, iterations=20, hlo_path=None):
    """CUPTI time (us, median over ``iterations``) of each kernel of one call of ``f``, keyed
    "index:name" in launch order. ``hlo_path``: also write the optimized HLO of that very
    executable there (gzip text), whose fusion names are the profile's kernel names."""
    import gzip

    import jax
    from jax.experimental.mosaic.gpu import profiler

    jf = jax.jit(f).lower(*args).compile()
    if hlo_path:
        with gzip.open(hlo_path, "wt") as fh:
            fh.write(jf.as_text())
    jax.block_until_ready(jf(*args))
    _, per_iter = profiler.measure(jf, aggregate=False, iterations=iterations)(*args)
    if not per_iter:
        return {}
    return {f"{i}:{name[:60]}": float(np.median([it[i][1] for it in per_iter])) * 1e3
            for i, (name, _) in enumerate(per_iter[0])}


def top_kernels(per_kernel: dict, top: int, scale: float = 1.0, steps: int = 1) -> dict:
    """Kernel times summed by name (over launches), the ``top`` largest, the rest as "other",
    "total", and "launches"; per one of the ``steps`` the profile covered, times multiplied
    by ``scale`` (a unit)."""
    per: dict = {}
    for key, us in per_kernel.items():
        name = key.split(":", 1)[-1]
        per[name] = per.get(name, 0.0) + us * scale / steps
    ranked = sorted(per.items(), key=lambda kv: -kv[1])
    out = dict(ranked[:top])
    out["other"] = sum(v for _, v in ranked[top:])
    out["total"] = sum(per.values())
    out["launches"] = len(per_kernel) / steps
    return out


def kernel_sources(hlo_text: str, names, roots=("quads_jax/", "rollout/", "pallas_kernels/")) -> dict:
    """Where in the project each profiled kernel comes from: ``names`` (a profile's kernel
    names: an HLO instruction's name or ``deduplicated_name`` with "." as "_") -> "file:line
    function" of the innermost stack frame under one of ``roots``, then " < " the innermost
    one in a different function (which model operation called it), read from the optimized
    HLO's stack-frame tables (``StackFrames`` lists ``parent_frame_id`` as the parent's id + 1,
    0 for none). Names that no instruction carries (Pallas kernels, named by their kernel) are
    left out."""
    import re

    tables: dict = {}
    section = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line, {})
        elif not line.strip():
            section = None
        elif section is not None:
            i, rest = line.split(" ", 1)
            section[int(i)] = rest
    files = {i: v.strip('"') for i, v in tables.get("FileNames", {}).items()}
    funcs = {i: v.strip('"') for i, v in tables.get("FunctionNames", {}).items()}
    field = lambda text, key: int(re.search(rf"{key}=(\d+)", text).group(1))
    locs = {i: (files.get(field(v, "file_name_id"), "?"), field(v, "line"), funcs.get(field(v, "function_name_id"), "?"))
            for i, v in tables.get("FileLocations", {}).items()}
    frames = {i: (field(v, "file_location_id"), field(v, "parent_frame_id") - 1) for i, v in tables.get("StackFrames", {}).items()}

    def chain(frame):
        seen = set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            loc, frame = frames[frame]
            if loc in locs:
                yield locs[loc]

    def describe(frame):
        ours = [(f, ln, fn) for f, ln, fn in chain(frame) if any(r in f for r in roots)]
        if not ours:
            return None
        short = lambda f, ln, fn: f"{f.rsplit('/', 2)[-2]}/{f.rsplit('/', 1)[-1]}:{ln} {fn}"
        out = short(*ours[0])
        caller = next((c for c in ours[1:] if c[2] != ours[0][2]), None)
        return out if caller is None else f"{out} < {short(*caller)}"

    wanted = set(names)
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = [^\n]*?stack_frame_id=(\d+)", hlo_text, re.M):
        line = hlo_text[m.start():hlo_text.find("\n", m.start())]
        dedup = re.search(r'deduplicated_name="([^"]+)"', line)
        for name in {m.group(1).replace(".", "_"), dedup.group(1).replace(".", "_") if dedup else None}:
            if name in wanted and name not in out:
                where = describe(int(m.group(2)))
                if where:
                    out[name] = where
    return out


def ceilings(measure, tiny: bool = False) -> dict:
    """Copy bandwidth (TB/s: read + write of a 2 GiB BF16 array) and the BF16 matmul rate
    (TFLOP/s at 8192^3), measured in this process. ``tiny``: small sizes for a CPU check."""
    import jax
    import jax.numpy as jnp

    rows = 64 if tiny else 1024
    x = jax.random.normal(jax.random.key(0), (rows, 1024 * 1024), jnp.float32).astype(jnp.bfloat16)
    us = measure(lambda a: a * jnp.bfloat16(1.0009765625), x, iterations=20)
    copy = 2 * x.size * 2 / us / 1e6
    del x
    n = 512 if tiny else 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    us_mm = measure(lambda a, b: a @ b, a, b, iterations=20)
    return {"copy_TBps": copy, "bf16_matmul_TFLOPs": 2 * n**3 / us_mm / 1e6, "timer": measure.source}


def rel(a, b) -> float:
    """Relative Frobenius error of ``a`` against ``b`` (FP64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class Results:
    """One run's results: date, device, versions and command, then ``sections`` (each
    section's result) and ``errors``. ``save`` writes ``<name>.json`` and ``<name>.md`` (by
    ``markdown(data)``) into ``out_dir``; ``section`` runs one section, records its result or
    its error (one failing section never hides the others), and saves."""

    def __init__(self, out_dir: str, name: str, markdown):
        import jax

        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.name, self.markdown = out_dir, name, markdown
        d = jax.devices()[0]
        self.data = {"date": datetime.date.today().isoformat(), "device": d.device_kind, "jax": jax.__version__,
                     "command": "python " + " ".join(sys.argv), "sections": {}, "errors": {}}

    @property
    def sections(self) -> dict:
        return self.data["sections"]

    def save(self):
        with open(os.path.join(self.out_dir, f"{self.name}.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        with open(os.path.join(self.out_dir, f"{self.name}.md"), "w") as f:
            f.write(self.markdown(self.data))

    def section(self, name: str, fn, *args, **kwargs):
        t0 = time.time()
        try:
            self.sections[name] = fn(*args, **kwargs)
        except Exception as e:
            self.data["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
        self.save()
        return self.sections.get(name)


def header(data: dict, title: str) -> list[str]:
    """The markdown lines every results file starts with: title, date, device, command, and
    the ceilings when the run measured them."""
    lines = [f"# {title} ({data.get('date')}, {data.get('device')}, jax {data.get('jax')})", "",
             f"Command: `{data.get('command', '')}`", ""]
    c = data["sections"].get("ceilings") or {}
    if c:
        lines += [f"Ceilings measured in this process: copy {c['copy_TBps']:.2f} TB/s, BF16 matmul "
                  f"{c['bf16_matmul_TFLOPs']:.0f} TFLOP/s ({c.get('timer', '?')} timer).", ""]
    return lines


def errors_md(data: dict) -> list[str]:
    return ["## Errors", ""] + [f"- {k}: {v[:300]}" for k, v in data["errors"].items()] if data["errors"] else []
