"""NVFP4: the 4-bit floating-point format with two-level scaling.

Elements are E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), one FP8 E4M3
scale per block of 16 consecutive elements along the quantized axis, and one FP32
"global" scale per tensor (or per expert / per row) equal to ``amax / (6 * 448)``.

Semantics (NVIDIA's two-level recipe, bit for bit)::

    global_scale = amax(|x|) / (6 * 448)                      # float32, unless given
    s            = e4m3_rne(clip((amax16 / 6) / global_scale, 2**-6, 448))
    code         = e2m1_rne(clip(x * ((1 / global_scale) / s), -6, 6))
    dequantized  = e2m1(code) * s * global_scale

All rounding here is done arithmetically in float32 (``round_to_float_grid``) instead of
by casting through ``float4_e2m1fn`` / ``float8_e4m3fn``: inside ``jax.jit`` on GPU, XLA
folds a round-trip cast away (excess precision), so cast-based fake quantization would
silently not quantize. The casts that remain only ever see values already on the grid.

Storage: ``codes`` is uint8 with two codes a byte along the quantized axis, the lower
index in the low nibble (the ModelOpt / serving-engine layout); bit 3 of a code is the
sign. ``scales`` is float8_e4m3fn with the quantized axis divided by 16.

Non-finite input: a block holding a NaN or +-inf gets a NaN scale (E4M3 0x7F) and
dequantizes to NaN; with the dynamic global scale the global scale is then non-finite too,
so the whole tensor dequantizes to non-finite values. Quantization never turns a
non-finite input into finite output silently.

A zero tensor (amax 0) gets global scale 1.0 and all-zero codes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
ROUNDINGS = ("rne", "stochastic")
BLOCK_SHAPES = ((1, 16), (16, 16))

# Decode table, index = 4-bit code (bit 3 = sign).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


# ----------------------------------------------------------------------------- grids


def _mantissa_exponent(v):
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    return (bits & 0x7FFFFF) | 0x800000, ((bits >> 23) & 0xFF) - 127


def ieee_div(a, b):
    """Correctly rounded float32 ``a / b`` (IEEE round to nearest even), on every backend.

    Plain float32 division is not: XLA on the GPU divides approximately (a large share of
    random quotients one ulp off), Triton emits ``div.full.f32``,
    and XLA on the CPU rewrites a division by a broadcast scalar into a reciprocal
    multiply. The NVFP4 recipe's divisions decide codes at rounding boundaries, so on the
    CPU they go through float64 (``f64_div``) and elsewhere through ``long_div``'s integer
    arithmetic: jitted for the GPU, the float64 route comes back with the approximate float32
    quotient (tests/test_gpu.py), which moves an E4M3 block scale one step in about one block
    in a million. The choice is
    made per lowering platform (``jax.lax.platform_dependent``), never by process state.
    Kernels use PTX ``div.rn.f32`` (``pallas_kernels.tile_math``).
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return jax.lax.platform_dependent(a, b, cpu=f64_div, default=long_div)


