"""The quads_nvfp4 plugin inside the real sglang package, on the CPU (run in its own process by
tests/test_sglang_plugin.py: SGLang keeps process-wide state). Prints RESULT + JSON.

    python tests/sglang_real_check.py EXPORT_DIR

Uses SGLang's own pieces throughout: its argument parser (``prepare_server_args``), its
model config's quantization resolution, its parallel linears and FusedMoE built with our
quantization config, their weight loaders fed our exported tensors with the shard ids
Qwen3-MoE's ``load_weights`` uses, and its dispatch / combine types for the MoE ``apply``.
"""

import glob
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import torch

from quads_jax import precision as P
from pallas_kernels import nvfp4_matmul
from rollout import sglang_plugin


def install_entry_points(root):
    """This checkout's entry points as an installed distribution's metadata under ``root``
    (what ``pip install .`` writes), so that importlib.metadata finds them."""
    import tomllib

    proj = tomllib.load(open("pyproject.toml", "rb"))["project"]
    info = os.path.join(root, f"quads_jax-{proj['version']}.dist-info")
    os.makedirs(info, exist_ok=True)
    open(os.path.join(info, "METADATA"), "w").write(f"Metadata-Version: 2.1\nName: quads-jax\nVersion: {proj['version']}\n")
    lines = []
    for group, eps in proj["entry-points"].items():
        lines += [f"[{group}]"] + [f"{k} = {v}" for k, v in eps.items()] + [""]
    open(os.path.join(info, "entry_points.txt"), "w").write("\n".join(lines))
    sys.path.insert(0, root)


