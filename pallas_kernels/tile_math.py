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
    if key == "f16":  # as the word decode: magnitudes times 2**8, the scale as s * 2**-8 (no float conversion)
        s = jax.lax.bitcast_convert_type(scale_halves(scale_bits, key).astype(jnp.uint16), jnp.float16)
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


# ----------------------------------------------------------------------------- E2M1 decode by byte permutes
#
# A BF16 E2M1 magnitude is two bytes, each a function of the 3-bit magnitude m: high byte
# HI[m] and low byte LO[m]. ``prmt`` looks up four bytes from an 8-byte table at once, given
# four 3-bit selectors in the nibbles of its selector register; a second ``prmt`` pairs the
# high and low bytes into BF16x2 words; ``mul.rn.bf16x2`` applies the scale (exact: 6
# significant bits); a third ``prmt`` of the codes moves the sign bits to bits 15 and 31.

HI_BYTES = (0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40)  # BF16 bits 15..8 of 0, .5, 1, 1.5, 2, 3, 4, 6
LO_BYTES = (0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0)  # BF16 bits 7..0


def operand_key(dtype) -> str:
    """"bf16" or "f16": the MMA operand type the decode produces."""
    if jnp.dtype(dtype) == jnp.float16:
        return "f16"
    if jnp.dtype(dtype) == jnp.bfloat16:
        return "bf16"
    raise ValueError(f"dtype={dtype}: the weight decode produces bfloat16 or float16 operands")


