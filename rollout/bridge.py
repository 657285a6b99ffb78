"""The weight bridge between the trainer and the rollout engine.

    bridge = WeightBridge(engine)
    bridge.push(state.params, version=step)               # colocated: device arrays, no disk
    bridge.load_from_disk("runs/x/ckpt")                  # orbax: params only, latest good step
    bridge.load_from_disk("exports/hf-bf16")              # a Hugging Face directory
    export_hf(cfg, params, "exports/hf-bf16")             # BF16 safetensors for any engine
    export_modelopt_nvfp4(cfg, params, "exports/nvfp4", recipe="quads")

Every load goes through ``Engine.load``: the float weights are quantized once for the
engine's recipe by ``precision.prepare_weight`` (the trainer's fake-quant path), then
swapped in under the engine's lock, so a generation in flight finishes on the old weights
and every result reports the version it used. A load that fails (missing directory, wrong
shapes, no finalized step) raises before the swap and the old weights stay.

The ModelOpt export holds the same codes the engine computes: it runs the same
``prepare_for_rollout`` and writes each NVFP4 weight as ``weight`` (uint8 [N, K/2], low
nibble first), ``weight_scale`` (E4M3 [N, K/16]) and ``weight_scale_2`` (float32), with a
``quantization_config`` naming the recipe. Activations are quantized online with dynamic
per-token scales, so no static ``input_scale`` is written; the QUADS SGLang method
(``rollout/sglang_plugin``) reads ``quads.rac_ratio`` from the config.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from quads_jax import hf
from quads_jax import precision as P
from quads_jax.model import ModelConfig, Transformer, prepare_for_rollout
from quads_jax.train.state import split_params, to_model


def abstract_params(cfg: ModelConfig) -> dict:
    """{name: ShapeDtypeStruct} of the model's flat params (nothing is allocated)."""
    g, params, _ = split_params(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return params


def check_params(cfg: ModelConfig, params: dict, what: str = "params") -> None:
    """Same names and shapes as ``cfg``'s model, else a ValueError naming the first mismatch."""
    want = abstract_params(cfg)
    missing = sorted(set(want) - set(params))
    extra = sorted(set(params) - set(want))
    if missing or extra:
        raise ValueError(f"{what}: parameter names differ from the config's model "
                         f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for k, v in want.items():
        if tuple(params[k].shape) != tuple(v.shape):
            raise ValueError(f"{what}[{k!r}]: shape {tuple(params[k].shape)}, the config's model needs {tuple(v.shape)}")


def is_orbax_dir(path: str) -> bool:
    return os.path.isdir(path) and any(d.isdigit() and os.path.isdir(os.path.join(path, d)) for d in os.listdir(path))


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def restore_params(directory: str, cfg: ModelConfig, step: int | None = None) -> tuple[dict, int]:
    """Only the parameters of a trainer checkpoint (latest finalized step by default)."""
    from quads_jax.train.checkpoint import Checkpointer

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    from quads_jax.train.checkpoint import CorruptCheckpoint

    ck = Checkpointer(directory, async_save=False)
    try:
        like = abstract_params(cfg)
        try:  # step None: the newest intact step (corrupt or partial ones are skipped with a warning)
            params = ck.restore_params(like, step=step)
        except CorruptCheckpoint as e:  # also a checkpoint of another config: orbax reports it deep inside
            raise CorruptCheckpoint(f"checkpoint {directory} cannot be read into the engine's config: {e}") from e
        step = ck.restored_step
    finally:
        ck.close()
    check_params(cfg, params, f"checkpoint {directory} step {step}")
    return params, step


def load_hf_params(path: str, cfg: ModelConfig) -> dict:
    model = hf.load_qwen3_moe(path, dtype=jnp.float32)
    params = split_params(model)[1]
    check_params(cfg, params, f"Hugging Face checkpoint {path}")
    return params


class WeightBridge:
    """Feeds an ``Engine`` with weights from memory, an orbax checkpoint or an HF directory."""

    def __init__(self, engine):
        self.engine = engine

    def push(self, params: dict, version: Any = None) -> Any:
        """In-process fast path: the trainer's (sharded) device arrays, no disk."""
        check_params(self.engine.cfg, params)
        self.engine.load(params, version)
        return version

    def load_from_disk(self, path: str, version: Any = None, step: int | None = None) -> Any:
        """An orbax trainer checkpoint directory or a Hugging Face directory."""
        params, name = read_params(path, self.engine.cfg, step)
        version = name if version is None else version
        self.engine.load(params, version)
        return version


def read_params(path: str, cfg: ModelConfig, step: int | None = None) -> tuple[dict, str]:
    """Float params from an orbax trainer checkpoint or a BF16/F32 Hugging Face directory,
    checked against ``cfg``; returns (params, a version name)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model_path not found: {path}")
    if is_orbax_dir(path):
        params, step = restore_params(path, cfg, step)
        return params, f"step-{step}"
    if is_hf_dir(path):
        qc = _quantized(path)
        if qc:
            raise ValueError(f"{path} is a quantized export ({qc.get('quant_algo')}); load the BF16 export "
                             "or the orbax checkpoint, the engine quantizes for its recipe itself")
        return load_hf_params(path, cfg), os.path.basename(os.path.normpath(path))
    raise FileNotFoundError(f"{path}: neither an orbax checkpoint (step directories) nor a Hugging Face "
                            "directory (config.json)")


def _quantized(path: str) -> dict | None:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("quantization_config")


# ----------------------------------------------------------------------------- exports


def export_hf(cfg: ModelConfig, params: dict, out_dir: str, *, dtype=jnp.bfloat16) -> str:
    """BF16 (or ``dtype``) Hugging Face safetensors + config.json, streamed tensor by tensor."""
    check_params(cfg, params)
    model = to_model(split_params(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0], params)
    return hf.export_qwen3_moe(model, out_dir, dtype=dtype)


NON_NVFP4_MODULES = {"router": "*mlp.gate", "lm_head": "lm_head", "shared_gate": "*mlp.shared_expert_gate"}


def quantization_config(recipe: P.Precision, name: str) -> dict:
    """The ModelOpt-style ``quantization_config`` of an NVFP4 export, plus QUADS' own keys."""
    exclude = [NON_NVFP4_MODULES["shared_gate"]]
    for kind, pattern in (("router", NON_NVFP4_MODULES["router"]), ("lm_head", "lm_head"),
                          ("attn", "*self_attn*"), ("experts", "*mlp.experts*"), ("shared", "*mlp.shared_expert.*"),
                          ("dense", "*mlp.*_proj")):
        if recipe.mode(kind) not in ("w4a4", "w4a16"):
            exclude.append(pattern)
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "exclude_modules": exclude,
        "quads": {"recipe": name, "rac_ratio": float(recipe.rac_ratio), "activation_scale": "dynamic_per_token",
                  "activations": "nvfp4" if recipe.mode("experts") == "w4a4" else "bf16"},
    }


def export_modelopt_nvfp4(cfg: ModelConfig, params: dict, out_dir: str, *, recipe: str = "quads",
                          dtype=jnp.bfloat16) -> str:
    """NVFP4 weights in the ModelOpt layout (the engine's exact codes), the rest in ``dtype``."""
    prec = P.rollout_recipe(recipe)
    if prec.mode("experts") not in ("w4a4", "w4a16"):
        raise ValueError(f"recipe={recipe!r}: not an NVFP4 recipe (expected one of nvfp4, quads, w4a16)")
    check_params(cfg, params)
    graphdef = split_params(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
    model = jax.jit(lambda p: nnx.split(prepare_for_rollout(to_model(graphdef, p), prec))[1])(params)
    rgraph = nnx.split(nnx.eval_shape(lambda: prepare_for_rollout(Transformer(cfg, rngs=nnx.Rngs(0)), prec)))[0]
    prepared = nnx.merge(rgraph, model)
    return hf.export_qwen3_moe(prepared, out_dir, dtype=dtype, extra_tensors=hf.hf_tensors(prepared, dtype),
                               quantization_config=quantization_config(prec, recipe))


def read_modelopt_weight(path: str, name: str):
    """The NVFP4Tensor of weight ``name`` (e.g. ``model.layers.0.self_attn.q_proj``) of an export."""
    from quads_jax import nvfp4

    src = hf.TensorSource(path)
    return nvfp4.from_modelopt(src.get(name + ".weight"), src.get(name + ".weight_scale"), src.get(name + ".weight_scale_2"))


__all__ = ["WeightBridge", "read_params", "export_hf", "export_modelopt_nvfp4", "read_modelopt_weight", "restore_params",
           "abstract_params", "check_params", "quantization_config"]
