"""Pallas kernels (interpret mode on the CPU) against their XLA references, on fresh random data."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from quads_jax import fp8, nvfp4
from pallas_kernels import cache_attention as CA, rac


def heavy(rng, shape):
    return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,)))).astype(np.float32)


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def assert_operand_equal(x, rho, config=None, order=("plain", 16), rows=None):
    """The Pallas quantizer's FP16 operand and global scales are the XLA reference's bits."""
    a, ga = pk.quantize_operand(x, rac_ratio=rho, order=order, rows=rows, backend="xla")
    b, gb = pk.quantize_operand(x, rac_ratio=rho, order=order, rows=rows, backend="pallas", config=config)
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16), err_msg=f"{config} {order}")
    np.testing.assert_array_equal(np.asarray(ga).view(np.uint32), np.asarray(gb).view(np.uint32))
    return b, gb


@pytest.mark.parametrize("act_scale", ["tensor", "token"])
def test_quantizer_reference_is_nvfp4_quantize(rng, act_scale):
    x = jnp.asarray(heavy(rng, (37, 256))).astype(jnp.bfloat16)
    a = pk.quantize_activations(x, act_scale=act_scale)
    ref = nvfp4.quantize(x.astype(jnp.float32), keep_axes=(0,) if act_scale == "token" else ())
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(ref.codes))
    np.testing.assert_array_equal(np.asarray(a.scales).view(np.uint8), np.asarray(ref.scales).view(np.uint8))


@pytest.mark.parametrize("rho", [0.0, 0.125, 0.5, 1.0])
def test_rac_quantizer_pallas_equals_xla(rng, rho):
    x = jnp.asarray(heavy(rng, (20, 512))).astype(jnp.bfloat16)
    assert_operand_equal(x, rho)


def test_rac_selects_the_largest_residual_blocks(rng):
    x = jnp.asarray(heavy(rng, (4, 256)))
    gx = rac.activation_global_scale(x, "token")
    r = rac.residual(x, gx)
    m = np.asarray(rac.selection_mask(r, 0.25, "token")).reshape(4, 16, 16)[:, :, 0]  # per 16-block
    e = np.asarray(rac.block_energy(r))
    assert m.sum(1).tolist() == [4] * 4  # 25% of 16 blocks per token
    for t in range(4):
        assert e[t][m[t]].min() >= e[t][~m[t]].max()


@pytest.mark.parametrize("t,rho", [(1, 0.0), (64, 0.0), (64, 0.5), (19, 0.125), (19, 1.0)])
def test_gemm_pallas_equals_xla(rng, t, rho):
    """The rollout's regime (per-token activation scales), the one the kernel computes: with
    per-tensor scales ``backend="pallas"`` runs the XLA reference too."""
    x = jnp.asarray(heavy(rng, (t, 256))).astype(jnp.bfloat16)
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((96, 256)).astype(np.float32)))
    a = pk.nvfp4_matmul(x, w, rac_ratio=rho, act_scale="token", backend="xla", out_dtype=jnp.float32)
    b = pk.nvfp4_matmul(x, w, rac_ratio=rho, act_scale="token", backend="pallas", out_dtype=jnp.float32)
    assert "pallas_call" in str(jax.make_jaxpr(lambda v: pk.nvfp4_matmul(v, w, rac_ratio=rho, act_scale="token", backend="pallas"))(x))
    assert b.shape == (t, 96)
    assert rel(b, a) < 1e-5  # same operands, FP32 accumulation in another order


def test_gemm_w4a16_and_rho_semantics(rng):
    x = jnp.asarray(heavy(rng, (16, 512))).astype(jnp.bfloat16)
    wf = jnp.asarray(rng.standard_normal((64, 512)).astype(np.float32))
    w = nvfp4.quantize(wf)
    wd = nvfp4.dequantize(w)
    xf = x.astype(jnp.float32)
    exact = np.asarray(xf @ wf.T)
    # FP32 sums of the same 512 products in another order differ by at most K * 2**-24 times
    # the sum of their magnitudes
    fp32_sum = lambda a: 512 * 2.0**-24 * np.asarray(np.abs(a) @ np.abs(wd).T)
    # rho = 0 is the plain W4A4 product (per-token scales: the kernel's regime)
    xq = nvfp4.dequantize(pk.quantize_activations(x, act_scale="token"))
    got0 = np.asarray(pk.nvfp4_matmul(x, w, act_scale="token", backend="pallas", out_dtype=jnp.float32))
    assert np.all(np.abs(got0 - np.asarray(xq @ wd.T)) <= fp32_sum(xq))
    # rho = 1 is (dq(q(x)) + dq(q(r))) @ dq(w).T: exactly so with rac_sum="exact"; with the
    # default FP16 sum, within FP16's unit roundoff (2**-11) of each compensated activation
    # ("exact" runs the XLA reference, "fp16" the kernel)
    xq1, rq1 = pk.quantize_activations_rac(x, rac_ratio=1.0, act_scale="token")
    comp = nvfp4.dequantize(xq1) + nvfp4.dequantize(rq1)
    ref1 = comp @ wd.T
    got = {s: pk.nvfp4_matmul(x, w, rac_ratio=1.0, rac_sum=s, act_scale="token", backend="pallas", out_dtype=jnp.float32)
           for s in pk.RAC_SUMS}
    assert np.all(np.abs(np.asarray(got["exact"]) - np.asarray(ref1)) <= fp32_sum(comp))
    bound = 2.0**-11 * (np.abs(comp) @ np.abs(wd).T) + fp32_sum(comp)
    assert np.all(np.abs(got["fp16"] - ref1) <= bound)
    assert 0 < rel(got["fp16"], ref1) < 1e-4  # rounded somewhere, far below the BF16 output's 2**-9
    # the activation error (against the product with the same dequantized weight: the weight's
    # error is common to every rho and, at this size, larger than the steps between them) falls
    # as rho grows
    act_ref = np.asarray(xf @ wd.T)
    act = [rel(pk.nvfp4_matmul(x, w, rac_ratio=r, backend="xla", out_dtype=jnp.float32), act_ref) for r in (0.0, 0.125, 0.5, 1.0)]
    assert act[0] > act[1] > act[2] > act[3], act
    errs = [rel(pk.nvfp4_matmul(x, w, rac_ratio=r, backend="xla", out_dtype=jnp.float32), exact) for r in (0.0, 1.0)]
    assert errs[0] > errs[1], errs
    w16 = rel(pk.nvfp4_matmul(x, w, mode="w4a16", backend="pallas", out_dtype=jnp.float32), exact)
    assert w16 < errs[1] * 1.2 and np.isclose(w16, rel(xf @ wd.T, exact), rtol=1e-3)


# rho 0 of the grouped kernel also runs in test_gemm_decode_variants_equal_xla
@pytest.mark.parametrize("rho", [pytest.param(0.0, marks=pytest.mark.slow), 0.5])
def test_grouped_pallas_equals_xla_with_empty_experts(rng, rho):
    e, m = 6, 52
    sizes = np.array([10, 0, 17, 0, 18, 0], np.int32)  # 45 rows; the 7 past them give zeros
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((e, 64, 128)).astype(np.float32) * np.arange(1, e + 1)[:, None, None]),
                       keep_axes=(0,))
    assert np.size(w.global_scale) == e
    x = jnp.asarray(heavy(rng, (m, 128))).astype(jnp.bfloat16)
    # per-token activation scales: the rollout's regime, the one the kernel computes
    a = pk.nvfp4_grouped_matmul(x, w, jnp.asarray(sizes), rac_ratio=rho, act_scale="token", backend="xla", out_dtype=jnp.float32)
    b = pk.nvfp4_grouped_matmul(x, w, jnp.asarray(sizes), rac_ratio=rho, act_scale="token", backend="pallas", out_dtype=jnp.float32)
    assert "pallas_call" in str(jax.make_jaxpr(
        lambda v: pk.nvfp4_grouped_matmul(v, w, jnp.asarray(sizes), rac_ratio=rho, act_scale="token", backend="pallas"))(x))
    assert rel(b, a) < 1e-5
    np.testing.assert_array_equal(np.asarray(b[45:]), 0.0)
    # each group equals the dense GEMM with that expert's weight (per-token activation scales,
    # so a row's quantization does not depend on the other rows)
    start = 0
    for ei, n in enumerate(sizes):
        if n:
            we = nvfp4.NVFP4Tensor(w.codes[ei], w.scales[ei], w.global_scale[ei].reshape(()), (64, 128), 1)
            d = pk.nvfp4_matmul(x[start:start + n], we, rac_ratio=rho, act_scale="token", backend="xla", out_dtype=jnp.float32)
            assert rel(a[start:start + n], d) < 1e-5
        start += n


def test_grouped_output_rows_past_the_group_sizes_are_zero(rng):
    """With fewer assigned rows than M (the sizes sum to less: expert parallelism's foreign
    rows), the trailing rows of the output are zero, written by the kernel's spare programs
    (interpret mode starts outputs as NaN, so a row no program writes fails): here with two
    weights in one launch and split K (FP32 partials); one weight, unsplit: the test above."""
    e, k = 4, 256
    sizes = jnp.asarray([9, 0, 12, 5], jnp.int32)  # 26 of 61 rows
    x = jnp.asarray(rng.standard_normal((61, k)), jnp.bfloat16)
    ws = [nvfp4.quantize(jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32), keep_axes=(0,)) for n in (64, 96)]
    kw = dict(rac_ratio=0.5, act_scale="token", out_dtype=jnp.float32)  # the kernel's regime
    ref = pk.nvfp4_grouped_matmul(x, ws, sizes, backend="xla", **kw)
    cfg = dataclasses.replace(pk.gemm_config(16, 160, k, programs_per_row_tile=e), split_k=2)
    got = pk.nvfp4_grouped_matmul(x, ws, sizes, backend="pallas", config=cfg, **kw)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(g[26:]), 0.0)
        assert rel(g[:26], r[:26]) < 1e-5


def test_grouped_work_items_cover_each_row_once(rng):
    """The grouped kernel's programs find their (expert, rows) items from the group sizes
    themselves: over all item slots, each row of each expert is covered exactly once, in tiles
    of at most block_m rows of one expert; the slots past the real items cover each trailing
    row (past the sizes' sum) once, as tail items, and then none."""
    from pallas_kernels.grouped_gemm import work_item

    for e, block_m, pad, trail in ((6, 16, 2, 0), (64, 16, 0, 37), (5, 64, 3, 130), (3, 16, 1, 0)):
        sizes = rng.integers(0, 40, e).astype(np.int32)
        sizes[rng.integers(0, e, 2)] = 0  # empty experts
        s = int(sizes.sum())
        m = s + trail
        gs = jnp.asarray(np.concatenate([sizes, np.zeros(pad, np.int32)]))
        cap = -(-m // block_m) + e
        items = np.array([[int(v) for v in work_item(gs, jnp.int32(i), block_m, e, m)] for i in range(cap)])
        ends = np.cumsum(sizes)
        covered = np.zeros(m, np.int32)
        for x, s0, s1, tail in items:
            assert 0 <= x < e and 0 <= s1 - s0 <= block_m
            if s1 > s0 and not tail:
                assert ends[x] - sizes[x] <= s0 and s1 <= ends[x], (x, s0, s1)
            if s1 > s0:
                assert (s0 >= s) == bool(tail), (s0, s, tail)
                covered[s0:s1] += 1
        np.testing.assert_array_equal(covered, 1)
        n_items = int(np.sum(-(-sizes // block_m)))
        start, end, tail = items[:, 1], items[:, 2], items[:, 3]
        assert np.all(end[:n_items] > start[:n_items]) and not tail[:n_items].any() and tail[n_items:].all()
        assert np.all(end[n_items + -(-trail // block_m):] == start[n_items + -(-trail // block_m):])


def test_fp8_quantize_rounds_to_nearest_even_with_the_slice_amax_at_448(rng):
    """Each row times 448 / its amax, rounded to the nearest E4M3 (ties to even: ml_dtypes'
    cast is the reference), the amax at exactly +-448; an all-zero row has scale 1."""
    import ml_dtypes

    x = (rng.standard_normal((32, 256)) * np.exp(3 * rng.standard_normal((32, 1)))).astype(np.float32)
    x[3] = 0.0
    x[5, :4] = [-1e-30, -0.0, 2.0**-12, 5.0]
    t = jax.jit(fp8.quantize)(jnp.asarray(x))
    amax = np.abs(x).max(1, keepdims=True)
    inv = np.where(amax > 0, np.float32(448) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    want = np.clip(x * inv, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(t.values).view(np.uint8), want.view(np.uint8))
    v = np.asarray(t.values).astype(np.float32)
    np.testing.assert_array_equal(np.abs(v).max(1)[np.arange(32) != 3], 448.0)
    assert np.asarray(t.scale)[3, 0] == 1.0 and not v[3].any()
    np.testing.assert_allclose(np.asarray(t.scale), np.where(amax > 0, amax / 448, 1), rtol=2**-23)
    # ties go to the even neighbour: 17 lies between 16 and 18 (E4M3's step there is 2), 19 between 18 and 20
    row = jnp.asarray([[448.0, 17.0, 19.0, 1.0625, 1.1875]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(fp8.quantize(row).values).astype(np.float32), [[448, 16, 20, 1.0, 1.25]])


def test_expert_of_rows_matches_searchsorted(rng):
    from pallas_kernels.grouped_gemm import expert_of_rows

    for _ in range(5):
        gs = rng.integers(0, 6, 7) * rng.integers(0, 2, 7)
        m = int(gs.sum()) + int(rng.integers(0, 4))
        want = np.searchsorted(np.cumsum(gs), np.arange(m), side="right")
        np.testing.assert_array_equal(np.asarray(expert_of_rows(jnp.asarray(gs, jnp.int32), m)), want)


def test_fp8_matmul_close_to_float(rng):
    x = jnp.asarray(rng.standard_normal((8, 256)).astype(np.float32))
    wf = jnp.asarray(rng.standard_normal((32, 256)).astype(np.float32))
    y = pk.fp8_matmul(x, fp8.quantize(wf), out_dtype=jnp.float32)
    assert rel(y, x @ wf.T) < 0.05
    wg = jnp.asarray(rng.standard_normal((3, 32, 256)).astype(np.float32))
    yg = pk.fp8_grouped_matmul(x, fp8.quantize(wg), jnp.array([3, 0, 5]), out_dtype=jnp.float32)
    ref = jnp.concatenate([x[:3] @ wg[0].T, x[3:] @ wg[2].T])
    assert rel(yg, ref) < 0.05
    # what the rollout loads: the quantized layout [E, N, K] itself (tokamax's FP8 kernel reads it)
    from quads_jax import precision as P

    wp = P.prepare_weight(wg, "fp8")
    assert wp.values.shape == (3, 32, 256) and wp.values.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(pk.fp8_grouped_matmul(x, wp, jnp.array([3, 0, 5]), out_dtype=jnp.float32)), np.asarray(yg))
    with pytest.raises(ValueError, match="x: expected"):
        pk.fp8_grouped_matmul(x[:, :128], wp, jnp.array([3, 0, 5]))


def test_grouped_dot_of_stored_kn_weights_equals_the_reference(rng):
    """The rollout's BF16 expert layout [E, K, N] (ExpertsKN) gives the [E, N, K] reference's
    numbers; FP8 values stay [E, N, K] (grouped_dot_fp8), and E4M3 activations are exact in BF16."""
    x = jnp.asarray(rng.standard_normal((9, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 32, 64)) / 8, jnp.bfloat16)
    gs = jnp.array([4, 0, 5])
    ref = pk.grouped_dot_xla(x, w, gs, out_dtype=jnp.float32)
    kn = pk.ExpertsKN.from_enk(w, jnp.bfloat16)
    assert kn.shape == (3, 32, 64) and kn.values.shape == (3, 64, 32)
    np.testing.assert_array_equal(np.asarray(pk.grouped_dot(x, kn, gs, out_dtype=jnp.float32)), np.asarray(ref))
    x8, w8 = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
    y8 = pk.grouped_dot_fp8(x8.astype(jnp.bfloat16), w8, gs)
    assert y8.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y8), np.asarray(pk.grouped_dot_xla(x8.astype(jnp.float32), w8.astype(jnp.float32), gs)),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="x: expected"):
        pk.grouped_dot_kn(x[:, :32], kn, gs)
    with pytest.raises(ValueError, match="grouped_dot_fp8"):
        pk.grouped_dot_kn(x, pk.ExpertsKN(jnp.swapaxes(w8, 1, 2)), gs)
    with pytest.raises(ValueError, match="values: expected"):
        pk.grouped_dot_fp8(x, w, gs)


@pytest.mark.parametrize("h,hkv,d,s,splits,block_k", [(8, 2, 64, 40, 1, 16), (8, 2, 64, 40, 3, 16), (4, 4, 32, 70, None, 32),
                                                     (16, 2, 64, 200, 2, 64), (16, 4, 32, 70, 1, 32), (32, 4, 64, 40, 3, 16),
                                                     (16, 2, 64, 200, None, 64), (24, 4, 32, 70, 2, 32)])
def test_decode_attention_pallas_equals_xla(rng, h, hkv, d, s, splits, block_k):
    """The live-key decode kernel (interpreted; query heads padded to 16 or a power of two where
    H is not one) against the reference over the whole cache: rows of every length, 0 (zeros out) and the full cache
    included; the output rounds once to BF16, so the tolerance is one BF16 ulp of the outputs."""
    b = 5
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
    lengths = jnp.asarray([0, 1, s, *rng.integers(2, s, 2)], jnp.int32)
    ref = pk.decode_attention(q, k, v, lengths, impl="xla")
    cfg = pk.DecodeAttentionConfig(block_k=block_k, splits=splits)
    out = pk.decode_attention(q, k, v, lengths, config=cfg)
    assert out.shape == (b, h, d) and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[0]), 0)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2 ** -7, rtol=2 ** -7)
    # keys past a row's length do not matter
    k2 = jnp.where(jnp.arange(s)[None, :, None, None] < lengths[:, None, None, None], k, 1e4)
    out2 = pk.decode_attention(q, k2, v, lengths, config=cfg)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    with pytest.raises(ValueError, match="lengths"):
        pk.decode_attention(q, k, v, lengths[:2])
    with pytest.raises(ValueError, match="block_k"):
        pk.DecodeAttentionConfig(block_k=24)
    with pytest.raises(ValueError, match="splits="):
        pk.DecodeAttentionConfig(splits=0)


@pytest.mark.parametrize("h,hkv,s,splits", [(8, 2, 40, 1), (16, 4, 70, 3), (24, 4, 40, 2)])
def test_decode_attention_appends_the_new_key(rng, h, hkv, s, splits):
    """With ``new``, the kernel writes each active row's key and value at its length (in
    place) and attends to them: the caches equal the reference's write bit for bit (inactive
    rows and full rows untouched), the outputs within a BF16 ulp of the reference."""
    b, d = 6, 32
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
    kn = jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.bfloat16)
    vn = jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.bfloat16)
    lengths = jnp.asarray([0, 1, s, s - 1, *rng.integers(2, s - 1, 2)], jnp.int32)  # a full row: no write, no new key
    active = jnp.asarray([True, True, True, True, False, True])
    new = (kn, vn, active)
    ro, rk, rv = pk.decode_attention(q, k, v, lengths, new=new, impl="xla")
    o, k2, v2 = pk.decode_attention(q, k, v, lengths, new=new, config=pk.DecodeAttentionConfig(block_k=16, splits=splits))
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(rk))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(rv))
    np.testing.assert_array_equal(np.asarray(k2[4]), np.asarray(k[4]))  # inactive
    np.testing.assert_array_equal(np.asarray(k2[0, 0]), np.asarray(kn[0]))  # written at its length
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ro, np.float32), atol=2 ** -7, rtol=2 ** -7)
    # the same as writing first and attending over one more key
    live = lengths + (active & (lengths < s)).astype(jnp.int32)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(pk.decode_attention(q, rk, rv, live, impl="xla"), np.float32),
                               atol=2 ** -7, rtol=2 ** -7)
    with pytest.raises(ValueError, match="new: expected"):
        pk.decode_attention(q, k, v, lengths, new=(kn[:, :1], vn, active))


