"""NVFP4 decode GEMM for Hopper in Mosaic GPU: the weight decoded in registers feeds wgmma.

    out[T, N] = gw * gx * (A @ Wq.T)          (FP16 operands, FP32 accumulation)

A is the token operand in FP16: the activations' NVFP4 block values (exact in FP16), or
RAC's compensated Xq + Rq / 4 (``rac.compensated_values``). Wq are the weight's block
values, E2M1 code times E4M3 scale, exact in FP16 (6 significant bits, 2**-10 .. 2688).

Why a second kernel beside the Triton one (``nvfp4_matmul``): at decode sizes the Triton
GEMM is bound by instruction issue, not by memory (run 13, ncu: 41% issue busy, 16% DRAM,
6.5-6.9 loop instructions per weight value). Here the MMA is computed transposed,
out.T = Wq @ A.T, so the weight is wgmma's A operand, which Hopper reads from registers:

* each thread loads its own code bytes from shared memory (the TMA pipeline fills it) and
  decodes them straight into the registers of the wgmma A fragment, with no store to
  shared memory and no layout conversion;
* the fragment's K order is free (a GEMM sums over K): a thread's 16 consecutive code
  bytes of a row give its values for all the tile's 8-channel column groups, and the token
  operand is laid out in the same channel order beforehand (``to_fragment_order``, one
  XLA gather of the small [T, K] activations);
* one 32-bit word of 8 codes becomes four FP16 pairs in 23 instructions (``WORD_PTX``):
  two byte permutes (the magnitude from an 8-entry table, the sign bits), a merge and the
  product with the block scale. Block scales come from E4M3 in one ``cvt`` per two.

Tokens are wgmma's N (8 to 256 in steps of 8: T is padded to a multiple of 8), so a
decode step wastes no MMA rows. The grid is (N / rows weight tiles, split-K). A program's K
range streams through a pipeline of TMA copies, ``MgpuConfig.pipeline``: "plain" (one
warpgroup decodes its fragments in turn) or "ws" (one compute warpgroup a fragment plus a
copy warpgroup). Partial sums leave as FP32 [splits, N, Tp]; one XLA fusion sums, transposes and scales.

Compiled only (the decode is inline PTX): on CPU the kernel lowers (tests check that)
and ``decode_words_emulated`` replays its integer steps in numpy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # weight rows per program: one wgmma M
TILE_K = 256  # channels per pipeline step (the scales' TMA box needs 16 bytes: 256 / 16)

# FP16 bit patterns' high bytes of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (low bytes 0)
F16_HI = (0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46)
TABLE_LO = sum(b << (8 * i) for i, b in enumerate(F16_HI[:4]))
TABLE_HI = sum(b << (8 * i) for i, b in enumerate(F16_HI[4:]))
# the four FP16 pairs of a word (8 codes, channel q at bits 4q..4q+3): which codes they hold
WORD_PAIRS = ((0, 2), (1, 3), (4, 6), (5, 7))
# prmt selectors moving a pair's sign bits (msb of bytes 0, 1 or 2, 3) to bits 15 and 31
SIGN_SEL_LOW, SIGN_SEL_HIGH = 0x9484, 0xB4A4

# $0..$3: the pairs WORD_PAIRS of word $4, times the scale pair $5 (FP16x2, both halves equal);
# $6, $7 the magnitude table, $8 = 0x7070 (selects the magnitudes of nibbles 1, 3), $9 = 0
WORD_PTX = """{
.reg .b32 w4, sel, mag, sg, msk, sgsel0, sgsel1;
mov.b32 msk, 0x80008000;
mov.b32 sgsel0, 0x9484;
mov.b32 sgsel1, 0xB4A4;
shl.b32 w4, $4, 4;
and.b32 sel, w4, $8;
prmt.b32 mag, $6, $7, sel;
prmt.b32 sg, w4, $9, sgsel0;
lop3.b32 mag, mag, sg, msk, 0xF8;
mul.rn.f16x2 $0, mag, $5;
and.b32 sel, $4, $8;
prmt.b32 mag, $6, $7, sel;
prmt.b32 sg, $4, $9, sgsel0;
lop3.b32 mag, mag, sg, msk, 0xF8;
mul.rn.f16x2 $1, mag, $5;
shr.b32 sel, w4, 16;
and.b32 sel, sel, $8;
prmt.b32 mag, $6, $7, sel;
prmt.b32 sg, w4, $9, sgsel1;
lop3.b32 mag, mag, sg, msk, 0xF8;
mul.rn.f16x2 $2, mag, $5;
shr.b32 sel, $4, 16;
and.b32 sel, sel, $8;
prmt.b32 mag, $6, $7, sel;
prmt.b32 sg, $4, $9, sgsel1;
lop3.b32 mag, mag, sg, msk, 0xF8;
mul.rn.f16x2 $3, mag, $5;
}"""

# $0..$3: E4M3 scale bytes 0..3 of $4 as FP16x2 pairs (s, s)
SCALE_PTX = """{
.reg .b16 lo, hi;
.reg .b32 p0, p1;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p0, lo;
cvt.rn.f16x2.e4m3x2 p1, hi;
prmt.b32 $0, p0, p0, 0x1010;
prmt.b32 $1, p0, p0, 0x3232;
prmt.b32 $2, p1, p1, 0x1010;
prmt.b32 $3, p1, p1, 0x3232;
}"""


PIPELINES = ("plain", "ws")
WS_MAX_FRAGS = 2  # compute warpgroups of the "ws" pipeline measured to run (run 15)


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles of the Mosaic GPU decode GEMM.

    split_k:  programs sharing a weight tile's K (FP32 partials summed after);
    stages:   TMA pipeline steps in flight per program;
    frags:    64-row weight fragments per program. They share the token tile, so more of
              them cut its shared-memory traffic per weight byte (at T=16 with one fragment
              it is as large as the weight's);
    chunks:   TILE_K chunks per pipeline step (fewer, larger steps);
    pipeline: "plain": one warpgroup decodes its fragments in turn (``plgpu.emit_pipeline``);
              "ws": one compute warpgroup per fragment and a copy warpgroup
              (``plgpu.emit_pipeline_warp_specialized``, warpgroup lowering semantics).

    Each fragment's MMA is waited for before the next decode: an MMA in flight reads its
    register operand, and the compiler may give those registers to the next decode (seen on
    the H200: overlapping configs returned wrong sums at random)."""

    split_k: int = 1
    stages: int = 2
    frags: int = 1
    chunks: int = 1
    pipeline: str = "plain"

    def __post_init__(self):
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline={self.pipeline!r}: expected one of {PIPELINES}")
        for f in ("split_k", "stages", "frags", "chunks"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 1):
                raise ValueError(f"{f}={getattr(self, f)!r}: expected a positive int")
        if self.pipeline == "ws" and self.frags > WS_MAX_FRAGS:
            # run 15: 4 compute warpgroups (split 2, 8 K steps a program) hung the H200
            raise ValueError(f"frags={self.frags}: the warp-specialized pipeline hung the H200 with more than "
                             f"{WS_MAX_FRAGS} compute warpgroups; use pipeline='plain'")

    @property
    def rows(self) -> int:
        return ROWS * self.frags

    @property
    def step_k(self) -> int:
        return TILE_K * self.chunks


