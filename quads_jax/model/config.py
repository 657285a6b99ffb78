"""The model configuration: one frozen dataclass, from YAML or a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import yaml

from quads_jax.config_util import build

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# per-block rematerialization: "none" keeps every activation; "full" keeps only each block's
# input; "dots" keeps the matmul outputs without batch dimensions (recomputes the rest)
REMAT_POLICIES = ("none", "full", "dots")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    n_experts: int = 8
    experts_per_token: int = 2
    expert_ffn: int = 64
    shared_expert_ffn: int = 0  # 0: no shared expert
    dense_ffn: int = 128  # FFN size of dense (non-MoE) layers
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of MoE
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 (and not in mlp_only_layers)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    norm_topk_prob: bool = True
    tie_embeddings: bool = False
    max_seq_len: int = 256
    router_aux_coef: float = 0.001
    router_z_coef: float = 0.0
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    # training memory: what each block keeps for the backward pass (REMAT_POLICIES), and how
    # many tokens' [chunk, vocab] FP32 logits token_logprobs holds at once (0: all)
    remat: str = "none"
    logits_chunk: int = 4096

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)!r}: expected a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim}: expected an even number (RoPE rotates pairs)")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"model.experts_per_token={self.experts_per_token}: expected 1..n_experts={self.n_experts}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"model.{name}={getattr(self, name)!r}: expected one of {sorted(DTYPES)}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if int(self.logits_chunk) < 0:
            raise ValueError(f"model.logits_chunk={self.logits_chunk!r}: expected 0 (no chunking) or a positive integer")

    @property
    def dtype(self):
        return DTYPES[self.compute_dtype]

    @property
    def pdtype(self):
        return DTYPES[self.param_dtype]

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(1, self.decoder_sparse_step) == 0)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # -- parameter counting (for MFU and reports)
    def param_counts(self) -> dict[str, int]:
        d, h = self.d_model, self.head_dim
        attn = d * h * (2 * self.n_heads + 2 * self.n_kv_heads) + 2 * h
        total = active = 0
        for i in range(self.n_layers):
            layer = attn + 2 * d
            if self.is_moe_layer(i):
                e = 3 * d * self.expert_ffn
                s = 3 * d * self.shared_expert_ffn + (d if self.shared_expert_ffn else 0)
                total += layer + self.n_experts * e + s + d * self.n_experts
                active += layer + self.experts_per_token * e + s + d * self.n_experts
            else:
                total += layer + 3 * d * self.dense_ffn
                active += layer + 3 * d * self.dense_ffn
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d
        return {"total": total + emb, "active": active + emb}


def from_dict(d: dict[str, Any]) -> ModelConfig:
    return build(ModelConfig, d, "model")


def from_yaml(path: str) -> ModelConfig:
    with open(path) as f:
        d = yaml.safe_load(f) or {}
    return from_dict(d.get("model", d))


def _first(d: dict, *keys, default=None):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def from_hf_config(path_or_dict) -> ModelConfig:
    """A Qwen3-MoE ``config.json`` (transformers 4 or 5 spellings) -> ModelConfig."""
    if isinstance(path_or_dict, dict):
        c = path_or_dict
    else:
        p = os.path.join(path_or_dict, "config.json") if os.path.isdir(path_or_dict) else path_or_dict
        if not os.path.exists(p):
            raise FileNotFoundError(f"config.json not found at {p}")
        with open(p) as f:
            c = json.load(f)
    arch = c.get("model_type", "")
    if arch not in ("qwen3_moe", "qwen3", "qwen2_moe"):
        raise ValueError(f"config.json: model_type={arch!r} is not supported (expected 'qwen3_moe' or 'qwen3')")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = _first(c, "rope_theta", default=rope.get("rope_theta", 10000.0))
    n_heads = c["num_attention_heads"]
    n_experts = _first(c, "num_experts", "num_local_experts", default=0) if arch != "qwen3" else 0
    return ModelConfig(
        vocab_size=c["vocab_size"],
        d_model=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=_first(c, "num_key_value_heads", default=n_heads),
        head_dim=_first(c, "head_dim", default=c["hidden_size"] // n_heads),
        n_experts=n_experts,
        experts_per_token=_first(c, "num_experts_per_tok", default=1),
        expert_ffn=_first(c, "moe_intermediate_size", default=c.get("intermediate_size", 0)),
        shared_expert_ffn=_first(c, "shared_expert_intermediate_size", default=0),
        dense_ffn=_first(c, "intermediate_size", default=0),
        mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
        decoder_sparse_step=_first(c, "decoder_sparse_step", default=1),
        rope_theta=float(theta),
        rms_eps=float(_first(c, "rms_norm_eps", default=1e-6)),
        norm_topk_prob=bool(_first(c, "norm_topk_prob", default=True)),
        tie_embeddings=bool(_first(c, "tie_word_embeddings", default=False)),
        max_seq_len=int(_first(c, "max_position_embeddings", default=4096)),
        router_aux_coef=float(_first(c, "router_aux_loss_coef", default=0.001)),
    )


def to_hf_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.expert_ffn,
        "intermediate_size": cfg.dense_ffn,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps,
        "norm_topk_prob": cfg.norm_topk_prob,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "router_aux_loss_coef": cfg.router_aux_coef,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }
