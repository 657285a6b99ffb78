"""One-off: offline sm_90 SASS of the activation quantizer's RAC selections at the rollout's
batch-64 / batch-16 shapes, every kernel a call launches (the energy pass too). Run from the
repo root: PYTHONPATH=. JAX_PLATFORMS=cpu python <this file> > quant_selects.jsonl"""
import collections
import dataclasses
import json
import re
import sys
import tempfile

sys.path.insert(0, "benchmarks")
import sass_offline as S  # noqa: E402

captured = S.capture_ttir()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import quantizer as QA, rac  # noqa: E402

tmp = tempfile.mkdtemp()
for t, k in ((64, 1024), (512, 512), (16, 1024)):
    x = jnp.ones((t, k), jnp.bfloat16)
    for sel in ("energies", "fused", "rank"):
        cfg = dataclasses.replace(QA.quant_config(t, k), select=sel)
        n = len(captured)
        jax.clear_caches()
        jax.jit(lambda v: QA._quant_call(v, n_sel=rac.num_selected(0.5, k // 16), cfg=cfg, interpret=False, order=("words", 128),
                                         rows=t)).trace(x).lower(lowering_platforms=("cuda",))
        for j, ttir in enumerate(captured[n:]):
            err, regs, _, sass = S.compile_ttir(sys.executable, ttir, f"{tmp}/q{t}_{k}_{sel}_{j}.ttir", cfg.num_warps, 1)
            ops = collections.Counter(m.group(2).split(".")[0] for m in
                                      re.finditer(r"/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
            print(json.dumps(dict(shape=f"T{t} K{k}", select=sel, kernel=j, parts=cfg.parts, warps=cfg.num_warps, error=err,
                                  registers=regs, instructions=sum(ops.values()),
                                  **{o: ops[o] for o in ("BAR", "SHFL", "LDG", "STG", "STS", "LDS", "LDL", "STL")})), flush=True)
