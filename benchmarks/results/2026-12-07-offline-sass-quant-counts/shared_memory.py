# Registers and shared memory of each kernel a RAC quantizer call launches, compiled offline for
# sm_90. Usage, from the repo root: PYTHONPATH=. JAX_PLATFORMS=cpu python <this> <python with
# triton 3.6> {registries|k4096}  ("registries": tiles the H100 registries timed; "k4096": tiles
# tried at K 4096). Prints: T, K, tiles changed from quant_config's, the config, kernel, (regs, shared bytes).
import sys, tempfile, importlib, dataclasses as dc, subprocess, os, re
sys.path.insert(0, "benchmarks")
import sass_offline as S
captured = S.capture_ttir()
import jax, jax.numpy as jnp
QA = importlib.import_module("pallas_kernels.quantizer")
CASES = {
    "registries": ((64, 4096, {}), (256, 4096, {}), (256, 2048, {}), (256, 2048, dict(chunk=256, num_warps=4)),
                   (256, 2048, dict(num_warps=4)), (64, 1024, {}), (64, 768, dict(num_warps=4)), (64, 768, {}), (512, 768, {})),
    "k4096": ((64, 4096, dict(parts=4)), (64, 4096, dict(num_warps=16)), (64, 4096, dict(chunk=512)), (64, 4096, dict(parts=4, chunk=512)),
              (256, 2048, dict(parts=1, chunk=1024)), (64, 2048, {}), (16, 4096, {}), (64, 4096, dict(count="bits")),
              (64, 4096, dict(select="split"))),
}
tmp = tempfile.mkdtemp()
for t, k, extra in CASES[sys.argv[2]]:
    x = jnp.ones((t, k), jnp.bfloat16)
    cfg = dc.replace(QA.quant_config(t, k), **extra)
    n_sel = QA.rac.num_selected(0.5, k // 16)
    jax.clear_caches(); first = len(captured)
    jax.jit(lambda v: QA._quant_call(v, n_sel=n_sel, cfg=cfg, interpret=False, order=("words", 128), rows=v.shape[0])).trace(x).lower(lowering_platforms=("cuda",))
    for j, ttir in enumerate(captured[first:]):
        p = os.path.join(tmp, f"s{t}_{k}_{j}.ttir"); open(p, "w").write(ttir)
        r = subprocess.run([sys.argv[1], "-c", S.COMPILE, p, str(cfg.num_warps), str(cfg.num_stages)], capture_output=True, text=True)
        m = re.search(r"REG:(\d+).*?SHARED:(\d+)", r.stdout.replace("\n", " "))
        print(t, k, extra, f"parts{cfg.parts} chunk{cfg.chunk} w{cfg.num_warps} {cfg.select}/{cfg.count}", f"[{j+1}]",
              m.groups() if m else r.stdout[-300:] + r.stderr[-300:], flush=True)
