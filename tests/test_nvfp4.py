"""NVFP4 format: exact bit patterns against an independent numpy reference (ml_dtypes casts)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quads_jax import nvfp4 as F


def np_reference(x, global_scale=None):
    """NVIDIA's two-level recipe written with numpy + ml_dtypes casts (eager, exact)."""
    x = np.asarray(x, np.float32)
    gs = np.float32(np.abs(x).max() / np.float32(6 * 448)) if global_scale is None else np.float32(global_scale)
    if gs == 0:
        gs = np.float32(1.0)
    xb = x.reshape(*x.shape[:-1], -1, 16)
    amax = np.abs(xb).max(-1)
    s = np.clip((amax / np.float32(6)) / gs, np.float32(2**-6), np.float32(448)).astype(ml_dtypes.float8_e4m3fn)
    v = np.clip(xb * ((np.float32(1) / gs) / s.astype(np.float32))[..., None], -6, 6)
    codes = (v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF).reshape(x.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, s, gs


def heavy_tailed(rng, shape, spread=3.0):
    return (rng.standard_normal(shape) * np.exp(spread * rng.standard_normal(shape[:-1] + (1,)))).astype(np.float32)


def test_decode_table_all_16_codes():
    got = np.asarray(F.decode_e2m1(jnp.arange(16)))
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.arange(16) >= 8)
    assert list(got[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize(
    "value,expected",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
     (0.26, 0.5), (2.51, 3.0), (5.01, 6.0), (7.0, 6.0), (0.0, 0.0)],
)
def test_every_tie_rounds_to_even(value, expected):
    for sign in (1.0, -1.0):
        got = F.round_e2m1(jnp.float32(min(abs(value), 6.0)))  # callers clamp to 6
        assert float(got) == expected
        code = F.encode_e2m1(jnp.float32(sign * min(expected, 6.0)))
        assert float(F.decode_e2m1(code)) == sign * expected


def test_encode_matches_hardware_cast_on_grid_and_signed_zero():
    vals = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    got = np.asarray(F.encode_e2m1(vals))
    want = vals.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.arange(16))


def test_e4m3_rounding_matches_cast():
    rng = np.random.default_rng(1)
    a = np.abs(rng.standard_normal(20000).astype(np.float32)) * np.exp2(rng.integers(-9, 9, 20000)).astype(np.float32)
    a = np.clip(a, 0, 448).astype(np.float32)
    got = np.asarray(F.round_e4m3(a))
    want = a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_packing_order_low_nibble_first():
    codes = jnp.array([[1, 2, 3, 4, 15, 0]], jnp.uint8)
    packed = np.asarray(F.pack_codes(codes))
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    np.testing.assert_array_equal(np.asarray(F.unpack_codes(packed)), np.asarray(codes))
    x = np.zeros((1, 16), np.float32)
    x[0, 0], x[0, 1] = 6.0, -0.5  # element 0 -> low nibble of byte 0
    t = F.quantize(x, global_scale=6.0 / 2688)  # block scale 448, so codes = values
    b0 = int(np.asarray(t.codes)[0, 0])
    assert b0 & 0xF == 0x7 and b0 >> 4 == 0x9


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bit_exact_against_reference(dtype):
    rng = np.random.default_rng(2)
    x = jnp.asarray(heavy_tailed(rng, (96, 512)), dtype)
    t = F.quantize(x)
    packed, s, gs = np_reference(np.asarray(x.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(t.codes), packed)
    np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), s.view(np.uint8))
    assert np.float32(t.global_scale) == gs
    assert t.codes.dtype == jnp.uint8 and t.scales.dtype == jnp.float8_e4m3fn
    assert t.codes.shape == (96, 256) and t.scales.shape == (96, 32)
    dq = np.asarray(F.dequantize(t))
    assert dq.shape == (96, 512)
    codes = np.asarray(F.unpack_codes(t.codes))
    ref_dq = (np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)[codes].reshape(96, 32, 16)
              * s.astype(np.float32)[..., None]).reshape(96, 512) * gs
    np.testing.assert_array_equal(dq, ref_dq)


