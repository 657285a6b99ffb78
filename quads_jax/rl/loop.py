"""The RL job: SFT warm start, then GRPO with a QUADS precision recipe.

Each GRPO step: sync the trainer's weights to the rollout engine (in-process: the float
params are quantized once by the engine for its recipe), generate G samples per prompt,
score them, recompute log-probs with the trainer (its QAT policy), log the
trainer-vs-rollout gap, and update.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from tqdm import tqdm

from quads_jax import metrics as MW
from quads_jax.config_util import build
from pallas_kernels import KernelConfig
from quads_jax import precision as P
from quads_jax.model import ModelConfig, Transformer, from_dict, token_logprobs
from quads_jax.rl import data as D
from quads_jax.rl import grpo as G
from quads_jax.rl.rewards import RewardPool
from quads_jax.rl.tasks import get_task
from quads_jax.rl.tokenizer import CharTokenizer
from quads_jax.train.checkpoint import Checkpointer
from quads_jax.train import flops as FL
from quads_jax.train.losses import sft_loss
from quads_jax.train.state import OptimConfig, init_state, make_optimizer, make_train_step, split_params, to_model
from rollout.engine import Engine, Request

# recipe -> (trainer precision policy, rollout recipe). The paper's RL comparison.
RECIPES = P.RECIPES  # (trainer policy, rollout recipe) by job recipe name

RL_COLUMNS = ["step", "reward_mean", "pass_at_1", "pass_at_1_bf16", "pass_at_1_bf16_rise_se", "gap_max", "gap_mean", "k3_kl", "entropy", "response_len",
              "clip_frac", "grad_norm", "loss", "skipped", "kl_ref", "tokens_per_s", "weight_sync_s", "rollout_s", "train_s"]


@dataclasses.dataclass(frozen=True)
class RLConfig:
    recipe: str = "quads"
    rac_ratio: float | None = None  # None: the recipe's (0.5 for quads)
    rac_sum: str | None = None  # None: the recipe's ("fp16"); "exact": pallas_kernels.rac
    steps: int = 20
    prompts_per_step: int = 16
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    eval_every: int = 10
    eval_n: int = 128
    seq_len: int = 48
    grpo: dict = dataclasses.field(default_factory=dict)
    optim: dict = dataclasses.field(default_factory=dict)
    # None: the engine in-process (weights synced as device arrays). A URL: a `quads serve` (or
    # SGLang-API) server, synced each step through an orbax step in OUT/weight_sync.
    rollout_url: str | None = None
    reward_workers: int = 4  # threads that score completions while the device computes log-probs


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = 300  # at most
    batch: int = 64
    seq_len: int = 48
    # stop once greedy held-out pass@1 reaches this (RL needs room to improve); 0 disables
    target_pass_at_1: float = 0.0
    eval_every: int = 20
    eval_n: int = 64
    optim: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class JobConfig:
    seed: int
    model: object
    task: str
    task_kwargs: dict
    sft: SFTConfig
    rl: RLConfig
    train_n: int
    kernels: object = None  # pallas_kernels.KernelConfig from `kernels: {backend, grouped, attention}`
    hf: str | None = None  # `model: {hf: DIR}`: start from a Hugging Face checkpoint (its config and weights)
    tokenizer: str | None = None  # `tokenizer: {hf: DIR}` (default with `model.hf`: that directory); None: characters
    data: object = None  # `data: {...}` (quads_jax.rl.prompts.PromptData): prompts from a file instead of `task`
    mesh: dict | None = None  # `mesh: {data, fsdp, expert, tensor}`: the train step sharded over every device

    @classmethod
    def load(cls, path, overrides: dict | None = None) -> "JobConfig":
        """A job config from one YAML file or several layered in order (later files override
        earlier ones key by key, e.g. a base job then ``configs/recipes/bf16.yaml``), then
        dotted ``overrides`` ("rl.recipe": "bf16")."""
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        d: dict = {}
        for one in paths:
            if not os.path.exists(one):
                raise FileNotFoundError(f"config file not found: {one}")
            with open(one) as f:
                layer = yaml.safe_load(f) or {}
            if not isinstance(layer, dict):
                raise ValueError(f"{one}: expected a mapping of config keys, got {type(layer).__name__}")
            d = _merge(d, layer)
        path = " + ".join(str(p) for p in paths)
        for k, v in (overrides or {}).items():  # "rl.recipe=bf16"
            node = d
            parts = k.split(".")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = v
        known = {"seed", "model", "task", "sft", "rl", "train_n", "kernels", "tokenizer", "data", "mesh"}
        if set(d) - known:
            raise ValueError(f"{path}: unknown top-level keys {sorted(set(d) - known)}; expected some of {sorted(known)}")
        task = dict(d.get("task") or {"name": "addition"})
        name = task.pop("name", "addition")
        rl = build(RLConfig, d.get("rl"), "rl")
        if rl.recipe not in RECIPES:
            raise ValueError(f"rl.recipe={rl.recipe!r}: expected one of {sorted(RECIPES)}")
        kernels = KernelConfig.from_dict(d.get("kernels"))
        model = dict(d.get("model") or {})
        hf_dir = model.pop("hf", None)
        if hf_dir is not None:  # the checkpoint's config, with this file's other model keys on top (remat, ...)
            from quads_jax.model import from_hf_config

            mcfg = from_hf_config(hf_dir).replace(**model) if model else from_hf_config(hf_dir)
        else:
            mcfg = from_dict(model)
        tk = d.get("tokenizer") or {}
        if not isinstance(tk, dict) or set(tk) - {"hf"}:
            raise ValueError(f"{path}: tokenizer: expected {{hf: DIR}}")
        from quads_jax.rl.prompts import PromptData

        data = PromptData.from_dict(d["data"]) if d.get("data") else None
        return cls(seed=int(d.get("seed", 0)), model=mcfg, task=name, task_kwargs=task,
                   sft=build(SFTConfig, d.get("sft"), "sft"), rl=rl, train_n=int(d.get("train_n", 4000)),
                   kernels=kernels, hf=hf_dir, tokenizer=tk.get("hf") or hf_dir, data=data,
                   mesh=dict(d["mesh"]) if d.get("mesh") else None)


def _merge(base: dict, top: dict) -> dict:
    """Deep merge of config mappings: ``top`` wins, nested mappings merge key by key."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_task(cfg: JobConfig):
    """The job's prompts and reward: a data set (``data:``) or a built-in task (``task:``)."""
    if cfg.data is not None:
        from quads_jax.rl.prompts import DatasetTask

        return DatasetTask(cfg.data)
    t = get_task(cfg.task)
    return type(t)(**cfg.task_kwargs) if cfg.task_kwargs else t


