"""GRPO: group-normalised advantages and the PPO-clipped token-level policy loss.

All functions are pure and work on [N, T] arrays where N = prompts x G samples and
``mask`` marks response tokens. Log-probs are aligned with tokens (``token_logprobs``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from quads_jax.config_util import build


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 8
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # k3 KL to the reference policy; 0 disables (no reference forward)
    tis_cap: float = 0.0  # truncated importance sampling cap C on p_train/p_rollout; 0 disables
    adv_eps: float = 1e-6
    routing_replay: bool = False

    @classmethod
    def from_dict(cls, d):
        return build(cls, d, "grpo")


def group_advantages(rewards, group_size: int, eps: float = 1e-6):
    """(r - mean_group) / (std_group + eps) for rewards [P * G] laid out group by group."""
    r = rewards.reshape(-1, group_size).astype(jnp.float32)
    a = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)
    return a.reshape(-1)


def tis_weights(old_logp, rollout_logp, cap: float):
    """min(p_old / p_rollout, cap): corrects for the rollout engine sampling from a slightly
    different distribution than the trainer's (no gradient)."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - rollout_logp), cap))


def k3(logp_p, logp_q):
    """k3 estimator of KL(q || p) from samples of q: exp(lp - lq) - 1 - (lp - lq)."""
    d = logp_p - logp_q
    return jnp.exp(d) - 1.0 - d


def masked_mean(x, mask):
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(m.sum(), 1.0)


def policy_loss(logp, old_logp, advantages, mask, cfg: GRPOConfig, *, rollout_logp=None, ref_logp=None):
    """Token-level GRPO loss and metrics.

    ratio = exp(logp - old_logp); per token -min(ratio * A, clip(ratio, 1 +- eps) * A),
    times the TIS weight when enabled, plus kl_coef * k3(ref || policy); averaged over all
    response tokens of the batch."""
    ratio = jnp.exp(logp - old_logp)
    a = advantages[:, None]
    unclipped = ratio * a
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * a
    pg = -jnp.minimum(unclipped, clipped)
    if cfg.tis_cap > 0 and rollout_logp is not None:
        pg = pg * tis_weights(old_logp, rollout_logp, cfg.tis_cap)
    loss = masked_mean(pg, mask)
    metrics = {"clip_frac": masked_mean((jnp.abs(ratio - 1.0) > cfg.clip_eps).astype(jnp.float32), mask),
               "pg_loss": loss}
    if cfg.kl_coef > 0 and ref_logp is not None:
        kl = masked_mean(k3(ref_logp, logp), mask)
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = kl
    return loss, metrics


def gap_metrics(train_logp, rollout_logp, mask):
    """Trainer-vs-rollout mismatch over response tokens: max / mean |dlogp| and k3 KL."""
    m = mask.astype(bool)
    d = jnp.abs(train_logp - rollout_logp)
    return {"gap_max": jnp.max(jnp.where(m, d, 0.0)), "gap_mean": masked_mean(d, m),
            "k3_kl": masked_mean(k3(train_logp, rollout_logp), m)}
