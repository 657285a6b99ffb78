"""Batched generation with a KV cache, continuous batching and per-token log-probabilities.

    eng = Engine(cfg, recipe=precision.rollout_recipe("quads"), max_batch=64, max_len=256)
    eng.load(params, version=1)          # flat float params; quantized once for the recipe
    results = eng.generate([Request(prompt=[1, 5, 7], max_new_tokens=16, seed=0)])

Scheduling: ``max_batch`` slots share one preallocated cache. Each iteration admits
waiting requests into free slots (one jitted prefill over the batch in which only the
new rows are real), then runs jitted decode steps for all active slots; a finished
sequence frees its slot for the next waiting request. Sampling is per row with its own
seed (``fold_in(key(seed), position)``), so a request's tokens do not depend on what it
is batched with. Quantized recipes use per-token activation scales for the same reason.

Log-probabilities are ``log_softmax`` of the raw (untempered) logits at the sampled
token, in float32: the quantity the trainer recomputes.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from quads_jax import precision as P
from quads_jax.model import ModelConfig, Transformer, prepare_for_rollout
from quads_jax.model.layers import init_kv_cache
from quads_jax.train.state import split_params, to_model


@dataclasses.dataclass
class Request:
    prompt: Sequence[int]
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    return_experts: bool = False


@dataclasses.dataclass
class Result:
    output_ids: list
    logprobs: list
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    weight_version: object
    experts: list | None = None  # per generated token: [moe_layers][k] expert ids


def sample(logits, temperature, top_p, top_k, keys):
    """Row-wise sampling: logits [B, V] float32; temperature/top_p/top_k [B]; keys [B].
    Returns (tokens [B], logprob of each under the raw logits [B])."""
    v = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1)
    srt = jnp.take_along_axis(logits, order, axis=-1)
    t = jnp.maximum(temperature, 1e-6)[:, None]
    scaled = srt / t
    rank = jnp.arange(v)[None, :]
    k = jnp.where(top_k > 0, top_k, v)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before this token
    keep = (rank < k) & ((before < top_p[:, None]) | (rank == 0))
    masked = jnp.where(keep, scaled, -jnp.inf)
    pick = jax.vmap(lambda key, l: jax.random.categorical(key, l))(keys, masked)
    pick = jnp.where(temperature <= 0, 0, pick)
    tok = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    lp = jax.nn.log_softmax(logits, axis=-1)
    return tok.astype(jnp.int32), jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]


class Engine:
    def __init__(self, cfg: ModelConfig, *, recipe: P.Precision | str = "bf16", max_batch: int = 32,
                 max_len: int | None = None, eos_token_id: int | None = None, prefill_bucket: int = 32):
        self.cfg = cfg
        self.recipe = P.rollout_recipe(recipe) if isinstance(recipe, str) else recipe
        self.recipe_name = recipe if isinstance(recipe, str) else "custom"
        self.max_batch = int(max_batch)
        self.max_len = int(max_len or cfg.max_seq_len)
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"max_len={self.max_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        self.eos = eos_token_id
        self.bucket = int(prefill_bucket)
        self.version = None
        self._model = None
        self._lock = threading.Lock()  # weight swaps wait for a running generate() to finish
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        self._graphdef, _, _ = split_params(abstract)
        recipe_ = self.recipe

        def prep(params):
            m = prepare_for_rollout(to_model(self._graphdef, params), recipe_)
            return nnx.split(m)[1]

        self._prepare = jax.jit(prep)
        self._rgraph = nnx.split(nnx.eval_shape(lambda: prepare_for_rollout(Transformer(cfg, rngs=nnx.Rngs(0)), recipe_)))[0]
        self._step = jax.jit(self._step_impl)

    # -- weights
    def load(self, params: dict, version=None):
        """Quantize float params once for the recipe and swap them in (after in-flight work)."""
        state = self._prepare(params)
        with self._lock:
            self._state = state
            self.version = version

    @property
    def loaded(self) -> bool:
        return self.version is not None or hasattr(self, "_state")

    def _step_impl(self, state, tokens, mask, cache, last_idx, temperature, top_p, top_k, keys):
        model = nnx.merge(self._rgraph, state)
        logits, aux, cache = model.forward(tokens, mask=mask, cache=cache)
        last = jnp.take_along_axis(logits, last_idx[:, None, None], axis=1)[:, 0]
        tok, lp = sample(last, temperature, top_p, top_k, keys)
        experts = aux["experts"]
        if experts is not None:  # [L, B, T, k] -> at the last real position [B, L, k]
            experts = jnp.take_along_axis(experts, last_idx[None, :, None, None], axis=2)[:, :, 0].transpose(1, 0, 2)
        return tok, lp, cache, experts

    # -- generation
    def validate(self, requests: Sequence[Request]) -> None:
        """ValueError naming the first request that cannot run (empty prompt, too long, bad ids)."""
        for i, r in enumerate(requests):
            if r.max_new_tokens < 1:
                raise ValueError(f"requests[{i}].max_new_tokens={r.max_new_tokens}: expected >= 1")
            if len(r.prompt) == 0:
                raise ValueError(f"requests[{i}].prompt: expected at least one token")
            if len(r.prompt) + r.max_new_tokens > self.max_len:
                raise ValueError(f"requests[{i}]: prompt ({len(r.prompt)}) + max_new_tokens ({r.max_new_tokens}) "
                                 f"exceeds the context length {self.max_len}")
            bad = [t for t in r.prompt if not 0 <= int(t) < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"requests[{i}].prompt: token ids {bad[:5]} outside [0, {self.cfg.vocab_size})")

    def generate(self, requests: Sequence[Request]) -> list[Result]:
        if not hasattr(self, "_state"):
            raise RuntimeError("Engine.generate: no weights loaded (call load(params) first)")
        self.validate(requests)
        with self._lock:
            return self._run(list(requests), self._state, self.version)

    def _run(self, requests, state, version):
        b = self.max_batch
        maxp = max(len(r.prompt) for r in requests)
        pb = -(-maxp // self.bucket) * self.bucket
        cache = init_kv_cache(self.cfg, b, self.max_len + pb)
        waiting = list(range(len(requests)))
        slot_req = [-1] * b
        out_ids = [[] for _ in requests]
        out_lp = [[] for _ in requests]
        out_ex = [[] for _ in requests]
        finish = [None] * len(requests)
        last_tok = np.zeros(b, np.int32)
        temp = np.ones(b, np.float32)
        topp = np.ones(b, np.float32)
        topk = np.zeros(b, np.int32)
        seeds = np.zeros(b, np.uint32)
        while waiting or any(s >= 0 for s in slot_req):
            free = [i for i in range(b) if slot_req[i] < 0]
            admit = []
            while free and waiting:
                s, r = free.pop(0), waiting.pop(0)
                slot_req[s] = r
                admit.append(s)
            if admit:  # prefill the new rows; other rows are masked off (their cache is untouched in range)
                toks = np.zeros((b, pb), np.int32)
                mask = np.zeros((b, pb), bool)
                lengths = np.asarray(cache["lengths"]).copy()
                for s in admit:
                    lengths[s] = 0
                    r = requests[slot_req[s]]
                    toks[s, : len(r.prompt)] = r.prompt
                    mask[s, : len(r.prompt)] = True
                    temp[s], topp[s], topk[s], seeds[s] = r.temperature, r.top_p, r.top_k, r.seed
                cache["lengths"] = jnp.asarray(lengths)
                last = np.maximum(mask.sum(1) - 1, 0).astype(np.int32)
                self._advance(state, toks, mask, cache, last, temp, topp, topk, seeds, admit, slot_req, requests,
                              out_ids, out_lp, out_ex, finish, last_tok)
                cache = self._cache
                continue
            active = [i for i in range(b) if slot_req[i] >= 0]
            toks = last_tok[:, None].copy()
            mask = np.zeros((b, 1), bool)
            mask[active] = True
            self._advance(state, toks, mask, cache, np.zeros(b, np.int32), temp, topp, topk, seeds, active, slot_req,
                          requests, out_ids, out_lp, out_ex, finish, last_tok)
            cache = self._cache
        return [Result(output_ids=out_ids[i], logprobs=out_lp[i], finish_reason=finish[i],
                       prompt_tokens=len(requests[i].prompt), weight_version=version,
                       experts=out_ex[i] if requests[i].return_experts else None) for i in range(len(requests))]

    def _advance(self, state, toks, mask, cache, last, temp, topp, topk, seeds, rows, slot_req, requests,
                 out_ids, out_lp, out_ex, finish, last_tok):
        pos = np.array([len(out_ids[slot_req[i]]) if slot_req[i] >= 0 else 0 for i in range(len(slot_req))])
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(jnp.asarray(seeds), jnp.asarray(pos))
        tok, lp, cache, experts = self._step(state, jnp.asarray(toks), jnp.asarray(mask), cache, jnp.asarray(last),
                                             jnp.asarray(temp), jnp.asarray(topp), jnp.asarray(topk), keys)
        self._cache = cache
        tok, lp = np.asarray(tok), np.asarray(lp)
        ex = None if experts is None else np.asarray(experts)
        for s in rows:
            ri = slot_req[s]
            r = requests[ri]
            t = int(tok[s])
            out_ids[ri].append(t)
            out_lp[ri].append(float(lp[s]))
            if r.return_experts and ex is not None:
                out_ex[ri].append(ex[s].tolist())
            last_tok[s] = t
            stop = (t in r.stop_token_ids) or (not r.ignore_eos and self.eos is not None and t == self.eos)
            if stop or len(out_ids[ri]) >= r.max_new_tokens:
                finish[ri] = "stop" if stop else "length"
                slot_req[s] = -1