def f64_div(a, b):
    """float32 ``a / b`` through float64: correctly rounded where the backend computes in
    float64 (float32 operands are exact in float64, and rounding the correctly rounded
    float64 quotient to float32 cannot err: 53 >= 2 * 24 + 2 bits). The divisor is a
    full-shape value behind an optimization barrier, so no reciprocal rewrite applies.
    XLA:GPU does not keep it (see ``ieee_div``)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    with jax.enable_x64(True):
        b64 = jax.lax.optimization_barrier(b.astype(jnp.float64))
        return (a.astype(jnp.float64) / b64).astype(jnp.float32)


def long_div(a, b):
    """Correctly rounded float32 ``a / b`` for a >= 0 and b > 0 by int32 long division.

    The independent cross-check of ``ieee_div`` (tests and the GPU bench compare them):
    25 shift-subtract steps give 24 quotient bits and a round bit, then round half to even.
    Zero numerators give 0; results outside the normal float32 range, subnormal or
    non-finite operands fall back to the hardware division (never hit by the recipe,
    whose quotients lie in [2**-9, 2**30]).
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    ma, ea = _mantissa_exponent(a)
    mb, eb = _mantissa_exponent(b)
    shift = ma < mb
    rem = jnp.where(shift, ma << 1, ma)
    e = ea - eb - shift.astype(jnp.int32)
    def step(_, carry):
        q, rem = carry
        ge = rem >= mb
        return (q << 1) | ge.astype(jnp.int32), jnp.where(ge, rem - mb, rem) << 1

    # A loop, not 25 unrolled steps: XLA's fusion duplicates an unrolled chain into every
    # consumer and compiles for minutes. (Triton kernels use PTX div.rn.f32 instead.)
    q, rem = jax.lax.fori_loop(0, 25, step, (jnp.zeros_like(ma), rem))
    mant, rbit = q >> 1, q & 1
    up = (rbit == 1) & ((rem != 0) | ((mant & 1) == 1))
    mant = mant + up.astype(jnp.int32)
    carry = mant >> 24
    mant, e = jnp.where(carry == 1, mant >> 1, mant), e + carry
    exact = jax.lax.bitcast_convert_type(((e + 127) << 23) | (mant & 0x7FFFFF), jnp.float32)
    fine = (ea > -127) & (ea < 128) & (eb > -127) & (eb < 128) & (e > -126) & (e < 128)
    out = jnp.where(fine, exact, a / b)
    return jnp.where(a == 0, jnp.zeros_like(a), out)


_RNE_MAGIC = 2.0**23  # (q + 2**23) - 2**23 rounds 0 <= q < 2**22 to an integer, ties to even


@dataclasses.dataclass(frozen=True)
class Arith:
    """The two float32 operations whose rounding XLA and Triton would otherwise change.

    div:    a correctly rounded division (``ieee_div`` everywhere, so all backends agree).
    opaque: hides a value from the optimizer so ``(q + C) - C`` is not folded to ``q``.
    mul:    a product rounded on its own, never contracted into an FMA with a later add
            (the RAC residual ``x - dq`` must round the same way everywhere).
    XLA gets optimization barriers; Pallas-Triton kernels pass the identity and PTX
    ``mul.rn.f32`` (Triton contracts multiply-adds into FMAs).
    """

    div: Callable
    opaque: Callable
    mul: Callable


XLA_ARITH = Arith(
    div=ieee_div,
    opaque=jax.lax.optimization_barrier,
    mul=lambda a, b: jax.lax.optimization_barrier(a * b),
)


def pow2(e):
    """2.0**e for int32 ``e`` in [-126, 127], exactly, built from the exponent bits."""
    return jax.lax.bitcast_convert_type((jnp.asarray(e, jnp.int32) + 127) << 23, jnp.float32)


def float_exponent(a):
    """floor(log2(a)) for positive normal float32 ``a`` from its bits (-127 for 0 and
    subnormals, which callers clamp)."""
    bits = jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def round_to_float_grid(a, *, mantissa_bits: int, min_exponent: int, key=None, arith: Arith = XLA_ARITH):
    """Round non-negative float32 ``a`` onto a minifloat grid, in float32 arithmetic.

    The grid has ``mantissa_bits`` explicit mantissa bits and smallest normal exponent
    ``min_exponent`` (subnormals below it). Round-to-nearest-even when ``key`` is None,
    else stochastic rounding (rounds up with probability equal to the fractional
    distance, so the expectation equals ``a``). Callers clamp to the grid's max first.

    Only bit operations, multiplies by powers of two and adds are used, so the same code
    runs under XLA and inside Pallas-Triton kernels (which lower no ``round``/``frexp``).
    """
    a = jnp.asarray(a, jnp.float32)
    e = jnp.maximum(float_exponent(a), min_exponent) - mantissa_bits
    q = a * pow2(-e)  # exact: scaling by a power of two; q < 2**(mantissa_bits + 2)
    if key is None:
        q = arith.opaque(q + _RNE_MAGIC) - _RNE_MAGIC
    else:
        lo = jnp.floor(q)
        u = jax.random.uniform(key, a.shape, jnp.float32)
        q = lo + (u < (q - lo)).astype(jnp.float32)
    return q * pow2(e)


