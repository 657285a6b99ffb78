import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from quads_jax import nvfp4
from quads_jax import precision as P
from quads_jax.model import ModelConfig, Transformer, from_hf_config, prepare_for_rollout, token_logprobs
from quads_jax.model import moe as M
from quads_jax.model import routing as RT

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
                  experts_per_token=2, expert_ffn=32, dense_ffn=64, mlp_only_layers=(1,), compute_dtype="float32")


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


@nnx.jit(static_argnames=("precision",))
def fwd(m, tokens, mask=None, precision=None):
    return m.forward(tokens, mask=mask, precision=precision)[0]


def toks(seed, b=2, t=12):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)


def test_shapes_and_layer_types(model):
    out = fwd(model, toks(0))
    assert out.shape == (2, 12, 64) and out.dtype == jnp.float32
    assert model.layers[0].is_moe and not model.layers[1].is_moe
    assert model.layers[0].moe.w_gate.get_value().shape == (8, 32, 64)
    assert model.layers[0].moe.w_gate.logical_axes == ("expert", "mlp", "embed")


def test_causality(model):
    t = toks(1)
    t2 = t.at[:, 8].set((t[:, 8] + 1) % 64)
    a, b = fwd(model, t), fwd(model, t2)
    np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert float(jnp.abs(a[:, 8:] - b[:, 8:]).max()) > 1e-3


def test_padding_keys_ignored(model):
    t = toks(2)
    mask = jnp.ones_like(t).at[:, 9:].set(0)
    t2 = t.at[:, 9:].set(0)
    a, b = fwd(model, t, mask), fwd(model, t2, mask)
    np.testing.assert_allclose(a[:, :9], b[:, :9], atol=1e-6)


def test_kv_cache_decode_equals_full_forward(model):
    t = toks(3)
    full = fwd(model, t)
    step = nnx.jit(lambda m, x, c, mask: m.forward(x, cache=c, mask=mask)[::2])
    cache = model.init_cache(2, 32)
    # row 1 has a shorter prompt: right padding, then decode continues at its own length
    mask = jnp.array([[1] * 6, [1] * 4 + [0] * 2])
    logits, cache = step(model, t[:, :6], cache, mask)
    np.testing.assert_allclose(logits[0], full[0, :6], atol=2e-5)
    np.testing.assert_allclose(logits[1, :4], full[1, :4], atol=2e-5)
    assert list(np.asarray(cache["lengths"])) == [6, 4]
    # feed row 0 token 6 and row 1 token 4 next
    nxt = jnp.stack([t[0, 6], t[1, 4]])[:, None]
    logits, cache = step(model, nxt, cache, jnp.ones((2, 1), int))
    np.testing.assert_allclose(logits[0, 0], full[0, 6], atol=2e-5)
    np.testing.assert_allclose(logits[1, 0], full[1, 4], atol=2e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_steps_through_the_live_key_kernel_equal_the_reference(model, splits):
    """A decode step with kernels.decode_attention="pallas" (interpreted here) gives the logits
    and cache of the XLA reference, rows of different lengths and an inactive row included."""
    import dataclasses

    import pallas_kernels as pk

    t = toks(4, b=3)
    mask = jnp.array([[1] * 7, [1] * 3 + [0] * 4, [0] * 7])
    out = {}
    for impl in ("xla", "pallas"):
        tiles = pk.DecodeAttentionConfig(splits=splits, block_k=16)
        prec = dataclasses.replace(P.Precision(), kernels=pk.KernelConfig(decode_attention=impl, decode_attention_tiles=tiles))
        step = nnx.jit(lambda m, x, c, mask: m.forward(x, cache=c, mask=mask, precision=prec)[::2])
        cache = model.init_cache(3, 40)
        _, cache = step(model, t[:, :7], cache, mask)
        out[impl] = step(model, t[:, 7:8], cache, jnp.array([[1], [1], [0]]))
    np.testing.assert_allclose(out["pallas"][0][:2], out["xla"][0][:2], atol=2e-5)
    for a, b in zip(jax.tree.leaves(out["pallas"][1]), jax.tree.leaves(out["xla"][1])):  # later layers' keys: FP32 rounding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_router_topk_and_renormalisation():
    logits = jax.random.normal(jax.random.key(0), (10, 8))
    probs, ids, w = M.route(logits, 3, True)
    ref = np.argsort(-np.asarray(probs), axis=1)[:, :3]
    np.testing.assert_array_equal(np.sort(ids, 1), np.sort(ref, 1))
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    # the softmax of the chosen logits: the chosen probs over their sum
    chosen = np.take_along_axis(np.asarray(probs), np.asarray(ids), 1)
    np.testing.assert_allclose(np.asarray(w), chosen / chosen.sum(1, keepdims=True), rtol=1e-6)
    _, _, w2 = M.route(logits, 3, False)
    assert float(w2.sum(-1).max()) < 1.0
    forced = jnp.zeros((10, 3), jnp.int32).at[:, 1].set(1).at[:, 2].set(2).at[4].set(-1)  # row 4 not forced
    _, ids3, w3 = M.route(logits, 3, True, forced)
    want = np.asarray(forced).copy()
    want[4] = np.asarray(ids)[4]
    np.testing.assert_array_equal(ids3, want)
    # forced rows weigh the replayed experts by their own logits' softmax; row 4 as unforced
    np.testing.assert_array_equal(w3, jax.nn.softmax(jnp.take_along_axis(logits, jnp.asarray(want), 1), axis=-1))
    np.testing.assert_array_equal(w3[4], w[4])


def test_aux_loss_hand_case():
    # 2 tokens, 2 experts, top-1: token 0 -> expert 0 (p=.75), token 1 -> expert 0 (p=.6)
    probs = jnp.array([[0.75, 0.25], [0.6, 0.4]])
    ids = jnp.array([[0], [0]])
    # f = [1, 0], P = [0.675, 0.325] -> 2 * 0.675
    np.testing.assert_allclose(M.load_balance_loss(probs, ids, 2), 1.35, rtol=1e-6)
    # balanced routing with uniform probs gives exactly 1
    np.testing.assert_allclose(M.load_balance_loss(jnp.full((2, 2), 0.5), jnp.array([[0], [1]]), 2), 1.0)


@pytest.mark.parametrize("m", [1, 48, 2048, RT.RANK_BY_COMPARISON_MAX + 8])
def test_expert_positions_are_the_stable_sort_and_its_inverse(m):
    """Both ways of placing the assignments (counted up to RANK_BY_COMPARISON_MAX, sorted
    beyond) give numpy's stable argsort and its inverse, ties (few experts) included."""
    rng = np.random.default_rng(m)
    for n_experts in (1, 3, 64):
        flat = rng.integers(0, n_experts, m).astype(np.int32)
        order, inv = (np.asarray(a) for a in jax.jit(RT.expert_positions)(jnp.asarray(flat)))
        want = np.argsort(flat, kind="stable")
        np.testing.assert_array_equal(order, want)
        np.testing.assert_array_equal(inv[want], np.arange(m))
        if m % 2 == 0:  # as [m / 2, 2] assignments: the tokens of the sorted rows, the group sizes
            _, _, token, sizes = jax.jit(RT.sort_by_expert, static_argnums=1)(jnp.asarray(flat.reshape(-1, 2)), n_experts + 2)
            np.testing.assert_array_equal(np.asarray(token), want // 2)
            np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat, minlength=n_experts + 2))


