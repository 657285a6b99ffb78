"""Batched generation with a KV cache, continuous batching and per-token log-probabilities.

    eng = Engine(cfg, recipe=precision.rollout_recipe("quads"), max_batch=64, max_len=256)
    eng.load(params, version=1)          # flat float params; quantized once for the recipe
    results = eng.generate([Request(prompt=[1, 5, 7], max_new_tokens=16, seed=0)])

Scheduling: ``max_batch`` slots share one preallocated cache (donated to every jitted
call, so it is updated in place). Each iteration admits waiting requests into free slots
(one jitted prefill over the batch in which only the new rows are real), then runs a
*decode burst*: ``decode_burst`` decode steps in one jitted loop on the device, with
sampling, stop tokens and length limits checked there (a row that finishes stops writing
its cache and emitting tokens), and one transfer to the host at the end. A finished
sequence frees its slot for the next waiting request at the end of the burst. Every burst
runs all its steps: with a constant trip count XLA runs the loop without copying its
predicate to the host each step, which costs more than the at most ``decode_burst - 1``
idle steps of a slot that frees mid-burst. Sampling
is per row with its own seed (``fold_in(key(seed), position)``), so a request's tokens
do not depend on what it is batched with nor on the burst length. Quantized recipes use
per-token activation scales for the same reason.

Batch invariance: every array shape a request meets depends only on the engine and on
its own prompt length, never on its companions: the cache holds ``max_len`` rounded up to a
prefill bucket for every call, rows admitted together are prefilled in groups of one bucket
each, and the stop-token table has a fixed width (``max_stop_ids``). So a request's tokens
and log-probs are the same alone or beside other prompts (tested bit for bit).

Log-probabilities are ``log_softmax`` of the raw (untempered) logits at the sampled
token, in float32: the quantity the trainer recomputes.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from numbers import Integral, Real
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
    top_logprobs: int = 0  # the most likely tokens' log-probs at each generated position (<= TOP_LOGPROBS_MAX)
    prompt_logprobs: bool = False  # log-probs of the prompt's tokens (and their top ones with top_logprobs)


@dataclasses.dataclass
class Result:
    output_ids: list
    logprobs: list
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    weight_version: object
    experts: list | None = None  # per generated token: [moe_layers][k] expert ids of the position that sampled it
    prompt_experts: list | None = None  # per prompt position but the last: [moe_layers][k] (the rest of SGLang's routed_experts)
    top_logprobs: list | None = None  # per generated token: [(logprob, token id)] * Request.top_logprobs, best first
    prompt_logprobs: list | None = None  # log p(prompt[i] | prompt[:i]) for i = 1 .. len(prompt) - 1
    prompt_top_logprobs: list | None = None  # per prompt position 1 ..: [(logprob, token id)] * Request.top_logprobs


def filters(top_k, top_p, vocab: int):
    """Per row, whether it samples from a top-k / top-p set (numpy or jax arrays [B])."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)


def sample(logits, temperature, top_p, top_k, keys, filtered: bool = True):
    """Row-wise sampling: logits [B, V] float32; temperature/top_p/top_k [B]; keys [B].
    Returns (tokens [B], logprob of each under the raw logits [B]).

    Gumbel-max over the tempered logits in vocabulary order, restricted to the top-k /
    top-p set of the rows that ask for one: the set is "logit >= the smallest kept logit"
    (tokens tied with the last kept one are kept too); other rows keep every token.
    ``filtered`` (a Python bool: whether any row may filter) skips the sort that finds the
    set when False; the engine knows it on the host, so its jitted decode loop holds no
    device-side branch (XLA:GPU copies a branch's predicate to the host and waits for it).
    temperature <= 0 is greedy (argmax)."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]

    def kept_floor(scaled):
        srt = -jnp.sort(-scaled, axis=-1)  # descending
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before this token
        rank = jnp.arange(v)[None, :]
        k = jnp.where(top_k > 0, top_k, v)[:, None]
        keep = (rank < k) & ((before < top_p[:, None]) | (rank == 0))
        return jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1)

    floor = jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype)
    if filtered:
        floor = jnp.where(filters(top_k, top_p, v), kept_floor(scaled), floor)
    g = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys)
    pick = jnp.argmax(jnp.where(scaled >= floor[:, None], scaled + g, -jnp.inf), axis=-1)
    tok = jnp.where(temperature <= 0, jnp.argmax(logits, axis=-1), pick).astype(jnp.int32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]


TOP_LOGPROBS_MAX = 20  # the widest top-log-prob list a request may ask for (one static shape)


def top_logprobs(logits, want):
    """The TOP_LOGPROBS_MAX largest log-probs of logits [..., V] and their token ids, best first;
    computed only when ``want``, zeros otherwise. ``want`` a Python bool: decided while
    tracing (the decode loop's case, which holds no device-side branch); a traced bool: a
    ``lax.cond`` (the prefill's, once per admitted batch)."""
    shape = logits.shape[:-1] + (TOP_LOGPROBS_MAX,)

    def run(x):
        v, i = jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), TOP_LOGPROBS_MAX)
        return v, i.astype(jnp.int32)

    zeros = lambda x: (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32))
    if isinstance(want, bool):
        return run(logits) if want else zeros(logits)
    return jax.lax.cond(want, run, zeros, logits)


