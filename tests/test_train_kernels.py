"""The trainer's fast paths against their references, on fresh random data: the grouped
expert GEMM (tokamax vs lax.ragged_dot), attention (cuDNN / tokamax vs the XLA reference),
chunked log-probs, rematerialization, and the load-balance loss without a one-hot.

On a CPU, tokamax and jax.nn run their XLA implementations: this checks the wiring (dimension
numbers, masks, lengths, gradients); tests/test_gpu.py checks the GPU kernels themselves."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels as pk
from quads_jax import precision as P
from quads_jax.model import ModelConfig, Transformer, token_logprobs
from quads_jax.model.moe import load_balance_loss
from quads_jax.model.transformer import chunked_logprobs


def _groups(rng, m, e):
    counts = rng.multinomial(m, rng.dirichlet(np.ones(e)))
    counts[rng.integers(e)] = 0  # an empty expert
    counts[0] += m - counts.sum()
    return counts


def _grouped_ref(x, w, counts):
    out, s = [], 0
    for e, c in enumerate(counts):
        out.append(x[s:s + c] @ w[e].T)
        s += c
    return jnp.concatenate(out)


@pytest.mark.parametrize("impl", ["xla", "tokamax"])
def test_grouped_dot_matches_per_expert_products_and_grads(impl):
    rng = np.random.default_rng()
    m, e, k, n = 96, 6, 32, 24
    counts = _groups(rng, m, e)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32)
    gs = jnp.asarray(counts)
    np.testing.assert_allclose(pk.grouped_dot(x, w, gs, impl=impl), _grouped_ref(x, w, counts), rtol=1e-5, atol=1e-4)
    ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    got = jax.grad(lambda x, w: jnp.sum(pk.grouped_dot(x, w, gs, impl=impl) * ct), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(_grouped_ref(x, w, counts) * ct), argnums=(0, 1))(x, w)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_tokamax_grouped_dot_gradient_transposes_the_weight_once():
    """The weight is stored [E, N, K]; tokamax's forward kernel reads [E, K, N]. The custom VJP
    has dx read the stored weight as it is and computes dW as dy_e.T @ x_e ([E, N, K]), so a
    train step has one weight transpose (the forward's), not a second for dW."""
    m, e, k, n = 64, 4, 32, 16
    x, w = jnp.ones((m, k), jnp.bfloat16), jnp.ones((e, n, k), jnp.float32)
    gs = jnp.array([16, 0, 30, 18])
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(pk.grouped_dot(x, w, gs, impl="tokamax").astype(jnp.float32)),
                                    argnums=(0, 1)))(x, w)

    def transposes(jx):
        n_t = 0
        for eq in jx.eqns:
            n_t += eq.primitive.name == "transpose" and eq.outvars[0].aval.ndim == 3
            for p in eq.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    if hasattr(sub, "jaxpr"):
                        n_t += transposes(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
        return n_t
    assert transposes(jaxpr.jaxpr) == 1


@pytest.mark.parametrize("tiles", [pk.DwTiles(block_k=32, block_n=16, block_r=16),
                                   pk.DwTiles(block_k=16, block_n=32, block_r=32, expert_outer=False)])
def test_pallas_grouped_dw_equals_per_expert_products(tiles):
    """Our dW kernel (interpreted here) against x_e.T @ dy_e per expert, with empty experts,
    groups that do not align with block_r, and trailing rows past the groups (ignored)."""
    rng = np.random.default_rng()
    m, e, k, n = 120, 5, 64, 64
    counts = rng.multinomial(m - 9, rng.dirichlet(np.ones(e)))
    counts[rng.integers(e)] = 0
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    got = pk.grouped_dw(x, dy, jnp.asarray(counts), out_dtype=jnp.float32, config=tiles)
    xf, df = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    s = 0
    for g, c in enumerate(counts):
        np.testing.assert_allclose(got[g], xf[s:s + c].T @ df[s:s + c], rtol=1e-5, atol=1e-4)
        s += c
    np.testing.assert_allclose(got, pk.grouped_dw_xla(x, dy, jnp.asarray(counts), out_dtype=jnp.float32), rtol=1e-5, atol=1e-4)


def test_pallas_grouped_dw_rejects_bad_input():
    with pytest.raises(ValueError, match="must divide K=48"):
        pk.grouped_dw(jnp.zeros((8, 48), jnp.bfloat16), jnp.zeros((8, 64), jnp.bfloat16), jnp.array([8]),
                      config=pk.DwTiles(block_k=32, block_n=32, block_r=16))
    with pytest.raises(ValueError, match="same M"):
        pk.grouped_dw(jnp.zeros((8, 32)), jnp.zeros((9, 32)), jnp.array([8]))
    with pytest.raises(ValueError, match="multiples of 16"):
        pk.DwTiles(block_k=24)
    with pytest.raises(ValueError, match="expert_outer"):
        pk.DwTiles(expert_outer="yes")
    assert pk.KernelConfig(grouped_tiles={"dw": {"block_k": 64, "block_n": 64, "block_r": 32}}).grouped_tiles.dw == \
        pk.DwTiles(block_k=64, block_n=64, block_r=32)
    with pytest.raises(ValueError, match="grouped_tiles"):
        pk.KernelConfig(grouped_tiles={"bwd": {}})


def test_grouped_dot_rejects_bad_shapes():
    with pytest.raises(ValueError, match="w: expected"):
        pk.grouped_dot(jnp.zeros((4, 8)), jnp.zeros((2, 3, 7)), jnp.array([2, 2]), impl="xla")
    with pytest.raises(ValueError, match="kernels.grouped"):
        pk.grouped_dot(jnp.zeros((4, 8)), jnp.zeros((2, 3, 8)), jnp.array([2, 2]), impl="cublas")


def _attn_ref(q, k, v, lengths):
    b, t, h, d = q.shape
    g = h // k.shape[2]
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(d)
    pos = jnp.arange(t)
    ok = (pos[None, :] <= pos[:, None])[None, None] & (pos[None, None, None, :] < lengths[:, None, None, None])
    p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, vv)