def test_decode_attention_splits_aim_at_one_wave():
    # one split a row at B=256 on 132 SMs, three at B=64, at most 8
    assert [CA.splits_for(b, programs=132) for b in (256, 64, 16, 1)] == [1, 3, 8, 8]


def test_bad_inputs_name_the_argument(rng):
    w = nvfp4.quantize(jnp.ones((32, 64)))
    with pytest.raises(ValueError, match="x"):
        pk.nvfp4_matmul(jnp.ones((4, 48), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="mode"):
        pk.nvfp4_matmul(jnp.ones((4, 64), jnp.bfloat16), w, mode="w8a8")
    with pytest.raises(ValueError, match="rac_ratio"):
        pk.nvfp4_matmul(jnp.ones((4, 64), jnp.bfloat16), w, rac_ratio=1.5)
    with pytest.raises(ValueError, match="backend"):
        pk.nvfp4_matmul(jnp.ones((4, 64), jnp.bfloat16), w, backend="cuda")
    with pytest.raises(ValueError, match="group_sizes"):
        pk.nvfp4_grouped_matmul(jnp.ones((4, 64), jnp.bfloat16), nvfp4.quantize(jnp.ones((2, 32, 64)), keep_axes=(0,)),
                                jnp.array([1, 2, 3]))


def test_e2m1_bit_decode_equals_the_grid():
    c = jnp.arange(16, dtype=jnp.int32)
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6] + [-0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    bits = np.asarray(nvfp4.decode_e2m1_bf16(c).astype(jnp.float32))
    np.testing.assert_array_equal(bits, grid)
    np.testing.assert_array_equal(np.signbit(bits), np.signbit(grid))  # -0 keeps its sign


def test_e4m3_bit_decodes_equal_the_format_for_all_256_patterns():
    b = jnp.arange(256, dtype=jnp.int32)
    want = np.asarray(jax.lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32))
    for got in (nvfp4.decode_e4m3_bits(b), nvfp4.decode_e4m3_bf16(b).astype(jnp.float32)):
        got = np.asarray(got)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(got[ok], want[ok])  # subnormals, zero, -0 and 448 included
        np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def _prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode) on uint32 numpy arrays."""
    pool = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint32)
    for k in range(4):
        idx = ((sel >> (4 * k)) & 7).astype(np.uint64)
        byte = (pool >> (idx * np.uint64(8))) & np.uint64(0xFF)
        out |= (byte.astype(np.uint32) << np.uint32(8 * k))
    return out


def _mul_x2(a, b, dt):
    """PTX ``mul.rn.bf16x2`` / ``mul.rn.f16x2``: two 16-bit products, rounded to nearest even."""
    halves = lambda v: np.stack([v & np.uint32(0xFFFF), v >> np.uint32(16)], -1).astype(np.uint16).view(dt).astype(np.float32)
    prod = (halves(a) * halves(b)).astype(dt).view(np.uint16).astype(np.uint32)
    return prod[..., 0] | (prod[..., 1] << np.uint32(16))


def run_ptx(ptx, args):
    """Execute an inline-PTX program of ``tile_math`` on uint32 numpy arrays: ``args`` maps
    $1, $2, ... to arrays; returns $0. Knows the instructions those programs use and fails on
    any other, so the test runs the kernels' PTX text itself, not a copy of its steps."""
    import ml_dtypes

    regs = {k: np.asarray(v, np.uint32) for k, v in args.items()}
    shape = next(iter(regs.values())).shape
    val = lambda o: regs[o] if o in regs else np.full(shape, int(o, 0), np.uint32)
    ops = {"mov.b32": lambda a: a, "shr.u32": lambda a, n: a >> n, "shl.b32": lambda a, n: a << n,
           "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "prmt.b32": _prmt,
           "mul.lo.u32": lambda a, b: (a.astype(np.uint64) * b).astype(np.uint32),
           "mul.rn.bf16x2": lambda a, b: _mul_x2(a, b, ml_dtypes.bfloat16), "mul.rn.f16x2": lambda a, b: _mul_x2(a, b, np.float16)}
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op not in ops:
            raise NotImplementedError(f"run_ptx: {op}")
        dst, *src = [o.strip() for o in rest.split(",")]
        regs[dst] = ops[op](*map(val, src)).astype(np.uint32)
    return regs["$0"]