def round_e2m1(a, key=None, arith: Arith = XLA_ARITH):
    """|values| in [0, 6] -> nearest E2M1 magnitude (ties to even)."""
    return round_to_float_grid(a, mantissa_bits=1, min_exponent=0, key=key, arith=arith)


def round_e4m3(a, arith: Arith = XLA_ARITH):
    """|values| in [0, 448] -> nearest E4M3 magnitude (ties to even)."""
    return round_to_float_grid(a, mantissa_bits=3, min_exponent=-6, arith=arith)


def encode_e2m1(v):
    """Values already on the E2M1 grid (float32, in [-6, 6]) -> 4-bit codes (uint8).

    The sign bit is taken from ``v < 0`` or a negative zero, matching a hardware cast.
    """
    v = jnp.asarray(v, jnp.float32)
    a = jnp.abs(v)
    mag = jnp.where(a < 2.0, 2.0 * a, jnp.where(a < 4.0, a + 2.0, 0.5 * a + 4.0))
    sign = (jax.lax.bitcast_convert_type(v, jnp.int32) >> 31) & 1  # also -0.0
    return mag.astype(jnp.uint8) | (sign.astype(jnp.uint8) << 3)


def decode_e2m1(codes, dtype=jnp.float32):
    """4-bit codes (any integer dtype, values 0..15) -> E2M1 values."""
    return jnp.asarray(E2M1_VALUES, dtype)[jnp.asarray(codes, jnp.int32) & 0xF]


def decode_e2m1_bf16(c):
    """4-bit codes (int32) -> BF16 E2M1 values built from bits (for kernels): the
    magnitude's BF16 pattern is ``(m + 252) << 6`` for the normal codes m = 2..7 and
    ``m * 0x3F00`` (0 or 0.5) for m = 0, 1; the code's sign bit moves to bit 15."""
    m = c & 7
    bits = jnp.where(m < 2, m * 0x3F00, (m + 252) << 6) | ((c & 8) << 12)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def decode_e4m3_bits(b):
    """E4M3 bit patterns (int32, 0..255) -> float32, exactly (for kernels)."""
    e, m = (b >> 3) & 15, b & 7
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    v = jnp.where(e == 0, m.astype(jnp.float32) * (2.0**-9), normal)
    v = jnp.where((b & 0x7F) == 0x7F, jnp.nan, v)
    return jnp.where((b & 0x80) != 0, -v, v)


def decode_e4m3_bf16(b):
    """E4M3 bit patterns (int32, 0..255) -> BF16, exactly, from integer bit operations (for
    kernels: a normal E4M3 value's BF16 pattern is its magnitude bits shifted left 4 plus
    the exponent bias difference 120 << 7; subnormals m * 2**-9 and NaN are selected in).
    Cheaper in a Triton kernel than ``decode_e4m3_bits`` followed by a BF16 conversion."""
    mag = b & 0x7F
    sub = jax.lax.bitcast_convert_type(mag.astype(jnp.float32) * (2.0**-9), jnp.int32) >> 16  # exact in BF16
    bits = jnp.where(mag >= 8, (mag << 4) + (120 << 7), sub)
    bits = jnp.where(mag == 0x7F, 0x7FC0, bits) | ((b & 0x80) << 8)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def pack_codes(codes, axis: int = -1):
    """Pack 4-bit codes two a byte along ``axis``: element 2i in the low nibble."""
    codes = jnp.moveaxis(jnp.asarray(codes, jnp.uint8), axis, -1)
    packed = (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)
    return jnp.moveaxis(packed, -1, axis)


