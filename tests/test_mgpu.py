"""The Mosaic GPU decode GEMM on the CPU: its decode's integer steps, its K order, that it
lowers for CUDA, and nvfp4_matmul's path="mgpu" (an XLA product of the same operands in
interpret mode) against the XLA backend. Only the device runs the kernel itself
(benchmarks/mgpu_check.py checks it there against XLA)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import nvfp4_matmul
from pallas_kernels import nvfp4_matmul_mgpu as M
from quads_jax import nvfp4
from quads_jax.tiling import PATHS, gemm_config

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float16)


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def test_word_decode_steps_give_the_e2m1_bit_patterns(rng):
    words = np.concatenate([rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32),
                            np.array([0, 0x88888888, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98], np.uint32)])
    pairs = M.decode_words_emulated(words)  # [n, 4] FP16x2
    got = np.stack([pairs & 0xFFFF, pairs >> 16], -1).astype(np.uint16)  # [n, 4, 2]
    codes = np.stack([(words >> (4 * q)) & 15 for q in range(8)], -1)
    want = np.stack([np.stack([E2M1[codes[:, a]], E2M1[codes[:, b]]], -1) for a, b in M.WORD_PAIRS], 1)
    np.testing.assert_array_equal(got, want.view(np.uint16))  # bit exact, -0 included


def test_fragment_order_is_the_kernels_register_map():
    perm = M.fragment_channel_order()
    assert sorted(perm.tolist()) == list(range(M.TILE_K))
    w = M.TILE_K // 32
    # thread c of a row, word u (its channels 8 (c w + u) + q), pair t -> column group 4 u + t
    for c in range(4):
        for u in range(w):
            for t, (q0, q1) in enumerate(M.WORD_PAIRS):
                j = 4 * u + t
                assert perm[8 * j + 2 * c] == 8 * (c * w + u) + q0
                assert perm[8 * j + 2 * c + 1] == 8 * (c * w + u) + q1
    a = jnp.arange(2 * 2 * M.TILE_K, dtype=jnp.float32).reshape(2, 2 * M.TILE_K)
    b = M.to_fragment_order(a)
    np.testing.assert_array_equal(np.asarray(b[:, M.TILE_K:]) - M.TILE_K, np.asarray(a[:, :M.TILE_K])[:, perm])
    # a permutation of K leaves the product unchanged: what lets the kernel pick the order
    w_ = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2 * M.TILE_K)), jnp.float32)
    np.testing.assert_allclose(np.asarray(b @ M.to_fragment_order(w_).T), np.asarray(a @ w_.T), rtol=1e-6)


@pytest.mark.parametrize("cfg", [M.MgpuConfig(split_k=2), M.MgpuConfig(split_k=1, frags=2, chunks=2, stages=3),
                                 M.MgpuConfig(split_k=2, frags=2, pipeline="ws")])
def test_kernel_lowers_for_cuda(cfg):
    t, k, n = 16, 1024, 256
    args = (jax.ShapeDtypeStruct((t, k), jnp.float16), jax.ShapeDtypeStruct((n, k // 8), jnp.int32),
            jax.ShapeDtypeStruct((n, k // 16), jnp.uint8))
    lowered = jax.jit(lambda a, w, s: M.decode_gemm_partials(a, w, s, cfg)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()[:4000]


def test_configs_and_shapes_are_checked():
    with pytest.raises(ValueError, match="pipeline"):
        M.MgpuConfig(pipeline="tma")
    with pytest.raises(ValueError, match="split_k"):
        M.MgpuConfig(split_k=0)
    with pytest.raises(ValueError, match="frags=4"):
        M.MgpuConfig(frags=4, pipeline="ws")
    with pytest.raises(ValueError, match="K=100"):
        M.check_shapes(16, 128, 100)
    with pytest.raises(ValueError, match="N=100"):
        M.check_shapes(16, 100, 256)
    with pytest.raises(ValueError, match="T=300"):
        M.check_shapes(300, 128, 256)
    with pytest.raises(ValueError, match="float16"):
        M.nvfp4_decode_gemm(jnp.zeros((4, 256), jnp.bfloat16), nvfp4.quantize(jnp.ones((64, 256))))
    # the measured splits (run 14, T=16)
    assert [M.mgpu_config(16, n, k).split_k for k, n in [(4096, 14336), (2048, 6144), (2048, 768)]] == [4, 4, 8]
    assert M.eligible(16, (768,), 2048) and not M.eligible(16, (100,), 2048)
    assert not M.eligible(16, (768,), 2048, rac_ratio=0.5, rac_sum="exact")
    assert not M.eligible(16, (768,), 2048, mode="w4a16")
    assert "mgpu" in PATHS and gemm_config(16, 768, 2048).path == "fused"  # opt-in: QUADS_GEMM_PATH=mgpu


@pytest.mark.parametrize("rho,act_scale", [(0.0, "token"), (0.5, "token"), (0.5, "tensor")])
def test_mgpu_path_equals_xla(rng, rho, act_scale):
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((128, 512)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((5, 512)) * np.exp(rng.standard_normal((5, 1))), jnp.float32).astype(jnp.bfloat16)
    cfg = dataclasses.replace(gemm_config(5, 128, 512), path="mgpu")
    got = nvfp4_matmul(x, w, rac_ratio=rho, act_scale=act_scale, backend="pallas", config=cfg, out_dtype=jnp.float32)
    want = nvfp4_matmul(x, w, rac_ratio=rho, act_scale=act_scale, backend="xla", out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_mgpu_path_falls_back_where_it_cannot_run(rng):
    # N = 96 (not a multiple of 64) and the exact RAC sum: the fused kernel runs instead
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((96, 256)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    cfg = dataclasses.replace(gemm_config(3, 96, 256), path="mgpu")
    for kw in (dict(rac_ratio=0.0), dict(rac_ratio=0.5, rac_sum="exact"), dict(mode="w4a16")):
        got = nvfp4_matmul(x, w, backend="pallas", config=cfg, **kw)
        want = nvfp4_matmul(x, w, backend="xla", **kw)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