def word_decode_emulated(words, key="bf16", scale=1.0):
    """``tile_math.WORD_DECODE_PTX[key]`` run on uint32 numpy words with one E4M3 block scale
    for every block, entering as the kernel passes it (``tile_math.word_scale_halves``): [n, 8]
    BF16 (or FP16) bit patterns in WORD_CHANNELS order, of the values times
    ``WORD_VALUE_SCALE``."""
    import ml_dtypes

    from pallas_kernels import tile_math as tm

    words = np.asarray(words, np.uint32)
    bits = jnp.asarray(np.asarray(scale, ml_dtypes.float8_e4m3fn).view(np.uint8))
    s16 = np.uint32(np.asarray(tm.word_scale_halves(bits, key)))
    pair = np.full_like(words, s16 * np.uint32(0x10001))
    out = []
    for ptx in tm.WORD_DECODE_PTX[key]:
        m = run_ptx(ptx, {"$1": words, "$2": pair})
        out += [m & 0xFFFF, m >> 16]
    return np.stack(out, axis=-1).astype(np.uint16)


# no default regime runs the unswapped fused kernel: one of its decodes runs by default
@pytest.mark.parametrize("decode,swap_ab", [pytest.param("bits", False, marks=pytest.mark.slow), ("bits", True), ("words", True),
                                            ("words", False)])
