import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from quads_jax import sharding as S
from quads_jax.model import ModelConfig, Transformer
from quads_jax.train.checkpoint import Checkpointer
from quads_jax.train.losses import sft_loss
from quads_jax.train.state import (OptimConfig, init_state, make_optimizer, make_train_step, sharded_init,
                                   split_params, to_model)

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
                  experts_per_token=2, expert_ffn=32, compute_dtype="float32")


def make():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def batch(seed, b=8, t=16):
    tok = jax.random.randint(jax.random.key(seed), (b, t), 0, 64)
    return {"tokens": tok, "attn": jnp.ones((b, t), bool), "loss_mask": jnp.ones((b, t), bool).at[:, 0].set(False)}


def setup(lr=1e-2):
    g, params, axes = split_params(make())
    tx = make_optimizer(OptimConfig(lr=lr, warmup_steps=1, total_steps=50))
    return g, params, axes, tx


def test_split_merge_roundtrip():
    m = make()
    g, params, _ = split_params(m)
    m2 = to_model(g, params)
    t = batch(0)["tokens"]
    np.testing.assert_array_equal(np.asarray(m(t)), np.asarray(m2(t)))
    assert "layers/0/moe/w_gate" in params


def test_training_lowers_loss_on_a_fixed_batch():
    g, params, _, tx = setup()
    step = make_train_step(g, tx, sft_loss())
    state = init_state(params, tx)
    b = batch(1)
    losses = []
    for _ in range(15):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses
    assert int(state.step) == 15


# pure data parallelism is a special case of the two mixed meshes: with -m slow
@pytest.mark.parametrize("mesh_shape", [pytest.param({"data": 8}, marks=pytest.mark.slow), {"data": 2, "fsdp": 2, "tensor": 2},
                                        {"fsdp": 4, "expert": 2}])
def test_sharded_step_equals_single_device(mesh_shape):
    g, params, axes, tx = setup()
    b = batch(2)
    single = make_train_step(g, tx, sft_loss(), donate=False)
    s1, m1 = single(init_state(params, tx), b)
    mesh = S.make_mesh(mesh_shape)
    step = make_train_step(g, tx, sft_loss(), mesh=mesh, axes=axes, donate=False)
    s2, m2 = step(init_state(params, tx), b)
    assert abs(float(m1["loss"]) - float(m2["loss"])) < 1e-5
    for k in params:
        np.testing.assert_allclose(np.asarray(s1.params[k]), np.asarray(s2.params[k]), atol=1e-5, err_msg=k)
    # parameters really are sharded by their logical axes
    sh = s2.params["layers/0/attn/q/w"].sharding
    assert sh.spec == S.logical_spec(("heads", "embed"), (64, 64), mesh)


def test_sharded_init_never_builds_the_full_model_on_one_device():
    mesh = S.make_mesh({"fsdp": 8})
    tx = make_optimizer(OptimConfig())
    g, axes, state = sharded_init(make, tx, mesh)
    w = state.params["embed"]
    assert w.sharding.spec == S.logical_spec(("vocab", "embed"), w.shape, mesh)
    assert {s.data.shape for s in w.addressable_shards} == {(64, 8)}


def test_gradient_accumulation_equals_big_batch():
    g, params, _, tx = setup()
    b = batch(3, b=8)
    s1, _ = make_train_step(g, tx, sft_loss(), donate=False)(init_state(params, tx), b)
    micro = jax.tree.map(lambda x: x.reshape(2, 4, *x.shape[1:]), b)
    s2, _ = make_train_step(g, tx, sft_loss(), grad_accum=2, donate=False)(init_state(params, tx), micro)
    for k in params:  # mean of per-micro-batch token means = big-batch mean here (equal token counts)
        np.testing.assert_allclose(np.asarray(s1.params[k]), np.asarray(s2.params[k]), atol=2e-5, err_msg=k)


def test_non_finite_step_is_skipped():
    g, params, _, tx = setup()

    def bad_loss(model, batch, rng):
        loss, m = sft_loss()(model, batch, rng)
        return loss * jnp.where(batch["poison"], jnp.nan, 1.0), m

    step = make_train_step(g, tx, bad_loss, donate=False)
    state = init_state(params, tx)
    b = dict(batch(4), poison=jnp.bool_(True))
    s2, m = step(state, b)
    assert int(s2.skipped) == 1 and int(s2.step) == 0 and int(m["skipped"]) == 1
    for k in params:
        np.testing.assert_array_equal(np.asarray(s2.params[k]), np.asarray(state.params[k]))
    s3, _ = step(s2, dict(b, poison=jnp.bool_(False)))
    assert int(s3.step) == 1 and int(s3.skipped) == 1


def test_checkpoint_resume_is_bit_identical_and_reshards(tmp_path):
    g, params, axes, tx = setup()
    step = make_train_step(g, tx, sft_loss(), donate=False)
    batches = [batch(10 + i) for i in range(6)]
    ref = init_state(params, tx)
    for b in batches:
        ref, _ = step(ref, b)
    ck = Checkpointer(str(tmp_path / "ck"), save_every=1, max_to_keep=2)
    s = init_state(params, tx)
    for b in batches[:3]:
        s, _ = step(s, b)
        ck.save(s)
    ck.wait()
    assert ck.latest_step() == 3 and ck.all_steps() == [2, 3]  # max_to_keep
    restored = ck.restore(init_state(params, tx))
    for b in batches[3:]:
        restored, _ = step(restored, b)
    for k in params:
        np.testing.assert_array_equal(np.asarray(ref.params[k]), np.asarray(restored.params[k]), err_msg=k)
    # restore onto a mesh: the target's shardings decide the layout
    mesh = S.make_mesh({"fsdp": 4, "tensor": 2})
    like = init_state(params, tx)
    like = jax.device_put(like, make_train_step(g, tx, sft_loss(), mesh=mesh, axes=axes).shardings(like))
    on_mesh = ck.restore(like, step=3)
    assert on_mesh.params["embed"].sharding == like.params["embed"].sharding
    p_only = ck.restore_params(params)
    np.testing.assert_array_equal(np.asarray(p_only["embed"]), np.asarray(on_mesh.params["embed"]))
    ck.close()