def unpack_codes(packed, axis: int = -1):
    """Inverse of ``pack_codes``."""
    packed = jnp.moveaxis(jnp.asarray(packed, jnp.uint8), axis, -1)
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return jnp.moveaxis(codes, -1, axis)


def code_words(codes):
    """Packed codes [..., K/2] uint8 -> [..., K/8] uint32 words of 8 codes (the same bytes,
    little-endian: code j of a word at bits 4j..4j+3). Words as given stay as they are."""
    codes = jnp.asarray(codes)
    if codes.dtype == jnp.uint32:
        return codes
    if codes.dtype != jnp.uint8 or codes.shape[-1] % 4:
        raise ValueError(f"codes: expected uint8 packed codes with a multiple of 4 bytes a row, got {codes.dtype}{codes.shape}")
    b = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def code_bytes(codes):
    """The inverse of ``code_words``: uint8 packed codes (uint8 input stays as it is)."""
    codes = jnp.asarray(codes)
    if codes.dtype == jnp.uint8:
        return codes
    if codes.dtype != jnp.uint32:
        raise ValueError(f"codes: expected uint8 packed codes or uint32 code words, got {codes.dtype}")
    b = jnp.stack([(codes >> (8 * i)) & 0xFF for i in range(4)], axis=-1).astype(jnp.uint8)
    return b.reshape(*codes.shape[:-1], codes.shape[-1] * 4)