def test_gemm_decode_variants_equal_xla(rng, decode, swap_ab):
    x = jnp.asarray(heavy(rng, (21, 256))).astype(jnp.bfloat16)
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((80, 256)).astype(np.float32)))
    bk = 64  # the word decode's smallest K tile: four parts of 16 channels
    cfg = pk.GemmConfig(block_m=16, block_n=32, block_k=bk, split_k=2, decode=decode, swap_ab=swap_ab)
    # the kernel's regimes: W4A4 with per-token scales, with and without RAC, and W4A16
    regimes = ({"rac_ratio": 0.5, "act_scale": "token"}, {"act_scale": "token"}, {"mode": "w4a16"})
    for kw in regimes:
        a = pk.nvfp4_matmul(x, w, backend="xla", out_dtype=jnp.float32, **kw)
        b = pk.nvfp4_matmul(x, w, backend="pallas", out_dtype=jnp.float32, config=cfg, **kw)
        assert rel(b, a) < 1e-5, kw
    if swap_ab:  # the grouped kernel shares the main loop: ragged experts, one empty
        sizes = jnp.asarray([7, 0, 14])
        wg = nvfp4.quantize(jnp.asarray(rng.standard_normal((3, 80, 256)).astype(np.float32)), keep_axes=(0,))
        for kw in regimes[:2]:
            a = pk.nvfp4_grouped_matmul(x, wg, sizes, backend="xla", out_dtype=jnp.float32, **kw)
            b = pk.nvfp4_grouped_matmul(x, wg, sizes, backend="pallas", out_dtype=jnp.float32, config=cfg, **kw)
            assert rel(b, a) < 1e-5, kw


def test_word_decode_steps_and_layout_equal_the_format():
    """decode='words': the four PTX programs, run by a numpy PTX interpreter, give every code's
    value times its block scale times 2**-7, exact in BF16 and FP16, in the WORD_CHANNELS order
    (the programs' outputs, low half first); the byte-to-word packing and the activations'
    part order are the matching permutations."""
    from pallas_kernels import tile_math

    rng = np.random.default_rng(3)
    words = rng.integers(0, 2**32, 512, dtype=np.uint64).astype(np.uint32)
    assert tile_math.WORD_VALUE_SCALE == 2.0**-7
    for key in ("bf16", "f16"):
        # with a block scale (E4M3 values, subnormal ones included: exact products in both
        # types, -0 kept; FP16's smallest, 0.5 x 2**-9 x 2**-7, is an FP16 subnormal; BF16's
        # placed code 0.5 is a BF16 subnormal, 2**-127)
        for scale in (1.0, 448.0, 0.001953125, 0.013671875, 1.375, 0.0):
            got = word_decode_emulated(words, key, scale).view({"bf16": jnp.bfloat16, "f16": np.float16}[key]).astype(np.float32)
            for p, ch in enumerate(tile_math.WORD_CHANNELS):
                want = np.asarray(nvfp4.decode_e2m1_bf16(jnp.asarray((words >> np.uint32(4 * ch)) & np.uint32(15), jnp.int32)),
                                  np.float32) * np.float32(scale) * np.float32(tile_math.WORD_VALUE_SCALE)
                np.testing.assert_array_equal(got[:, p], want)
                np.testing.assert_array_equal(np.signbit(got[:, p]), np.signbit(want))
        assert np.isnan(word_decode_emulated(words, key, np.nan).view({"bf16": jnp.bfloat16, "f16": np.float16}[key])
                        .astype(np.float32)).all()  # a NaN scale (E4M3 0x7F) gives NaN
    codes = jnp.asarray(rng.integers(0, 256, (3, 64), dtype=np.uint8))
    w = np.asarray(nvfp4.code_words(codes))
    np.testing.assert_array_equal(w.view(np.uint8).reshape(3, 64), np.asarray(codes))  # the same bytes, little-endian
    v = jnp.arange(2 * 256, dtype=jnp.float32).reshape(2, 256)
    o = np.asarray(tile_math.to_word_parts_order(v, 128))
    assert o[0, 1] == 2 and o[0, 2] == 8 and o[0, 32] == 4 and o[0, 128 + 127] == 128 + 8 * 15 + 7  # part 0: channels 0, 2 of each group
    np.testing.assert_array_equal(np.sort(o, axis=1), np.asarray(v))
    with pytest.raises(ValueError, match="block_k"):
        pk.GemmConfig(block_m=16, block_n=32, block_k=32, decode="words")