@pytest.mark.parametrize("impl", ["xla", "cudnn", "tokamax"])
def test_causal_attention_matches_reference_on_real_positions(impl):
    rng = np.random.default_rng()
    b, t, h, hkv, d = 3, 24, 4, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, h, d), (b, t, hkv, d), (b, t, hkv, d)))
    lengths = jnp.asarray([t, rng.integers(1, t), rng.integers(1, t)], jnp.int32)
    real = (jnp.arange(t)[None, :] < lengths[:, None])[..., None, None]
    got = pk.causal_attention(q, k, v, lengths, impl=impl)
    np.testing.assert_allclose(jnp.where(real, got, 0), jnp.where(real, _attn_ref(q, k, v, lengths), 0), rtol=1e-5, atol=1e-5)
    ct = jnp.where(real, jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32), 0)
    gots = jax.grad(lambda *a: jnp.sum(pk.causal_attention(*a, lengths, impl=impl) * ct), argnums=(0, 1, 2))(q, k, v)
    refs = jax.grad(lambda *a: jnp.sum(_attn_ref(*a, lengths) * ct), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(gots, refs):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)


def test_chunked_logprobs_equal_unchunked_with_grads():
    rng = np.random.default_rng()
    n, d, v = 37, 16, 50
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, d)), jnp.float32)
    tg = jnp.asarray(rng.integers(0, v, n))
    head = lambda x, w: x @ w.T
    ref = jax.nn.log_softmax(h @ w.T)[jnp.arange(n), tg]
    for chunk in (0, 8, 16, 64):
        np.testing.assert_allclose(chunked_logprobs(h, w, tg, head, chunk), ref, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda h, w: jnp.sum(chunked_logprobs(h, w, tg, head, 8) ** 2), argnums=(0, 1))(h, w)
    r = jax.grad(lambda h, w: jnp.sum(jax.nn.log_softmax(h @ w.T)[jnp.arange(n), tg] ** 2), argnums=(0, 1))(h, w)
    for a, b in zip(g, r):
        # the same sums in another order: FP32 rounding relative to the largest entries (a
        # small entry is a cancellation of large terms; a fixed atol failed one on fresh data)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4,
                  experts_per_token=2, expert_ffn=16, compute_dtype="float32")


def _loss_and_grads(cfg, prec, tokens, mask):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    g, st = nnx.split(model, nnx.Param)

    def f(st):
        lp = token_logprobs(nnx.merge(g, st), tokens, mask, precision=prec)
        return -jnp.sum(lp)

    return jax.jit(jax.value_and_grad(f))(st)