# ----------------------------------------------------------------------------- tensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4-quantized array. A pytree: arrays are leaves, layout is static.

    codes:        uint8, ``shape`` with ``shape[axis] // 2`` along ``axis`` (packed); or, for
                  a tensor quantized along its last axis, the same bytes as uint32 words of
                  8 codes (``code_words``: what the GEMMs' word decode reads).
    scales:       float8_e4m3fn, ``shape`` with ``shape[axis] // 16`` along ``axis``.
    global_scale: float32, a scalar or an array broadcastable to ``shape`` (keepdims,
                  e.g. [E, 1, 1] for per-expert scales of an [E, N, K] weight).
    """

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.codes.size * self.codes.dtype.itemsize + self.scales.size + 4 * np.size(self.global_scale))

    def dequantize(self, dtype=jnp.float32):
        return dequantize(self, dtype)


def _normalize_axis(axis: int, ndim: int, name: str = "axis") -> int:
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis!r} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def _check_input(x, axis, block_shape):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a floating-point array, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError("x: expected an array of rank >= 1, got a scalar")
    axis = _normalize_axis(axis, x.ndim)
    if x.shape[axis] % BLOCK:
        raise ValueError(
            f"x: the quantized axis {axis} has size {x.shape[axis]}, "
            f"expected a multiple of {BLOCK} (x.shape={tuple(x.shape)})"
        )
    block_shape = tuple(block_shape)
    if block_shape not in BLOCK_SHAPES:
        raise ValueError(f"block_shape={block_shape!r}: expected one of {BLOCK_SHAPES}")
    if block_shape == (16, 16):
        if x.ndim < 2 or axis < x.ndim - 2:
            raise ValueError(
                f"block_shape=(16, 16) needs the quantized axis among the last two of a "
                f"rank >= 2 array, got axis={axis} for shape {tuple(x.shape)}"
            )
        other = _other_block_axis(axis, x.ndim)
        if x.shape[other] % BLOCK:
            raise ValueError(
                f"x: block_shape=(16, 16) needs axis {other} (size {x.shape[other]}) to be "
                f"a multiple of {BLOCK}"
            )
    return x, axis, block_shape


def _other_block_axis(axis: int, ndim: int) -> int:
    return ndim - 2 if axis == ndim - 1 else ndim - 1


def global_scale_for(x, *, keep_axes: Sequence[int] = (), scale_max: float = E4M3_MAX):
    """The dynamic global scale ``amax(|x|) / (6 * scale_max)`` in float32.

    ``keep_axes`` keeps separate scales along those axes (keepdims shape), e.g. ``(0,)``
    for per-expert scales of [E, N, K] weights, or every non-quantized axis for per-token
    scales of activations. A zero amax gives 1.0; a non-finite amax stays non-finite.
    """
    x = jnp.asarray(x)
    keep = {_normalize_axis(a, x.ndim, "keep_axes") for a in keep_axes}
    red = tuple(i for i in range(x.ndim) if i not in keep)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=red, keepdims=bool(keep))
    return global_scale_from_amax(amax, scale_max=scale_max)


def global_scale_from_amax(amax, *, scale_max: float = E4M3_MAX, arith: Arith = XLA_ARITH):
    """``amax / (6 * scale_max)`` with ``arith``'s division (kernels pass theirs), 1.0 where
    it is zero: ``global_scale_for`` after its reduction."""
    gs = arith.div(amax, E2M1_MAX * scale_max)
    return jnp.where(gs == 0, jnp.float32(1.0), gs)


def _block_amax_1d(xl):
    """|max| per 16-block of the last axis: [..., K] -> [..., K/16]."""
    return jnp.abs(xl).reshape(*xl.shape[:-1], xl.shape[-1] // BLOCK, BLOCK).max(-1)


def quantize_blocks(xb, amax16, gs, *, block_max=E2M1_MAX, key=None, arith: Arith = XLA_ARITH):
    """The core of the recipe on blocks: map each block's max to ``block_max`` (6, or 4 for
    4-over-6), round the block scale to E4M3 and the elements to E2M1.

    xb: [..., nb, m] float32 (m = 16, or 8 for one nibble-half of a block in kernels);
    amax16: [..., nb] the block amax; gs: global scale broadcastable to [..., nb].
    Returns (E2M1-grid values [..., nb, m] float32, scales [..., nb] on the E4M3 grid).
    Kernels call this on tiles with their own ``arith``, so both compute the same bits.
    """
    s = jnp.clip(arith.div(arith.div(amax16, block_max), gs), E4M3_MIN_NORMAL, E4M3_MAX)
    s = round_e4m3(s, arith)
    s = jnp.where(jnp.isfinite(amax16) & jnp.isfinite(gs), s, jnp.nan)
    inv = arith.div(arith.div(1.0, gs), s)
    v = jnp.clip(xb * inv[..., None], -E2M1_MAX, E2M1_MAX)
    v = jnp.where(v == v, v, 0.0)  # NaN -> 0 (its block scale is already NaN)
    a = jnp.abs(v)
    q = round_e2m1(a, key, arith)
    # v's sign bit onto q, as a hardware cast keeps it (-0.001 -> -0, code 8). Not ``-q``:
    # Pallas-Triton lowers negation as 0 - q, which turns -0 into +0.
    sign = jax.lax.bitcast_convert_type(v, jnp.int32) & jnp.int32(-(2**31))
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(q, jnp.int32) | sign, jnp.float32), s


def _grid_values(x, *, global_scale=None, axis: int = -1, rounding: str = "rne", key=None,
                 block_shape: Sequence[int] = (1, 16), keep_axes: Sequence[int] = (), four_over_six: bool = False):
    """``quantize``'s recipe up to the grid, its arguments checked: (E2M1 values [..., K/16,
    16] float32, block scales [..., K/16] on the E4M3 grid, the global scale, lead shape, K,
    the quantized axis) with that axis moved last. ``quantize`` encodes these; the fake quant
    multiplies them back (the same numbers as dequantize(quantize(x)), without the codes)."""
    x, axis, block_shape = _check_input(x, axis, block_shape)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: expected one of {ROUNDINGS}")
    if rounding == "stochastic":
        if key is None or not _is_prng_key(key):
            raise ValueError(
                f"key={key!r}: rounding='stochastic' needs a jax.random key "
                "(jax.random.key(seed) or jax.random.PRNGKey(seed))"
            )
    elif key is not None:
        raise ValueError("key: only used with rounding='stochastic'; got rounding='rne'")
    scale_max = 256.0 if four_over_six else E4M3_MAX
    xf = x.astype(jnp.float32)
    if global_scale is None:
        gs = global_scale_for(xf, keep_axes=keep_axes, scale_max=scale_max)
    else:
        gs = jnp.asarray(global_scale, jnp.float32)
        try:
            jnp.broadcast_shapes(gs.shape, x.shape)
        except ValueError:
            raise ValueError(
                f"global_scale: shape {gs.shape} does not broadcast to x.shape {tuple(x.shape)} "
                "(use keepdims shapes, e.g. [E, 1, 1] for per-expert scales)"
            ) from None
    if gs.ndim:
        if gs.ndim < x.ndim:
            gs = gs.reshape((1,) * (x.ndim - gs.ndim) + gs.shape)
        if gs.shape[axis] != 1:
            raise ValueError(
                f"global_scale: shape {gs.shape} varies along the quantized axis {axis}; "
                "expected size 1 there (one global scale per row / expert / tensor)"
            )
    xl = jnp.moveaxis(xf, axis, -1)
    lead, k = xl.shape[:-1], xl.shape[-1]
    amax16 = _block_amax_2d(xf, axis) if block_shape == (16, 16) else _block_amax_1d(xl)
    gsb = jnp.moveaxis(gs, axis, -1) if gs.ndim else gs
    xb = xl.reshape(*lead, k // BLOCK, BLOCK)
    q, s = quantize_blocks(xb, amax16, gsb, key=key)
    if four_over_six:
        k4 = None if key is None else jax.random.fold_in(key, 4)
        q4, s4 = quantize_blocks(xb, amax16, gsb, block_max=4.0, key=k4)
        g = gsb[..., None] if gs.ndim else gs
        err6 = jnp.sum(jnp.square(q * s[..., None] * g - xb), -1)
        err4 = jnp.sum(jnp.square(q4 * s4[..., None] * g - xb), -1)
        use4 = err4 < err6
        q = jnp.where(use4[..., None], q4, q)
        s = jnp.where(use4, s4, s)
    return q, s, gs, lead, k, axis


def quantize(
    x,
    *,
    global_scale=None,
    axis: int = -1,
    rounding: str = "rne",
    key=None,
    block_shape: Sequence[int] = (1, 16),
    keep_axes: Sequence[int] = (),
    four_over_six: bool = False,
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 along ``axis``.

    global_scale:  float32 scalar or keepdims array; default ``global_scale_for(x)``.
    rounding:      "rne" (round to nearest even) or "stochastic" (needs ``key``); only the
                   elements are rounded stochastically, scales always RNE.
    block_shape:   (1, 16), or (16, 16) for 2D weight blocks: 16 rows of the other of the
                   last two axes share one scale, so the dequantized tensor is the same
                   whichever of the two axes is quantized (and reduced in a matmul).
    keep_axes:     axes with separate dynamic global scales (per expert, per token).
    four_over_six: per block, map the block max to 6 or to 4, whichever gives the lower
                   squared error; the dynamic global scale then uses 256 instead of 448.
    """
    q, s, gs, lead, k, axis = _grid_values(x, global_scale=global_scale, axis=axis, rounding=rounding, key=key,
                                           block_shape=block_shape, keep_axes=keep_axes, four_over_six=four_over_six)
    codes = encode_e2m1(q.reshape(*lead, k))
    codes = jnp.moveaxis(pack_codes(codes, -1), -1, axis)
    scales = jnp.moveaxis(s, -1, axis).astype(jnp.float8_e4m3fn)
    return NVFP4Tensor(codes=codes, scales=scales, global_scale=gs, shape=tuple(jnp.shape(x)), axis=axis)