def test_bit_decode_gives_the_same_block_values_in_both_operand_types():
    """decode="bits" (``tile_math.decode_tile``): every code byte under every non-negative E4M3
    scale (NaN included) decodes to the same values, signs of zero too, in FP16 (magnitudes
    times 2**8, the scale as s * 2**-8) as in BF16 and as the format's reference."""
    from pallas_kernels import tile_math

    rng = np.random.default_rng(5)
    codes = jnp.asarray(rng.integers(0, 256, (128, 16)), jnp.uint8)
    scales = jnp.asarray(np.repeat(np.arange(128, dtype=np.uint8)[:, None], 2, axis=1))  # row r: scale bits r
    want = np.asarray(nvfp4.decode_e4m3_bits(scales.astype(jnp.int32)))[:, :, None]
    for parity, shift in ((0, 0), (1, 4)):
        ref = np.asarray(nvfp4.decode_e2m1_bf16((codes.astype(jnp.int32) >> shift) & 15), np.float32)
        ref = (ref.reshape(128, 2, 8) * want).reshape(128, 16)
        for dtype in (jnp.bfloat16, jnp.float16):
            got = np.asarray(tile_math.decode_tile(codes, scales, 128, 32, dtype)[parity], np.float32)
            np.testing.assert_array_equal(got, ref)  # NaN where the scale is NaN (bits 0x7F)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))


def test_decode_tiles_follow_the_measured_choices():
    """The decode-size heuristic (pallas_kernels.tiling.gemm_config, run-12 measurements): the
    word decode at 128-wide tiles, the grouped GEMM too,
    activation values with words; K tiles the word decode cannot split fall back to bits."""
    from pallas_kernels import tiling

    for t in (16, 64):
        c = tiling.gemm_config(t, 14336, 4096)
        assert (c.decode, c.block_n, c.swap_ab) == ("words", 128, True)
        assert c.split_k * c.block_k <= 4096 and 4096 % (c.split_k * c.block_k) == 0
        # large weights: 256-channel K tiles, split to 1.5 waves (112 N tiles x 2), 3 stages
        assert (c.block_k, c.split_k, c.num_stages) == (256, 2, 3)
    # the rollout's mid batches (T=256) keep the decode tiles: 64-token tiles, the word decode,
    # split-K to fill the chip (the bench model's q/k/v: 4 row tiles x 12 N tiles)
    mid = tiling.gemm_config(256, 1536, 1024, num_sms=132)
    assert (mid.block_m, mid.decode, mid.swap_ab, mid.path, mid.split_k) == (64, "words", True, "fused", 4)
    small = tiling.gemm_config(16, 768, 2048, num_sms=132)
    assert (small.block_k, small.split_k) == (128, 8)  # few N tiles: deep split, 2 K tiles a program
    # ... and where that split still leaves the chip under half full, 64-wide N tiles (the bench
    # model's q/k/v at T64: 12 N tiles x split 4 = 48 programs at 128 wide, 96 at 64)
    assert small.block_n == 64
    qkv = tiling.gemm_config(64, 1536, 1024, num_sms=132)
    assert (qkv.block_n, qkv.split_k) == (64, 4) and mid.block_n == 128
    # grouped: M tiles of about twice an expert's mean rows (8 -> 16, 32 -> 64), 128-wide N
    # tiles; 16-row items: 4 warps and 2 stages at four K tiles (the bench model's down
    # projection), 8 warps and 4 stages at more (its gate/up; 2026-12-07-h100-pairs-fused and
    # 2026-12-07-h100-static-registries)
    g = tiling.gemm_config(8, 1024, 512, programs_per_row_tile=64)
    assert (g.decode, g.block_n, g.block_m, g.num_warps, g.num_stages) == ("words", 128, 16, 4, 2)
    g = tiling.gemm_config(8, 1024, 1024, programs_per_row_tile=64)
    assert (g.decode, g.block_n, g.block_m, g.num_warps, g.num_stages) == ("words", 128, 16, 8, 4)
    g = tiling.gemm_config(32, 1024, 1024, programs_per_row_tile=64)
    assert (g.block_m, g.block_n, g.num_warps) == (64, 128, 4)
    assert tiling.gemm_config(16, 768, 96).decode == "bits"  # K tile 32
    # the split follows the device's multiprocessors (here given): fewer SMs, less split
    assert tiling.gemm_config(16, 768, 2048, num_sms=16).split_k < small.split_k
    x = jnp.ones((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="rac_sum"):
        pk.nvfp4_matmul(x, nvfp4.quantize(jnp.ones((32, 64))), rac_ratio=0.5, rac_sum="bf16", backend="xla")


def test_prefill_path_dequant_equals_xla_and_is_the_large_t_default(rng):
    assert pk.gemm_config(4096, 4096, 4096).path == "dequant"
    assert pk.gemm_config(16, 4096, 4096).path == "fused"
    assert pk.gemm_config(4096, 768, 2048, programs_per_row_tile=64).path == "fused"  # grouped: fused only
    x = jnp.asarray(heavy(rng, (40, 256))).astype(jnp.bfloat16)
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((96, 256)).astype(np.float32)))
    cfg = pk.GemmConfig(block_m=16, block_n=32, block_k=64, path="dequant")
    for kw in ({"rac_ratio": 0.5, "act_scale": "token"}, {"mode": "w4a16"}, {}):
        a = pk.nvfp4_matmul(x, w, backend="xla", out_dtype=jnp.float32, **kw)
        b = pk.nvfp4_matmul(x, w, backend="pallas", out_dtype=jnp.float32, config=cfg, **kw)
        assert rel(b, a) < 1e-6, kw
    wg = nvfp4.quantize(jnp.ones((2, 32, 256)), keep_axes=(0,))
    with pytest.raises(ValueError, match="path"):
        pk.nvfp4_grouped_matmul(x, wg, jnp.asarray([20, 20]), act_scale="token", backend="pallas", config=cfg)


def test_quantized_rows_gathered_equal_quantizing_the_gathered_rows(rng):
    """The MoE dispatch quantizes its N tokens once and gathers them: bit-identical to
    quantizing the N x k sorted rows (per-token scales and selection), on both backends."""
    from quads_jax import precision as P

    n_tok, k, e, topk = 12, 128, 4, 2
    x = jnp.asarray(heavy(rng, (n_tok, k))).astype(jnp.bfloat16)
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((e, 64, k)).astype(np.float32)), keep_axes=(0,))
    ids = jnp.asarray(rng.integers(0, e, (n_tok, topk)))
    order = jnp.argsort(ids.reshape(-1), stable=True)
    token = order // topk
    sizes = jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
    for backend in ("xla", "pallas"):
        want = P.grouped_linear(x[token], w, sizes, "w4a4", rac_ratio=0.5, backend=backend, dtype=jnp.float32)
        rows = P.take_rows(P.quantize_rows_for(x, w, "w4a4", rac_ratio=0.5, backend=backend), token)
        assert isinstance(rows, pk.QuantizedRows) and rows.shape == (n_tok * topk, k)
        assert rows.rows is not None  # the gather is left to the grouped GEMM's loads
        got = P.grouped_linear(rows, w, sizes, "w4a4", rac_ratio=0.5, backend=backend, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=backend)
        # a gather of a gather composes; the dense GEMM applies it before its kernel
        twice = P.take_rows(P.take_rows(P.quantize_rows_for(x, w, "w4a4", rac_ratio=0.5, backend=backend), token), jnp.arange(4) * 3)
        wd = nvfp4.quantize(jnp.asarray(rng.standard_normal((32, k)).astype(np.float32)))
        np.testing.assert_array_equal(
            np.asarray(pk.nvfp4_matmul(twice, wd, rac_ratio=0.5, act_scale="token", backend=backend)),
            np.asarray(pk.nvfp4_matmul(x[token[jnp.arange(4) * 3]], wd, rac_ratio=0.5, act_scale="token", backend=backend)), err_msg=backend)
    wd = nvfp4.quantize(jnp.asarray(rng.standard_normal((32, k)).astype(np.float32)))
    dense = pk.nvfp4_matmul(pk.quantize_rows(x, rac_ratio=0.5, backend="xla"), wd, rac_ratio=0.5, act_scale="token", backend="xla")
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(pk.nvfp4_matmul(x, wd, rac_ratio=0.5, act_scale="token", backend="xla")))
    assert P.quantize_rows_for(x, wd, "w4a16") is x  # only W4A4 quantizes activations
    with pytest.raises(ValueError, match="QuantizedRows"):
        pk.nvfp4_matmul(pk.quantize_rows(x, rac_ratio=0.5, backend="xla"), wd, act_scale="token", backend="xla")  # rho differs
    with pytest.raises(ValueError, match="rac_mode"):
        pk.quantize_rows(x, rac_ratio=0.5, rac_mode="channel")


