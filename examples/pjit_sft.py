"""A user's own pjit-style sharded training script, built from quads-jax pieces.

    PYTHONPATH=. XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python examples/pjit_sft.py --steps 20 --out /tmp/example_run

It builds a mesh, initialises a small MoE directly sharded on it, trains it on a toy
copy task with the QUADS trainer policy (NVFP4 weight QAT) through the jitted sharded
train step, checkpoints with orbax, restores the last step and checks that the loss fell.

Multi-host: start one copy per process with the same arguments plus
``--coordinator HOST:PORT --num-processes N --process-id I`` (or the QUADS_* environment
variables); the mesh then spans every process's devices and orbax writes one checkpoint.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from quads_jax import distributed, precision, sharding
from quads_jax.model import ModelConfig, Transformer
from quads_jax.train.checkpoint import Checkpointer
from quads_jax.train.losses import sft_loss
from quads_jax.train.state import OptimConfig, make_optimizer, make_train_step, sharded_init


def toy_batch(rng, batch, seq, vocab):
    """Sequences whose second half repeats the first: learnable, so the loss must fall."""
    half = rng.integers(3, vocab, (batch, seq // 2))
    tokens = np.concatenate([half, half], axis=1).astype(np.int32)
    loss_mask = np.zeros((batch, seq), bool)
    loss_mask[:, seq // 2:] = True
    return {"tokens": jnp.asarray(tokens), "attn": jnp.ones((batch, seq), bool), "loss_mask": jnp.asarray(loss_mask)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="/tmp/quads_example")
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--losses-json", default=None, help="write the per-step losses here (process 0)")
    a = ap.parse_args()
    distributed.initialize(a.coordinator, a.num_processes, a.process_id)

    n = len(jax.devices())  # global: every process's devices
    mesh = sharding.make_mesh({"data": 2 if n % 2 == 0 else 1, "fsdp": -1})
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      n_experts=4, experts_per_token=2, expert_ffn=64, compute_dtype="float32")
    tx = make_optimizer(OptimConfig(lr=3e-3, warmup_steps=2, total_steps=a.steps))
    make_model = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, axes, state = sharded_init(make_model, tx, mesh)
    print("embed sharding:", state.params["embed"].sharding.spec)

    loss_fn = sft_loss(precision.train_policy("nvfp4_w"))
    step = make_train_step(graphdef, tx, loss_fn, mesh=mesh, axes=axes)
    ckpt = Checkpointer(a.out, save_every=10, max_to_keep=2)
    rng = np.random.default_rng(0)
    losses = []
    for i in range(a.steps):
        state, metrics = step(state, toy_batch(rng, 16, 16, cfg.vocab_size))
        losses.append(float(metrics["loss"]))
        ckpt.save(state)
        if i % 5 == 0:
            print(f"step {i:3d}  loss {losses[-1]:.4f}  grad_norm {float(metrics['grad_norm']):.3f}")
    ckpt.save(state, force=True)
    ckpt.wait()

    restored = ckpt.restore(state)  # onto the same shardings
    equal = jax.jit(lambda a, b: jnp.all(jnp.stack([jnp.array_equal(a[k], b[k]) for k in a])))  # works across hosts
    same = bool(equal(restored.params, state.params))
    ckpt.close()
    print(f"[process {jax.process_index()}/{jax.process_count()}] loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"restored step {int(restored.step)} identical: {same}")
    if a.losses_json and distributed.is_coordinator():
        json.dump({"losses": losses, "devices": n, "processes": jax.process_count()}, open(a.losses_json, "w"))
    assert losses[-1] < losses[0] and same


if __name__ == "__main__":
    main()