def scale_halves(scale_bits, key: str):
    """E4M3 scale bits (any int type) -> the uint32 16-bit pattern that multiplies the decoded
    values for operand type ``key``: the scale's BF16 bits, or for FP16 (``decode_tile``,
    whose FP16 values are times 2**8) the bits of s * 2**-8, ``(b & 0x7F) << 7`` (integer
    operations, no float conversion; exact: s * 2**-8 >= 2**-17 has at most 4 significant
    bits, exact as an FP16 subnormal), with E4M3's NaN kept as an FP16 NaN. NVFP4 block scales
    are non-negative: the sign bit is not read (the word decode ORs each code's sign onto
    the product; offline SASS, keeping it cost 4% more main-loop instructions)."""
    if key == "bf16":
        return jax.lax.bitcast_convert_type(scales_as(scale_bits, jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    mag = scale_bits.astype(jnp.uint32) & 0x7F
    return jnp.where(mag == 0x7F, jnp.uint32(0x7E00), mag << 7)


def _word(table, start):
    return sum(b << (8 * i) for i, b in enumerate(table[start:start + 4])) if table else 0


def _tables_ptx():
    return (f"    mov.b32 qha, {_word(HI_BYTES, 0):#x};\n    mov.b32 qhb, {_word(HI_BYTES, 4):#x};\n"
            f"    mov.b32 qla, {_word(LO_BYTES, 0):#x};\n    mov.b32 qlb, {_word(LO_BYTES, 4):#x};\n")


# the selector ``t | t >> 12`` of t = codes & 0x07070707 holds the magnitudes of bytes 0, 2, 1, 3
# in its nibbles 0..3, so the looked-up bytes come in the order 0, 2, 1, 3; the pairing permutes
# (bytes of LO are 0-3, of HI 4-7) put values 0, 1 in the first word and 2, 3 in the second
PAIR_01, PAIR_23 = 0x6240, 0x7351
# the signs: a code's bit 3 is its byte's bit 7 (high nibbles; the low ones after a shift left
# by 4); one byte permute of the word moves bytes (2 half, 2 half + 1) to bytes 1 and 3, so the
# pair's signs land on bits 15 and 31
SIGN_BYTES = (0x1000, 0x3222)


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


def _word_pair_ptx(shift: int, half: int) -> str:
    """PTX: the nibbles at bit ``shift`` of bytes (2 half, 2 half + 1) of word $1, times the
    BF16 scale pair $2 -> one BF16x2 word $0 (the first byte's value in the low half)."""
    src = "$1" if shift == 0 else "qc"
    pair = PAIR_01 if half == 0 else PAIR_23
    signs = "qs" if shift == 0 else "$1"  # the pair's sign bits at bit 7 of their bytes
    return (
        "{\n    .reg .b32 qt, qsel, qhi, qlo, qm, qsg, qc, qs, qha, qhb, qla, qlb;\n"
        + _tables_ptx()
        + (f"    shr.u32 qc, $1, {shift};\n" if shift else "")
        + f"    and.b32 qt, {src}, 0x07070707;\n"
        "    shr.u32 qsel, qt, 12;\n    or.b32 qsel, qsel, qt;\n"
        "    prmt.b32 qhi, qha, qhb, qsel;\n    prmt.b32 qlo, qla, qlb, qsel;\n"
        + f"    prmt.b32 qm, qlo, qhi, {pair:#x};\n    mul.rn.bf16x2 qm, qm, $2;\n"
        + ("    shl.b32 qs, $1, 4;\n" if shift == 0 else "")
        + f"    prmt.b32 qsg, {signs}, {signs}, {SIGN_BYTES[half]:#x};\n"
        "    and.b32 qsg, qsg, 0x80008000;\n    or.b32 $0, qm, qsg;\n}"
    )


# FP16 operands (the W4A4 and RAC kernels) take no table: an E2M1 code s e1 e0 m placed in an
# FP16 pattern as s at bit 15 and e1 e0 m at bits 11..9 is the code's value times 2**-14 (the
# exponent bias 15 against E2M1's 1; the code 0.5, e = 0, lands on FP16's subnormal 2**-15,
# so no case is special). One byte permute puts the pair's two bytes at bytes 1 and 3 (the
# high nibbles then hold the sign at bits 15 and 31 already), shifts and masks place the rest,
# and ``mul.rn.f16x2`` applies the block scale times 2**7 (``word_scale_halves``): the value
# times 2**-7, exact (E2M1 x E4M3 x 2**-7 lies in [2**-17, 21] with its lowest bit at or above
# 2**-17). The project's quantizer keeps block scales >= 2**-6 (``nvfp4.E4M3_MIN_NORMAL``), so
# every nonzero product is at least 0.5 x 2**-6 x 2**-7 = 2**-14, a normal FP16 number; only a
# checkpoint quantized elsewhere with E4M3's subnormal scales hands the MMA FP16 subnormals.
# The FP32 accumulator is multiplied by 2**7 in the epilogue (``WORD_VALUE_SCALE``).
WORD_VALUE_SCALE = {"bf16": 1.0, "f16": 2.0**-7}  # the word decode's values: the block values times this


def _word_pair_f16_ptx(shift: int, half: int) -> str:
    """PTX: the nibbles at bit ``shift`` of bytes (2 half, 2 half + 1) of word $1 as FP16 values
    times 2**-14, times the FP16 scale pair $2 (s * 2**7) -> one FP16x2 word $0 (the first
    byte's value in the low half)."""
    sel = 0x1404 if half == 0 else 0x3424  # bytes 0, b, 0, b + 1 (selector 4: the zero register's byte)
    place = ("    shr.u32 qa, qu, 3;\n    and.b32 qb, qu, 0x80008000;\n" if shift == 4 else
             "    shl.b32 qa, qu, 1;\n    shl.b32 qb, qu, 4;\n    and.b32 qb, qb, 0x80008000;\n")
    return ("{\n    .reg .b32 qz, qu, qa, qb;\n    mov.b32 qz, 0;\n"
            f"    prmt.b32 qu, $1, qz, {sel:#x};\n" + place +
            "    and.b32 qa, qa, 0x0E000E00;\n    or.b32 qa, qa, qb;\n    mul.rn.f16x2 $0, qa, $2;\n}")


# programs in WORD_PAIRS order, per operand type
WORD_DECODE_PTX = {"bf16": tuple(_word_pair_ptx(shift, half) for shift in (0, 4) for half in (0, 1)),
                   "f16": tuple(_word_pair_f16_ptx(shift, half) for shift in (0, 4) for half in (0, 1))}
WORD_PARTS = len(WORD_PAIRS)


def word_scale_halves(scale_bits, key: str):
    """E4M3 scale bits -> the uint32 16-bit pattern the word decode's ``mul.rn`` takes: the
    scale's BF16 bits (``scale_halves``), or for FP16 the bits of s * 2**7 (converted
    exactly, one instruction for two scales on sm_90, then an exact FP16 product: at most
    448 * 2**7 = 57344; E4M3's NaN stays a NaN)."""
    if key == "bf16":
        return scale_halves(scale_bits, key)
    s = jax.lax.bitcast_convert_type(scale_bits.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float16) * jnp.float16(2**7)
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
    [rows, bk/4] of the tile's block values times ``WORD_VALUE_SCALE[key]`` in ``dtype``
    (BF16 or FP16, exact), in WORD_PAIRS order (part q, element 2g + h: channel
    8g + WORD_PAIRS[q][h])."""
    key = operand_key(dtype)
    pairs = lambda lo, hi: jnp.stack([lo, hi], axis=-1).reshape(rows, bk // 4)  # a join: each pair stays in one register
    if interpret:
        s = scales_as(scale_bits, jnp.float32) * WORD_VALUE_SCALE[key]  # [rows, bk/16]
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