def mgpu_config(t: int, n: int, k: int, num_sms: int = 132) -> MgpuConfig:
    """Split K while each program keeps two or more steps and the programs stay within about
    seven per SM, or while they do not fill the SMs once (run 14, T=16: 4096 x 14336 best
    at split 4, 2048 x 6144 at 4, 2048 x 768 at 8)."""
    cfg = MgpuConfig()
    tiles, steps, split = n // cfg.rows, k // cfg.step_k, 1
    while steps % (2 * split) == 0 and (
            (steps // (2 * split) >= 2 and tiles * 2 * split <= 7 * num_sms) or tiles * 2 * split <= num_sms):
        split *= 2
    return dataclasses.replace(cfg, split_k=split)


def check_shapes(t: int, n: int, k: int):
    if k % TILE_K:
        raise ValueError(f"K={k}: the Mosaic GPU decode GEMM needs K divisible by {TILE_K}")
    if n % ROWS:
        raise ValueError(f"N={n}: the Mosaic GPU decode GEMM needs N divisible by {ROWS}")
    if not 1 <= t <= 256:
        raise ValueError(f"T={t}: the Mosaic GPU decode GEMM takes 1 to 256 tokens (wgmma N)")


# ----------------------------------------------------------------------------- the K order


def fragment_channel_order(tile_k: int = TILE_K) -> np.ndarray:
    """perm [tile_k]: fragment column L of a K tile holds physical channel perm[L].

    Thread c of a row's four (lane % 4) decodes the row's words [c W, (c + 1) W), W =
    tile_k / 32; word u's pair t (``WORD_PAIRS``) is its register for column group
    j = 4 u + t, i.e. columns 8 j + 2 c + {0, 1} (the wgmma A fragment: a thread holds
    columns 2 c, 2 c + 1 of each group of 8)."""
    w = tile_k // 32
    perm = np.empty(tile_k, np.int64)
    for c in range(4):
        for u in range(w):
            for t, pair in enumerate(WORD_PAIRS):
                for v, q in enumerate(pair):
                    perm[8 * (4 * u + t) + 2 * c + v] = 8 * (c * w + u) + q
    return perm


def to_fragment_order(a, tile_k: int = TILE_K):
    """Token operand [T, K] -> the same values with each K tile in ``fragment_channel_order``."""
    t, k = a.shape
    perm = jnp.asarray(fragment_channel_order(tile_k))
    return a.reshape(t, k // tile_k, tile_k)[:, :, perm].reshape(t, k)


# ----------------------------------------------------------------------------- numpy replay


def _prmt(a, b, sel):
    pool = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint32)
    for i in range(4):
        s = (sel >> np.uint32(4 * i)) & np.uint32(15)
        byte = ((pool >> ((s & np.uint32(7)).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint32)
        byte = np.where(s & np.uint32(8), np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0)), byte)
        out |= byte << np.uint32(8 * i)
    return out


def decode_words_emulated(words):
    """``WORD_PTX``'s integer steps in numpy, without the scale product: uint32 words [...]
    -> their four FP16x2 pairs [..., 4] as uint32 (``WORD_PAIRS`` order)."""
    w = np.asarray(words, np.uint32)
    w4 = w << np.uint32(4)
    lo, hi, zero = np.uint32(TABLE_LO), np.uint32(TABLE_HI), np.zeros_like(w)
    out = []
    for src, shift, ssel in ((w4, 0, SIGN_SEL_LOW), (w, 0, SIGN_SEL_LOW), (w4, 16, SIGN_SEL_HIGH), (w, 16, SIGN_SEL_HIGH)):
        sel = (src >> np.uint32(shift)) & np.uint32(0x7070)
        mag = _prmt(np.full_like(w, lo), np.full_like(w, hi), sel)
        sg = _prmt(src, zero, np.full_like(w, ssel))
        out.append(mag | (sg & np.uint32(0x80008000)))
    return np.stack(out, axis=-1)


# ----------------------------------------------------------------------------- the kernel


def _decode_fragment(tile_k):
    """inline_mgpu: codes [ROWS, tile_k / 8] (int32 words) and scale bytes [ROWS, tile_k / 16]
    in shared memory -> the [ROWS, tile_k] FP16 wgmma A fragment of their block values."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector

    w_per = tile_k // 32  # words per row per thread

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((ROWS, tile_k), jnp.float16, layout=plgpu.Layout.WGMMA),
    )
    def decode(ctx, codes_ref, scales_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        c32 = lambda v: arith.constant(i32, v)
        tid = arith.remui(mu.thread_idx(), c32(128))
        lane = arith.andi(tid, c32(31))
        warp = arith.shrui(tid, c32(5))
        col = arith.andi(lane, c32(3))
        row0 = arith.addi(arith.muli(warp, c32(16)), arith.shrui(lane, c32(2)))
        codes_ptr, scales_ptr = mu.memref_ptr(codes_ref), mu.memref_ptr(scales_ref)
        (code_stride, _), _ = ir.MemRefType(codes_ref.type).get_strides_and_offset()
        (scale_stride, _), _ = ir.MemRefType(scales_ref.type).get_strides_and_offset()
        table = (c32(TABLE_LO - (1 << 32) if TABLE_LO >= 1 << 31 else TABLE_LO), c32(TABLE_HI), c32(0x7070), c32(0))
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((ROWS, tile_k)), dtype=object)
        for i in range(2):  # rows row0 and row0 + 8
            row = arith.addi(row0, c32(8 * i))
            # the thread's words: row * stride + col * w_per, in 16-byte loads
            word0 = arith.addi(arith.muli(row, c32(code_stride)), arith.muli(col, c32(w_per)))
            words = []
            for v in range(w_per // 4):
                ptr = mu.getelementptr(codes_ptr, [arith.extui(i64, arith.addi(word0, c32(4 * v)))], i32)
                vec = llvm.load(ir.VectorType.get((4,), i32), ptr, alignment=16)
                words += [vector.extract(vec, dynamic_position=[], static_position=[e]) for e in range(4)]
            # the thread's scale bytes: blocks [col * w_per / 2, ...) of 16 channels, one 32-bit load per 4
            sbyte0 = arith.addi(arith.muli(row, c32(scale_stride)), arith.muli(col, c32(w_per // 2)))
            scales = []
            for v in range(w_per // 8):
                ptr = mu.getelementptr(scales_ptr, [arith.extui(i64, arith.addi(sbyte0, c32(4 * v)))], ir.IntegerType.get_signless(8))
                sw = llvm.load(i32, ptr, alignment=4)
                scales += list(mu.inline_ptx(SCALE_PTX, sw, result_types=[i32] * 4))
            for u, word in enumerate(words):
                pairs = mu.inline_ptx(WORD_PTX, word, scales[u // 2], *table, result_types=[i32] * 4)
                for t, p in enumerate(pairs):
                    j = 4 * u + t
                    regs[0, j, 0, 0, i, 0, 0, 0, 0] = mu.bitcast(p, f16x2)
        assert all(r is not None for r in regs.flat)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return decode


def _in_specs(tp, cfg):
    x_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    return [
        plgpu.BlockSpec((tp, cfg.step_k), lambda kt: (0, kt), transforms=x_transforms),
        plgpu.BlockSpec((cfg.rows, cfg.step_k // 8), lambda kt: (0, kt)),
        plgpu.BlockSpec((cfg.rows, cfg.step_k // 16), lambda kt: (0, kt)),
    ]


def _fragment_mmas(decode, acc, x_smem, c_smem, s_smem, rows, chunks):
    """acc += the fragment ``rows`` of the step's weight tile @ the token tile, chunk by chunk."""
    for ch in range(chunks):
        a = decode(c_smem.at[rows, pl.ds(ch * (TILE_K // 8), TILE_K // 8)],
                   s_smem.at[rows, pl.ds(ch * (TILE_K // 16), TILE_K // 16)])
        plgpu.wgmma(acc, a, x_smem.at[:, pl.ds(ch * TILE_K, TILE_K)].transpose((1, 0)))
        plgpu.wgmma_wait(0)  # the fragment's registers are free again


@functools.lru_cache(maxsize=None)
def _build(tp: int, n: int, k: int, cfg: MgpuConfig):
    if n % cfg.rows or k % (cfg.step_k * cfg.split_k):
        raise ValueError(f"N={n}, K={k}: the config {cfg} needs N divisible by {cfg.rows} and K by {cfg.step_k * cfg.split_k}")
    split, ks, rows = cfg.split_k, k // cfg.split_k, cfg.rows
    steps = ks // cfg.step_k
    stages = min(cfg.stages, steps)
    if cfg.pipeline == "ws" and stages < 2:
        # one step, one slot: the probe configs that hung the H200 had it (not proven the cause)
        raise ValueError(f"{cfg}: the warp-specialized pipeline needs two or more K steps per program (got {steps})")
    decode = _decode_fragment(TILE_K)

    def gmem_views(x_gmem, wc_gmem, ws_gmem, jn, sk):
        n_sl = pl.ds(jn * rows, rows)
        return (x_gmem.at[:, pl.ds(sk * ks, ks)], wc_gmem.at[n_sl, pl.ds(sk * (ks // 8), ks // 8)],
                ws_gmem.at[n_sl, pl.ds(sk * (ks // 16), ks // 16)])

    def plain(x_gmem, wc_gmem, ws_gmem, out_gmem, out_smem):
        jn, sk = jax.lax.axis_index("n"), jax.lax.axis_index("s")

        def scope(*accs):
            def step(_, x_smem, c_smem, s_smem):
                for f, acc in enumerate(accs):
                    _fragment_mmas(decode, acc, x_smem, c_smem, s_smem, pl.ds(f * ROWS, ROWS), cfg.chunks)

            plgpu.emit_pipeline(step, grid=(steps,), in_specs=_in_specs(tp, cfg), max_concurrent_steps=stages)(
                *gmem_views(x_gmem, wc_gmem, ws_gmem, jn, sk))
            for f, acc in enumerate(accs):
                out_smem[pl.ds(f * ROWS, ROWS), :] = acc[...]

        pl.run_scoped(scope, *[plgpu.ACC((ROWS, tp), jnp.float32) for _ in range(cfg.frags)])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[sk, pl.ds(jn * rows, rows)])
        plgpu.wait_smem_to_gmem(0)

    def pipeline_ws(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=40, in_specs=_in_specs(tp, cfg), wg_axis="wg",
            num_compute_wgs=cfg.frags, max_concurrent_steps=stages, compute_context=context)

    def ws(x_gmem, wc_gmem, ws_gmem, out_gmem, out_smem):
        jn, sk = jax.lax.axis_index("n"), jax.lax.axis_index("s")
        gmem = gmem_views(x_gmem, wc_gmem, ws_gmem, jn, sk)
        ignore = lambda *_, **__: None

        @functools.partial(pl.run_scoped, allocs=pipeline_ws(ignore, ignore).get_allocations(*gmem), collective_axes="wg")
        def _scope(allocs):
            wg = jax.lax.axis_index("wg")

            def step(_, x_smem, c_smem, s_smem, acc):
                _fragment_mmas(decode, acc, x_smem, c_smem, s_smem, pl.ds(wg * ROWS, ROWS), cfg.chunks)
                return acc

            def context(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((ROWS, tp), jnp.float32))
                def _acc(acc):
                    run(acc)
                    out_smem[wg] = acc[...]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[sk, pl.ds(jn * rows + wg * ROWS, ROWS)])

            pipeline_ws(step, context)(*gmem, allocations=allocs)
        plgpu.wait_smem_to_gmem(0)

    out_type = jax.ShapeDtypeStruct((split, n, tp), jnp.float32)
    if cfg.pipeline == "plain":
        return plgpu.kernel(plain, out_type=out_type, grid=(n // rows, split), grid_names=("n", "s"),
                            scratch_types=[plgpu.SMEM((rows, tp), jnp.float32)])
    return plgpu.kernel(ws, out_type=out_type, grid=(n // rows, split), grid_names=("n", "s"),
                        num_threads=cfg.frags + 1, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        scratch_types=[plgpu.SMEM((cfg.frags, ROWS, tp), jnp.float32)])


def decode_gemm_partials(a16, words, scale_bits, cfg: MgpuConfig):
    """The raw kernel: a16 [Tp, K] FP16 in fragment order (Tp a multiple of 8), code words
    [N, K / 8] (int32), scale bits [N, K / 16] (uint8) -> FP32 partials [split, N, Tp]."""
    tp, k = a16.shape
    n = words.shape[0]
    return _build(tp, n, k, cfg)(a16, words, scale_bits)


def eligible(t: int, ns, k: int, *, mode="w4a4", rac_ratio=0.0, rac_sum="fp16") -> bool:
    """Whether ``nvfp4_matmul``'s path="mgpu" takes this product (else it runs "fused"): W4A4,
    RAC summed in FP16 (or none), N a multiple of 64, K of 256, at most 256 tokens."""
    return (mode == "w4a4" and (rac_ratio == 0 or rac_sum == "fp16") and 1 <= t <= 256 and k % TILE_K == 0
            and all(n % ROWS == 0 for n in ns))


def nvfp4_product(xq, rq, w, *, out_dtype=jnp.bfloat16, interpret=False, config: MgpuConfig | None = None):
    """gw * gx * (A @ Wq.T) for quantized activations ``xq`` (and residual ``rq``), A their FP16
    token operand (``rac.token_operand``)."""
    from pallas_kernels import rac

    a = rac.token_operand(xq, rq)
    return fragment_product(fragment_operand(a), w, a.shape[0], gx=xq.global_scale, out_dtype=out_dtype, interpret=interpret,
                            config=config)


def fragment_product(a16, w, t: int, *, gx, out_dtype=jnp.bfloat16, interpret=False, config: MgpuConfig | None = None):
    """``fragment_gemm``; with ``interpret`` (CPU: the kernel's PTX cannot run there) the same
    product by an XLA dot of the same fragment-ordered operand and the weight's FP16 block
    values put in that channel order (a wrong order changes the sum)."""
    from quads_jax import nvfp4

    if not interpret:
        return fragment_gemm(a16, w, t, gx=gx, config=config, out_dtype=out_dtype)
    wv = to_fragment_order(nvfp4.block_values(w, jnp.float16))
    out = jax.lax.dot_general(a16[:t], wv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * gx * jnp.reshape(w.global_scale, ())).astype(out_dtype)


def nvfp4_decode_gemm(a, w, *, gx=None, config: MgpuConfig | None = None, out_dtype=jnp.bfloat16):
    """a [T, K] FP16 token operand (NVFP4 block values, or RAC's compensated values) @ Wq.T for
    an NVFP4Tensor weight [N, K]; ``gx`` the activations' global scale (scalar or [T, 1]).
    Returns gw * gx * (a @ Wq.T) [T, N] in ``out_dtype``."""
    if a.dtype != jnp.float16:
        raise ValueError(f"a: expected the float16 token operand, got {a.dtype}")
    return fragment_gemm(fragment_operand(a), w, a.shape[0], gx=gx, config=config, out_dtype=out_dtype)


def padded_tokens(t: int) -> int:
    """The token operand's rows: T padded to wgmma's N granularity (8)."""
    return -(-t // 8) * 8


def fragment_operand(a):
    """Token operand [T, K] -> the kernel's: rows padded to ``padded_tokens(T)`` with zeros,
    channels in ``to_fragment_order``."""
    t = a.shape[0]
    return to_fragment_order(jnp.pad(a, ((0, padded_tokens(t) - t), (0, 0))))


def fragment_gemm(a16, w, t: int, *, gx=None, config: MgpuConfig | None = None, out_dtype=jnp.bfloat16):
    """``nvfp4_decode_gemm`` for a token operand already in fragment order with
    ``padded_tokens(t)`` rows (``to_fragment_order``, or the activation quantizer's
    ``quantize_operand(order=("fragment", TILE_K))``, which writes it so): [t, N]."""
    from quads_jax import nvfp4

    tp, k = a16.shape
    n = w.shape[0]
    check_shapes(t, n, k)
    if a16.dtype != jnp.float16 or tp != padded_tokens(t):
        raise ValueError(f"a16: expected the float16 operand of {padded_tokens(t)} rows, got {a16.dtype}{a16.shape}")
    cfg = config or mgpu_config(t, n, k)
    words = jax.lax.bitcast_convert_type(nvfp4.code_words(w.codes), jnp.int32)
    sbits = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
    parts = decode_gemm_partials(a16, words, sbits, cfg)
    out = parts.sum(0).T[:t] * jnp.reshape(w.global_scale, ())
    if gx is not None:
        out = out * gx
    return out.astype(out_dtype)
