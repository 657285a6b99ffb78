import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from quads_jax.model import ModelConfig, Transformer, token_logprobs
from quads_jax.rl import grpo as G
from quads_jax.rl.tasks import get_task
from quads_jax.rl.tokenizer import CharTokenizer
from quads_jax.train.state import split_params
from rollout.engine import Engine, Request, sample


def test_group_advantages_hand_values():
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = np.asarray(G.group_advantages(r, 4, eps=0.0 + 1e-12))
    np.testing.assert_allclose(a[:4], [1, -1, -1, 1], atol=1e-6)  # mean .5, std .5
    np.testing.assert_allclose(a[4:], 0.0, atol=1e-6)  # all solved: no signal


def test_policy_loss_clipping_and_hand_value():
    cfg = G.GRPOConfig(clip_eps=0.2)
    old = jnp.zeros((2, 3))
    logp = jnp.log(jnp.array([[1.5, 1.0, 0.5], [1.5, 1.0, 0.5]]))
    adv = jnp.array([1.0, -1.0])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
    loss, m = G.policy_loss(logp, old, adv, mask, cfg)
    # A=+1: -min(r, clip r) = -[1.2, 1.0, 0.5]; A=-1: -min(-r, -clip r) = [1.5, 1.0] (masked third)
    np.testing.assert_allclose(loss, (-1.2 - 1.0 - 0.5 + 1.5 + 1.0) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac"], 3 / 5, rtol=1e-6)
    # gradient is zero where the clipped branch is active (A>0, ratio above 1+eps)
    g = jax.grad(lambda lp: G.policy_loss(lp, old, adv, mask, cfg)[0])(logp)
    assert float(g[0, 0]) == 0.0 and float(g[0, 2]) != 0.0


def test_tis_weights_and_k3():
    w = G.tis_weights(jnp.log(jnp.array([0.5, 0.9])), jnp.log(jnp.array([0.1, 0.9])), cap=2.0)
    np.testing.assert_allclose(w, [2.0, 1.0], rtol=1e-6)
    lp, lq = jnp.log(0.3), jnp.log(0.5)
    np.testing.assert_allclose(G.k3(lp, lq), 0.3 / 0.5 - 1 - np.log(0.6), rtol=1e-6)
    g = G.gap_metrics(jnp.array([[0.0, -1.0, -2.0]]), jnp.array([[5.0, -1.5, -2.0]]), jnp.array([[0, 1, 1]], bool))
    np.testing.assert_allclose([g["gap_max"], g["gap_mean"]], [0.5, 0.25], rtol=1e-6)


def test_tasks_rewards_and_splits():
    add = get_task("addition")
    p = add.sample(np.random.default_rng(0))
    assert add.reward(p, p.demo) == 1.0 and add.reward(p, "1+1+0=2:999") == 0.0
    train = add.split("train", 500, seed=0)
    test = add.split("test", 50, seed=0)
    assert not ({q.prompt for q in train} & {q.prompt for q in test})
    assert [q.prompt for q in add.split("test", 50, seed=0)] == [q.prompt for q in test]  # deterministic
    cd = get_task("countdown")
    q = cd.sample(np.random.default_rng(1))
    assert cd.reward(q, q.demo) == 1.0 and cd.reward(q, "1+1") == 0.0
    with pytest.raises(ValueError, match="task"):
        get_task("chess")


def test_tokenizer_roundtrip_and_errors():
    tok = CharTokenizer()
    ids = tok.encode("12+34=", bos=True)
    assert ids[0] == tok.bos_id and tok.decode(ids) == "12+34="
    assert tok.decode(tok.encode("5") + [tok.eos_id] + tok.encode("7")) == "5"
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("12#")


# ----------------------------------------------------------------------------- engine

CFG = ModelConfig(vocab_size=56, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
                  experts_per_token=2, expert_ffn=64, max_seq_len=64, compute_dtype="float32")


@pytest.fixture(scope="module")
def params():
    m = Transformer(CFG, rngs=nnx.Rngs(3))
    return split_params(m)[1], m


def test_sampling_top_k_top_p_greedy():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 3))
    keys = jax.random.split(jax.random.key(0), 3)
    tok, lp = sample(logits, jnp.array([0.0, 1.0, 1.0]), jnp.array([1.0, 1.0, 0.6]), jnp.array([0, 1, 0]), keys)
    assert int(tok[0]) == 0 and int(tok[1]) == 0  # greedy; top-k 1
    np.testing.assert_allclose(lp[0], np.log(0.5), rtol=1e-5)
    draws = [int(sample(logits[:1], jnp.array([1.0]), jnp.array([0.6]), jnp.array([0]),
                        jax.random.key(i)[None])[0][0]) for i in range(40)]
    assert set(draws) <= {0, 1} and len(set(draws)) == 2  # top-p 0.6 keeps the first two