def test_dropless_moe_equals_loop_over_experts():
    rng = np.random.default_rng(0)
    n, d, f, e, k = 24, 32, 16, 6, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((e, f, d)) * 0.2, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((e, d, f)) * 0.2, jnp.float32)
    logits = jnp.asarray(rng.standard_normal((n, e)), jnp.float32).at[:, 5].add(-50)  # expert 5 gets nothing
    _, ids, w = M.route(logits, k, True)
    y = M.moe_ffn(x, ids, w, wg, wu, wd, P.Precision(), jnp.float32)
    ref = np.zeros((n, d))
    for i in range(n):
        for j in range(k):
            ee = int(ids[i, j])
            h = jax.nn.silu(x[i] @ wg[ee].T) * (x[i] @ wu[ee].T)
            ref[i] += float(w[i, j]) * np.asarray(h @ wd[ee].T)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_precision_policies_change_outputs_by_their_format_error(model):
    t = toks(4)
    base = fwd(model, t)
    errs = {}
    for name in ("fp8", "nvfp4_w", "nvfp4_wa"):
        out = fwd(model, t, precision=P.train_policy(name))
        errs[name] = float(jnp.abs(out - base).mean() / jnp.abs(base).mean())
    # FP8 (3 mantissa bits) is far more accurate than NVFP4 weights, and W4A4 adds activation error.
    assert 0 < errs["fp8"] < errs["nvfp4_w"] < errs["nvfp4_wa"] < 0.5, errs


def test_ste_gradients_flow(model):
    t = toks(5)
    loss = lambda m, prec: token_logprobs(m, t, precision=prec).sum()
    grad = nnx.jit(nnx.grad(loss), static_argnums=1)
    g_q = grad(model, P.train_policy("nvfp4_w"))
    g_b = grad(model, P.train_policy("bf16"))
    gq = g_q["layers"][0]["moe"]["w_gate"].get_value()
    gb = g_b["layers"][0]["moe"]["w_gate"].get_value()
    assert float(jnp.abs(gq).max()) > 0
    cos = float(jnp.sum(gq * gb) / jnp.linalg.norm(gq) / jnp.linalg.norm(gb))
    assert 0.8 < cos < 0.99999, cos  # STE: the BF16 gradient direction, evaluated at quantized weights


