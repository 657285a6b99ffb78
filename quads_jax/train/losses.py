"""Loss functions with the ``loss_fn(model, batch, rng) -> (loss, metrics)`` signature."""

from __future__ import annotations

import jax.numpy as jnp

from quads_jax.model import token_logprobs


def sft_loss(precision=None, aux_coef: float | None = None):
    """Cross-entropy on ``batch["loss_mask"]`` tokens (plus the router's load-balance loss)."""

    def loss_fn(model, batch, rng):
        del rng
        lp, aux = token_logprobs(model, batch["tokens"], batch["attn"], precision=precision, return_aux=True)
        m = batch["loss_mask"].astype(jnp.float32)
        ce = -jnp.sum(lp * m) / jnp.maximum(m.sum(), 1.0)
        coef = model.cfg.router_aux_coef if aux_coef is None else aux_coef
        loss = ce + coef * aux["aux_loss"] + model.cfg.router_z_coef * aux["z_loss"]
        return loss, {"ce": ce, "aux_loss": aux["aux_loss"], "tokens": m.sum()}

    return loss_fn
