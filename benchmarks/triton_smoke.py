"""Minimal GPU check of the SGLang plugin's Triton GEMM: torch launch vs the torch
reference, jax-triton launch vs the Pallas kernel, on one decode shape (prints JSON)."""

import json
import os
import traceback

os.environ.setdefault("TRITON_HOME", "/tmp/triton_home")
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/triton_cache")
os.makedirs(os.environ["TRITON_CACHE_DIR"], exist_ok=True)

import numpy as np  # noqa: E402

out = {"env": {k: os.environ.get(k) for k in ("TRITON_HOME", "TRITON_CACHE_DIR", "HOME")}}
try:
    import torch

    from rollout.sglang_plugin import numerics as N
    from rollout.sglang_plugin import triton_gemm as TG

    torch.manual_seed(0)
    t, n, k = 16, 768, 2048
    x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    wf = torch.randn(n, k, device="cuda")
    gw = N.global_scale(wf.reshape(1, -1)).reshape(())
    q, s = N.quantize(wf, gw.reshape(1, 1).expand(n, 1))
    wc, ws = N.pack(q, s)
    for rho in (0.0, 0.5):
        ref = N.quads_linear(x, wc, ws.view(torch.float8_e4m3fn), gw, rac_ratio=rho, out_dtype=torch.float32)
        got = TG.quads_linear_triton(x, wc, ws.view(torch.float8_e4m3fn), gw, rac_ratio=rho, out_dtype=torch.float32)
        out[f"torch_triton_rho{rho}_rel_vs_torch_ref"] = float((got - ref).norm() / ref.norm())
except Exception:
    out["torch_error"] = traceback.format_exc()[-1500:]
print(json.dumps(out), flush=True)
try:
    import jax.numpy as jnp

    from quads_jax import nvfp4 as F
    from pallas_kernels import nvfp4_matmul, quantize_activations_rac
    from rollout.sglang_plugin.jax_launch import triton_nvfp4_matmul

    rng = np.random.default_rng(0)
    w = F.quantize(jnp.asarray(rng.standard_normal((768, 2048)).astype(np.float32)))
    xj = jnp.asarray(rng.standard_normal((16, 2048)).astype(np.float32)).astype(jnp.bfloat16)
    for rho in (0.0, 0.5):
        xq, rq = quantize_activations_rac(xj, rac_ratio=rho, act_scale="token", backend="pallas")
        a = np.asarray(triton_nvfp4_matmul(xq, rq, w, out_dtype=jnp.float32))
        b = np.asarray(nvfp4_matmul(xj, w, rac_ratio=rho, act_scale="token", backend="pallas", out_dtype=jnp.float32))
        out[f"jax_triton_rho{rho}_rel_vs_pallas"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
except Exception:
    out["jax_error"] = traceback.format_exc()[-1500:]
print(json.dumps(out), flush=True)
try:  # a torch launch after jax-triton's import (which blanks TRITON_CACHE_DIR unless undone)
    got = TG.quads_linear_triton(x, wc, ws.view(torch.float8_e4m3fn), gw, rac_ratio=0.25, out_dtype=torch.float32)
    ref = N.quads_linear(x, wc, ws.view(torch.float8_e4m3fn), gw, rac_ratio=0.25, out_dtype=torch.float32)
    out["torch_after_jax_triton_rho0.25_rel_vs_torch_ref"] = float((got - ref).norm() / ref.norm())
except Exception:
    out["torch_after_jax_triton_error"] = traceback.format_exc()[-1500:]
print(json.dumps(out, indent=1))
