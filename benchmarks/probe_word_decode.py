"""Offline probe (not a kernel of the package, numerics not checked): a swapped decode GEMM
main loop that loads the weight codes as uint32 words (8 codes) and decodes each word with
four single-output inline-PTX programs (a BF16 pair each), feeding eight K = bk/8 MMAs in a
permuted channel order. It measures what the word layout would save in the compiled loop:
see benchmarks/results/2026-12-04-offline-sass/README.md. Usage:
    PYTHONPATH=. python benchmarks/probe_word_decode.py /path/to/python-with-triton"""
import functools
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from sass_offline import COMPILE, capture_ttir, main_loop  # noqa: E402

captured = capture_ttir()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import tile_math as TM
from quads_jax import nvfp4

def word_ptx(shift, half):
    """One bf16x2 word: the nibbles at ``shift`` of bytes (0, 1) (half 0) or (2, 3) (half 1)."""
    src = "$1" if shift == 0 else "qc"
    pair = TM.PAIR_01 if half == 0 else TM.PAIR_23
    sg = f"and.b32 qsg, {src}, 0x808;" if half == 0 else f"shr.u32 qsg, {src}, 16;\n and.b32 qsg, qsg, 0x808;"
    return ("{\n .reg .b32 qt, qsel, qhi, qlo, qm, qsg, qc, qha, qhb, qla, qlb;\n"
            f" mov.b32 qha, {TM._word(TM.HI_BYTES, 0):#x};\n mov.b32 qhb, {TM._word(TM.HI_BYTES, 4):#x};\n"
            f" mov.b32 qla, {TM._word(TM.LO_BYTES, 0):#x};\n mov.b32 qlb, {TM._word(TM.LO_BYTES, 4):#x};\n"
            f" shr.u32 qc, $1, {shift};\n and.b32 qt, {src}, 0x07070707;\n shr.u32 qsel, qt, 12;\n or.b32 qsel, qsel, qt;\n"
            " prmt.b32 qhi, qha, qhb, qsel;\n prmt.b32 qlo, qla, qlb, qsel;\n"
            f" prmt.b32 qm, qlo, qhi, {pair:#x};\n mul.rn.bf16x2 qm, qm, $2;\n {sg}\n"
            f" mul.lo.u32 qsg, qsg, {TM.SIGN_SPREAD:#x};\n and.b32 qsg, qsg, 0x80008000;\n or.b32 $0, qm, qsg;\n}}")

def decode_words(words, s2):
    parts = []
    for shift in (0, 4):
        for half in (0, 1):
            [o] = plgpu.elementwise_inline_asm(word_ptx(shift, half), args=[words, s2], constraints="=r,r,r", pack=1,
                                               result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.int32)])
            for q in range(2):
                h = ((o >> (16 * q)) & 0xFFFF).astype(jnp.uint16)
                parts.append(jax.lax.bitcast_convert_type(h, jnp.bfloat16))
    return parts

def kernel(a_ref, wc_ref, ws_ref, o_ref, *, bn, bk, steps):
    jn, sk = pl.program_id(1), pl.program_id(2)
    col = pl.ds(jn * bn, bn)
    def body(i, acc):
        kt = sk * steps + i
        w = plgpu.load(wc_ref.at[col, pl.ds(kt * (bk // 8), bk // 8)])
        sb = plgpu.load(ws_ref.at[col, pl.ds(kt * (bk // 16), bk // 16)]).astype(jnp.int32)
        s16 = jax.lax.bitcast_convert_type(nvfp4.decode_e4m3_bf16(sb), jnp.uint16).astype(jnp.uint32)
        s2 = jnp.broadcast_to((s16 * 0x10001)[:, :, None], (bn, bk // 16, 2)).reshape(bn, bk // 8)
        parts = decode_words(w, s2)
        for p in range(8):
            a = plgpu.load(a_ref.at[pl.ds(0, 16), pl.ds(kt * bk + p * (bk // 8), bk // 8)])
            acc = acc + jax.lax.dot_general(parts[p], a, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, 16), jnp.float32))
    plgpu.store(o_ref.at[sk, pl.ds(0, 16), col], acc.T)

n, k, bn, bk, split = 14336, 4096, 64, 128, 2
steps = k // (bk * split)
a = jnp.ones((16, k), jnp.bfloat16)
wc = jnp.ones((n, k // 8), jnp.uint32)
ws = jnp.ones((n, k // 16), jnp.uint8)
f = lambda a, wc, ws: pl.pallas_call(functools.partial(kernel, bn=bn, bk=bk, steps=steps),
    out_shape=jax.ShapeDtypeStruct((split, 16, n), jnp.float32), grid=(1, n // bn, split),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=4), name="probe")(a, wc, ws)
jax.jit(f).trace(a, wc, ws).lower(lowering_platforms=("cuda",))
p = os.path.join(tempfile.mkdtemp(), "probe.ttir")
open(p, "w").write(captured[-1])
r = subprocess.run([sys.argv[1], "-c", COMPILE, p, "4", "4"], capture_output=True, text=True)  # argv[1]: a Python with triton
print(r.stderr[-1500:] if r.returncode else "")
n_, body = main_loop(open(p + ".sass").read())
print("loop", n_, "per value", n_ / 64, dict(body.most_common(14)))
