"""The README's quickstart: the NVFP4 format, the W4A4 + RAC GEMM, and the trainer-vs-rollout
log-prob gap of a tiny MoE. Runs on a CPU in under a minute: python examples/quickstart.py"""

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk
from quads_jax import nvfp4, precision
from quads_jax.model import ModelConfig, Transformer, prepare_for_rollout, token_logprobs

key = jax.random.key(0)
x = jax.random.normal(key, (16, 256), jnp.bfloat16)             # 16 tokens, 256 channels
w = jax.random.normal(jax.random.key(1), (512, 256)) * 0.05       # a weight [out, in]

t = precision.quantize_weight(w)                                  # NVFP4Tensor: E2M1 codes, E4M3 scales, FP32 scale
y = pk.nvfp4_matmul(x, t, rac_ratio=0.5, act_scale="token")       # W4A4 + RAC (the XLA reference on a CPU)
y_ref = x.astype(jnp.float32) @ w.T
print("W4A4+RAC relative error:", float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref)))
w_qat = nvfp4.fake_quant(w)                                       # straight-through fake quantization (trainer)

cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
                  experts_per_token=2, expert_ffn=64)
model = Transformer(cfg, rngs=nnx.Rngs(0))
tokens = jax.random.randint(key, (2, 12), 0, cfg.vocab_size)
mask = jnp.ones((2, 12), bool)
lp_train = token_logprobs(model, tokens, mask, precision=precision.train_policy("nvfp4_w"))   # QAT trainer
rollout = precision.rollout_recipe("quads")                                                  # W4A4 + RAC rollout
lp_roll = token_logprobs(prepare_for_rollout(model, rollout), tokens, mask)
print("max |log-prob gap| trainer vs rollout:", float(jnp.abs(lp_train - lp_roll).max()))