def test_sampling_filters_only_the_rows_that_ask():
    """A row with top-k / top-p off samples from the whole vocabulary although its neighbour
    filters; with ``filtered=False`` (the engine's flag when no row filters) the draws equal
    the filtered call's for unfiltered rows, and no sort runs."""
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]] * 2))
    temp, topp, topk = jnp.array([1.0, 1.0]), jnp.array([1.0, 0.4]), jnp.array([0, 0])
    draws = {0: set(), 1: set()}
    for i in range(60):
        keys = jax.random.split(jax.random.key(i), 2)
        tok, _ = sample(logits, temp, topp, topk, keys)
        draws[0].add(int(tok[0]))
        draws[1].add(int(tok[1]))
        alone, _ = sample(logits[:1], temp[:1], topp[:1], topk[:1], keys[:1], filtered=False)
        assert int(alone[0]) == int(tok[0])
    assert draws[0] == {0, 1, 2, 3} and draws[1] == {0}  # top-p 0.4: the first token alone
    hlo = jax.jit(lambda l, k: sample(l, temp, topp * 0 + 1, topk, k, filtered=False)).lower(
        logits, jax.random.split(jax.random.key(0), 2)).as_text()
    assert "stablehlo.sort" not in hlo and "stablehlo.case" not in hlo


def test_engine_seeded_logprobs_match_trainer_and_batching_is_invariant(params):
    flat, model = params
    eng = Engine(CFG, recipe="bf16", max_batch=4, max_len=40)
    eng.load(flat, version=7)
    rng = np.random.default_rng(0)
    reqs = [Request(prompt=rng.integers(3, 56, int(n)).tolist(), max_new_tokens=int(k), seed=i)
            for i, (n, k) in enumerate([(5, 9), (3, 12), (7, 4), (4, 10), (6, 8), (2, 11)])]  # 6 requests, 4 slots
    res = eng.generate(reqs)
    assert [len(r.output_ids) for r in res] == [9, 12, 4, 10, 8, 11]
    assert all(r.finish_reason == "length" and r.weight_version == 7 for r in res)
    again = eng.generate(reqs)
    assert [r.output_ids for r in again] == [r.output_ids for r in res]  # same seeds, same tokens
    step_by_step = Engine(CFG, recipe="bf16", max_batch=4, max_len=40, decode_burst=1)  # one host round trip a token
    step_by_step.load(flat, version=7)
    assert [r.output_ids for r in step_by_step.generate(reqs)] == [r.output_ids for r in res]  # bursts change nothing
    with pytest.raises(ValueError, match="decode_burst"):
        Engine(CFG, recipe="bf16", max_batch=4, max_len=40, decode_burst=0)
    one = [eng.generate([q])[0] for q in reqs[:3]]  # one at a time
    for a, b in zip(one, res[:3]):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    for q, r in zip(reqs, res):  # the trainer's log-probs of the same sequence
        seq = jnp.asarray([list(q.prompt) + r.output_ids])
        lp = np.asarray(token_logprobs(model, seq))[0, len(q.prompt):]
        np.testing.assert_allclose(r.logprobs, lp, atol=1e-4)


def test_engine_stop_tokens_experts_and_errors(params):
    flat, _ = params
    eng = Engine(CFG, recipe="quads", max_batch=2, max_len=32, eos_token_id=2)
    eng.load(flat)
    r = eng.generate([Request(prompt=[1, 5, 6], max_new_tokens=10, temperature=0.0, return_experts=True)])[0]
    first = r.output_ids[0]
    r2 = eng.generate([Request(prompt=[1, 5, 6], max_new_tokens=10, temperature=0.0, stop_token_ids=[first])])[0]
    assert r2.output_ids == [first] and r2.finish_reason == "stop"
    assert len(r.experts) == len(r.output_ids) and np.asarray(r.experts).shape[1:] == (2, 2)  # [L_moe, k]
    with pytest.raises(ValueError, match="context length"):
        eng.generate([Request(prompt=[1] * 30, max_new_tokens=10)])
    with pytest.raises(ValueError, match="outside"):
        eng.generate([Request(prompt=[1, 999], max_new_tokens=2)])


