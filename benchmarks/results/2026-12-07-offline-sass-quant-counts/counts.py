import sys, types, tempfile, importlib, dataclasses as dc
sys.path.insert(0, "benchmarks")
import sass_offline as S
captured = S.capture_ttir()
import jax, jax.numpy as jnp
QA = importlib.import_module("pallas_kernels.quantizer")
def cases():
    for t, k in ((256, 2048), (64, 4096), (64, 1024), (512, 768)):
        x = jnp.ones((t, k), jnp.bfloat16)
        base = QA.quant_config(t, k)
        n_sel = QA.rac.num_selected(0.5, k // 16)
        for name, cfg in (("default", base), ("count bits", dc.replace(base, count="bits")), ("rank bits", dc.replace(base, select="rank", count="bits"))):
            fn = lambda cfg=cfg, n_sel=n_sel, x=x: jax.jit(lambda v: QA._quant_call(v, n_sel=n_sel, cfg=cfg, interpret=False, order=("words", 128), rows=v.shape[0])).trace(x).lower(lowering_platforms=("cuda",))
            yield f"T{t} K{k} {name} {cfg.select}/{cfg.count} p{cfg.parts} c{cfg.chunk} w{cfg.num_warps}", fn, cfg
a = types.SimpleNamespace(triton_python=sys.argv[1], out="/tmp/k4096/bits")
S.quant_main(a, captured, tempfile.mkdtemp(), list(cases()), "bits")