@pytest.mark.parametrize("remat,chunk,kernels", [
    ("full", 0, pk.KernelConfig()),
    ("dots", 8, pk.KernelConfig()),
    ("none", 8, pk.KernelConfig(grouped="tokamax", attention="cudnn")),
    ("full", 16, pk.KernelConfig(grouped="tokamax", attention="tokamax")),
])
def test_train_paths_give_the_reference_loss_and_grads(remat, chunk, kernels):
    """Remat policies, logits chunking and kernel choices change memory and speed, never the
    loss or gradients (beyond float reassociation)."""
    rng = np.random.default_rng()
    tokens = jnp.asarray(rng.integers(0, 64, (3, 12)))
    mask = jnp.arange(12)[None, :] < jnp.asarray([[12], [7], [10]])
    ref_l, ref_g = _loss_and_grads(CFG.replace(logits_chunk=0), P.train_policy("nvfp4_w"), tokens, mask)
    prec = dataclasses.replace(P.train_policy("nvfp4_w"), kernels=kernels)
    l, g = _loss_and_grads(CFG.replace(remat=remat, logits_chunk=chunk), prec, tokens, mask)
    np.testing.assert_allclose(l, ref_l, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_load_balance_loss_equals_the_one_hot_formula():
    rng = np.random.default_rng()
    n, e, k = 50, 8, 3
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((n, e)), jnp.float32))
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]))
    mask = jnp.asarray(rng.random(n) < 0.7)
    m = mask.astype(jnp.float32)
    f = (jax.nn.one_hot(ids, e).sum(1) * m[:, None]).sum(0) / (m.sum() * k)
    p = (probs * m[:, None]).sum(0) / m.sum()
    np.testing.assert_allclose(load_balance_loss(probs, ids, e, mask), e * jnp.sum(f * p), rtol=1e-6)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="model.remat"):
        CFG.replace(remat="some")
    with pytest.raises(ValueError, match="kernels.attention"):
        pk.KernelConfig(attention="flash")
    with pytest.raises(ValueError, match="unknown keys"):
        pk.KernelConfig.from_dict({"grouped": "xla", "tiles": 3})
    kc = pk.KernelConfig.from_dict({"decode_attention_tiles": {"block_k": 32, "splits": 2}})  # as a job's YAML gives it
    assert kc.decode_attention_tiles == pk.DecodeAttentionConfig(block_k=32, splits=2)
    with pytest.raises(ValueError, match="kernels.decode_attention_tiles"):
        pk.KernelConfig(decode_attention_tiles=64)
    with pytest.raises(ValueError, match="block_k="):
        pk.KernelConfig.from_dict({"decode_attention_tiles": {"block_k": 48}})


def _dot_operand_dtypes(jaxpr):
    """The operand dtypes of every dot_general in a jaxpr and the jaxprs nested in it."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append(tuple(str(v.aval.dtype) for v in e.invars))
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _dot_operand_dtypes(inner)
    return out


def test_head_backward_multiplies_in_the_operand_type():
    """The head's FP32 logits from BF16 operands: its backward products read the cotangent in
    BF16 (no FP32 x BF16 product, which XLA runs as a TF32 GEMM), and its gradients equal
    JAX's own transpose within BF16 rounding of the cotangent."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((24, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((40, 64)) / 8, jnp.bfloat16)
    dn = (((1,), (1,)), ((), ()))
    weights = jnp.arange(40.0)
    loss = lambda x, w: jnp.sum(jax.nn.log_softmax(P.linear(x, w, "bf16", dtype=jnp.float32, operand_dtype=jnp.bfloat16)) * weights)
    ref = lambda x, w: jnp.sum(jax.nn.log_softmax(jax.lax.dot_general(x, w, dn, preferred_element_type=jnp.float32)) * weights)
    np.testing.assert_array_equal(np.asarray(loss(x, w)), np.asarray(ref(x, w)))
    dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w).jaxpr)
    assert len(dots) == 3 and all(d == ("bfloat16", "bfloat16") for d in dots), dots
    assert any("float32" in d for d in _dot_operand_dtypes(jax.make_jaxpr(jax.grad(ref, (0, 1)))(x, w).jaxpr))  # JAX's own
    got, want = jax.grad(loss, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(g - r).max() <= 2**-7 * np.abs(r).max()
