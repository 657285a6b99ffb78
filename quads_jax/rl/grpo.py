"""GRPO: group-normalised advantages and the PPO-clipped token-level policy loss.

All functions are pure and work on [N, T] arrays where N = prompts x G samples and
``mask`` marks response tokens. Log-probs are aligned with tokens (``token_logprobs``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from quads_jax.config_util import build


LOSS_AGG = ("token_mean", "seq_mean", "seq_sum_norm")
OVERLONG = ("none", "mask")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO and the variants RL frameworks offer as options.

    loss_agg: "token_mean" (every response token of the batch weighs the same; DAPO),
    "seq_mean" (each sequence's token mean, then the mean over sequences; the original GRPO),
    "seq_sum_norm" (each sequence's token sum over a constant, the response budget; Dr.GRPO).
    clip_eps_high: the upper clip 1 + clip_eps_high (DAPO's clip-higher); None: clip_eps.
    std_norm: divide advantages by the group's std (False: Dr.GRPO). overlong: "mask" drops
    the loss of responses cut at max_new_tokens (DAPO's overlong filtering).
    mini_batches: PPO updates per rollout batch, on disjoint shuffled parts of it.
    micro_batches: gradient accumulation within each update (same gradient, less memory)."""

    group_size: int = 8
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0  # k3 KL to the reference policy; 0 disables (no reference forward)
    tis_cap: float = 0.0  # truncated importance sampling cap C on p_train/p_rollout; 0 disables
    adv_eps: float = 1e-6
    std_norm: bool = True
    loss_agg: str = "token_mean"
    overlong: str = "none"
    mini_batches: int = 1
    micro_batches: int = 1
    routing_replay: bool = False

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGG:
            raise ValueError(f"grpo.loss_agg={self.loss_agg!r}: expected one of {LOSS_AGG}")
        if self.overlong not in OVERLONG:
            raise ValueError(f"grpo.overlong={self.overlong!r}: expected one of {OVERLONG}")
        for f in ("group_size", "mini_batches", "micro_batches"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"grpo.{f}={getattr(self, f)!r}: expected an integer >= 1")

    @classmethod
    def from_dict(cls, d):
        return build(cls, d, "grpo")


def group_advantages(rewards, group_size: int, eps: float = 1e-6, std_norm: bool = True):
    """(r - mean_group) / (std_group + eps) for rewards [P * G] laid out group by group; without
    ``std_norm``, r - mean_group (Dr.GRPO)."""
    r = rewards.reshape(-1, group_size).astype(jnp.float32)
    a = r - r.mean(1, keepdims=True)
    if std_norm:
        a = a / (r.std(1, keepdims=True) + eps)
    return a.reshape(-1)


def aggregate(x, mask, how: str, *, seq_budget: float | None = None, denom=None):
    """The batch loss from per-token values x [N, T] on ``mask``, by ``how`` (LOSS_AGG).
    ``denom``: the normalizer of the whole update when x is one micro-batch of it (token count
    for token_mean, sequence count otherwise), so micro-batch losses add up to the full one."""
    m = mask.astype(jnp.float32)
    if how == "token_mean":
        return jnp.sum(x * m) / (jnp.maximum(m.sum(), 1.0) if denom is None else denom)
    if how == "seq_mean":
        per = jnp.sum(x * m, axis=1) / jnp.maximum(m.sum(1), 1.0)
    else:
        per = jnp.sum(x * m, axis=1) / float(seq_budget or x.shape[1])
    return jnp.sum(per) / (x.shape[0] if denom is None else denom)


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


def policy_loss(logp, old_logp, advantages, mask, cfg: GRPOConfig, *, rollout_logp=None, ref_logp=None,
                seq_budget: float | None = None, denom=None):
    """GRPO loss and metrics.

    ratio = exp(logp - old_logp); per token -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A),
    times the TIS weight when enabled, plus kl_coef * k3(ref || policy); aggregated over the
    response tokens as ``cfg.loss_agg`` says (``aggregate``)."""
    ratio = jnp.exp(logp - old_logp)
    a = advantages[:, None]
    hi = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    unclipped = ratio * a
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + hi) * a
    pg = -jnp.minimum(unclipped, clipped)
    if cfg.tis_cap > 0 and rollout_logp is not None:
        pg = pg * tis_weights(old_logp, rollout_logp, cfg.tis_cap)
    loss = aggregate(pg, mask, cfg.loss_agg, seq_budget=seq_budget, denom=denom)
    metrics = {"clip_frac": masked_mean(((ratio < 1.0 - cfg.clip_eps) | (ratio > 1.0 + hi)).astype(jnp.float32), mask),
               "pg_loss": loss}
    if cfg.kl_coef > 0 and ref_logp is not None:
        kl = aggregate(k3(ref_logp, logp), mask, cfg.loss_agg, seq_budget=seq_budget, denom=denom)
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = kl
    return loss, metrics


def gap_metrics(train_logp, rollout_logp, mask):
    """Trainer-vs-rollout mismatch over response tokens: max / mean |dlogp| and k3 KL."""
    m = mask.astype(bool)
    d = jnp.abs(train_logp - rollout_logp)
    return {"gap_max": jnp.max(jnp.where(m, d, 0.0)), "gap_mean": masked_mean(d, m),
            "k3_kl": masked_mean(k3(train_logp, rollout_logp), m)}
