"""Qwen3-style MoE transformer in flax nnx (see ``transformer``)."""

from quads_jax.model.config import ModelConfig, from_dict, from_hf_config, from_yaml, to_hf_config
from quads_jax.model.transformer import Transformer, prepare_for_rollout, token_logprobs

__all__ = ["ModelConfig", "Transformer", "from_dict", "from_hf_config", "from_yaml", "prepare_for_rollout",
           "to_hf_config", "token_logprobs"]