def test_decode_burst_is_a_loop_of_known_trip_count(params):
    """The decode burst's loop runs a constant number of steps (``decode_burst``), so XLA
    annotates its trip count and XLA:GPU need not copy the loop's predicate to the host each
    step (a traced count cost 21% of a batch-64 step on an H100)."""
    import re

    from benchmarks.bench_rollout import STATIC, _burst_args

    flat, _ = params
    eng = Engine(CFG, recipe="bf16", max_batch=2, max_len=40, decode_burst=5)
    eng.load(flat)
    hlo = eng._burst.lower(*_burst_args(eng, 2, 3), **STATIC).compile().as_text()
    assert "5" in re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)


def test_decode_bursts_of_every_recipe_hold_no_extra_device_loops(params):
    """Every recipe's decode burst has the loops bf16's has (the decode loop and the sampling
    keys' hash) and no more: a loop inside a decode step (``searchsorted``'s scan once placed
    FP8's expert scales, 8 such loops a step) runs several kernels an iteration. The FP8
    baseline computes in float32 (a float64 division once ran over its activations)."""
    import re

    from benchmarks.bench_rollout import STATIC, _burst_args

    flat, _ = params
    text = {}
    for recipe in ("bf16", "fp8", "nvfp4_naive", "quads"):
        eng = Engine(CFG, recipe=recipe, max_batch=2, max_len=40, decode_burst=5)
        eng.load(flat)
        text[recipe] = eng._burst.lower(*_burst_args(eng, 2, 3), **STATIC).as_text()
    loops = {r: len(re.findall(r"stablehlo\.while", t)) for r, t in text.items()}
    assert len(set(loops.values())) == 1, loops
    assert "f64" not in text["fp8"]


def test_engine_stops_a_row_inside_a_burst_and_keeps_its_neighbour(params):
    """A stop token met inside a decode burst ends its row there: the host keeps that row's
    tokens, log-probs, experts and top log-probs up to it, and the row beside it (another
    length, still running) gets what it gets without the stop."""
    flat, _ = params
    eng = Engine(CFG, recipe="bf16", max_batch=2, max_len=40, decode_burst=4)
    eng.load(flat)
    a = Request(prompt=[1, 5, 6], max_new_tokens=12, seed=7, return_experts=True, top_logprobs=2)
    b = Request(prompt=[1, 7, 8, 9], max_new_tokens=9, seed=4)
    full_a, full_b = eng.generate([a, b])
    ids = full_a.output_ids
    # output 0 comes from the prefill, 1-4 from the first burst: a token first seen at 2-4
    j = next(i for i in (2, 3, 4, 6, 7, 8) if ids[i] not in ids[:i])
    got_a, got_b = eng.generate([dataclasses.replace(a, stop_token_ids=[ids[j]]), b])
    assert got_a.output_ids == ids[: j + 1] and got_a.finish_reason == "stop"
    assert got_a.logprobs == full_a.logprobs[: j + 1] and got_a.experts == full_a.experts[: j + 1]
    assert got_a.top_logprobs == full_a.top_logprobs[: j + 1]
    assert got_b.output_ids == full_b.output_ids and got_b.logprobs == full_b.logprobs and got_b.finish_reason == "length"
    assert len(full_a.output_ids) == 12 and len(full_b.output_ids) == 9


def test_engine_compiles_with_the_recipes_command_buffers(params):
    """KernelConfig.command_buffers reaches the engine's programs as XLA compiler options: a
    CPU compile accepts and ignores the GPU ones, so the tokens equal the default engine's;
    an unknown form is named."""
    import pallas_kernels as pk
    from quads_jax import precision as P

    flat, _ = params
    assert pk.KernelConfig(command_buffers="xla").compiler_options() is None
    graphed = pk.KernelConfig().compiler_options()  # the default: graphs around kernels, not the loop
    assert graphed["xla_gpu_enable_command_buffer"] == "FUSION,CUBLASLT,CUSTOM_CALL"
    assert pk.KernelConfig(command_buffers="off").compiler_options() == {"xla_gpu_enable_command_buffer": ""}
    loops = pk.KernelConfig(command_buffers="loops").compiler_options()
    assert loops["xla_gpu_enable_command_buffer"].split(",")[-2:] == ["WHILE", "CONDITIONAL"]
    q = [Request(prompt=[1, 5, 6, 9], max_new_tokens=5, seed=3)]
    out = []
    for form in ("xla", "kernels"):
        eng = Engine(CFG, recipe=P.rollout_recipe("bf16", kernels=pk.KernelConfig(command_buffers=form)), max_batch=2, max_len=32)
        eng.load(flat)
        out.append(eng.generate(q)[0].output_ids)
    assert out[0] == out[1] and len(out[0]) == 5
    with pytest.raises(ValueError, match="kernels.command_buffers='graphs'"):
        pk.KernelConfig.from_dict({"command_buffers": "graphs"})


