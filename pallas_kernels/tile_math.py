"""Arithmetic shared by the kernels: the float32 division and opacity they use.

The recipe needs correctly rounded float32 divisions and products that are rounded on
their own. Triton divides approximately (``div.full.f32``) and contracts ``x - a * b``
into an FMA, so compiled kernels emit PTX ``div.rn.f32`` (IEEE round-to-nearest-even, the
same bits as ``nvfp4.ieee_div``'s integer long division in the XLA reference) and
``mul.rn.f32``. In interpret mode the kernel body is run by XLA, which gets the
reference's arithmetic instead (``nvfp4.XLA_ARITH``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as _triton_lowering  # jax is pinned (0.11.2): see mma_acc
from jax.experimental import pallas as pl
from jax.extend import core as jax_core
from jax.interpreters import mlir
from jax.experimental.pallas import triton as plgpu

from quads_jax import nvfp4


def _ptx_binary(op: str):
    """A float32 binary op as one PTX instruction (``op`` like ``"mul.rn.f32"``)."""

    def f(a, b):
        a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
        [out] = plgpu.elementwise_inline_asm(
            f"{op} $0, $1, $2;",
            args=[a, b],
            constraints="=r,r,r",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
        )
        return out

    return f


TRITON_ARITH = nvfp4.Arith(div=_ptx_binary("div.rn.f32"), opaque=lambda x: x, mul=_ptx_binary("mul.rn.f32"))


# ----------------------------------------------------------------------------- MMA into the accumulator
#
# ``acc + jax.lax.dot_general(a, b)`` lowers in Pallas' Triton backend to a dot into a fresh
# zero accumulator and a separate float add, which Triton's dot-add combine does not fold
# (the zero is a splat, not a constant): offline SASS of the decode GEMMs showed one FADD per
# accumulator value per K part (a third of the T=64 loop) and a wgmma wait after every MMA.
# ``mma_acc`` is one primitive whose Triton lowering is ``tt.dot(a, b.T, acc)``, so the MMAs
# of a K tile chain on the accumulator; elsewhere (XLA, interpret mode) it is the plain sum.

def _mma_acc_impl(acc, a, b):
    return acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


mma_acc_p = jax_core.Primitive("quads_mma_acc")
mma_acc_p.def_impl(_mma_acc_impl)
mma_acc_p.def_abstract_eval(lambda acc, a, b: jax.core.ShapedArray(acc.shape, acc.dtype))
mlir.register_lowering(mma_acc_p, mlir.lower_fun(_mma_acc_impl, multiple_results=False))


def _mma_acc_triton(ctx, acc, a, b):
    from jax._src.lib.triton import dialect as tt_dialect

    return tt_dialect.dot(a, tt_dialect.trans(b, (1, 0)), acc)


_triton_lowering.triton_lowering_rules[mma_acc_p] = _mma_acc_triton


def mma_acc(acc, a, b):
    """acc + a @ b.T in FP32 (a [m, k], b [n, k] BF16 or FP16, acc [m, n] float32): one MMA
    accumulating in place in compiled kernels."""
    if acc.dtype != jnp.float32 or a.dtype != b.dtype or a.shape[1] != b.shape[1] or acc.shape != (a.shape[0], b.shape[0]):
        raise ValueError(f"mma_acc: expected float32 acc [m, n], a [m, k], b [n, k] of one type; got acc {acc.dtype}{acc.shape}, "
                         f"a {a.dtype}{a.shape}, b {b.dtype}{b.shape}")
    return mma_acc_p.bind(acc, a, b)


def rows_at(ref, rows, cols):
    """``ref.at[rows, cols]`` for a column slice ``cols`` (``pl.ds``) and ``rows`` a slice or
    an index array [r] (a gather of rows). With an index array both axes become index
    arrays ([r, 1] and [1, w]): interpret mode loads no mix of the two, and the compiled
    pointers are the same (a row offset plus the slice's range)."""
    if isinstance(rows, pl.Slice):
        return ref.at[rows, cols]
    c = cols.start + cols.stride * jnp.arange(cols.size, dtype=jnp.int32)
    return ref.at[rows[:, None], c[None, :]]


def load_even_odd(ref, rows, start, width, mask, interpret, other=0):
    """The even and odd columns of ``ref[rows, start:start + width]`` ([r, width // 2]
    each; ``rows`` as ``rows_at``'s): the low and high nibbles of packed codes. Compiled:
    two stride-2 loads. Interpret mode has no strided loads, so it de-interleaves a
    contiguous load."""
    if not interpret:
        even = plgpu.load(rows_at(ref, rows, pl.ds(start, width // 2, stride=2)), mask=mask, other=other)
        odd = plgpu.load(rows_at(ref, rows, pl.ds(start + 1, width // 2, stride=2)), mask=mask, other=other)
        return even, odd
    v = plgpu.load(rows_at(ref, rows, pl.ds(start, width)), mask=mask, other=other)
    v = v.reshape(v.shape[0], width // 2, 2)
    return v[:, :, 0], v[:, :, 1]


def scales_as(scale_bits, dtype):
    """E4M3 scale bits -> their values in the operand type (BF16 or FP16; exact in both).
    The BF16 values come from integer bit operations: far fewer instructions in the compiled
    loop than a float32 decode and conversion."""
    s = nvfp4.decode_e4m3_bf16(scale_bits.astype(jnp.int32))
    return s if jnp.dtype(dtype) == jnp.bfloat16 else s.astype(dtype)


def decode_tile(codes, scale_bits, rows, bk, dtype=jnp.bfloat16):
    """Packed codes [rows, bk/2] (uint8) and E4M3 scale bits [rows, bk/16] -> the even and
    odd channels' block values in ``dtype``, BF16 or FP16 (exact: E2M1 x E4M3 has at most 6
    significant bits), each [rows, bk/2]: BF16 bit patterns, one product by the scale."""
    key = operand_key(dtype)
    c = codes.astype(jnp.int32)
    if key == "f16":  # magnitudes times 2**8, the scale as s * 2**-8 (no float conversion)
        s = jax.lax.bitcast_convert_type(scale_halves(scale_bits).astype(jnp.uint16), jnp.float16)
        values = _e2m1_f16_times_256
    else:
        s, values = scales_as(scale_bits, dtype), nvfp4.decode_e2m1_bf16
    s = jnp.broadcast_to(s[:, :, None], (rows, bk // 16, 8)).reshape(rows, bk // 2)
    return tuple(values(v) * s for v in (c & 15, c >> 4))


def _e2m1_f16_times_256(c):
    """4-bit codes (int32) -> FP16 E2M1 values times 2**8, from bits: the magnitude's pattern
    is ``(m + 44) << 9`` for the normal codes m = 2..7 and ``m * 0x5800`` (0 or 128) for
    m = 0, 1; the sign moves to bit 15."""
    m = c & 7
    bits = jnp.where(m < 2, m * 0x5800, (m + 44) << 9) | ((c & 8) << 12)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


def kernel_arith(interpret: bool) -> nvfp4.Arith:
    return nvfp4.XLA_ARITH if interpret else TRITON_ARITH


def pad_axis(x, axis: int, size: int):
    """Zero-pad ``x`` along ``axis`` up to ``size`` (no-op if already that size)."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def operand_key(dtype) -> str:
    """"bf16" or "f16": the MMA operand type the decode produces."""
    if jnp.dtype(dtype) == jnp.float16:
        return "f16"
    if jnp.dtype(dtype) == jnp.bfloat16:
        return "bf16"
    raise ValueError(f"dtype={dtype}: the weight decode produces bfloat16 or float16 operands")


def scale_halves(scale_bits):
    """E4M3 scale bits (any int type) -> the uint32 FP16 pattern of s * 2**-8, the factor of
    ``decode_tile``'s FP16 values (times 2**8): ``(b & 0x7F) << 7`` (integer operations, no
    float conversion; exact: s * 2**-8 >= 2**-17 has at most 4 significant bits, exact as an
    FP16 subnormal), with E4M3's NaN kept as an FP16 NaN. NVFP4 block scales are
    non-negative: the sign bit is not read."""
    mag = scale_bits.astype(jnp.uint32) & 0x7F
    return jnp.where(mag == 0x7F, jnp.uint32(0x7E00), mag << 7)


# ----------------------------------------------------------------------------- codes as 32-bit words
#
# decode="words": the weight codes enter the kernel as uint32 words of 8 codes (the same bytes,
# little-endian: channel 8w + j at bits 4j..4j+3). Each word is decoded by four single-output
# PTX programs, one BF16 / FP16 pair each: program q gives the channels WORD_PAIRS[q] of its
# word's group of 8, in the low and high half of one 32-bit register. A K tile is summed in
# four parts (four MMAs of K = bk / 4), part q holding the pairs of program q in group order:
# element 2g + h is channel 8g + WORD_PAIRS[q][h]. The two halves of a program's register are
# then the two K-adjacent values of one MMA operand register, so the decoded words feed the
# MMA as they are (parts of single channels would pair the halves of two programs' outputs in
# each operand register: a byte permute a register). The activations enter in the same
# channel order. Triton never unpacks uint8 elements or repacks them around the assembly.

WORD_PAIRS = ((0, 2), (4, 6), (1, 3), (5, 7))  # programs (shift 0, bytes 0-1), (0, 2-3), (4, 0-1), (4, 2-3)
WORD_CHANNELS = tuple(c for pair in WORD_PAIRS for c in pair)  # the programs' outputs, low half first
WORD_PARTS = len(WORD_PAIRS)

# No table: an E2M1 code s e1 e0 m placed in a BF16 or FP16 pattern as s at bit 15 and e1 e0 m
# at the low exponent bits and the top mantissa bit (BF16: bits 8..6, FP16: 11..9) is the
# code's value times 2**(1 - bias) (BF16: 2**-126, FP16: 2**-14; the code 0.5, e = 0, lands
# on the type's subnormal half of that, so no case is special). One byte permute puts the
# pair's two bytes at bytes 1 and 3 (the high nibbles then hold the sign at bits 15 and 31
# already), shifts and masks place the rest, and ``mul.rn`` applies the block scale times
# 2**(bias - 8) (``word_scale_halves``): the value times 2**-7 in both types, exact (E2M1 x
# E4M3 x 2**-7 lies in [2**-17, 21] with its lowest bit at or above 2**-17). The project's
# quantizer keeps block scales >= 2**-6 (``nvfp4.E4M3_MIN_NORMAL``), so every nonzero product
# is at least 0.5 x 2**-6 x 2**-7 = 2**-14, a normal number in both types; only a checkpoint
# quantized elsewhere with E4M3's subnormal scales hands the FP16 MMA subnormals. The FP32
# accumulator is multiplied by 2**7 in the epilogue (``WORD_VALUE_SCALE``).
WORD_VALUE_SCALE = 2.0**-7  # the word decode's values: the block values times this
_PLACE = {  # operand type: (a high nibble's right shift, a low nibble's left shift (negative: right), e1 e0 m mask, mul)
    "bf16": (6, -2, 0x01C001C0, "mul.rn.bf16x2"),
    "f16": (3, 1, 0x0E000E00, "mul.rn.f16x2"),
}


def _word_pair_ptx(key: str, shift: int, half: int) -> str:
    """PTX: the nibbles at bit ``shift`` of bytes (2 half, 2 half + 1) of word $1 as ``key``
    values times 2**(1 - bias), times the scale pair $2 (s * 2**(bias - 8)) -> one 32-bit word
    $0 of two values (the first byte's value in the low half)."""
    right, left, mask, mul = _PLACE[key]
    sel = 0x1404 if half == 0 else 0x3424  # bytes 0, b, 0, b + 1 (selector 4: the zero register's byte)
    if shift == 4:  # the high nibble: the sign is in place
        place = f"    shr.u32 qa, qu, {right};\n    and.b32 qb, qu, 0x80008000;\n"
    else:  # the low nibble: its sign (bit 11) moves up 4 bits
        move = f"shl.b32 qa, qu, {left}" if left > 0 else f"shr.u32 qa, qu, {-left}"
        place = f"    {move};\n    shl.b32 qb, qu, 4;\n    and.b32 qb, qb, 0x80008000;\n"
    return ("{\n    .reg .b32 qz, qu, qa, qb;\n    mov.b32 qz, 0;\n"
            f"    prmt.b32 qu, $1, qz, {sel:#x};\n" + place +
            f"    and.b32 qa, qa, {mask:#x};\n    or.b32 qa, qa, qb;\n    {mul} $0, qa, $2;\n}}")


# programs in WORD_PAIRS order, per operand type
WORD_DECODE_PTX = {key: tuple(_word_pair_ptx(key, shift, half) for shift in (0, 4) for half in (0, 1)) for key in _PLACE}


def word_scale_halves(scale_bits, key: str):
    """E4M3 scale bits -> the uint32 16-bit pattern the word decode's ``mul.rn`` takes: the
    bits of s * 2**(bias - 8) in the operand type (BF16: s * 2**119 <= 1.75 * 2**127, FP16:
    s * 2**7 <= 57344), converted exactly (FP16: one instruction for two scales on sm_90);
    E4M3's NaN stays a NaN."""
    s = jax.lax.bitcast_convert_type(scale_bits.astype(jnp.uint8), jnp.float8_e4m3fn)
    if key == "bf16":  # through float32, whose range holds s * 2**119 as BF16's does
        s = (s.astype(jnp.float32) * 2.0**119).astype(jnp.bfloat16)
    else:
        s = s.astype(jnp.float16) * jnp.float16(2**7)
    return jax.lax.bitcast_convert_type(s, jnp.uint16).astype(jnp.uint32)


def to_word_parts_order(v, bk: int):
    """Activation values [T, K] -> the same values with each K tile of ``bk`` channels laid out
    as the four word parts (part q, element 2g + h: channel 8g + WORD_PAIRS[q][h]), so that
    part q of tile kt is the contiguous slice kt * bk + q * bk / 4 of length bk / 4."""
    t, k = v.shape
    g = v.reshape(t, k // bk, bk // 8, 8)[..., jnp.asarray(WORD_CHANNELS)]  # each group's channels as the pairs
    return jnp.swapaxes(g.reshape(t, k // bk, bk // 8, WORD_PARTS, 2), 2, 3).reshape(t, k)


OPERAND_ORDERS = ("plain", "words")


def operand_columns(ch, order):
    """Where channel ``ch`` (int32 array) of a token operand goes in ``order`` = (kind, tile):
    "plain" keeps it; ("words", bk) is ``to_word_parts_order(v, bk)``. Integer operations
    only: kernels scatter with it."""
    kind, tile = order
    if kind not in OPERAND_ORDERS or tile & (tile - 1):
        raise ValueError(f"order={order!r}: expected (one of {OPERAND_ORDERS}, a power-of-two tile)")
    if kind == "plain":
        return ch
    base, c, g = ch - (ch & (tile - 1)), ch & 7, (ch & (tile - 1)) >> 3
    # c's place in WORD_CHANNELS (0, 2, 4, 6, 1, 3, 5, 7) is (c >> 1) + 4 (c & 1): part i >> 1, half i & 1
    i = (c >> 1) + 4 * (c & 1)
    return base + (i >> 1) * (tile // 4) + 2 * g + (i & 1)


def decode_words(words, scale_bits, rows, bk, interpret=False, dtype=jnp.bfloat16):
    """Code words [rows, bk/8] and E4M3 scale bits [rows, bk/16] -> the four parts
    [rows, bk/4] of the tile's block values times ``WORD_VALUE_SCALE`` in ``dtype``
    (BF16 or FP16, exact), in WORD_PAIRS order (part q, element 2g + h: channel
    8g + WORD_PAIRS[q][h])."""
    key = operand_key(dtype)
    pairs = lambda lo, hi: jnp.stack([lo, hi], axis=-1).reshape(rows, bk // 4)  # a join: each pair stays in one register
    if interpret:
        s = scales_as(scale_bits, jnp.float32) * WORD_VALUE_SCALE  # [rows, bk/16]
        s = jnp.broadcast_to(s[:, :, None], (rows, bk // 16, 2)).reshape(rows, bk // 8)
        w = words.astype(jnp.uint32)
        one = lambda ch: (nvfp4.decode_e2m1_bf16(((w >> (4 * ch)) & 15).astype(jnp.int32)).astype(jnp.float32) * s).astype(dtype)
        return [pairs(one(a), one(b)) for a, b in WORD_PAIRS]
    s2 = jnp.broadcast_to((word_scale_halves(scale_bits, key) * 0x10001)[:, :, None], (rows, bk // 16, 2)).reshape(rows, bk // 8)
    parts = []
    for ptx in WORD_DECODE_PTX[key]:
        [o] = plgpu.elementwise_inline_asm(ptx, args=[words, s2], constraints="=r,r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.int32)])
        half = lambda q: jax.lax.bitcast_convert_type(((o >> (16 * q)) & 0xFFFF).astype(jnp.uint16), dtype)
        parts.append(pairs(half(0), half(1)))
    return parts