def test_gemm_config_rejects_bad_values():
    with pytest.raises(ValueError, match="decode"):
        pk.GemmConfig(block_m=16, block_n=32, block_k=64, decode="lut")
    with pytest.raises(ValueError, match="path"):
        pk.GemmConfig(block_m=16, block_n=32, block_k=64, path="cublas")
    with pytest.raises(ValueError, match="decode"):
        pk.GemmConfig(block_m=16, block_n=32, block_k=64, decode="prmt")
    with pytest.raises(ValueError, match="block_n"):
        pk.GemmConfig(block_m=16, block_n=48, block_k=64)


def test_quantizer_per_token_scales_equal_xla(rng):
    """The kernel's per-token global scales (an all-zero token gets 1.0) and operand equal the
    reference's bits (rho 0's operand: test_quantizer_writes_the_gemm_operand_bit_identical).
    The GEMMs run the kernels only in the rollout's regime: a per-tensor scale, the tensor /
    channel selections and the exact RAC sum run the reference, with no kernel in their program."""
    x = jnp.asarray(heavy(rng, (37, 512))).astype(jnp.bfloat16).at[3].set(0.0)
    _, gx = assert_operand_equal(x, 0.5, pk.QuantConfig(chunk=128))
    assert float(gx[3, 0]) == 1.0
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((64, 512)).astype(np.float32)))
    kernels = lambda **kw: str(jax.make_jaxpr(lambda v: pk.nvfp4_matmul(v, w, backend="pallas", **kw))(x)).count("pallas_call")
    for rho in (0.0, 0.5):
        # the quantizer and the GEMM, and with RAC below 1024 tokens the selection's energy pass
        assert kernels(rac_ratio=rho, act_scale="token") == (3 if rho else 2)
        assert kernels(rac_ratio=rho, act_scale="tensor") == 0
    assert kernels(rac_ratio=0.5, rac_mode="channel", act_scale="token") == 0
    assert kernels(rac_ratio=0.5, rac_sum="exact", act_scale="token") == 0
    assert kernels(mode="w4a16") == 1


def test_quant_config_is_checked(rng):
    with pytest.raises(ValueError, match="select"):
        pk.QuantConfig(select="sort")
    with pytest.raises(ValueError, match="chunk"):
        pk.QuantConfig(chunk=96)
    with pytest.raises(ValueError, match="parts=3"):
        pk.QuantConfig(parts=3)
    x = jnp.asarray(rng.standard_normal((4, 192)), jnp.bfloat16)
    for backend in ("pallas", "xla"):  # a config given is checked whatever path runs
        with pytest.raises(ValueError, match="chunk=128 must divide K=192"):
            pk.quantize_operand(x, backend=backend, config=pk.QuantConfig(chunk=128))
    with pytest.raises(ValueError, match="parts=8 must divide K=192"):
        pk.quantize_operand(x, backend="pallas", config=pk.QuantConfig(chunk=16, parts=8))
    with pytest.raises(ValueError, match="chunk=64 must divide K=192 / parts=4"):
        pk.quantize_operand(x, backend="pallas", config=pk.QuantConfig(chunk=64, parts=4))


@pytest.mark.parametrize("parts,chunk,select,rhos", [
    (2, 128, "rank", (0.0, 0.25)), (4, 64, "energies", (0.25,)),
    pytest.param(2, 64, "rank", (0.25,), marks=pytest.mark.slow), pytest.param(8, 64, "rank", (0.0, 0.25), marks=pytest.mark.slow)])
def test_quantizer_row_split_is_bit_identical(rng, parts, chunk, select, rhos):
    """``QuantConfig.parts`` programs a row (each storing its share of the channels, the
    amax and RAC's selection taken over the whole row) give the XLA reference's bits for any
    split, with ties across the parts' boundary and T not a multiple of anything (rho 0
    selects nothing, so it runs at two of the splits only)."""
    x = heavy(rng, (11, 512))
    blocks = x.reshape(11, 32, 16)
    blocks[2, 6:10] = blocks[2, 0]  # a tie spanning parts (16-channel blocks 6..9 cross channel 128)
    x = jnp.asarray(blocks.reshape(11, 512)).astype(jnp.bfloat16).at[4].set(0.0)  # and an all-zero token
    for rho in rhos:
        assert_operand_equal(x, rho, pk.QuantConfig(chunk=chunk, parts=parts, select=select), order=("words", 128))


def test_energies_selection_with_two_rows_a_program_and_padded_rows(rng):
    """``select="energies"`` (a first kernel's energies, ranked by the quantizer) by either count,
    with two token rows a program, an odd T and operand rows padded past T: the reference's
    bits, rho 0 / 0.5 / 1."""
    x = jnp.asarray(heavy(rng, (11, 256))).astype(jnp.bfloat16)
    # rho 1 and 0 rank nothing: once each
    for cfg, rhos in ((pk.QuantConfig(block_rows=2, chunk=64, parts=2, select="energies"), (0.5, 1.0)),
                      (pk.QuantConfig(block_rows=2, chunk=128, select="energies"), (0.0,)),
                      (pk.QuantConfig(block_rows=2, chunk=64, parts=2, select="energies", count="bits"), (0.5,))):
        for rho in rhos:
            assert_operand_equal(x, rho, cfg, order=("words", 128), rows=16)