def _block_amax_2d(xf, axis):
    """Block amax for 16x16 blocks over the last two axes, laid out per 1x16 block of
    ``axis`` moved last: shape [..., other, K/16]."""
    ndim = xf.ndim
    m = jnp.abs(xf)
    r, c = m.shape[-2:]
    m = m.reshape(*m.shape[:-2], r // BLOCK, BLOCK, c // BLOCK, BLOCK).max(axis=(-3, -1))
    m = jnp.repeat(m, BLOCK, axis=-2) if axis == ndim - 1 else jnp.repeat(m, BLOCK, axis=-1)
    # m is [..., R, C/16] when quantizing the last axis, [..., R/16, C] for axis -2.
    return m if axis == ndim - 1 else jnp.swapaxes(m, -1, -2)


def _is_prng_key(key) -> bool:
    try:
        k = jnp.asarray(key) if not hasattr(key, "dtype") else key
        if jnp.issubdtype(k.dtype, jax.dtypes.prng_key):
            return k.ndim == 0
        return k.dtype == jnp.uint32 and k.shape == (2,)
    except Exception:
        return False


def dequantize(t: NVFP4Tensor, dtype=jnp.float32):
    """``e2m1(code) * float32(scale) * global_scale``, cast to ``dtype`` at the end."""
    if not isinstance(t, NVFP4Tensor):
        raise ValueError(f"t: expected an NVFP4Tensor, got {type(t).__name__}")
    return (block_values(t, jnp.float32) * t.global_scale).astype(dtype)  # block values are exact


def block_values(t: NVFP4Tensor, dtype=jnp.bfloat16):
    """``e2m1(code) * scale`` without the global scale. Exact in bfloat16 (a 2-bit by 4-bit
    significand product, exponents in [-10, 12]): the operand a Hopper kernel feeds to
    its BF16 MMA, the global scales going to the epilogue."""
    # computed per packed byte in BF16 (both products exact), interleaved once at the end:
    # the unpack-first form measured several times slower on the GPU
    p = jnp.moveaxis(code_bytes(t.codes), t.axis, -1).astype(jnp.int32)
    s = jnp.moveaxis(t.scales, t.axis, -1).astype(jnp.float32).astype(jnp.bfloat16)
    s = jnp.repeat(s, BLOCK // 2, axis=-1)  # one scale per packed byte
    lo, hi = decode_e2m1_bf16(p & 15) * s, decode_e2m1_bf16(p >> 4) * s
    v = jnp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    return jnp.moveaxis(v, -1, t.axis).astype(dtype)


# ----------------------------------------------------------------------------- fake quant


def fake_quant(x, *, dtype=None, **kwargs):
    """``dequantize(quantize(x, **kwargs))`` in ``dtype`` (default x's), with a
    straight-through gradient in x's dtype: the identity for elements inside the
    representable range (|x| <= 6 * 448 * global_scale) and zero for elements that saturate.

    ``dtype`` is the type the product reads the weight in (the QAT step's BF16 from FP32
    master weights): the same numbers as ``fake_quant(x).astype(dtype)`` (the FP32 values
    rounded once), without writing and reading back the FP32 tensor.

    With the dynamic global scale (no ``global_scale`` given) nothing saturates by design,
    so the gradient is the plain identity: no mask is computed or kept for the backward
    pass (the QAT step's weights take this path). A mask there would also be wrong at the
    margin: ``amax / (6 * 448)`` rounded to float32 can put the tensor's own max element one
    ulp outside the limit, which zeroed its gradient in about 7% of random tensors."""
    kw = tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))
    if kwargs.get("global_scale") is None:
        y, _ = _fq_forward(jax.lax.stop_gradient(x), kw)
        return straight_through(x, y.astype(dtype or x.dtype))
    return _fake_quant_ste(x, kw).astype(dtype or x.dtype)


