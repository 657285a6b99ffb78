"""The SGLang method's torch numerics equal the JAX reference on the same weights (CPU)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is needed for the SGLang plugin's numerics")

from quads_jax import nvfp4 as F
from quads_jax import precision as P
from pallas_kernels import nvfp4_grouped_matmul, nvfp4_matmul
from rollout import sglang_plugin
from rollout.sglang_plugin import launcher
from rollout.sglang_plugin import numerics as N


def _modelopt_torch(t: F.NVFP4Tensor):
    m = F.to_modelopt(t)
    w = torch.from_numpy(np.array(m["weight"]))
    s = torch.from_numpy(np.array(m["weight_scale"]).view(np.uint8)).view(torch.float8_e4m3fn)
    return w, s, float(np.asarray(m["weight_scale_2"]).reshape(()))


def _act(rng, t, k):
    x = (rng.standard_normal((t, k)) * np.exp(rng.standard_normal((t, 1)))).astype(np.float32)
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    return xb, torch.from_numpy(np.array(xb.astype(jnp.float32))).to(torch.bfloat16)


@pytest.mark.parametrize("rho", [0.0, 0.125, 0.5, 1.0])
def test_torch_linear_equals_jax_reference_bitwise(rho):
    rng = np.random.default_rng(int(rho * 8) + 1)
    xb, xt = _act(rng, 37, 256)
    wq = P.quantize_weight(jnp.asarray(rng.standard_normal((96, 256)).astype(np.float32)))
    want = np.asarray(nvfp4_matmul(xb, wq, rac_ratio=rho, rac_sum="exact", act_scale="token", backend="xla", out_dtype=jnp.float32))
    got = N.quads_linear(xt, *_modelopt_torch(wq), rac_ratio=rho, out_dtype=torch.float32).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())  # accumulation order only
    w4a16 = np.asarray(nvfp4_matmul(xb, wq, mode="w4a16", backend="xla", out_dtype=jnp.float32))
    got16 = N.quads_linear(xt, *_modelopt_torch(wq), mode="w4a16", out_dtype=torch.float32).numpy()
    np.testing.assert_allclose(got16, w4a16, rtol=1e-6, atol=1e-6 * np.abs(w4a16).max())


def test_torch_activation_codes_equal_jax_quantizer():
    from pallas_kernels import quantize_activations_rac

    rng = np.random.default_rng(5)
    xb, xt = _act(rng, 64, 512)
    xq, rq = quantize_activations_rac(xb, rac_ratio=0.5, act_scale="token")
    (xv, gx), (rv, gr) = N.rac_operands(xt, 0.5)
    np.testing.assert_array_equal(xv.numpy(), np.asarray(F.block_values(xq)))
    np.testing.assert_array_equal(rv.numpy(), np.asarray(F.block_values(rq)))
    np.testing.assert_array_equal(gx.numpy().view(np.uint32), np.asarray(xq.global_scale).view(np.uint32))
    np.testing.assert_array_equal(gr.numpy().view(np.uint32), np.asarray(rq.global_scale).view(np.uint32))
    # ties: E2M1 rounding in torch equals the format's table
    a = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert N.round_e2m1(a).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.slow  # 15-25 s on 2 cores; the default suite stays near 15 minutes
def test_torch_grouped_and_moe_equal_jax_with_empty_experts():
    from quads_jax.model.moe import moe_ffn

    rng = np.random.default_rng(7)
    e, d, f, t, k = 6, 128, 64, 21, 2
    ids = np.stack([rng.choice([0, 2, 3, 5], 2, replace=False) for _ in range(t)]).astype(np.int32)  # experts 1, 4 empty
    wts = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    xb, xt = _act(rng, t, d)
    mk = lambda *s: P.quantize_weight(jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.1))
    wg, wu, wd = mk(e, f, d), mk(e, f, d), mk(e, d, f)
    per_expert = lambda w: [_modelopt_torch(F.NVFP4Tensor(codes=w.codes[i], scales=w.scales[i],
                                                          global_scale=jnp.asarray(w.global_scale)[i].reshape(()),
                                                          shape=w.shape[1:], axis=1)) for i in range(e)]
    prec = P.rollout_recipe("quads", rac_sum="exact")  # the plugin sums the RAC products in FP32
    want = np.asarray(moe_ffn(xb, jnp.asarray(ids), jnp.asarray(wts), wg, wu, wd, prec, jnp.bfloat16), np.float32)
    got = N.quads_moe(xt, torch.from_numpy(ids).long(), torch.from_numpy(wts), per_expert(wg), per_expert(wu), per_expert(wd),
                      rac_ratio=prec.rac_ratio).float().numpy()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())  # BF16 intermediates
    assert np.mean(got == want) > 0.95
    sizes = np.bincount(ids.reshape(-1), minlength=e).astype(np.int32)
    xs, xst = _act(rng, int(sizes.sum()), d)
    g = np.asarray(nvfp4_grouped_matmul(xs, wg, jnp.asarray(sizes), rac_ratio=0.5, rac_sum="exact", act_scale="token", backend="xla", out_dtype=jnp.float32))
    gt = N.quads_grouped_linear(xst, torch.from_numpy(sizes), per_expert(wg), rac_ratio=0.5, out_dtype=torch.float32).numpy()
    np.testing.assert_allclose(gt, g, rtol=1e-6, atol=1e-6 * np.abs(g).max())


def test_export_to_torch_round_trip_and_launcher(tmp_path):
    from flax import nnx
    from quads_jax.model import ModelConfig, Transformer
    from quads_jax.train.state import split_params
    from rollout import bridge

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
                      experts_per_token=2, expert_ffn=32, max_seq_len=32, compute_dtype="float32")
    params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
    out = bridge.export_modelopt_nvfp4(cfg, params, str(tmp_path / "nvfp4"))
    from safetensors.torch import load_file
    shard = [f for f in os.listdir(out) if f.endswith(".safetensors")][0]
    st = load_file(os.path.join(out, shard))
    name = "model.layers.0.self_attn.o_proj"
    wt = (st[name + ".weight"], st[name + ".weight_scale"], float(st[name + ".weight_scale_2"]))
    assert wt[0].dtype == torch.uint8 and wt[1].dtype == torch.float8_e4m3fn
    rng = np.random.default_rng(0)
    xb, xt = _act(rng, 5, 64)
    want = np.asarray(nvfp4_matmul(xb, P.quantize_weight(params["layers/0/attn/o/w"]), rac_ratio=0.5, rac_sum="exact",
                                   act_scale="token", backend="xla", out_dtype=jnp.float32))
    np.testing.assert_allclose(N.quads_linear(xt, *wt, out_dtype=torch.float32).numpy(), want, rtol=1e-6, atol=1e-6)
    assert launcher.read_rac_ratio(out) == 0.5
    cmd = launcher.launch_command(out, port=31000, tp=2, python="python3")
    assert cmd[:3] == ["python3", "-m", "rollout.sglang_plugin.launcher"] and "--quantization" in cmd
    assert cmd[cmd.index("--quantization") + 1] == "quads_nvfp4" and cmd[cmd.index("--tp-size") + 1] == "2"
    bridge.export_hf(cfg, params, str(tmp_path / "bf16"))
    with pytest.raises(ValueError, match="NVFP4 export"):
        launcher.launch_command(str(tmp_path / "bf16"))


def test_register_without_sglang_says_why(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sglang", None)  # an environment without sglang: its import fails
    assert not sglang_plugin.sglang_available()
    with pytest.raises(ImportError, match="sglang is not installed"):
        sglang_plugin.register()


@pytest.mark.skipif(not sglang_plugin.sglang_available(), reason="sglang is not installed (./test.sh installs it: scripts/bootstrap.sh)")
def test_plugin_inside_the_real_sglang(tmp_path):
    """The method in sglang 0.5.23 itself (its parser, model config, linears, FusedMoE, weight
    loaders and MoE dispatch types), in its own process: --quantization quads_nvfp4 parses, our
    export resolves to it ahead of modelopt_fp4, every layer gets its method, SGLang's loaders
    take every exported tensor (fused q/k/v and gate/up global scales included), and apply()
    equals the JAX reference."""
    import subprocess
    import sys

    from flax import nnx
    from quads_jax.model import ModelConfig, Transformer
    from quads_jax.train.state import split_params
    from rollout import bridge

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
                      experts_per_token=2, expert_ffn=32, dense_ffn=96, mlp_only_layers=(1,), max_seq_len=32,
                      compute_dtype="float32")
    params = split_params(Transformer(cfg, rngs=nnx.Rngs(3)))[1]
    out = bridge.export_modelopt_nvfp4(cfg, params, str(tmp_path / "nvfp4"))
    np.savez(os.path.join(out, "params.npz"), **{k: np.asarray(v) for k, v in params.items()})
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    port = str(29500 + os.getpid() % 400)
    r = subprocess.run([sys.executable, "tests/sglang_real_check.py", out, port], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "RESULT" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])
    res = json.loads(r.stdout.split("RESULT", 1)[1])
    assert res["entry_point_registered"]  # SGLang's load_plugins() found the installed entry point
    assert res["first_in_method_table"] and res["parsed"] == "quads_nvfp4" and res["bad_choice"] == "rejected"
    assert res["resolved_default"] == res["resolved_modelopt"] == "quads_nvfp4"
    assert res["resolved_explicit_modelopt_fp4"] == "modelopt_fp4"  # a user's explicit choice stands
    assert res["methods"] == {"qkv": "QuadsLinearMethod", "o": "QuadsLinearMethod", "gate_up": "QuadsLinearMethod",
                              "down": "QuadsLinearMethod", "router": "UnquantizedLinearMethod", "experts": "QuadsMoEMethod"}
    # 3 tensors for each of q, k, v, o, gate, up, down, 1 for the router, 3 x 3 per expert
    assert res["tensors_loaded"] == 7 * 3 + 1 + cfg.n_experts * 9
    for key in ("qkv", "o", "gate_up"):  # the reference rounded once to BF16; ties of the FP32 sums may round apart
        assert res["rel_" + key] < 2**-8 and res["bf16_equal_" + key] > 0.98, (key, res)
    assert res["rel_router"] < 1e-2  # BF16 weights and activations
    assert res["combine_type"] == "StandardCombineInput"
    assert res["rel_moe"] < 2e-2 and res["moe_equal_fraction"] > 0.9  # BF16 intermediates


TRITON_CHECK = r"""
import os, sys, json
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch, jax.numpy as jnp
from quads_jax import nvfp4 as F, precision as P
from pallas_kernels import nvfp4_matmul, quantize_activations_rac
from rollout.sglang_plugin import numerics as N, triton_gemm as TG
out = {}
rng = np.random.default_rng(11)
t, n, k = 21, 80, 256
x = (rng.standard_normal((t, k)) * np.exp(rng.standard_normal((t, 1)))).astype(np.float32)
xb = jnp.asarray(x).astype(jnp.bfloat16)
xt = torch.from_numpy(np.array(xb.astype(jnp.float32))).to(torch.bfloat16)
wq = P.quantize_weight(jnp.asarray(rng.standard_normal((n, k)).astype(np.float32)))
m = F.to_modelopt(wq)
w = torch.from_numpy(np.array(m["weight"]))
s = torch.from_numpy(np.array(m["weight_scale"]).view(np.uint8)).view(torch.float8_e4m3fn)
gw = float(np.asarray(m["weight_scale_2"]).reshape(()))
# the packed operands are the JAX quantizer's bits
xq, rq = quantize_activations_rac(xb, rac_ratio=0.5, act_scale="token")
(xc, xs, gx), (rc, rs, gr) = N.packed_operands(xt, 0.5)
out["codes_equal"] = bool(np.array_equal(xc.numpy(), np.asarray(xq.codes)) and np.array_equal(rc.numpy(), np.asarray(rq.codes)))
out["scales_equal"] = bool(np.array_equal(xs.numpy(), np.asarray(xq.scales).view(np.uint8))
                           and np.array_equal(rs.numpy(), np.asarray(rq.scales).view(np.uint8)))