def row_keys(seeds, positions):
    """The sampling key of each row: fold_in(key(seed), number of tokens it generated)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


class Engine:
    def __init__(self, cfg: ModelConfig, *, recipe: P.Precision | str = "bf16", max_batch: int = 32,
                 max_len: int | None = None, eos_token_id: int | None = None, prefill_bucket: int = 32,
                 decode_burst: int = 16, max_stop_ids: int = 8):
        self.cfg = cfg
        self.recipe = P.rollout_recipe(recipe) if isinstance(recipe, str) else recipe
        self.recipe_name = recipe if isinstance(recipe, str) else "custom"
        self.max_batch = int(max_batch)
        self.max_len = int(max_len or cfg.max_seq_len)
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"max_len={self.max_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        self.eos = eos_token_id
        self.bucket = int(prefill_bucket)
        if int(decode_burst) < 1:
            raise ValueError(f"decode_burst={decode_burst}: expected >= 1 (decode steps per device loop)")
        self.decode_burst = int(decode_burst)
        if int(max_stop_ids) < 1:
            raise ValueError(f"max_stop_ids={max_stop_ids}: expected >= 1 (stop ids per request, EOS included)")
        self.max_stop_ids = int(max_stop_ids)
        self.cache_len = -(-self.max_len // self.bucket) * self.bucket  # one shape for every call
        self.version = None
        self._model = None
        self._lock = threading.Lock()  # weight swaps wait for a running generate() to finish
        self._host_state = None  # the weights while released to host memory (release_memory)
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        self._graphdef, _, _ = split_params(abstract)
        recipe_ = self.recipe

        def prep(params):
            m = prepare_for_rollout(to_model(self._graphdef, params), recipe_)
            return nnx.split(m)[1]

        self._prepare = jax.jit(prep)
        self._rgraph = nnx.split(nnx.eval_shape(lambda: prepare_for_rollout(Transformer(cfg, rngs=nnx.Rngs(0)), recipe_)))[0]
        # the recipe's KernelConfig.command_buffers: how the prefill and decode programs launch kernels
        xla = self.recipe.kernels.compiler_options()
        self._step = jax.jit(self._step_impl, donate_argnames=("cache",), static_argnames=("filtered",), compiler_options=xla)
        self._burst = jax.jit(self._burst_impl, donate_argnames=("cache",), static_argnames=("filtered", "want_top"),
                              compiler_options=xla)

    # -- weights
    def load(self, params: dict, version=None):
        """Quantize float params once for the recipe and swap them in (after in-flight work)."""
        state = self._prepare(params)
        with self._lock:
            self._state = state
            self._host_state = None
            self.version = version

    MEMORY_TAGS = ("weights", "kv_cache")

    def release_memory(self, tags=None):
        """Free device memory between rollouts (SGLang's release_memory_occupation): "weights"
        moves the prepared weights to host memory; "kv_cache" frees nothing, because the cache
        lives only inside a ``generate`` call. Waits for a running ``generate``."""
        tags = self._tags(tags)
        with self._lock:
            if "weights" in tags and hasattr(self, "_state") and self._host_state is None:
                self._host_state = jax.device_get(self._state)
                jax.tree.map(lambda a: a.delete() if isinstance(a, jax.Array) else None, self._state)
                del self._state

    def resume_memory(self, tags=None):
        """Undo ``release_memory``: the weights back on the device, as they were."""
        tags = self._tags(tags)
        with self._lock:
            if "weights" in tags and self._host_state is not None:
                self._state = jax.device_put(self._host_state)
                self._host_state = None

    @property
    def released(self) -> bool:
        return self._host_state is not None

    def _tags(self, tags):
        tags = self.MEMORY_TAGS if tags is None else tuple(tags)
        bad = [t for t in tags if t not in self.MEMORY_TAGS]
        if bad:
            raise ValueError(f"tags={bad}: expected some of {list(self.MEMORY_TAGS)}")
        return tags

    @property
    def loaded(self) -> bool:
        return self.version is not None or hasattr(self, "_state")

    def _sample_at(self, model, tokens, mask, cache, last_idx, temperature, top_p, top_k, seeds, pos, want_top, filtered):
        """One forward over tokens [B, T]; samples at each row's last_idx. -> (tok, lp, cache,
        experts [B, L_moe, k] at that position or None, top log-probs (values, ids) [B, TOP],
        logits [B, T, V], experts of every position [B, T, L_moe, k] or None)."""
        logits, aux, cache = model.forward(tokens, mask=mask, cache=cache)
        last = jnp.take_along_axis(logits, last_idx[:, None, None], axis=1)[:, 0]
        tok, lp = sample(last, temperature, top_p, top_k, row_keys(seeds, pos), filtered)
        top = top_logprobs(last, want_top if isinstance(want_top, bool) else jnp.any(want_top & mask.any(1)))
        every = None if aux["experts"] is None else aux["experts"].transpose(1, 2, 0, 3)  # [B, T, L, k]
        at_last = None if every is None else jnp.take_along_axis(every, last_idx[:, None, None, None], axis=1)[:, 0]
        return tok, lp, cache, at_last, top, logits, every

    def _step_impl(self, state, tokens, mask, cache, last_idx, temperature, top_p, top_k, seeds, pos, want_top,
                   want_prompt, filtered):
        """A prefill: ``_sample_at``, plus for the rows that ask (computed only when one does) the
        prompt's log-probs [B, T-1] and their top ones, and the experts of every position
        [B, T, L, k] (fetched to the host only for requests that asked for their routing)."""
        model = nnx.merge(self._rgraph, state)
        tok, lp, cache, at_last, top, logits, every = self._sample_at(model, tokens, mask, cache, last_idx, temperature,
                                                                      top_p, top_k, seeds, pos, want_top, filtered)
        pred = logits[:, :-1]  # position i predicts token i + 1

        def prompt_lp(x):
            return jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tokens[:, 1:, None], axis=-1)[..., 0]

        any_prompt = jnp.any(want_prompt & mask.any(1))
        plp = jax.lax.cond(any_prompt, prompt_lp, lambda x: jnp.zeros(x.shape[:2], jnp.float32), pred)
        ptop = top_logprobs(pred, jnp.any(want_prompt & want_top & mask.any(1)))
        return tok, lp, cache, at_last, top, every, plp, ptop

    def _burst_impl(self, state, tok, alive, cache, temperature, top_p, top_k, seeds, pos, remaining, stops,
                    want_top: bool, filtered: bool):
        """``decode_burst`` decode steps in one device loop (a constant trip count). Row b feeds its
        last token while ``alive[b]``; it stops after ``remaining[b]`` tokens or on a token in
        ``stops[b]`` (padded with -1). ``want_top`` (top log-probs for every row) and
        ``filtered`` (some row filters by top-k / top-p) are static: the step holds no
        device-side branch. Returns per step [decode_burst, B] tokens, logprobs, and whether
        the row emitted a token, the experts ([burst, B, L, k] or None), and the cache."""
        model = nnx.merge(self._rgraph, state)
        b, nb = tok.shape[0], self.decode_burst
        zeros_b = jnp.zeros((b,), jnp.int32)

        def step(tok, alive, cache, pos):
            t, lp, cache, ex, top, _, _ = self._sample_at(model, tok[:, None], alive[:, None], cache, zeros_b, temperature,
                                                          top_p, top_k, seeds, pos, want_top, filtered)
            return t, lp, cache, ex, top

        shapes = jax.eval_shape(step, tok, alive, cache, pos)
        out = {"tok": jnp.zeros((nb, b), jnp.int32), "lp": jnp.zeros((nb, b), jnp.float32),
               "emitted": jnp.zeros((nb, b), bool), "top_lp": jnp.zeros((nb, b, TOP_LOGPROBS_MAX), jnp.float32),
               "top_id": jnp.zeros((nb, b, TOP_LOGPROBS_MAX), jnp.int32)}
        if shapes[3] is not None:
            out["experts"] = jnp.zeros((nb,) + shapes[3].shape, shapes[3].dtype)

        def body(i, carry):
            tok, alive, cache, pos, rem, out = carry
            t, lp, cache, ex, (tv, ti) = step(tok, alive, cache, pos)
            out = dict(out, tok=out["tok"].at[i].set(t), lp=out["lp"].at[i].set(lp), emitted=out["emitted"].at[i].set(alive),
                       top_lp=out["top_lp"].at[i].set(tv), top_id=out["top_id"].at[i].set(ti))
            if ex is not None:
                out["experts"] = out["experts"].at[i].set(ex)
            step_on = alive.astype(jnp.int32)
            rem = rem - step_on
            stopped = jnp.any(t[:, None] == stops, axis=1)
            return jnp.where(alive, t, tok), alive & (rem > 0) & ~stopped, cache, pos + step_on, rem, out

        carry = jax.lax.fori_loop(0, nb, body, (tok, alive, cache, pos, remaining, out))
        return carry[5], carry[2]

    # -- generation
    def validate(self, requests: Sequence[Request]) -> None:
        """ValueError naming the first request that cannot run, checked against the engine's
        true limits (types, ranges, context length, vocabulary, seed width, stop-table width)."""
        v = self.cfg.vocab_size
        for i, r in enumerate(requests):
            name = f"requests[{i}]"
            if not isinstance(r, Request):
                raise ValueError(f"{name}: expected a rollout.engine.Request, got {type(r).__name__}")
            if not isinstance(r.max_new_tokens, Integral) or isinstance(r.max_new_tokens, bool) or r.max_new_tokens < 1:
                raise ValueError(f"{name}.max_new_tokens={r.max_new_tokens!r}: expected an integer >= 1")
            for field, lo, hi in (("temperature", 0.0, math.inf), ("top_p", 0.0, 1.0)):
                x = getattr(r, field)
                if not isinstance(x, Real) or isinstance(x, bool) or not math.isfinite(x) or not lo <= x <= hi or (field == "top_p" and x == 0):
                    raise ValueError(f"{name}.{field}={x!r}: expected a finite number in "
                                     + ("[0, inf)" if field == "temperature" else "(0, 1]"))
            if not isinstance(r.top_k, Integral) or isinstance(r.top_k, bool) or r.top_k < 0:
                raise ValueError(f"{name}.top_k={r.top_k!r}: expected an integer >= 0 (0: off; values >= the vocabulary also mean off)")
            if not isinstance(r.seed, Integral) or isinstance(r.seed, bool) or not 0 <= r.seed < 2**32:
                raise ValueError(f"{name}.seed={r.seed!r}: expected an integer in [0, 2**32)")
            prompt = list(r.prompt)
            if len(prompt) == 0:
                raise ValueError(f"{name}.prompt: expected at least one token")
            if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
                raise ValueError(f"{name}.prompt: expected integer token ids")
            if len(prompt) + r.max_new_tokens > self.max_len:
                raise ValueError(f"{name}: prompt ({len(prompt)}) + max_new_tokens ({r.max_new_tokens}) "
                                 f"exceeds the context length {self.max_len}")
            bad = [t for t in prompt if not 0 <= int(t) < v]
            if bad:
                raise ValueError(f"{name}.prompt: token ids {bad[:5]} outside [0, {v})")
            if not isinstance(r.top_logprobs, Integral) or isinstance(r.top_logprobs, bool) or not 0 <= r.top_logprobs <= TOP_LOGPROBS_MAX:
                raise ValueError(f"{name}.top_logprobs={r.top_logprobs!r}: expected an integer in [0, {TOP_LOGPROBS_MAX}]")
            stops = list(r.stop_token_ids)
            if not all(isinstance(t, Integral) and not isinstance(t, bool) and 0 <= t < v for t in stops):
                raise ValueError(f"{name}.stop_token_ids: expected token ids in [0, {v})")
            if len(set(self._stop_ids(r))) > self.max_stop_ids:
                raise ValueError(f"{name}.stop_token_ids: at most {self.max_stop_ids} stop ids (EOS included) per request")

    def _stop_ids(self, r: Request) -> list[int]:
        ids = list(dict.fromkeys(int(t) for t in r.stop_token_ids))
        if not r.ignore_eos and self.eos is not None and self.eos not in ids:
            ids.append(int(self.eos))
        return ids

    def generate(self, requests: Sequence[Request]) -> list[Result]:
        if self.released:
            raise RuntimeError("Engine.generate: the weights are released to host memory (call resume_memory() first)")
        if not hasattr(self, "_state"):
            raise RuntimeError("Engine.generate: no weights loaded (call load(params) first)")
        requests = list(requests)
        self.validate(requests)
        if not requests:
            return []
        with self._lock:
            return self._run(requests, self._state, self.version)

    def _run(self, requests, state, version):
        b = self.max_batch
        cache = init_kv_cache(self.cfg, b, self.cache_len)
        vocab = self.cfg.vocab_size
        waiting = list(range(len(requests)))
        slot_req = [-1] * b
        out_ids = [[] for _ in requests]
        out_lp = [[] for _ in requests]
        out_ex = [[] for _ in requests]
        prompt_ex = [None] * len(requests)
        out_top = [[] for _ in requests]
        prompt_lp = [None] * len(requests)
        prompt_top = [None] * len(requests)
        finish = [None] * len(requests)
        last_tok = np.zeros(b, np.int32)
        temp = np.ones(b, np.float32)
        topp = np.ones(b, np.float32)
        topk = np.zeros(b, np.int32)
        seeds = np.zeros(b, np.uint32)
        want_top = np.zeros(b, bool)
        want_prompt = np.zeros(b, bool)
        stops = np.full((b, self.max_stop_ids), -1, np.int32)  # a slot's stop ids; one width: one compile

        stop_sets = [set(self._stop_ids(r)) for r in requests]

        def pairs(vals, ids, n):
            return [(float(v), int(t)) for v, t in zip(vals[:n], ids[:n])]

        def record(rows, toks, lps, emitted, experts, top=None):
            """Append each row's emitted tokens ([steps, B] arrays); finish and free slots.
            A row emits on a prefix of the steps (the device stops it after its first stop
            token or its last allowed one), so only a row's last token can finish it. One
            list operation a row, not a token: at batch 512 the host's share of a burst."""
            counts = emitted.sum(0)
            if not np.array_equal(emitted, np.arange(emitted.shape[0])[:, None] < counts):
                raise RuntimeError("decode burst: a row emitted after it stopped")
            tok_rows, lp_rows = toks.T.tolist(), lps.T.tolist()
            rows = [s for s in rows if slot_req[s] >= 0 and counts[s]]
            last_tok[rows] = toks[counts[rows] - 1, rows]
            for s in rows:
                ri, c = slot_req[s], int(counts[s])
                r = requests[ri]
                out_ids[ri] += tok_rows[s][:c]
                out_lp[ri] += lp_rows[s][:c]
                if r.return_experts and experts is not None:
                    out_ex[ri] += experts[:c, s].tolist()
                if r.top_logprobs:
                    out_top[ri] += [pairs(top[0][i, s], top[1][i, s], r.top_logprobs) for i in range(c)]
                stop = tok_rows[s][c - 1] in stop_sets[ri]
                if stop or len(out_ids[ri]) >= r.max_new_tokens:
                    finish[ri] = "stop" if stop else "length"
                    slot_req[s] = -1

        def filtered(rows):  # whether a row of ``rows`` samples from a top-k / top-p set
            return bool(filters(topk[rows], topp[rows], vocab).any())

        def positions():
            return np.array([len(out_ids[q]) if q >= 0 else 0 for q in slot_req], np.int32)

        while waiting or any(s >= 0 for s in slot_req):
            free = [i for i in range(b) if slot_req[i] < 0]
            admit = []
            while free and waiting:
                s, r = free.pop(0), waiting.pop(0)
                slot_req[s] = r
                admit.append(s)
            if admit:  # prefill the new rows, one call per prompt bucket; other rows are masked off
                for s in admit:
                    r = requests[slot_req[s]]
                    temp[s], topp[s], seeds[s] = r.temperature, r.top_p, r.seed
                    topk[s] = 0 if r.top_k >= vocab else r.top_k
                    want_top[s], want_prompt[s] = r.top_logprobs > 0, r.prompt_logprobs
                    x = sorted(stop_sets[slot_req[s]])
                    stops[s] = -1
                    stops[s, : len(x)] = x
                groups: dict[int, list[int]] = {}
                for s in admit:
                    n = len(requests[slot_req[s]].prompt)
                    groups.setdefault(-(-n // self.bucket) * self.bucket, []).append(s)
                for pb, rows in sorted(groups.items()):
                    toks = np.zeros((b, pb), np.int32)
                    mask = np.zeros((b, pb), bool)
                    lengths = np.asarray(cache["lengths"]).copy()
                    for s in rows:
                        lengths[s] = 0
                        r = requests[slot_req[s]]
                        toks[s, : len(r.prompt)] = r.prompt
                        mask[s, : len(r.prompt)] = True
                    cache["lengths"] = jnp.asarray(lengths)
                    last = np.maximum(mask.sum(1) - 1, 0).astype(np.int32)
                    tok, lp, cache, ex, top, every, plp, ptop = self._step(
                        state, toks, mask, cache, last, temp, topp, topk, seeds, positions(), want_top & mask.any(1),
                        want_prompt & mask.any(1), filtered=filtered(rows))
                    # what only some requests asked for leaves the device only when one of them did
                    wants = [s for s in rows if requests[slot_req[s]].return_experts]
                    if wants and every is not None:
                        every_h = np.asarray(every)
                        for s in wants:
                            prompt_ex[slot_req[s]] = every_h[s, : len(requests[slot_req[s]].prompt) - 1].tolist()
                    wants = [s for s in rows if requests[slot_req[s]].prompt_logprobs]
                    if wants:
                        plp_h, (pv, pi) = np.asarray(plp), jax.device_get(ptop)
                        for s in wants:
                            r, n = requests[slot_req[s]], len(requests[slot_req[s]].prompt) - 1
                            prompt_lp[slot_req[s]] = plp_h[s, :n].tolist()
                            if r.top_logprobs:
                                prompt_top[slot_req[s]] = [pairs(pv[s, j], pi[s, j], r.top_logprobs) for j in range(n)]
                    top_h = tuple(a[None] for a in jax.device_get(top)) if want_top[rows].any() else None
                    record(rows, np.asarray(tok)[None], np.asarray(lp)[None], np.ones((1, b), bool),
                           None if ex is None else np.asarray(ex)[None], top_h)
                continue
            active = [i for i in range(b) if slot_req[i] >= 0]
            remaining = np.zeros(b, np.int32)
            for s in active:
                remaining[s] = requests[slot_req[s]].max_new_tokens - len(out_ids[slot_req[s]])
            any_top = bool(want_top[active].any())
            out, cache = self._burst(state, last_tok, remaining > 0, cache, temp, topp, topk, seeds, positions(),
                                     remaining, stops, want_top=any_top, filtered=filtered(active))
            if not any_top:  # the top log-probs were not computed: leave them on the device
                out = {k: v for k, v in out.items() if not k.startswith("top_")}
            out = jax.device_get(out)
            record(active, out["tok"], out["lp"], out["emitted"], out.get("experts"),
                   (out["top_lp"], out["top_id"]) if "top_lp" in out else None)
        return [Result(output_ids=out_ids[i], logprobs=out_lp[i], finish_reason=finish[i],
                       prompt_tokens=len(requests[i].prompt), weight_version=version,
                       experts=out_ex[i] if requests[i].return_experts else None,
                       prompt_experts=prompt_ex[i] if requests[i].return_experts else None,
                       top_logprobs=out_top[i] if requests[i].top_logprobs else None,
                       prompt_logprobs=prompt_lp[i], prompt_top_logprobs=prompt_top[i]) for i in range(len(requests))]