def test_fp8_engine_stores_e4m3_experts_and_stays_near_the_trainer(params):
    """The fp8 recipe (expert weights stored [E, N, K] in E4M3, as tokamax's FP8 kernel reads
    them) scores its own samples close to the BF16 trainer, but not equal to it: the weights
    and activations are quantized."""
    from quads_jax import fp8

    flat, model = params
    eng = Engine(CFG, recipe="fp8", max_batch=2, max_len=32)
    eng.load(flat)
    experts = [w for w in jax.tree_util.tree_leaves(eng._state, is_leaf=lambda t: isinstance(t, fp8.FP8Tensor))
               if isinstance(w, fp8.FP8Tensor) and w.values.ndim == 3]
    assert experts and all(w.values.dtype == jnp.float8_e4m3fn and w.scale.shape[-1] == 1 for w in experts)
    q = Request(prompt=[1, 5, 6, 9], max_new_tokens=12, seed=3)
    r = eng.generate([q])[0]
    lp = np.asarray(token_logprobs(model, jnp.asarray([list(q.prompt) + r.output_ids])))[0, len(q.prompt):]
    gap = np.abs(np.asarray(r.logprobs) - lp)
    assert 0 < gap.max() < 0.5, gap


@pytest.mark.slow
def test_engine_pallas_and_xla_backends_generate_the_same(params):
    """The engine stores NVFP4 codes as uint32 code words (one storage form); the Pallas GEMMs,
    and decode attention (its caches written by the kernel, in the decode loop; interpreted
    here) and the XLA references give the same tokens, log-probs equal up to accumulation
    order."""
    import pallas_kernels as pk
    from quads_jax import precision as P

    flat, _ = params
    q = [Request(prompt=[1, 5, 6, 9], max_new_tokens=8, seed=3), Request(prompt=[4, 4, 7], max_new_tokens=6, seed=5)]
    out = {}
    for backend in ("pallas", "xla"):
        kernels = pk.KernelConfig(backend=backend, decode_attention=backend, decode_attention_tiles=dict(block_k=16))
        eng = Engine(CFG, recipe=P.rollout_recipe("quads", kernels=kernels), max_batch=2, max_len=32)
        eng.load(flat)
        assert any(getattr(l, "dtype", None) == jnp.uint32 for l in jax.tree_util.tree_leaves(eng._state))
        out[backend] = eng.generate(q)
    assert [r.output_ids for r in out["pallas"]] == [r.output_ids for r in out["xla"]]
    for a, b in zip(out["pallas"], out["xla"]):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


@pytest.mark.slow
def test_gap_bf16_below_nvfp4_naive(params):
    """Trainer in BF16 policy vs rollout engines: the naive W4A4 rollout drifts more than BF16,
    and QUADS (QAT trainer + RAC rollout) sits between."""
    from quads_jax.rl.gap import measure_gaps

    flat, model = params
    cfg = CFG.replace(compute_dtype="bfloat16")
    rows = {r["recipe"]: r for r in measure_gaps(cfg, flat, n_prompts=8, max_new_tokens=12, recipes=("bf16", "nvfp4_naive", "quads"),
                                                  rac_ratios=())}
    assert rows["bf16"]["gap_mean"] < rows["quads"]["gap_mean"] < rows["nvfp4_naive"]["gap_mean"], rows


# ----------------------------------------------------------------------------- the RL loop learns


class _DigitsTask:
    """Reward = fraction of generated characters that are digits (a random policy gets ~20%)."""

    name = "digits_test"

    def sample(self, rng):
        from quads_jax.rl.tasks import Problem
        a = int(rng.integers(0, 10**6))
        return Problem(prompt=f"{a}=", answer="", demo="1")

    def reward(self, problem, completion):
        return sum(c.isdigit() for c in completion) / 6.0

    split = get_task("addition").__class__.split


