"""Turning problems and completions into padded token batches."""

from __future__ import annotations

import numpy as np

from quads_jax.rl.tokenizer import CharTokenizer


def prompt_ids(tok: CharTokenizer, prompt: str, system: str | None = None) -> list[int]:
    """The prompt as the model sees it (the tokenizer's chat template, where it has one)."""
    return tok.prompt_ids(prompt, system)


def sft_batch(tok: CharTokenizer, problems, seq_len: int):
    """tokens [B, L], attn mask [B, L], loss mask [B, L] (on the demonstration and EOS)."""
    b = len(problems)
    tokens = np.zeros((b, seq_len), np.int32)
    attn = np.zeros((b, seq_len), bool)
    loss = np.zeros((b, seq_len), bool)
    for i, p in enumerate(problems):
        pr = prompt_ids(tok, p.prompt)
        full = pr + tok.encode(p.demo) + [tok.eos_id]
        if len(full) > seq_len:
            raise ValueError(f"sft: sequence of {len(full)} tokens exceeds seq_len={seq_len}; raise sft.seq_len")
        tokens[i, : len(full)] = full
        attn[i, : len(full)] = True
        loss[i, len(pr): len(full)] = True
    return {"tokens": tokens, "attn": attn, "loss_mask": loss}


def rl_batch(prompts: list[list[int]], outputs: list[list[int]], rollout_lps: list[list[float]], seq_len: int,
             experts: list | None = None):
    """Prompt + response batches with the rollout's log-probs aligned to response tokens.

    ``experts`` (routing replay): per sequence, the engine's experts per generated token
    ([moe_layers][k] each, the routing of the position whose logits sampled it). They go to
    ``forced_experts`` [B, L_moe, T, k] at positions len(prompt) - 1 + j; every other
    position holds -1 (the trainer routes it itself)."""
    b = len(prompts)
    tokens = np.zeros((b, seq_len), np.int32)
    attn = np.zeros((b, seq_len), bool)
    resp = np.zeros((b, seq_len), bool)
    rlp = np.zeros((b, seq_len), np.float32)
    for i, (p, o, lp) in enumerate(zip(prompts, outputs, rollout_lps)):
        n = len(p) + len(o)
        if n > seq_len:
            raise ValueError(f"rl: sequence of {n} tokens exceeds seq_len={seq_len}")
        tokens[i, :n] = p + o
        attn[i, :n] = True
        resp[i, len(p):n] = True
        rlp[i, len(p):n] = lp
    out = {"tokens": tokens, "attn": attn, "resp_mask": resp, "rollout_logp": rlp}
    if experts is not None:
        ex = [np.asarray(e, np.int32) for e in experts]  # [m, L, k] each
        shape = next((e.shape[1:] for e in ex if e.size), None)
        if shape is None:
            raise ValueError("rl_batch: experts given but every sequence's list is empty")
        forced = np.full((b, shape[0], seq_len, shape[1]), -1, np.int32)
        for i, (p, e) in enumerate(zip(prompts, ex)):
            if len(e) != len(outputs[i]):
                raise ValueError(f"rl_batch: sequence {i} has {len(e)} expert rows for {len(outputs[i])} generated tokens")
            if len(e):
                forced[i, :, len(p) - 1:len(p) - 1 + len(e)] = e.transpose(1, 0, 2)
        out["forced_experts"] = forced
    return out