def test_selections_of_rows_of_any_block_count(rng):
    """``select="energies"`` with a block count that is not a power of two (48 and 24
    blocks: each row's energies are padded to 64 / 32 with -1.0, which no real energy is below),
    and the in-kernel rank over 48 blocks (quant_config's choice at K = 768) and over two rows of
    two chunks (its choice for prefill's 512-channel rows): the reference's bits
    with ties across the boundary and an all-zero row, one and several programs a row, T not a
    multiple of the row tile."""
    for t, k, cfg, rho in ((5, 768, pk.QuantConfig(chunk=256, select="energies"), 0.5),
                           (9, 384, pk.QuantConfig(block_rows=2, chunk=64, parts=2, select="energies"), 0.25),
                           (5, 768, pk.quant_config(64, 768), 0.5),
                           (5, 512, pk.quant_config(2048, 512), 0.5)):  # two rows a program, two chunks a row
        x = heavy(rng, (t, k))
        blocks = x.reshape(t, k // 16, 16)
        blocks[1] = blocks[1, :1]  # all tie: every block selected
        blocks[2, 5:20] = blocks[2, 0]  # a run of ties across the selection boundary
        x = jnp.asarray(blocks.reshape(t, k)).astype(jnp.bfloat16).at[3].set(0.0)
        cfg.check(k)
        assert_operand_equal(x, rho, cfg, order=("words", 128))


def test_bitwise_count_selects_the_blocks_of_the_pairs_count(rng):
    """``QuantConfig.count="bits"`` (the n-th largest energy's bit pattern, one bit at a time)
    over the first kernel's padded energies (48 blocks padded to 64) and over the row's own
    registers with several programs a row: the reference's bits, with ties across the
    boundary, an all-tied row and an all-zero row."""
    for t, k, cfg, rho in ((5, 768, pk.QuantConfig(chunk=256, select="energies", count="bits"), 0.5),
                           (9, 384, pk.QuantConfig(block_rows=2, chunk=64, parts=2, select="rank", count="bits"), 0.25)):
        x = heavy(rng, (t, k))
        blocks = x.reshape(t, k // 16, 16)
        blocks[1] = blocks[1, :1]
        blocks[2, 5:20] = blocks[2, 0]
        x = jnp.asarray(blocks.reshape(t, k)).astype(jnp.bfloat16).at[3].set(0.0)
        assert_operand_equal(x, rho, cfg, order=("words", 128))


@pytest.mark.parametrize("count", ["bits", "pairs"])
def test_selection_of_long_rows_with_ties(rng, count):
    """Rows of 288 blocks (padded to 512), past PAIRS_MAX_BLOCKS: the first kernel's energies
    ranked by the bitwise count (quant_config's choice there) and by the all-pairs count
    (which no config picks there: it grows with the square of the blocks): the reference's
    bits, with a tie across the selection boundary, an all-tied row and an all-zero row."""
    k = 16 * 288
    x = heavy(rng, (5, k))
    blocks = x.reshape(5, k // 16, 16)
    blocks[1] = blocks[1, :1]  # every block equal: all tie, all selected
    blocks[2, 100:200] = blocks[2, 0]  # a run of ties spanning the boundary
    x = jnp.asarray(blocks.reshape(5, k)).astype(jnp.bfloat16).at[3].set(0.0)
    assert_operand_equal(x, 0.5, pk.QuantConfig(chunk=256, parts=2, select="energies", count=count), order=("words", 128))


def test_quant_config_rejects_tiles_that_cannot_run():
    with pytest.raises(ValueError, match="chunk=128 must divide"):
        pk.QuantConfig(chunk=128, parts=4).check(256)
    with pytest.raises(ValueError, match="select="):
        pk.QuantConfig(select="bisect")
    with pytest.raises(ValueError, match="count="):
        pk.QuantConfig(count="sort")
    pk.QuantConfig(chunk=128, select="energies").check(512)


def test_quant_config_splits_rows_at_decode_sizes():
    from pallas_kernels.quantizer import quant_config

    assert [quant_config(t, 4096).parts for t in (1, 16, 64, 128, 4096)] == [16, 8, 2, 2, 2]
    assert quant_config(256, 512).parts == 2 and quant_config(256, 768).parts == 1  # two a row where K allows it
    assert quant_config(2048, 512).parts == 1 and quant_config(2048, 1024).parts == 2  # two-token programs: whole rows to 512
    # RAC's selection: rows of up to PAIRS_MAX_BLOCKS blocks ranked by the all-pairs count, in
    # the quantizer's own pass from 1024 tokens and where a program owns its whole row (768
    # channels: 48 blocks), else over the first kernel's energies; longer rows by the bitwise
    # count over the first kernel's energies, at any size
    shapes = ((16, 4096), (256, 1024), (2048, 512), (2048, 4096), (16, 768), (64, 8192), (512, 512), (256, 2048))
    assert [(quant_config(t, k).select, quant_config(t, k).count) for t, k in shapes] == [
        ("energies", "bits"), ("energies", "pairs"), ("rank", "pairs"), ("energies", "bits"), ("rank", "pairs"),
        ("energies", "bits"), ("energies", "pairs"), ("energies", "pairs")]
    assert quant_config(16, 2048).parts == 8 and quant_config(16, 1024).parts == 4  # each part owns >= 256 channels
    for t, k in ((1, 4096), (16, 4096), (64, 1024), (16, 768), (4096, 4096)):
        cfg = quant_config(t, k)
        cfg.check(k)
        assert (k // cfg.parts) % cfg.chunk == 0
        # a parity half of a chunk is at least one value a thread, except whole rows of 256-channel
        # chunks (K = 768): 8 warps there (4 were 4.8x slower with RAC on an H100)
        whole_row_of_256 = cfg.chunk == 256 and cfg.parts == 1
        assert cfg.chunk // 2 >= 32 * cfg.num_warps if not whole_row_of_256 else cfg.num_warps == 8
    assert quant_config(512, 512).num_warps == 4  # half rows of 256 channels
    # two whole rows of 512 channels a program: 256-channel chunks, 8 warps (as for K = 768)
    assert (quant_config(2048, 512).chunk, quant_config(2048, 512).num_warps) == (256, 8)
    assert quant_config(2048, 1024).chunk == 512  # two parts of a row: chunks as before


# "energies" with ties: test_selections_of_rows_of_any_block_count (also across programs)
@pytest.mark.parametrize("select", ["rank", pytest.param("energies", marks=pytest.mark.slow)])
def test_rac_selections_equal_xla_with_ties(rng, select):
    x = heavy(rng, (9, 512))
    blocks = x.reshape(9, 32, 16)
    blocks[1] = blocks[1, :1]  # every block of token 1 equal: all tie, all selected
    blocks[2, 8:16] = blocks[2, 0]  # a tie across the selection boundary
    x = jnp.asarray(blocks.reshape(9, 512)).astype(jnp.bfloat16)
    cfg = pk.QuantConfig(chunk=128, select=select)  # four chunks a row: the counts span chunks
    for rho in (0.125, 0.5):
        assert_operand_equal(x, rho, cfg)
        _, rq = pk.quantize_activations_rac(x, rac_ratio=rho, act_scale="token")
        codes = np.asarray(rq.codes).reshape(9, 32, 8)
        assert (codes[1] != 0).any(axis=1).all()  # all tie: every block selected (more than the fraction)
        assert (codes[0] != 0).any(axis=1).sum() == rac.num_selected(rho, 32)  # no ties: exactly the fraction


@pytest.mark.parametrize("kw", [pytest.param({"rac_ratio": 0.5, "act_scale": "token"}, marks=pytest.mark.slow), {"mode": "w4a16"}])
def test_weights_sharing_an_input_one_launch_equal_separate_products(rng, kw):
    """q/k/v and gate/up: one launch over several weights equals each product alone (XLA)."""
    x = jnp.asarray(heavy(rng, (19, 128))).astype(jnp.bfloat16)
    ws = [nvfp4.quantize(jnp.asarray(rng.standard_normal((n, 128)), jnp.float32)) for n in (96, 40, 64)]
    got = pk.nvfp4_matmul(x, ws, backend="pallas", out_dtype=jnp.float32, **kw)
    assert isinstance(got, tuple) and [g.shape for g in got] == [(19, 96), (19, 40), (19, 64)]
    for g, w in zip(got, ws):
        want = pk.nvfp4_matmul(x, w, backend="xla", out_dtype=jnp.float32, **kw)
        assert rel(g, want) < 1e-5  # the same products, summed in FP32 in another order
    sizes = jnp.asarray([5, 0, 9, 3], jnp.int32)  # an empty expert; 2 trailing rows unassigned
    wg = [nvfp4.quantize(jnp.asarray(rng.standard_normal((4, n, 128)), jnp.float32), keep_axes=(0,)) for n in (48, 80)]
    got = pk.nvfp4_grouped_matmul(x, wg, sizes, backend="pallas", out_dtype=jnp.float32, **kw)
    ref = pk.nvfp4_grouped_matmul(x, wg, sizes, backend="xla", out_dtype=jnp.float32, **kw)
    for g, w, r in zip(got, wg, ref):
        want = pk.nvfp4_grouped_matmul(x, w, sizes, backend="xla", out_dtype=jnp.float32, **kw)
        np.testing.assert_array_equal(np.asarray(r), np.asarray(want))
        assert rel(g, want) < 1e-5
        assert not np.asarray(g)[17:].any()
    with pytest.raises(ValueError, match="expert count"):
        pk.nvfp4_grouped_matmul(x, [wg[0], nvfp4.quantize(jnp.ones((3, 8, 128)), keep_axes=(0,))], sizes, backend="pallas")


def test_operand_columns_invert_the_gemms_channel_orders(rng):
    from pallas_kernels.tile_math import operand_columns, to_word_parts_order

    v = rng.standard_normal((3, 1024)).astype(np.float32)
    for order, want in ((("plain", 16), v), (("words", 128), to_word_parts_order(jnp.asarray(v), 128)),
                        (("words", 256), to_word_parts_order(jnp.asarray(v), 256))):
        cols = np.asarray(operand_columns(np.arange(1024), order))
        out = np.full_like(v, np.nan)
        out[:, cols] = v  # channel ch goes to column cols[ch]
        np.testing.assert_array_equal(out, np.asarray(want), err_msg=str(order))
    with pytest.raises(ValueError, match="order"):
        operand_columns(np.arange(16), ("rows", 16))


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_quantizer_writes_the_gemm_operand_bit_identical(rng, rho):
    """``quantize_operand``: the FP16 token operand (block values, or RAC's FP16 sum) in each
    GEMM's channel order and padded rows, straight from the kernel: the XLA reference's bits,
    which are ``rac.token_operand`` of the quantized rows, reordered."""
    from pallas_kernels.quantizer import quantize_operand
    from pallas_kernels.tile_math import operand_columns

    x = jnp.asarray(heavy(rng, (13, 512))).astype(jnp.bfloat16).at[5].set(0.0)
    xq, rq = pk.quantize_activations_rac(x, rac_ratio=rho, act_scale="token")
    plain = np.asarray(rac.token_operand(xq, rq if rho else None)).view(np.uint16)
    for order, rows, cfg in ((("plain", 16), 13, None), (("words", 128), 13, pk.QuantConfig(chunk=128, parts=2)),
                             (("words", 256), 16, pk.QuantConfig(chunk=64, parts=4))):
        a, ga = quantize_operand(x, rac_ratio=rho, order=order, rows=rows, backend="xla")
        b, gb = quantize_operand(x, rac_ratio=rho, order=order, rows=rows, backend="pallas", config=cfg)
        assert b.dtype == jnp.float16 and b.shape == (rows, 512) and gb.shape == (13, 1)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16), err_msg=str(order))
        np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))
        np.testing.assert_array_equal(np.asarray(b)[:, np.asarray(operand_columns(np.arange(512), order))][:13].view(np.uint16), plain)
        assert not np.asarray(b)[13:].any()  # the padded rows are zero
    with pytest.raises(ValueError, match="rows=12"):
        quantize_operand(x, rows=12, backend="pallas")