def _digits_config(tmp_path, *, steps, prompts, group) -> str:
    """A tiny policy on the digits task (registered here), as a job config file."""
    from quads_jax.rl import tasks as T

    T.TASKS["digits_test"] = _DigitsTask()
    p = tmp_path / "c.yaml"
    p.write_text(f"""
seed: 0
train_n: 200
model: {{vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, head_dim: 16, n_experts: 4,
        experts_per_token: 2, expert_ffn: 32, max_seq_len: 32, compute_dtype: float32}}
task: {{name: digits_test}}
rl: {{recipe: quads, steps: {steps}, prompts_per_step: {prompts}, max_new_tokens: 6, eval_every: 100, eval_n: 4,
     seq_len: 16, grpo: {{group_size: {group}}}, optim: {{lr: 0.01, warmup_steps: 1}}}}
""")
    return str(p)


def test_grpo_run_raises_reward(tmp_path):
    from quads_jax.rl import loop

    cfg = loop.JobConfig.load(_digits_config(tmp_path, steps=12, prompts=4, group=8))
    m = Transformer(cfg.model, rngs=nnx.Rngs(0))
    g, params, _ = split_params(m)
    _, hist = loop.run_grpo(cfg, g, params, cfg.model, str(tmp_path / "run"))
    # the train step donates its state: the caller's params must survive (quads compare reuses them)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
    r = [h["reward_mean"] for h in hist if "reward_mean" in h]
    assert np.mean(r[-3:]) > np.mean(r[:3]) + 0.15, r
    s = loop.summarize(hist)
    assert s["steps"] == 12 and s["gap_max_peak"] > 0
    assert (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].startswith("step,reward_mean,pass_at_1,pass_at_1_bf16,pass_at_1_bf16_rise_se,gap_max")