from rollout.sglang_plugin.tiles import TritonTiles
cfgs = [None, TritonTiles(16, 32, 64, split_k=2), TritonTiles(32, 16, 32), TritonTiles(16, 32, 64, swap_ab=True),
        TritonTiles(16, 32, 64, dequant=True)]
for rho in (0.0, 0.125, 0.5, 1.0):
    want = np.asarray(nvfp4_matmul(xb, wq, rac_ratio=rho, rac_sum="exact", act_scale="token", backend="xla", out_dtype=jnp.float32))
    for i, cfg in enumerate(cfgs):
        got = TG.quads_linear_triton(xt, w, s, gw, rac_ratio=rho, out_dtype=torch.float32, config=cfg).numpy()
        out[f"rel_rho{rho}_cfg{i}"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
try:
    TG.w4a4_rac_gemm(xc[:, :100], xs, gx, w, s.view(torch.uint8), gw)
except ValueError as e:
    out["bad_shape_error"] = str(e)
print("RESULT" + json.dumps(out))
"""


def test_triton_kernel_equals_jax_reference_in_the_interpreter():
    """The SGLang/jax-triton GEMM kernel, run by Triton's CPU interpreter, against the JAX
    XLA reference on the same weights and activations (split-K and odd tiles included)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is needed for the kernel")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.split("RESULT", 1)[1])
    assert res["codes_equal"] and res["scales_equal"]
    rels = {key: v for key, v in res.items() if key.startswith("rel_")}
    assert len(rels) == 20 and max(rels.values()) < 1e-6, rels  # accumulation order only
    assert "x codes" in res["bad_shape_error"] and "uint8" in res["bad_shape_error"]


def test_import_jax_triton_keeps_the_triton_cache_dir(monkeypatch, tmp_path):
    """jax-triton 0.3.1 blanks TRITON_CACHE_DIR at import; the wrapper puts it back."""
    import sys
    import types

    from rollout.sglang_plugin import jax_launch as triton_interop

    fake = types.ModuleType("jax_triton")
    monkeypatch.setitem(sys.modules, "jax_triton", fake)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    real_import = __builtins__["__import__"] if isinstance(__builtins__, dict) else __builtins__.__import__

    def blanking_import(name, *a, **k):
        mod = real_import(name, *a, **k)
        if name == "jax_triton":
            os.environ["TRITON_CACHE_DIR"] = ""  # what the real package does at import
        return mod

    monkeypatch.setattr("builtins.__import__", blanking_import)
    assert triton_interop.import_jax_triton() is fake
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path)
    monkeypatch.delenv("TRITON_CACHE_DIR")
    triton_interop.import_jax_triton()
    assert "TRITON_CACHE_DIR" not in os.environ