def test_crash_mid_save_keeps_last_good_checkpoint(tmp_path):
    g, params, _, tx = setup()
    d = str(tmp_path / "ck")
    ck = Checkpointer(d, save_every=1, async_save=False)
    s = init_state(params, tx)
    ck.save(s, force=True)
    ck.wait()
    # a save interrupted before it was finalized leaves only a temporary directory behind
    os.makedirs(os.path.join(d, "1.orbax-checkpoint-tmp-123", "params"))
    with open(os.path.join(d, "1.orbax-checkpoint-tmp-123", "params", "junk"), "w") as f:
        f.write("partial")
    ck.close()
    ck2 = Checkpointer(d, save_every=1)
    assert ck2.latest_step() == 0
    r = ck2.restore(init_state(params, tx))
    np.testing.assert_array_equal(np.asarray(r.params["embed"]), np.asarray(params["embed"]))
    with pytest.raises(FileNotFoundError, match="step 7"):
        ck2.restore(init_state(params, tx), step=7)
    ck2.close()
    with pytest.raises(FileNotFoundError, match="no finalized checkpoint"):
        Checkpointer(str(tmp_path / "empty")).restore_params()


def test_mesh_errors():
    with pytest.raises(ValueError, match="unknown axes"):
        S.make_mesh({"pipeline": 2})
    with pytest.raises(ValueError, match="need 6 devices"):
        S.make_mesh({"data": 3, "fsdp": 2})


# ----------------------------------------------------------------------------- expert parallelism


@pytest.mark.parametrize("mesh_shape", [pytest.param({"expert": 8}, marks=pytest.mark.slow), {"data": 2, "expert": 4},
                                        {"fsdp": 2, "expert": 2, "data": 2}])
def test_expert_parallel_moe_equals_dense(mesh_shape):
    from quads_jax import precision as P
    from quads_jax.model import moe as M
    from quads_jax.model.expert_parallel import expert_parallel_moe

    rng = np.random.default_rng(0)
    n, d, f, e, k = 64, 32, 16, 8, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((e, f, d)) * 0.2, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((e, d, f)) * 0.2, jnp.float32)
    logits = jnp.asarray(rng.standard_normal((n, e)), jnp.float32).at[:, 3].add(-50)  # expert 3 gets no tokens
    _, ids, w = M.route(logits, k, True)
    ref = M.moe_ffn(x, ids, w, wg, wu, wd, P.Precision(), jnp.float32)
    mesh = S.make_mesh(mesh_shape)
    y, dropped = jax.jit(lambda *a: expert_parallel_moe(mesh, *a, P.Precision(), jnp.float32))(x, ids, w, wg, wu, wd)
    assert int(dropped) == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # a small capacity drops assignments and says how many
    y2, dropped2 = expert_parallel_moe(mesh, x, ids, w, wg, wu, wd, P.Precision(), jnp.float32, capacity_factor=0.5)
    assert int(dropped2) > 0


def test_expert_parallel_model_forward_and_grad():
    from quads_jax.model.expert_parallel import expert_parallel_fn

    mesh = S.make_mesh({"data": 2, "expert": 4})
    m = make()
    t = batch(7)["tokens"]
    fn = expert_parallel_fn(mesh)
    ref = nnx.jit(lambda m, t: m(t))(m, t)
    out = nnx.jit(lambda m, t: m.forward(t, expert_fn=fn)[0])(m, t)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4)
    g = nnx.jit(nnx.grad(lambda m: m.forward(t, expert_fn=fn)[0].sum()))(m)
    g0 = nnx.jit(nnx.grad(lambda m: m(t).sum()))(m)
    np.testing.assert_allclose(np.asarray(g["layers"][0]["moe"]["w_up"].get_value()),
                               np.asarray(g0["layers"][0]["moe"]["w_up"].get_value()), rtol=1e-3, atol=1e-4)


def test_flops_mfu_and_distributed_settings(monkeypatch):
    from quads_jax import distributed
    from quads_jax.model import ModelConfig
    from quads_jax.train import flops

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
                      experts_per_token=2, expert_ffn=64)
    want = 6 * cfg.param_counts()["active"] + 12 * 2 * 4 * 16 * 128
    assert flops.flops_per_token(cfg, 128) == want
    assert np.isnan(flops.mfu(1000.0, cfg, 128))  # a CPU has no listed peak
    assert flops.mfu(1000.0, cfg, 128, peak=1e12) == pytest.approx(1000.0 * want / 1e12)
    assert distributed.initialize() is False  # nothing configured: single process, no-op
    with pytest.raises(ValueError, match="missing"):
        distributed.initialize(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="QUADS_NUM_PROCESSES"):
        distributed.settings_from_env({"QUADS_NUM_PROCESSES": "two"})