def make_tokenizer(cfg: JobConfig):
    """A Hugging Face tokenizer (``tokenizer: {hf: DIR}``, or the model's directory), else the
    character tokenizer of the built-in tasks."""
    if cfg.tokenizer:
        from quads_jax.rl.hf_tokenizer import HFTokenizer

        return HFTokenizer(cfg.tokenizer)
    return CharTokenizer()


def job_model_config(cfg: JobConfig, tok) -> ModelConfig:
    """The model config of a job: a character vocabulary widened to the tokenizer's."""
    return cfg.model if cfg.hf else cfg.model.replace(vocab_size=max(cfg.model.vocab_size, tok.vocab_size))


def prompt_of(tok, task, problem) -> list[int]:
    """A problem's prompt tokens, with its data set's system prompt where it has one."""
    return D.prompt_ids(tok, problem.prompt, getattr(task, "system", {}).get(problem.prompt))


# ----------------------------------------------------------------------------- pieces


def evaluate_each(engine: Engine, task, tok, problems, max_new_tokens: int) -> np.ndarray:
    """Each held-out problem's reward under greedy decoding (pass@1 is their mean)."""
    reqs = [Request(prompt=prompt_of(tok, task, p), max_new_tokens=max_new_tokens, temperature=0.0, seed=i)
            for i, p in enumerate(problems)]
    res = engine.generate(reqs)
    return np.asarray([task.reward(p, tok.decode(r.output_ids)) for p, r in zip(problems, res)], np.float64)