def test_jit_equals_eager_global_and_block_scales_bitwise():
    # Division by a constant must stay an IEEE division under jit (XLA would otherwise use
    # a reciprocal multiply): check the scales bit for bit on many amaxes.
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((512, 64)).astype(np.float32) * 37.0)
    e = F.quantize(x, keep_axes=(0,))
    j = jax.jit(lambda x: F.quantize(x, keep_axes=(0,)))(x)
    np.testing.assert_array_equal(np.asarray(e.global_scale).view(np.uint32), np.asarray(j.global_scale).view(np.uint32))
    ref = np.abs(np.asarray(x)).max(1, keepdims=True) / np.float32(2688)
    np.testing.assert_array_equal(np.asarray(j.global_scale).view(np.uint32), ref.view(np.uint32))


def test_jit_equals_eager():
    rng = np.random.default_rng(3)
    x = jnp.asarray(heavy_tailed(rng, (32, 256)))
    for kw in [{}, {"four_over_six": True}, {"block_shape": (16, 16)}, {"global_scale": 1e-3}]:
        e = F.quantize(x, **kw)
        j = jax.jit(lambda x: F.quantize(x, **kw))(x)
        np.testing.assert_array_equal(np.asarray(e.codes), np.asarray(j.codes))
        np.testing.assert_array_equal(np.asarray(e.scales).view(np.uint8), np.asarray(j.scales).view(np.uint8))
    fq = jax.jit(F.fake_quant)(x)
    np.testing.assert_array_equal(np.asarray(fq), np.asarray(F.fake_quant(x)))
    assert not np.array_equal(np.asarray(fq), np.asarray(x))  # it really quantized


def test_zero_and_subnormal_blocks():
    x = np.zeros((2, 32), np.float32)
    t = F.quantize(x)
    assert float(t.global_scale) == 1.0
    assert np.all(np.asarray(t.codes) == 0)
    assert np.all(np.asarray(F.dequantize(t)) == 0)
    # A block far below the global max: scale clamps at 2**-6, small values flush or round.
    y = np.zeros((1, 32), np.float32)
    y[0, :16] = 1000.0
    y[0, 16] = 1000.0 * 2**-20
    t = F.quantize(y)
    s = np.asarray(t.scales).astype(np.float32)
    assert s[0, 1] == 2**-6 and s[0, 0] == 448
    packed, sref, _ = np_reference(y)
    np.testing.assert_array_equal(np.asarray(t.codes), packed)
    # f32 subnormal inputs
    # float32 subnormals: XLA flushes denormals, so such a tensor quantizes to zeros.
    z = np.full((1, 16), 1e-40, np.float32)
    t = F.quantize(z)
    assert np.all(np.asarray(t.codes) == 0) and np.all(np.asarray(F.dequantize(t)) == 0)


def test_wide_dynamic_range_rows():
    rng = np.random.default_rng(4)
    x = heavy_tailed(rng, (64, 128), spread=6.0)
    t = F.quantize(x)
    np.testing.assert_array_equal(np.asarray(t.codes), np_reference(x)[0])
    # Per-row global scales keep small rows accurate.
    tr = F.quantize(x, keep_axes=(0,))
    err = np.abs(np.asarray(F.dequantize(tr)) - x).max(1) / np.abs(x).max(1)
    assert err.max() < 0.2