def main(export):
    out = {}
    # a server process: SGLang loads its general plugins, ours among them, before parsing
    from importlib.metadata import entry_points

    installed = any(e.name == "quads_nvfp4" for e in entry_points(group="sglang.srt.plugins"))
    out["entry_point_source"] = "installed" if installed else "this checkout's pyproject.toml"
    if not installed:  # the package is not pip-installed here: write the metadata pip would
        install_entry_points(os.path.join(os.path.dirname(export), "site"))
    from sglang.srt.layers import quantization as q
    from sglang.srt.plugins import load_plugins

    load_plugins()
    out["entry_point_registered"] = q.QUANTIZATION_METHODS.get("quads_nvfp4") is not None
    cls = sglang_plugin.register()  # idempotent
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import prepare_server_args

    out["first_in_method_table"] = next(iter(q.QUANTIZATION_METHODS)) == "quads_nvfp4"
    sa = prepare_server_args(["--model-path", export, "--quantization", "quads_nvfp4", "--device", "cpu"])
    out["parsed"] = sa.quantization
    try:
        prepare_server_args(["--model-path", export, "--quantization", "quads_nvfp5"])
        out["bad_choice"] = "accepted"
    except SystemExit:
        out["bad_choice"] = "rejected"
    resolve = lambda *extra: ModelConfig.from_server_args(prepare_server_args(["--model-path", export, "--device", "cpu", *extra])).quantization
    out["resolved_default"] = resolve()
    out["resolved_modelopt"] = resolve("--quantization", "modelopt")
    out["resolved_explicit_modelopt_fp4"] = resolve("--quantization", "modelopt_fp4")

    # the parallel state of a one-process server
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, publish

    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{int(sys.argv[2]) if len(sys.argv) > 2 else 29541}")
    ps.initialize_model_parallel(backend="gloo")
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    hf = json.load(open(os.path.join(export, "config.json")))
    qc = cls.from_config(hf["quantization_config"])
    d, h, kv, hd = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    e, f, k, fd = hf["num_experts"], hf["moe_intermediate_size"], hf["num_experts_per_tok"], hf["intermediate_size"]
    torch.set_default_dtype(torch.bfloat16)
    a, m = "model.layers.0.self_attn", "model.layers.1.mlp"
    layers = {
        "qkv": QKVParallelLinear(d, hd, h, kv, bias=False, quant_config=qc, prefix=f"{a}.qkv_proj"),
        "o": RowParallelLinear(h * hd, d, bias=False, quant_config=qc, prefix=f"{a}.o_proj"),
        "gate_up": MergedColumnParallelLinear(d, [fd, fd], bias=False, quant_config=qc, prefix=f"{m}.gate_up_proj"),
        "down": RowParallelLinear(fd, d, bias=False, quant_config=qc, prefix=f"{m}.down_proj"),
        "router": ReplicatedLinear(d, e, bias=False, quant_config=qc, prefix="model.layers.0.mlp.gate"),
        "experts": FusedMoE(num_experts=e, hidden_size=d, intermediate_size=f, top_k=k, layer_id=0, quant_config=qc,
                            prefix="model.layers.0.mlp.experts"),
    }
    out["methods"] = {n: type(l.quant_method).__name__ for n, l in layers.items()}

    # our exported tensors through SGLang's loaders, mapped as Qwen3-MoE's load_weights maps them
    from safetensors.torch import load_file

    tensors = {}
    for path in glob.glob(os.path.join(export, "*.safetensors")):
        tensors.update(load_file(path))
    stacked = [("qkv", f"{a}.q_proj", "q"), ("qkv", f"{a}.k_proj", "k"), ("qkv", f"{a}.v_proj", "v"),
               ("gate_up", f"{m}.gate_proj", 0), ("gate_up", f"{m}.up_proj", 1), ("o", f"{a}.o_proj", None),
               ("down", f"{m}.down_proj", None), ("router", "model.layers.0.mlp.gate", None)]
    loaded = 0
    for layer, src, shard in stacked:
        for suffix in ("weight", "weight_scale", "weight_scale_2"):
            name = f"{src}.{suffix}"
            if name not in tensors:
                continue
            param = getattr(layers[layer], suffix)
            if shard is None:
                param.weight_loader(param, tensors[name])
            else:
                param.weight_loader(param, tensors[name], shard)
            loaded += 1
    moe = layers["experts"]
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
                                                  ckpt_up_proj_name="up_proj", num_experts=e)
    for name, t in tensors.items():
        if ".mlp.experts." not in name or not name.startswith("model.layers.0."):
            continue
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            pname = name.replace(weight_name, param_name).split("experts.", 1)[1]
            param = getattr(moe, pname)
            param.weight_loader(param, t, name, shard_id=shard_id, expert_id=expert_id)
            loaded += 1
            break
    out["tensors_loaded"] = loaded
    for l in layers.values():
        l.quant_method.process_weights_after_loading(l)

    # apply() against the JAX reference on the same float params
    params = {kk: jnp.asarray(v) for kk, v in np.load(os.path.join(export, "params.npz")).items()}
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, d)) * np.exp(rng.standard_normal((7, 1)))).astype(np.float32)
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    xt = torch.from_numpy(np.asarray(xb.astype(jnp.float32))).to(torch.bfloat16)
    rac = qc.rac_ratio
    ref = lambda xj, ws: np.concatenate([np.asarray(nvfp4_matmul(xj, P.quantize_weight(params[w]), rac_ratio=rac, rac_sum="exact",
                                                                 act_scale="token", backend="xla", out_dtype=jnp.float32))
                                         for w in ws], axis=1)
    rel = lambda got, want: float(np.linalg.norm(got - want) / np.linalg.norm(want))

    def close(name, got, want):  # BF16 outputs of an FP32 reference: one rounding apart at most
        out["rel_" + name] = rel(got, want)
        out["bf16_equal_" + name] = float(np.mean(got == np.asarray(jnp.asarray(want).astype(jnp.bfloat16).astype(jnp.float32))))

    got = layers["qkv"].quant_method.apply(layers["qkv"], xt).float().numpy()
    close("qkv", got, ref(xb, ["layers/0/attn/q/w", "layers/0/attn/k/w", "layers/0/attn/v/w"]))
    xo = jnp.asarray(rng.standard_normal((7, h * hd)), jnp.bfloat16)
    got = layers["o"].quant_method.apply(layers["o"], torch.from_numpy(np.asarray(xo.astype(jnp.float32))).to(torch.bfloat16)).float().numpy()
    close("o", got, ref(xo, ["layers/0/attn/o/w"]))
    got = layers["gate_up"].quant_method.apply(layers["gate_up"], xt).float().numpy()
    close("gate_up", got, ref(xb, ["layers/1/mlp/gate/w", "layers/1/mlp/up/w"]))
    router = layers["router"].quant_method.apply(layers["router"], xt).float().numpy()
    out["rel_router"] = rel(router, x @ np.asarray(params["layers/0/moe/router/w"], np.float32).T)

    from quads_jax.model.moe import moe_ffn

    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(7)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (7, k)).astype(np.float32)
    prec = P.rollout_recipe("quads", rac_ratio=rac, rac_sum="exact")
    ws = [P.prepare_weight(params[f"layers/0/moe/{n}"], "w4a4") for n in ("w_gate", "w_up", "w_down")]
    want = np.asarray(moe_ffn(xb, jnp.asarray(ids), jnp.asarray(wts), *ws, prec, jnp.bfloat16), np.float32)
    topk = StandardTopKOutput(topk_weights=torch.from_numpy(wts), topk_ids=torch.from_numpy(ids).long(),
                              router_logits=torch.zeros(7, e))
    combine = moe.quant_method.apply(moe, StandardDispatchOutput(hidden_states=xt, hidden_states_scale=None, topk_output=topk))
    got = combine.hidden_states.float().numpy()
    out["combine_type"] = type(combine).__name__
    out["rel_moe"] = rel(got, want)
    out["moe_equal_fraction"] = float(np.mean(got == want))
    print("RESULT" + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