def _fq_forward(x, kw):
    """dequantize(quantize(x)) computed from the grid values directly (no codes packed and
    unpacked: fewer passes over a weight each QAT step), bit for bit the same numbers."""
    kw = dict(kw)
    q, s, gs, lead, k, axis = _grid_values(x, **kw)
    y = jnp.moveaxis((q * s[..., None]).reshape(*lead, k), -1, axis) * gs  # block values exact in FP32, as dequantize
    limit = E2M1_MAX * (256.0 if kw.get("four_over_six") else E4M3_MAX) * gs
    inside = jnp.abs(x.astype(jnp.float32)) <= limit
    return y.astype(x.dtype), inside


@jax.custom_vjp
def _ste_core(x, y, inside):
    del x, inside
    return y


def _ste_fwd(x, y, inside):
    return y, inside


def _ste_bwd(inside, g):
    return (jnp.where(inside, g, jnp.zeros_like(g)), None, None)


_ste_core.defvjp(_ste_fwd, _ste_bwd)


@jax.custom_vjp
def straight_through(x, y):
    """y in the forward pass, the identity from y's cotangent to x's (in x's dtype) in the
    backward: the gradient of a fake quantization whose range nothing exceeds."""
    del x
    return y


# the residual is an empty array of x's dtype: the cotangent goes back in x's type
straight_through.defvjp(lambda x, y: (y, jnp.zeros((0,), x.dtype)), lambda r, g: (g.astype(r.dtype), None))