def test_fake_quant_ste_gradient():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 64)).astype(np.float32))
    g = jax.grad(lambda x: jnp.sum(F.fake_quant(x) * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0, np.float32))
    # With a fixed global scale, saturating elements get zero gradient.
    gs = 0.5 / (6 * 448)
    y = jnp.array([[0.1] * 15 + [2.0]], jnp.float32)
    g = jax.grad(lambda y: jnp.sum(F.fake_quant(y, global_scale=gs)))(y)
    assert np.asarray(g)[0, -1] == 0.0 and np.all(np.asarray(g)[0, :-1] == 1.0)
    assert F.fake_quant(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    # dynamic scale: the identity everywhere, also for each tensor's own max element, whose
    # |x| can exceed 6 * 448 * fp32(amax / 2688) by one ulp
    for i in range(40):
        z = jnp.asarray((rng.standard_normal((4, 64)) * np.exp(rng.standard_normal())).astype(np.float32))
        gz = jax.grad(lambda z: jnp.sum(F.fake_quant(z, keep_axes=(0,))))(z)
        np.testing.assert_array_equal(np.asarray(gz), np.ones(z.shape, np.float32))
    # and the forward value is unchanged by the gradient path
    np.testing.assert_array_equal(np.asarray(F.fake_quant(x)), np.asarray(F.dequantize(F.quantize(x))))


@pytest.mark.parametrize("kw", [dict(), dict(axis=1), dict(keep_axes=(0,)), dict(block_shape=(16, 16)),
                                dict(block_shape=(16, 16), axis=-2), dict(four_over_six=True), dict(global_scale=1e-3),
                                dict(axis=-1, keep_axes=(0,), global_scale=None)])
def test_fake_quant_is_dequantize_of_quantize_bit_for_bit(kw):
    """The fake quant computes the grid values directly (no codes): the same bits as
    dequantize(quantize(x)), signed zeros, NaN / inf blocks, subnormal scales and saturation
    included, in FP32 and BF16, jitted."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 32, 48)) * np.exp(2 * rng.standard_normal((3, 32, 1)))).astype(np.float32)
    x[0, 0, :16] = -1e-30  # a block of tiny negatives: -0 codes, the smallest scale
    x[0, 1, 16:32] = 0.0
    x[1, 2, 3] = np.nan
    x[2, 5, 40] = np.inf
    x[2, 7, :] *= 1e4  # saturates against a fixed global scale
    for dt in (jnp.float32, jnp.bfloat16):
        xj = jnp.asarray(x).astype(dt)
        want = F.dequantize(F.quantize(xj, **kw), jnp.float32).astype(dt)
        got = jax.jit(lambda v: F.fake_quant(v, **kw))(xj)
        assert got.dtype == dt
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)).view(np.uint32),
                                      np.asarray(want.astype(jnp.float32)).view(np.uint32))
    with pytest.raises(TypeError, match="unexpected"):
        F.fake_quant(jnp.ones((16,)), scale=2)


def test_stochastic_rounding_unbiased():
    x = jnp.full((4096, 16), 0.0, jnp.float32).at[:, 0].set(6.0).at[:, 1:].set(2.6)
    gs = jnp.float32(2.0**-8)  # block scale (6 / 6) / gs = 256 exactly -> scaled values = x
    keys = jax.random.split(jax.random.key(0), 8)
    means = []
    for k in keys:
        dq = F.dequantize(F.quantize(x, global_scale=gs, rounding="stochastic", key=k))
        vals = np.asarray(dq)[:, 1:]
        assert set(np.unique(vals)).issubset({2.0, 3.0})
        means.append(vals.mean())
    m = float(np.mean(means))
    # P(up) = 0.6 -> mean 2.6; std of the mean over 8*4096*15 draws ~ 0.0014
    assert abs(m - 2.6) < 0.01
    rne = np.asarray(F.dequantize(F.quantize(x, global_scale=gs)))[:, 1:]
    assert np.all(rne == 3.0)


def test_two_d_blocks_same_for_either_axis():
    rng = np.random.default_rng(6)
    w = heavy_tailed(rng, (64, 96))
    a = F.quantize(w, block_shape=(16, 16))
    b = F.quantize(w, axis=0, block_shape=(16, 16))
    np.testing.assert_array_equal(np.asarray(F.dequantize(a)), np.asarray(F.dequantize(b)))
    s = np.asarray(a.scales).astype(np.float32)  # [64, 6]
    assert np.all(s.reshape(4, 16, 6) == s.reshape(4, 16, 6)[:, :1, :])
    assert b.codes.shape == (32, 96) and b.scales.shape == (4, 96)
    with pytest.raises(ValueError, match="block_shape"):
        F.quantize(np.ones((8, 32), np.float32), block_shape=(16, 16))


def test_per_expert_global_scales():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4, 32, 64)).astype(np.float32) * np.array([1e-3, 1, 10, 1e3], np.float32)[:, None, None]
    t = F.quantize(w, keep_axes=(0,))
    assert t.global_scale.shape == (4, 1, 1)
    for e in range(4):
        te = F.quantize(w[e])
        np.testing.assert_array_equal(np.asarray(t.codes[e]), np.asarray(te.codes))
        np.testing.assert_array_equal(np.asarray(F.dequantize(t)[e]), np.asarray(F.dequantize(te)))


def test_modelopt_round_trip():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((3, 48, 64)).astype(np.float32)
    t = F.quantize(w, keep_axes=(0,))
    m = F.to_modelopt(t)
    assert m["weight"].shape == (3, 48, 32) and m["weight"].dtype == jnp.uint8
    assert m["weight_scale"].shape == (3, 48, 4) and m["weight_scale"].dtype == jnp.float8_e4m3fn
    assert m["weight_scale_2"].shape == (3,)
    t2 = F.from_modelopt(m["weight"], m["weight_scale"], m["weight_scale_2"])
    np.testing.assert_array_equal(np.asarray(F.dequantize(t2)), np.asarray(F.dequantize(t)))
    with pytest.raises(ValueError, match="weight_scale"):
        F.from_modelopt(m["weight"], m["weight_scale"][..., :2], m["weight_scale_2"])


def test_pytree_and_axis():
    x = jnp.asarray(np.random.default_rng(9).standard_normal((32, 8)).astype(np.float32))
    t = F.quantize(x, axis=0)
    assert t.codes.shape == (16, 8) and t.scales.shape == (2, 8)
    leaves = jax.tree_util.tree_leaves(t)
    assert len(leaves) == 3
    t2 = jax.tree_util.tree_map(lambda a: a, t)
    np.testing.assert_array_equal(np.asarray(F.dequantize(t2)), np.asarray(F.dequantize(F.quantize(x.T)).T))


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"x: the quantized axis 1 has size 20, expected a multiple of 16"):
        F.quantize(np.ones((2, 20), np.float32))
    with pytest.raises(ValueError, match="floating-point.*int32"):
        F.quantize(np.ones((2, 16), np.int32))
    with pytest.raises(ValueError, match="rounding='nearest'"):
        F.quantize(np.ones((2, 16), np.float32), rounding="nearest")
    with pytest.raises(ValueError, match="key"):
        F.quantize(np.ones((2, 16), np.float32), rounding="stochastic")
    with pytest.raises(ValueError, match="key"):
        F.quantize(np.ones((2, 16), np.float32), rounding="stochastic", key=42)
    with pytest.raises(ValueError, match="axis=5"):
        F.quantize(np.ones((2, 16), np.float32), axis=5)
    with pytest.raises(ValueError, match="global_scale"):
        F.quantize(np.ones((2, 16), np.float32), global_scale=np.ones((3,)))
    with pytest.raises(TypeError):
        F.quantize(np.ones((2, 16), np.float32), blocksize=32)


def test_non_finite_input_is_never_silently_finite():
    x = np.random.default_rng(10).standard_normal((2, 64)).astype(np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[1, 20] = bad
        dq = np.asarray(F.dequantize(F.quantize(y)))
        assert not np.isfinite(dq).all()
        # with a fixed global scale only the block holding the bad value is poisoned
        t = F.quantize(y, global_scale=np.float32(np.abs(x).max() / 2688))
        dq = np.asarray(F.dequantize(t))
        assert np.isnan(dq[1, 16:32]).all()
        assert np.isfinite(np.delete(dq.reshape(8, 16), 5, axis=0)).all()
        assert np.asarray(t.scales).view(np.uint8)[1, 1] & 0x7F == 0x7F


# Magnitudes from 1e-20 (so the global scale stays a normal float32) to 1e6, and zeros.
finite_f32 = st.one_of(
    st.just(0.0), st.floats(np.float32(1e-20), 1e6, width=32), st.floats(-1e6, np.float32(-1e-20), width=32)
)


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.sampled_from([16, 32, 64])), elements=finite_f32))
def test_property_error_bound_and_exactness(x):
    t = F.quantize(x)
    dq = np.asarray(F.dequantize(t))
    np.testing.assert_array_equal(np.asarray(t.codes), np_reference(x)[0])
    gs = float(t.global_scale)
    amax16 = np.repeat(np.abs(x).reshape(x.shape[0], -1, 16).max(-1), 16, axis=-1)
    # Half an E2M1 step is at most 1 (in units of the block scale): the block max maps to 6
    # (E4M3 rounding of the scale adds at most 1/16), or, where the scale clamps at 2**-6,
    # the error is at most 2**-6 * global_scale.
    bound = np.maximum(amax16 / 6 * (1 + 1 / 16), 2**-6 * gs) * (1 + 1e-6)
    assert np.all(np.abs(dq - x) <= bound)


@pytest.mark.parametrize("div", ["ieee_div", "long_div"])
def test_division_is_correctly_rounded_under_jit(div):
    """Both exact divisions equal numpy's IEEE float32 division bit for bit, under jit,
    including a broadcast scalar divisor (which XLA:CPU would turn into a reciprocal
    multiply) and quotients at the ends of the recipe's range."""
    rng = np.random.default_rng(11)
    a = np.exp(rng.uniform(-9, 12, 200_000)).astype(np.float32)
    b = np.exp(rng.uniform(-9, 12, 200_000)).astype(np.float32)
    f = getattr(F, div)
    got = np.asarray(jax.jit(f)(a, b))
    np.testing.assert_array_equal(got.view(np.uint32), (a / b).view(np.uint32))
    got = np.asarray(jax.jit(lambda u: f(u, np.float32(2688.0)))(a))
    np.testing.assert_array_equal(got.view(np.uint32), (a / np.float32(2688.0)).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(f(np.float32(0.0), np.float32(3.0))), 0.0)


@pytest.mark.parametrize("shape,axis,keep", [((48, 64), -1, ()), ((64, 40), 0, ()), ((3, 24, 96), -1, (0,))])
def test_block_values_times_global_scale_is_dequantize(shape, axis, keep):
    """block_values (BF16, per packed byte) times the global scale, and dequantize (built on
    it), equal code value x float32 block scale x global scale computed in numpy from the
    unpacked codes, bit for bit, over heavy-tailed data reaching every code and many scales."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal(shape) * np.exp(2.5 * rng.standard_normal(shape))
    t = F.quantize(jnp.asarray(x, jnp.float32), axis=axis, keep_axes=keep)
    codes = np.asarray(F.unpack_codes(t.codes, t.axis))
    assert len(np.unique(codes)) >= 15  # (nearly) every E2M1 code, both signs
    v = F.block_values(t, jnp.float32)
    assert v.shape == tuple(shape)
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    sc = np.repeat(np.asarray(t.scales.astype(jnp.float32)), 16, axis=axis)
    ref = grid[codes] * sc * np.asarray(t.global_scale, np.float32)
    np.testing.assert_array_equal(np.asarray(v * t.global_scale), ref)
    np.testing.assert_array_equal(np.asarray(F.dequantize(t, jnp.float32)), ref)
    np.testing.assert_array_equal(np.asarray(F.block_values(t, jnp.bfloat16).astype(jnp.float32)), np.asarray(v))


def test_code_words_hold_the_same_bytes_and_values():
    """Codes stored as uint32 words (what the GEMMs' word decode reads): the same bytes,
    little-endian; block values, dequantization and the ModelOpt export are unchanged."""
    import dataclasses

    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 8, 64)), jnp.float32)
    t = F.quantize(x, keep_axes=(0,))
    w = F.code_words(t.codes)
    assert w.dtype == jnp.uint32 and w.shape == (3, 8, 8)
    np.testing.assert_array_equal(np.asarray(w).view(np.uint8).reshape(3, 8, 32), np.asarray(t.codes))
    np.testing.assert_array_equal(np.asarray(F.code_bytes(w)), np.asarray(t.codes))
    tw = dataclasses.replace(t, codes=w)
    np.testing.assert_array_equal(np.asarray(F.block_values(tw, jnp.float32)), np.asarray(F.block_values(t, jnp.float32)))
    np.testing.assert_array_equal(np.asarray(F.dequantize(tw)), np.asarray(F.dequantize(t)))
    np.testing.assert_array_equal(np.asarray(F.to_modelopt(tw)["weight"]), np.asarray(t.codes))
    assert tw.nbytes == t.nbytes
    with pytest.raises(ValueError, match="codes"):
        F.code_words(jnp.zeros((2, 6), jnp.uint8))  # 6 bytes a row: not whole words


def test_fake_quant_in_the_product_dtype_equals_rounding_the_fp32_result():
    """fake_quant(w, dtype=bf16) (the QAT weight in the product's type) is the FP32 result
    rounded once, bit for bit, and its gradient comes back in w's dtype (FP32), straight through."""
    rng = np.random.default_rng()
    w = jnp.asarray(rng.standard_normal((4, 48, 64)) * np.exp(rng.standard_normal((4, 1, 64))), jnp.float32)
    got = F.fake_quant(w, dtype=jnp.bfloat16, keep_axes=(0,))
    assert got.dtype == jnp.bfloat16
    want = F.fake_quant(w, keep_axes=(0,)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    ct = jnp.asarray(rng.standard_normal(w.shape), jnp.bfloat16)
    g = jax.grad(lambda v: jnp.sum(F.fake_quant(v, dtype=jnp.bfloat16, keep_axes=(0,)).astype(jnp.float32) * ct))(w)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g), np.asarray(ct, np.float32))
