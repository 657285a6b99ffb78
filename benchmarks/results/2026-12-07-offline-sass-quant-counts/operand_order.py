import sys, types, tempfile, importlib
sys.path.insert(0, "benchmarks")
import sass_offline as S
captured = S.capture_ttir()
import jax, jax.numpy as jnp
QA = importlib.import_module("pallas_kernels.quantizer")
def cases():
    for t in (64, 256):
        x = jnp.ones((t, 4096), jnp.bfloat16)
        cfg = QA.quant_config(t, 4096)
        for rho in (0.0, 0.5):
            n_sel = QA.rac.num_selected(rho, 256)
            for order in (("words", 128), ("words", 256)):
                fn = lambda cfg=cfg, n_sel=n_sel, x=x, order=order: jax.jit(lambda v: QA._quant_call(v, n_sel=n_sel, cfg=cfg, interpret=False, order=order, rows=v.shape[0])).trace(x).lower(lowering_platforms=("cuda",))
                yield f"T{t} rho{rho} order{order[1]} {cfg}", fn, cfg
a = types.SimpleNamespace(triton_python=sys.argv[1], out="/tmp/k4096/out")
S.quant_main(a, captured, tempfile.mkdtemp(), list(cases()), "k4096")