def evaluate(engine: Engine, task, tok, problems, max_new_tokens: int) -> float:
    """Held-out pass@1 with greedy decoding."""
    return float(np.mean(evaluate_each(engine, task, tok, problems, max_new_tokens)))


def paired_se(before: np.ndarray, after: np.ndarray) -> float:
    """The standard error of mean(after) - mean(before) on the same problems (paired)."""
    d = np.asarray(after, np.float64) - np.asarray(before, np.float64)
    return float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")


def run_sft(cfg: JobConfig, out_dir: str, *, log=print):
    """Supervised warm start on task demonstrations; returns (graphdef, params)."""
    tok = make_tokenizer(cfg)
    task = make_task(cfg)
    mcfg = job_model_config(cfg, tok)
    model = Transformer(mcfg, rngs=nnx.Rngs(cfg.seed))
    graphdef, params, axes = split_params(model)
    ocfg = OptimConfig.from_dict({"total_steps": cfg.sft.steps, **cfg.sft.optim})
    tx = make_optimizer(ocfg)
    state = init_state(params, tx, cfg.seed)
    step = make_train_step(graphdef, tx, sft_loss())
    train = task.split("train", cfg.train_n, cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    writer = MW.MetricsWriter(out_dir, ["step", "loss", "ce", "grad_norm", "tokens_per_s", "mfu", "pass_at_1"],
                              filename="sft_metrics.csv")
    sc = cfg.sft
    engine = None
    if sc.target_pass_at_1 > 0:
        engine = Engine(mcfg, recipe="bf16", max_batch=64, max_len=sc.seq_len, eos_token_id=tok.eos_id)
        held = task.split("test", sc.eval_n, cfg.seed + 1000)
    bar = tqdm(range(sc.steps), desc="sft", dynamic_ncols=True, mininterval=1.0)
    t0, since = time.perf_counter(), 0
    for i in bar:
        batch = D.sft_batch(tok, [train[j] for j in rng.integers(0, len(train), sc.batch)], sc.seq_len)
        state, m = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        since += 1
        row = None
        if i % 10 == 0 or i == sc.steps - 1:
            m = jax.device_get(m)  # waits for the step: the time covers the steps since the last row
            tps = float(m["tokens"]) * since / max(time.perf_counter() - t0, 1e-9)
            t0, since = time.perf_counter(), 0
            row = {**m, "tokens_per_s": tps, "mfu": FL.mfu(tps, mcfg, sc.seq_len)}
            bar.set_postfix(loss=f"{float(m['loss']):.3f}", tok_s=f"{tps:.0f}")
        if engine is not None and i > 0 and i % sc.eval_every == 0:
            engine.load(state.params, version=i)
            acc = evaluate(engine, task, tok, held, cfg.rl.max_new_tokens)
            row = {**(row or {}), "pass_at_1": acc}
            bar.set_postfix(loss=f"{float(m['loss']):.3f}", pass1=f"{acc:.2f}")
            if acc >= sc.target_pass_at_1:
                writer.write(i, row)
                log(f"[sft] held-out pass@1 {acc:.2f} >= target {sc.target_pass_at_1} at step {i}: stopping")
                break
        if row is not None:
            writer.write(i, row)
    writer.close()
    return graphdef, state.params, mcfg


def run_grpo(cfg: JobConfig, graphdef, params, mcfg, out_dir: str, *, log=print, checkpoint_every: int = 0):
    """GRPO from ``params`` in the configured recipe; writes ``out_dir/metrics.csv`` and the
    final policy (and every ``checkpoint_every`` steps, if set) to ``out_dir/checkpoints``.

    Held-out pass@1 is measured twice at each evaluation: ``pass_at_1`` through the recipe's
    own rollout engine (what RL samples from), and ``pass_at_1_bf16`` with the same weights
    decoded in BF16 (the policy itself, free of rollout quantization)."""
    tok = make_tokenizer(cfg)
    task = make_task(cfg)
    rl = cfg.rl
    gcfg = G.GRPOConfig.from_dict(rl.grpo)
    train_name, roll_name = RECIPES[rl.recipe]
    train_prec = P.train_policy_with(train_name, cfg.kernels)
    roll_prec = P.rollout_recipe(roll_name, rl.rac_ratio, rac_sum=rl.rac_sum, kernels=cfg.kernels)
    ocfg = OptimConfig.from_dict({"total_steps": rl.steps, "warmup_steps": 2, **rl.optim})
    tx = make_optimizer(ocfg)
    # the train step donates its state: copy, so the caller's params (a shared base policy) stay valid
    state = init_state(jax.tree.map(jnp.copy, params), tx, cfg.seed + 1)

    def forced(batch):  # [B, L, T, k] in the batch (sharded along B) -> the model's [L, B, T, k]
        f = batch.get("forced_experts")
        return None if f is None else jnp.moveaxis(f, 1, 0)

    micro = gcfg.micro_batches

    def loss_fn(model, batch, rng):
        del rng
        logp = token_logprobs(model, batch["tokens"], batch["attn"], precision=train_prec, forced_experts=forced(batch))
        loss, m = G.policy_loss(logp, batch["old_logp"], batch["adv"], batch["resp_mask"], gcfg,
                                rollout_logp=batch["rollout_logp"], ref_logp=batch.get("ref_logp"),
                                seq_budget=rl.max_new_tokens, denom=batch["denom"])
        return loss * micro, m  # the step averages micro-batch gradients: their sum is the update's

    mesh_kw = {}
    if cfg.mesh:  # parameters and optimizer state sharded by their logical axes (experts over "expert", FSDP ...)
        from quads_jax import sharding as S

        axes = split_params(nnx.eval_shape(lambda: to_model(graphdef, params)))[2]
        mesh_kw = {"mesh": S.make_mesh(cfg.mesh), "axes": axes}
    step_fn = make_train_step(graphdef, tx, loss_fn, grad_accum=micro, **mesh_kw)
    score = jax.jit(lambda p, b: token_logprobs(to_model(graphdef, p), b["tokens"], b["attn"], precision=train_prec,
                                                forced_experts=forced(b)))
    # KL to a reference: the starting policy, frozen (its own copy: the step donates the state)
    ref_params = jax.tree.map(jnp.copy, params) if gcfg.kl_coef > 0 else None
    if rl.rollout_url:
        from rollout.client import RemoteRollout, RolloutClient

        engine = RemoteRollout(RolloutClient(rl.rollout_url), os.path.join(os.path.abspath(out_dir), "weight_sync"),
                               precision=roll_prec)
    else:
        engine = Engine(mcfg, recipe=roll_prec, max_batch=min(64, rl.prompts_per_step * gcfg.group_size),
                        max_len=rl.seq_len, eos_token_id=tok.eos_id)
    train = task.split("train", cfg.train_n, cfg.seed)
    test = task.split("test", rl.eval_n, cfg.seed)
    rng = np.random.default_rng(cfg.seed + 7)
    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), save_every=checkpoint_every or max(1, rl.steps))
    bf16_eval = engine if roll_name == "bf16" and not rl.rollout_url else Engine(
        mcfg, recipe=P.rollout_recipe("bf16", kernels=cfg.kernels), max_batch=64, max_len=rl.seq_len, eos_token_id=tok.eos_id)
    writer = MW.MetricsWriter(out_dir, RL_COLUMNS)
    step_probs: list = []  # this step's problems, for the reward workers
    scorer = RewardPool(lambda text, j: task.reward(step_probs[j], text), workers=rl.reward_workers)
    bar = tqdm(range(rl.steps + 1), desc=f"grpo[{rl.recipe}]", dynamic_ncols=True, mininterval=1.0)
    history = []
    first_bf16 = None  # each held-out problem's BF16-decoding reward at step 0: the paired baseline
    for i in bar:
        t0 = time.perf_counter()
        engine.load(state.params, version=i)  # weight sync (the engine / server quantizes once per sync)
        t1 = time.perf_counter()
        row = {}
        if i % rl.eval_every == 0 or i == rl.steps:
            row["pass_at_1"] = evaluate(engine, task, tok, test, rl.max_new_tokens)
            if bf16_eval is not engine:
                bf16_eval.load(state.params, version=i)
            each = evaluate_each(bf16_eval, task, tok, test, rl.max_new_tokens)
            row["pass_at_1_bf16"] = float(np.mean(each))
            first_bf16 = each if first_bf16 is None else first_bf16
            if i > 0:
                row["pass_at_1_bf16_rise_se"] = paired_se(first_bf16, each)
        if i == rl.steps:  # the final evaluation row
            writer.write(i, row)
            history.append({"step": i, **row})
            break
        probs = [train[j] for j in rng.integers(0, len(train), rl.prompts_per_step)]
        step_probs[:] = probs
        prompts = [prompt_of(tok, task, p) for p in probs for _ in range(gcfg.group_size)]
        reqs = [Request(prompt=pr, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                        seed=int(rng.integers(0, 2**31)), return_experts=gcfg.routing_replay) for pr in prompts]
        res = engine.generate(reqs)
        if gcfg.routing_replay and any(r.experts is None for r in res):
            raise ValueError("grpo.routing_replay: the rollout returned no experts (the HTTP server does not; "
                             "use the in-process engine, rl.rollout_url unset)")
        t2 = time.perf_counter()
        # rewards are scored in worker threads while the device computes the trainer's log-probs
        texts = [tok.decode(r.output_ids) for r in res]
        scored = scorer.submit(texts, [k // gcfg.group_size for k in range(len(res))])
        b = D.rl_batch(prompts, [r.output_ids for r in res], [r.logprobs for r in res], rl.seq_len,
                       experts=[r.experts for r in res] if gcfg.routing_replay else None)
        b = {k: jnp.asarray(v) for k, v in b.items()}
        old = score(state.params, b)
        if ref_params is not None:
            b["ref_logp"] = score(ref_params, b)
        gaps = jax.device_get(G.gap_metrics(old, b["rollout_logp"], b["resp_mask"]))
        rewards = scored.result()
        b["old_logp"] = old
        b["adv"] = G.group_advantages(jnp.asarray(rewards), gcfg.group_size, gcfg.adv_eps, gcfg.std_norm)
        if gcfg.overlong == "mask":  # responses cut at the length limit teach nothing about their answer
            cut = jnp.asarray([r.finish_reason == "length" for r in res])
            b["resp_mask"] = b["resp_mask"] & ~cut[:, None]
        for part in np.array_split(rng.permutation(len(res)), gcfg.mini_batches):  # PPO updates
            mb = {k: v[jnp.asarray(part)] for k, v in b.items()}
            denom = mb["resp_mask"].sum() if gcfg.loss_agg == "token_mean" else len(part)
            mb["denom"] = jnp.maximum(jnp.asarray(denom, jnp.float32), 1.0)
            if micro > 1:
                if len(part) % micro:
                    raise ValueError(f"grpo.micro_batches={micro} must divide each mini-batch ({len(part)} sequences)")
                mb = {k: (jnp.broadcast_to(v, (micro,)) if k == "denom" else v.reshape(micro, -1, *v.shape[1:]))
                      for k, v in mb.items()}
            state, m = step_fn(state, mb)
        m = jax.device_get(m)
        t3 = time.perf_counter()
        n_tok = int(sum(len(r.output_ids) for r in res))
        ent = -float(np.mean([np.mean(r.logprobs) for r in res]))
        row.update(reward_mean=float(rewards.mean()), **{k: float(v) for k, v in gaps.items()},
                   entropy=ent, response_len=n_tok / len(res), clip_frac=float(m["clip_frac"]),
                   grad_norm=float(m["grad_norm"]), loss=float(m["loss"]), skipped=int(m["skipped"]),
                   **({"kl_ref": float(m["kl_ref"])} if "kl_ref" in m else {}),
                   tokens_per_s=n_tok / max(t2 - t1, 1e-9), weight_sync_s=t1 - t0, rollout_s=t2 - t1, train_s=t3 - t2)
        writer.write(i, row)
        history.append({"step": i, **row})
        bar.set_postfix(reward=f"{row['reward_mean']:.2f}", gap=f"{row['gap_max']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                        **({"pass1": f"{row['pass_at_1']:.2f}"} if "pass_at_1" in row else {}))
        if checkpoint_every:
            ckpt.save(state)
    writer.close()
    scorer.close()
    ckpt.save(state, force=True)
    ckpt.wait()
    ckpt.close()
    return state, history


def summarize(history: list[dict]) -> dict:
    rows = [h for h in history if "reward_mean" in h]
    evals = [h["pass_at_1"] for h in history if "pass_at_1" in h]
    bf16 = [h["pass_at_1_bf16"] for h in history if "pass_at_1_bf16" in h]
    k = max(1, len(rows) // 4)
    return {
        "steps": len(rows),
        "reward_first": float(np.mean([h["reward_mean"] for h in rows[:k]])) if rows else float("nan"),
        "reward_last": float(np.mean([h["reward_mean"] for h in rows[-k:]])) if rows else float("nan"),
        "pass_at_1_first": evals[0] if evals else float("nan"),
        "pass_at_1_last": evals[-1] if evals else float("nan"),
        "pass_at_1_bf16_first": bf16[0] if bf16 else float("nan"),
        "pass_at_1_bf16_last": bf16[-1] if bf16 else float("nan"),
        "pass_at_1_bf16_rise_se": next((h["pass_at_1_bf16_rise_se"] for h in reversed(history) if "pass_at_1_bf16_rise_se" in h),
                                       float("nan")),
        "gap_max_peak": max((h["gap_max"] for h in rows), default=float("nan")),
        "gap_mean_avg": float(np.mean([h["gap_mean"] for h in rows])) if rows else float("nan"),
        "k3_kl_avg": float(np.mean([h["k3_kl"] for h in rows])) if rows else float("nan"),
        "tokens_per_s": float(np.mean([h["tokens_per_s"] for h in rows[1:] or rows])) if rows else float("nan"),
    }


def base_policy(cfg, out_dir):
    """The policy RL starts from: a Hugging Face checkpoint (``model: {hf: DIR}``), or an SFT
    warm start on the task's demonstrations, cached in OUT/base (a rerun reuses it)."""
    from quads_jax.train.checkpoint import Checkpointer
    from quads_jax.train.state import split_params
    from quads_jax.model import Transformer
    from flax import nnx

    if cfg.hf:
        from quads_jax import hf

        params = split_params(hf.load_qwen3_moe(cfg.hf, dtype=cfg.model.dtype))[1]
        graphdef = split_params(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0]  # the job's config
        print(f"[quads] starting from the Hugging Face checkpoint {cfg.hf}")
        return graphdef, params, cfg.model
    base = os.path.join(out_dir, "base")
    mcfg = job_model_config(cfg, make_tokenizer(cfg))
    graphdef, like, _ = split_params(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))))
    ck = Checkpointer(base, save_every=1, max_to_keep=1, async_save=False)
    if ck.latest_step() is not None:
        print(f"[quads] reusing the SFT base policy in {base}")
        params = ck.restore_params(like)
    else:
        graphdef, params, mcfg = run_sft(cfg, out_dir)
        ck.save_params(params, step=1)
        ck.wait()
    ck.close()
    return graphdef, params, mcfg