def _fake_quant_ste(x, kw):
    y, inside = _fq_forward(jax.lax.stop_gradient(x), kw)
    return _ste_core(x, y, inside)


# ----------------------------------------------------------------------------- ModelOpt layout


def to_modelopt(t: NVFP4Tensor) -> dict:
    """NVFP4Tensor of a weight [..., N, K] quantized along K -> ModelOpt checkpoint arrays:
    ``weight`` uint8 [..., N, K/2], ``weight_scale`` E4M3 [..., N, K/16],
    ``weight_scale_2`` float32 (scalar, or [...] per expert)."""
    if t.axis != t.ndim - 1:
        raise ValueError(f"t.axis={t.axis}: the ModelOpt layout quantizes the last axis")
    gs = jnp.asarray(t.global_scale, jnp.float32)
    if gs.ndim:
        gs = gs.reshape(gs.shape[: t.ndim - 2]) if gs.size == np.prod(gs.shape[: t.ndim - 2]) else gs
    return {"weight": code_bytes(t.codes), "weight_scale": t.scales, "weight_scale_2": gs}


def from_modelopt(weight, weight_scale, weight_scale_2) -> NVFP4Tensor:
    """ModelOpt arrays -> NVFP4Tensor (inverse of ``to_modelopt``)."""
    weight = jnp.asarray(weight)
    weight_scale = jnp.asarray(weight_scale)
    if weight.dtype != jnp.uint8:
        raise ValueError(f"weight: expected uint8 packed codes, got {weight.dtype}")
    if weight_scale.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"weight_scale: expected float8_e4m3fn, got {weight_scale.dtype}")
    shape = (*weight.shape[:-1], weight.shape[-1] * 2)
    if weight_scale.shape != (*shape[:-1], shape[-1] // BLOCK):
        raise ValueError(
            f"weight_scale: expected shape {(*shape[:-1], shape[-1] // BLOCK)} for weight "
            f"{tuple(weight.shape)}, got {tuple(weight_scale.shape)}"
        )
    gs = jnp.asarray(weight_scale_2, jnp.float32)
    if gs.ndim:
        gs = gs.reshape(*gs.shape, *([1] * (len(shape) - gs.ndim)))
    return NVFP4Tensor(codes=weight, scales=weight_scale, global_scale=gs, shape=shape, axis=len(shape) - 1)