@pytest.mark.parametrize("t,rho", [(1, 0.5), (19, 0.0)])
def test_gemm_takes_rows_quantized_ahead_in_either_order(rng, t, rho):
    """QuantizedRows (the operand written ahead of the GEMM, in the word or the channel order)
    give the same output bits as quantizing inside the GEMM with the decode that reads that
    order (word and bit decodes), and the XLA backend's numbers."""
    import importlib

    NM = importlib.import_module("pallas_kernels.gemm")
    x = jnp.asarray(heavy(rng, (t, 512))).astype(jnp.bfloat16)
    w = [nvfp4.quantize(jnp.asarray(rng.standard_normal((n, 512)).astype(np.float32))) for n in (128, 64)]
    base = pk.gemm_config(t, 192, 512)
    ref = pk.nvfp4_matmul(x, w, rac_ratio=rho, act_scale="token", backend="xla", out_dtype=jnp.float32)
    bits = dataclasses.replace(base, decode="bits", block_k=64)
    for cfg in (base, bits):
        rows = pk.quantize_rows(x, rac_ratio=rho, order=NM.operand_order(cfg), backend="pallas")
        want = pk.nvfp4_matmul(x, w, rac_ratio=rho, act_scale="token", backend="pallas", config=cfg, out_dtype=jnp.float32)
        for given in (base, bits):  # the GEMM's config follows the rows' order
            got = pk.nvfp4_matmul(rows, w, rac_ratio=rho, act_scale="token", backend="pallas", config=given, out_dtype=jnp.float32)
            for g, c, r in zip(got, want, ref):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(c), err_msg=f"{cfg} {given}")
                assert rel(g, r) < 1e-5
    with pytest.raises(ValueError, match="QuantizedRows in order"):
        NM.following(dataclasses.replace(base, split_k=8), ("words", 128), 512)
    with pytest.raises(ValueError, match="rac_sum"):  # rows hold the FP16 sum
        pk.nvfp4_matmul(pk.quantize_rows(x, rac_ratio=0.5, backend="xla"), w, rac_ratio=0.5, rac_sum="exact", act_scale="token")


@pytest.mark.parametrize("shape,config", [((64, 128), None), ((4, 48, 96), None),
                                          ((3, 40, 1024), pk.FakeQuantConfig(block_rows=4, block_k=256))])
def test_weight_fake_quant_kernel_equals_xla_with_identity_gradient(rng, shape, config):
    """The trainer's QAT weight from the kernel: nvfp4.fake_quant's bits (one global scale per
    matrix, per expert for stacked weights), in BF16 and FP32, and the identity gradient."""
    w = jnp.asarray(heavy(rng, shape) * 3.0)
    for dtype in (jnp.bfloat16, jnp.float32):
        a = pk.weight_fake_quant(w, dtype=dtype, backend="pallas", config=config)
        b = nvfp4.fake_quant(w, dtype=dtype, axis=-1, keep_axes=(0,) if w.ndim == 3 else ())
        assert a.dtype == dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    ct = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    g = jax.grad(lambda v: jnp.sum(pk.weight_fake_quant(v, dtype=jnp.bfloat16, backend="pallas").astype(jnp.float32) * ct))(w)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g), np.asarray(ct.astype(jnp.bfloat16).astype(jnp.float32)))


def test_weight_fake_quant_rejects_bad_input():
    with pytest.raises(ValueError, match="w: expected a weight"):
        pk.weight_fake_quant(jnp.ones((2, 3, 4, 16)), backend="pallas")
    with pytest.raises(ValueError, match="K=40"):
        pk.weight_fake_quant(jnp.ones((8, 40)), backend="pallas")
    with pytest.raises(ValueError, match="block_k"):
        pk.FakeQuantConfig(block_k=24)
    with pytest.raises(ValueError, match="must divide"):
        pk.weight_fake_quant(jnp.ones((8, 64)), backend="pallas", config=pk.FakeQuantConfig(block_rows=3, block_k=64))