def test_rollout_weights_bit_identical_to_trainer_fake_quant(model):
    r = prepare_for_rollout(model, P.rollout_recipe("quads"))
    wq = r.layers[0].moe.w_gate.get_value()
    assert isinstance(wq, nvfp4.NVFP4Tensor) and np.size(wq.global_scale) == CFG.n_experts
    fq = P.fake_quant_weight(model.layers[0].moe.w_gate.get_value())
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(wq)), np.asarray(fq))
    wa = r.layers[0].attn.q.w.get_value()
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(wa)),
                                  np.asarray(P.fake_quant_weight(model.layers[0].attn.q.w.get_value())))
    assert not isinstance(r.layers[0].moe.router.w.get_value(), nvfp4.NVFP4Tensor)  # router stays BF16


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_float_rollout_weights_are_stored_as_their_gemm_reads_them(recipe):
    """BF16 / FP8 rollout weights are converted once: experts stored [E, K, N], float weights
    in the compute dtype (the router keeps FP32), and the BF16 rollout's logits equal the
    unprepared model's under the same policy bit for bit."""
    import dataclasses

    import pallas_kernels as pk
    from quads_jax import fp8

    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    m = Transformer(cfg, rngs=nnx.Rngs(1))
    r = prepare_for_rollout(m, P.rollout_recipe(recipe))
    wg = r.layers[0].moe.w_gate.get_value()
    if recipe == "bf16":
        assert isinstance(wg, pk.ExpertsKN) and wg.values.shape == (8, 64, 32) and wg.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(wg.values), np.asarray(jnp.swapaxes(m.layers[0].moe.w_gate.get_value(), 1, 2).astype(jnp.bfloat16)))
        assert r.layers[0].attn.q.w.get_value().dtype == jnp.bfloat16
        t = toks(5)
        np.testing.assert_array_equal(np.asarray(fwd(r, t)), np.asarray(fwd(m, t, precision=P.rollout_recipe("bf16"))))
    else:
        assert isinstance(wg, fp8.FP8Tensor) and wg.values.shape == (8, 32, 64)  # [E, N, K], as tokamax's FP8 kernel reads it
    assert r.layers[0].moe.router.w.get_value().dtype == jnp.float32


def test_token_logprobs_matches_manual(model):
    t = toks(6)
    lp = token_logprobs(model, t, jnp.ones_like(t))
    logits = fwd(model, t)
    ref = jax.nn.log_softmax(logits, -1)[0, 3, t[0, 4]]
    np.testing.assert_allclose(lp[0, 4], ref, rtol=1e-5)
    assert float(lp[0, 0]) == 0.0 and lp.shape == t.shape


def test_bad_config_errors():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="precision.attn"):
        P.Precision(attn="int8")
    with pytest.raises(ValueError, match="model_type"):
        from_hf_config({"model_type": "llama"})


# ----------------------------------------------------------------------------- Hugging Face

torch = pytest.importorskip("torch", reason="torch is not installed: HF parity needs transformers + torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    c = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=128)
    m = transformers.Qwen3MoeForCausalLM(c).eval()
    with torch.no_grad():  # non-trivial norms so a mixed-up norm cannot hide
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("hf")
    m.save_pretrained(d, max_shard_size="200KB")
    return str(d), m


def test_hf_parity_logits_and_greedy(hf_dir):
    from quads_jax import hf

    path, ref = hf_dir
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # sharded
    model = hf.load_qwen3_moe(path, dtype=jnp.float32)
    ids = np.random.default_rng(0).integers(0, 96, (2, 10))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(fwd(model, jnp.asarray(ids)))
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-4, rel
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_hf_export_reload_and_errors(hf_dir, tmp_path):
    from quads_jax import hf

    path, _ = hf_dir
    model = hf.load_qwen3_moe(path, dtype=jnp.float32)
    out = hf.export_qwen3_moe(model, str(tmp_path / "exp"), dtype=jnp.float32, shard_bytes=1 << 18)
    again = hf.load_qwen3_moe(out, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 96, (1, 7)))
    np.testing.assert_array_equal(np.asarray(fwd(model, ids)), np.asarray(fwd(again, ids)))
    # the exported directory also loads in transformers
    m2 = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert m2.config.num_experts == 8
    with pytest.raises(FileNotFoundError, match="not found"):
        hf.load_qwen3_moe(str(tmp_path / "nope"))
    # a shape mismatch names the key
    cfgp = os.path.join(out, "config.json")
    c = json.load(open(cfgp))
    c["moe_intermediate_size"] = 48
    json.dump(c, open(cfgp, "w"))
    with pytest.raises(ValueError, match=r"mlp\.experts|gate_proj|shape"):
        hf.load_qwen3_moe(out)
