"""Hugging Face interop: load a Qwen3-MoE checkpoint directory into the nnx model, export back.

    model = load_qwen3_moe("/path/to/Qwen3-30B-A3B", dtype=jnp.bfloat16)
    logits = model(input_ids)
    export_qwen3_moe(model, "/tmp/out")            # config.json + sharded safetensors + index

Memory: the model is built abstractly (``nnx.eval_shape``) and each parameter is read from
its file (memory-mapped by safetensors) straight into its final array, so a large model
is never held twice. Expert weights are accepted both as per-expert keys
(``mlp.experts.{e}.gate_proj.weight``, the on-disk layout) and as the fused tensors of
transformers 5 (``mlp.experts.gate_up_proj`` [E, 2F, d], ``mlp.experts.down_proj``).
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from quads_jax import nvfp4
from quads_jax.model import config as C
from quads_jax.model.transformer import Transformer


class TensorSource:
    """Reads tensors by name from the safetensors files of a checkpoint directory."""

    def __init__(self, path: str):
        from safetensors import safe_open

        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory not found: {path}")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                wm = json.load(f)["weight_map"]
            files = sorted(set(wm.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path}")
            wm = None
        self._path = path
        self._handles = {f: safe_open(os.path.join(path, f), framework="flax") for f in files}
        self._where = {}
        for f, h in self._handles.items():
            for k in h.keys():
                self._where[k] = f
        if wm is not None:
            missing = [f for f in set(wm.values()) if f not in self._handles]
            if missing:
                raise FileNotFoundError(f"index names missing shard files {missing} in {path}")

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str):
        if key not in self._where:
            raise KeyError(f"tensor {key!r} not found in the checkpoint")
        try:
            return self._handles[self._where[key]].get_tensor(key)
        except AttributeError:  # numpy has no float8: read the raw bytes (ModelOpt scales)
            return _read_raw(os.path.join(self._path, self._where[key]), key)

    def keys(self):
        return self._where.keys()


def _names(cfg: C.ModelConfig) -> dict[tuple, tuple]:
    """Our parameter path -> (kind, HF name(s)). kind: 'one', 'experts', 'shared_gate'."""
    out = {("embed",): ("one", "model.embed_tokens.weight"), ("final_norm", "scale"): ("one", "model.norm.weight")}
    if not cfg.tie_embeddings:
        out[("lm_head", "w")] = ("one", "lm_head.weight")
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out[("layers", i, "attn_norm", "scale")] = ("one", p + "input_layernorm.weight")
        out[("layers", i, "mlp_norm", "scale")] = ("one", p + "post_attention_layernorm.weight")
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            out[("layers", i, "attn", ours, "w")] = ("one", p + f"self_attn.{theirs}.weight")
        out[("layers", i, "attn", "q_norm", "scale")] = ("one", p + "self_attn.q_norm.weight")
        out[("layers", i, "attn", "k_norm", "scale")] = ("one", p + "self_attn.k_norm.weight")
        if cfg.is_moe_layer(i):
            out[("layers", i, "moe", "router", "w")] = ("one", p + "mlp.gate.weight")
            for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                out[("layers", i, "moe", ours)] = ("experts", p + "mlp.experts.{e}." + theirs + ".weight", p, theirs)
            if cfg.shared_expert_ffn:
                for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                    out[("layers", i, "moe", "shared", ours, "w")] = ("one", p + f"mlp.shared_expert.{theirs}.weight")
                out[("layers", i, "moe", "shared_gate", "w")] = ("one", p + "mlp.shared_expert_gate.weight")
        else:
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                out[("layers", i, "mlp", ours, "w")] = ("one", p + f"mlp.{theirs}.weight")
    return out


_RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn", "U8": "uint8", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _read_raw(file: str, key: str):
    """One tensor from a safetensors file by its header (for dtypes numpy lacks)."""
    import ml_dtypes

    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))[key]
        lo, hi = meta["data_offsets"]
        f.seek(8 + n + lo)
        buf = f.read(hi - lo)
    name = _RAW_DTYPES.get(meta["dtype"])
    if name is None:
        raise ValueError(f"tensor {key!r}: unsupported safetensors dtype {meta['dtype']}")
    dt = getattr(ml_dtypes, name, None) or np.dtype(name)
    return jnp.asarray(np.frombuffer(buf, dtype=dt).reshape(meta["shape"]))


def _read_experts(src: TensorSource, spec, n_experts: int, ffn: int):
    _, template, prefix, which = spec
    if template.format(e=0) in src:
        return jnp.stack([src.get(template.format(e=e)) for e in range(n_experts)])
    if which in ("gate_proj", "up_proj") and prefix + "mlp.experts.gate_up_proj" in src:
        fused = src.get(prefix + "mlp.experts.gate_up_proj")  # [E, 2F, d]: gate rows, then up rows
        return fused[:, :ffn] if which == "gate_proj" else fused[:, ffn:]
    if which == "down_proj" and prefix + "mlp.experts.down_proj" in src:
        return src.get(prefix + "mlp.experts.down_proj")
    raise KeyError(f"expert weights {template.format(e='{e}')} (or the fused {prefix}mlp.experts.*) not found")


def load_qwen3_moe(path: str, dtype=jnp.bfloat16, *, param_dtype=jnp.float32, precision=None) -> Transformer:
    """Load a local HF Qwen3-MoE checkpoint directory; ``dtype`` is the compute dtype."""
    cfg = C.from_hf_config(path)
    cdt = {jnp.dtype(v): k for k, v in C.DTYPES.items()}
    cfg = cfg.replace(compute_dtype=cdt[jnp.dtype(dtype)], param_dtype=cdt[jnp.dtype(param_dtype)])
    src = TensorSource(path)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), precision=precision))
    graphdef, state = nnx.split(abstract)
    names = _names(cfg)
    flat = nnx.to_flat_state(state)
    for p, var in flat:
        key = tuple(p)
        if key not in names:
            raise KeyError(f"no Hugging Face name for parameter {'/'.join(map(str, key))}")
        spec = names[key]
        arr = src.get(spec[1]) if spec[0] == "one" else _read_experts(src, spec, cfg.n_experts, cfg.expert_ffn)
        want = tuple(var.get_value().shape)
        if tuple(arr.shape) != want:
            raise ValueError(f"{spec[1]}: shape {tuple(arr.shape)} does not match the config's {want}")
        var.set_value(jnp.asarray(arr, param_dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _expert(v, e: int):
    """Expert ``e`` of a stacked [E, ...] weight (float array or per-expert NVFP4Tensor)."""
    if isinstance(v, nvfp4.NVFP4Tensor):
        gs = jnp.asarray(v.global_scale)
        return nvfp4.NVFP4Tensor(codes=v.codes[e], scales=v.scales[e], global_scale=gs[e] if gs.ndim else gs,
                                 shape=v.shape[1:], axis=v.axis - 1)
    return v[e]


def _tensor_entries(name: str, v, dtype):
    """HF entries of one weight: ``name`` in ``dtype``, or for an NVFP4 weight the ModelOpt
    triple ``.weight`` (uint8 [N, K/2]), ``.weight_scale`` (E4M3 [N, K/16]) and
    ``.weight_scale_2`` (float32 global scale)."""
    if isinstance(v, nvfp4.NVFP4Tensor):
        base = name[: -len(".weight")]
        m = nvfp4.to_modelopt(v)
        yield base + ".weight", m["weight"]
        yield base + ".weight_scale", m["weight_scale"]
        yield base + ".weight_scale_2", jnp.asarray(m["weight_scale_2"], jnp.float32).reshape(())
    else:
        yield name, jnp.asarray(v, dtype)


def hf_tensors(model: Transformer, dtype=jnp.bfloat16) -> Iterator[tuple[str, jax.Array]]:
    """(HF name, array) pairs in the on-disk layout (per-expert keys), one at a time.
    Weights a rollout recipe has quantized to NVFP4 come out in the ModelOpt layout."""
    cfg = model.cfg
    names = _names(cfg)
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        spec = names[tuple(p)]
        v = var.get_value()
        if spec[0] == "one":
            yield from _tensor_entries(spec[1], v, dtype)
        else:
            n = v.shape[0]
            for e in range(n):
                yield from _tensor_entries(spec[1].format(e=e), _expert(v, e), dtype)


def export_qwen3_moe(model: Transformer, out_dir: str, *, dtype=jnp.bfloat16, shard_bytes: int = 2 << 30,
                     extra_tensors: Iterator[tuple[str, jax.Array]] | None = None, quantization_config=None) -> str:
    """Write config.json, ``model-XXXXX.safetensors`` shards of about ``shard_bytes`` and the index."""
    from safetensors.flax import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = extra_tensors if extra_tensors is not None else hf_tensors(model, dtype)
    shards, cur, size, wm = [], {}, 0, {}

    def flush():
        nonlocal cur, size
        if cur:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(cur, os.path.join(out_dir, name), metadata={"format": "pt"})
            for k in cur:
                wm[k] = name
            shards.append(name)
            cur, size = {}, 0

    total = 0
    for k, v in tensors:
        cur[k] = v
        size += v.nbytes
        total += v.nbytes
        if size >= shard_bytes:
            flush()
    flush()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(total)}, "weight_map": wm}, f, indent=1)
    hfc = C.to_hf_config(model.cfg)
    hfc["torch_dtype"] = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}.get(jnp.dtype(dtype).name, "bfloat16")
    if quantization_config is not None:
        hfc["quantization_config"] = quantization_config
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hfc, f, indent=1)
    return out_dir