@pytest.mark.slow  # a minute or more on 2 cores (CI): ./test.sh -m slow
def test_grpo_through_the_rollout_server_equals_in_process(tmp_path):
    """rl.rollout_url: each step syncs weights through an orbax step and /update_weights_from_disk
    and generates over HTTP; the run is the same as with the engine in-process."""
    import os
    import threading

    from quads_jax.rl import loop
    from rollout.server import RolloutServer, make_http_server

    path = _digits_config(tmp_path, steps=2, prompts=2, group=4)
    cfg = loop.JobConfig.load(path)
    g, params, _ = split_params(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    tok = CharTokenizer()
    srv = RolloutServer(Engine(cfg.model, recipe="quads", max_batch=8, max_len=16, eos_token_id=tok.eos_id), tok,
                        weights_dirs=[str(tmp_path)])
    httpd = make_http_server(srv, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        remote = loop.JobConfig.load(path, {"rl.rollout_url": f"http://127.0.0.1:{httpd.server_address[1]}"})
        _, h_remote = loop.run_grpo(remote, g, params, cfg.model, str(tmp_path / "remote"))
        assert srv.engine.version == "2" and os.path.isdir(tmp_path / "remote" / "weight_sync")
        bad = loop.JobConfig.load(path, {"rl.rollout_url": remote.rl.rollout_url, "rl.recipe": "bf16"})
        with pytest.raises(ValueError, match="different precision"):
            loop.run_grpo(bad, g, params, cfg.model, str(tmp_path / "bad"))
    finally:
        httpd.shutdown()
        srv.close()
    _, h_local = loop.run_grpo(cfg, g, params, cfg.model, str(tmp_path / "local"))
    # the RL policy is saved by default, and pass@1 is reported through the rollout and in BF16
    from quads_jax.train.checkpoint import Checkpointer
    assert Checkpointer(str(tmp_path / "local" / "checkpoints")).latest_step() == 2
    assert "pass_at_1_bf16" in h_local[0] and "pass_at_1_bf16" in h_local[-1]
    for a, b in zip(h_remote, h_local):
        assert a.get("reward_mean") == b.get("reward_mean")
        if "gap_max" in a:
            np.testing.assert_allclose(a["gap_max"], b["gap_max"], atol=1e-5)


def test_job_config_keys_and_cli_overrides(tmp_path):
    import pallas_kernels as pk
    from quads_jax import cli
    from quads_jax import precision as P
    from quads_jax.rl import loop

    path = _digits_config(tmp_path, steps=1, prompts=1, group=2)
    assert loop.JobConfig.load(path).kernels == pk.KernelConfig()
    cfg = loop.JobConfig.load(path, {"kernels.backend": "pallas", "kernels.grouped": "xla"})
    assert cfg.kernels == pk.KernelConfig(backend="pallas", grouped="xla")
    assert P.rollout_recipe("quads", None, kernels=cfg.kernels).backend == "pallas"
    assert P.rollout_recipe("quads", 0.25, "xla").rac_ratio == 0.25
    with pytest.raises(ValueError, match="kernels.backend='triton'"):
        loop.JobConfig.load(path, {"kernels.backend": "triton"})
    with pytest.raises(ValueError, match="unknown keys"):
        loop.JobConfig.load(path, {"kernels.tile": 64})
    with pytest.raises(ValueError, match="unknown top-level keys"):
        loop.JobConfig.load(path, {"kernel": {"backend": "xla"}})
    with pytest.raises(FileNotFoundError, match="config file not found"):
        loop.JobConfig.load(str(tmp_path / "missing.yaml"))
    # --set is repeatable and also takes several pairs at once; the values are parsed as YAML
    a = cli.build_parser().parse_args(["gap", "--config", path, "--set", "rl.steps=3", "--set", "kernels.backend=xla", "rl.temperature=2e-1"])
    ov = cli._overrides(a.set)
    assert ov == {"rl.steps": 3, "kernels.backend": "xla", "rl.temperature": 0.2}
    cfg = loop.JobConfig.load(path, ov)
    assert (cfg.rl.steps, cfg.kernels.backend, cfg.rl.temperature) == (3, "xla", 0.2)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        cli._overrides(["rl.steps"])


def test_gap_and_run_plots(tmp_path):
    from quads_jax.plot import plot_runs
    from quads_jax.rl.gap import plot_gaps

    rows = [{"recipe": r, "sweep": False, "rac_ratio": "-", "gap_max": 1.0, "gap_mean": m, "k3_kl": m / 10}
            for r, m in (("bf16", 0.001), ("nvfp4_naive", 0.02), ("quads", 0.008))]
    rows += [{"recipe": "quads", "sweep": True, "rac_ratio": rho, "gap_max": 1.0, "gap_mean": 0.02 * (1 - rho), "k3_kl": 0.001}
             for rho in (0.0, 0.5, 1.0)]
    png = plot_gaps(rows, str(tmp_path / "gap.png"))
    assert (tmp_path / "gap.png").stat().st_size > 10_000
    # a run directory with only some of the columns: only those panels are drawn
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.csv").write_text("step,reward_mean,gap_max\n0,0.1,0.5\n1,0.3,0.4\n")
    out = plot_runs([str(d)], str(tmp_path / "c.png"))
    assert os.path.getsize(out) > 5_000 and png.endswith("gap.png")


def test_routing_replay_aligns_the_engines_experts_with_the_trainer(params):
    """The engine's experts for generated token j are the routing of position len(prompt)-1+j;
    rl_batch puts them there (-1 elsewhere) and the trainer replays exactly them."""
    from quads_jax.model.moe import route
    from quads_jax.rl import data as D

    flat, model = params
    eng = Engine(CFG, recipe="bf16", max_batch=2, max_len=32)
    eng.load(flat)
    prompts = [[1, 5, 6, 9], [3, 4]]
    res = eng.generate([Request(prompt=p, max_new_tokens=6, seed=i, return_experts=True) for i, p in enumerate(prompts)])
    b = D.rl_batch(prompts, [r.output_ids for r in res], [r.logprobs for r in res], 16, experts=[r.experts for r in res])
    f = b["forced_experts"]  # [B, L, T, k]
    assert f.shape == (2, 2, 16, 2)
    assert (f[0, :, :3] == -1).all() and (f[0, :, 3:9] >= 0).all() and (f[0, :, 9:] == -1).all()
    # unforced, the trainer (same float32 model) routes those positions the same way: the alignment
    _, aux = token_logprobs(model, jnp.asarray(b["tokens"]), jnp.asarray(b["attn"]), return_aux=True)
    own = np.asarray(aux["experts"]).transpose(1, 0, 2, 3)  # [B, L, T, k]
    sel = f >= 0
    np.testing.assert_array_equal(np.sort(own, -1)[sel], np.sort(f, -1)[sel])
    # forced: the replayed ids, and -1 rows keep their own top-k
    forced = np.array(f)
    forced[1, :, 1] = (own[1, :, 1] + 1) % CFG.n_experts  # replay something else at one position
    _, aux2 = token_logprobs(model, jnp.asarray(b["tokens"]), jnp.asarray(b["attn"]),
                             forced_experts=jnp.asarray(forced).transpose(1, 0, 2, 3), return_aux=True)
    got = np.asarray(aux2["experts"]).transpose(1, 0, 2, 3)
    np.testing.assert_array_equal(got[1, :, 1], forced[1, :, 1])
    np.testing.assert_array_equal(got[0, :, :3], own[0, :, :3])
    probs, ids, w = route(jnp.array([[0.0, 2.0, 1.0, -1.0]] * 2), 2, True, jnp.array([[3, 0], [-1, -1]]))
    assert ids.tolist() == [[3, 0], [1, 2]] and np.allclose(np.asarray(w).sum(-1), 1.0)
    with pytest.raises(ValueError, match="expert rows"):
        D.rl_batch(prompts, [r.output_ids for r in res], [r.logprobs for r in res], 16, experts=[res[0].experts[:2], res[1].experts])


@pytest.mark.slow  # 15-25 s on 2 cores; the default suite stays near 15 minutes
def test_grpo_with_kl_reference_and_routing_replay(tmp_path):
    from quads_jax.metrics import read_csv
    from quads_jax.rl import loop

    path = _digits_config(tmp_path, steps=2, prompts=2, group=4)
    cfg = loop.JobConfig.load(path, {"rl.grpo": {"group_size": 4, "kl_coef": 0.1, "routing_replay": True}})
    g, params, _ = split_params(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    _, hist = loop.run_grpo(cfg, g, params, cfg.model, str(tmp_path / "run"))
    rows = [h for h in hist if "reward_mean" in h]
    assert len(rows) == 2 and all(np.isfinite(h["kl_ref"]) and h["kl_ref"] >= 0 for h in rows)
    assert rows[0]["kl_ref"] < 1e-6  # the first step's policy is the reference
    m = read_csv(str(tmp_path / "run" / "metrics.csv"))
    assert "kl_ref" in m and np.isfinite(m["kl_ref"][1])


def test_recipe_configs_layer_on_a_job_config():
    import glob

    from quads_jax import cli
    from quads_jax.rl import loop

    files = sorted(glob.glob("configs/recipes/*.yaml"))
    assert {os.path.basename(f)[:-5] for f in files} == set(loop.RECIPES)  # one file per recipe
    base = loop.JobConfig.load("configs/tiny_cpu.yaml")
    for f in files:
        cfg = loop.JobConfig.load(["configs/tiny_cpu.yaml", f])
        assert cfg.rl.recipe == os.path.basename(f)[:-5]
        # the layer replaces only its keys: the rest of rl and the model come from the base
        assert (cfg.rl.steps, cfg.rl.grpo, cfg.model) == (base.rl.steps, base.rl.grpo, base.model)
    assert loop.JobConfig.load(["configs/tiny_cpu.yaml", "configs/recipes/quads.yaml"], {"rl.rac_ratio": 0.25}).rl.rac_ratio == 0.25
    a = cli.build_parser().parse_args(["train", "--config", "configs/tiny_cpu.yaml", "--config", "configs/recipes/bf16.yaml"])
    assert a.config == ["configs/tiny_cpu.yaml", "configs/recipes/bf16.yaml"]
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        loop.JobConfig.load(["configs/tiny_cpu.yaml", "configs/recipes/nope.yaml"])


def test_grpo_variants_aggregate_clip_and_normalise_as_documented():
    rng = np.random.default_rng()
    n, t = 6, 7
    x = jnp.asarray(rng.standard_normal((n, t)), jnp.float32)
    mask = jnp.asarray(rng.random((n, t)) < 0.6)
    m = np.asarray(mask, np.float32)
    # a mean of ~40 standard normals can cancel to ~1e-4, so a relative bound alone is flaky;
    # FP32 summation order changes a mean by a few ulps of the largest summand
    tol = 8 * np.finfo(np.float32).eps * float(np.abs(np.asarray(x)).max())
    np.testing.assert_allclose(G.aggregate(x, mask, "token_mean"), (np.asarray(x) * m).sum() / m.sum(), rtol=1e-6, atol=tol)
    per = (np.asarray(x) * m).sum(1) / np.maximum(m.sum(1), 1)
    np.testing.assert_allclose(G.aggregate(x, mask, "seq_mean"), per.mean(), rtol=1e-6, atol=tol)
    np.testing.assert_allclose(G.aggregate(x, mask, "seq_sum_norm", seq_budget=10), ((np.asarray(x) * m).sum(1) / 10).mean(), rtol=1e-6, atol=tol)
    # micro-batch losses with the update's denominator add up to the whole batch's loss
    for how in G.LOSS_AGG:
        whole = G.aggregate(x, mask, how, seq_budget=10)
        d = m.sum() if how == "token_mean" else n
        parts = sum(G.aggregate(x[i:i + 2], mask[i:i + 2], how, seq_budget=10, denom=d) for i in range(0, n, 2))
        np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=tol)
    r = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(G.group_advantages(r, 3, std_norm=False), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], atol=1e-6)
    # clip-higher: a ratio of 1.25 with a positive advantage is clipped at 1.2, not at 1.28
    lp, old = jnp.log(jnp.asarray([[1.25]])), jnp.zeros((1, 1))
    for hi, want in ((None, -1.2), (0.28, -1.25)):
        loss, _ = G.policy_loss(lp, old, jnp.asarray([1.0]), jnp.ones((1, 1), bool), G.GRPOConfig(clip_eps_high=hi))
        np.testing.assert_allclose(loss, want, rtol=1e-5)
    with pytest.raises(ValueError, match="grpo.loss_agg"):
        G.GRPOConfig(loss_agg="sum")


@pytest.mark.slow  # a minute or more on 2 cores (CI): ./test.sh -m slow
def test_micro_batches_give_the_same_update(tmp_path):
    """Gradient accumulation over micro-batches is the same update."""
    from quads_jax.rl import loop

    path = _digits_config(tmp_path, steps=1, prompts=2, group=4)
    cfg = loop.JobConfig.load(path)
    g, params, _ = split_params(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    out = {}
    for micro in (1, 2):
        c = loop.JobConfig.load(path, {"rl.grpo.micro_batches": micro})
        out[micro], _ = loop.run_grpo(c, g, params, cfg.model, str(tmp_path / f"m{micro}"))
    for k in params:
        np.testing.assert_allclose(np.asarray(out[2].params[k]), np.asarray(out[1].params[k]), rtol=2e-4, atol=2e-6)


@pytest.mark.slow
def test_sharded_rl_step_and_grpo_variants(tmp_path):
    """The RL update sharded over the 8 simulated devices (experts over "expert", FSDP, tensor
    parallel) equals the single-device one; several PPO mini-batches, Dr.GRPO advantages,
    clip-higher and overlong masking run through the loop."""
    from quads_jax.rl import loop

    path = _digits_config(tmp_path, steps=1, prompts=2, group=4)
    cfg = loop.JobConfig.load(path)
    g, params, _ = split_params(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    c = loop.JobConfig.load(path, {"rl.grpo.micro_batches": 2})
    one, _ = loop.run_grpo(c, g, params, cfg.model, str(tmp_path / "one"))
    sharded, _ = loop.run_grpo(dataclasses.replace(c, mesh={"expert": 2, "fsdp": 2, "tensor": 2}), g, params, cfg.model,
                               str(tmp_path / "mesh"))
    assert any(len(v.sharding.device_set) > 1 for v in jax.tree.leaves(sharded.params))
    for k in params:
        np.testing.assert_allclose(np.asarray(sharded.params[k]), np.asarray(one.params[k]), rtol=2e-4, atol=2e-6)
    c = loop.JobConfig.load(path, {"rl.steps": 2, "rl.grpo": {"group_size": 4, "mini_batches": 2, "micro_batches": 2,
                                                              "std_norm": False, "loss_agg": "seq_mean", "clip_eps_high": 0.28,
                                                              "overlong": "mask"}})
    st, hist = loop.run_grpo(c, g, params, cfg.model, str(tmp_path / "variants"))
    assert int(st.step) == 4 and all(np.isfinite(h["loss"]) for h in hist if "loss" in h)  # 2 rollouts x 2 updates


def test_responses_of_a_thousand_tokens_roll_out_and_score():
    """Long responses: the engine generates 1024 tokens a request, and the trainer scores
    the 1030-token sequences with a chunked head; their log-probs agree (float32 model)."""
    from quads_jax.model import token_logprobs
    from quads_jax.rl import data as D

    cfg = CFG.replace(max_seq_len=1040, logits_chunk=256)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    _, flat, _ = split_params(model)
    eng = Engine(cfg, recipe="bf16", max_batch=2, max_len=1040, decode_burst=64)
    eng.load(flat)
    reqs = [Request(prompt=[1, 5, 6, 7, 8, 9], max_new_tokens=1024, seed=s, ignore_eos=True) for s in (1, 2)]
    res = eng.generate(reqs)
    assert [len(r.output_ids) for r in res] == [1024, 1024]
    b = D.rl_batch([r.prompt for r in reqs], [r.output_ids for r in res], [r.logprobs for r in res], 1040)
    lp = jax.jit(lambda t, a: token_logprobs(model, t, a))(jnp.asarray(b["tokens"]), jnp.asarray(b["attn"]))
    m = b["resp_mask"]
    assert np.abs(np.asarray(lp)[m] - b["rollout_logp"][m]).max() < 2e-3
