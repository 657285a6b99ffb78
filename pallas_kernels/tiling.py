"""Tiles of the Pallas NVFP4 GEMMs: a frozen ``GemmConfig`` and the ``gemm_config``
heuristic that picks it (the plan, kept apart from the launch). A caller that wants other
tiles passes a ``GemmConfig`` to the op; nothing here reads process state."""

from __future__ import annotations

import dataclasses

import jax


def device_sms(default: int = 132) -> int:
    """Multiprocessors of the first device (``core_count`` on a GPU), ``default`` elsewhere."""
    return int(getattr(jax.devices()[0], "core_count", 0) or default)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Pallas only (the Triton kernel always decodes from bits with per-column scale pointers):
    # weight-tile decode: "bits" (BF16 bit patterns, one BF16 product by the scale) or "prmt" (four code bytes at a time through
    # PTX byte permutes, pallas_kernels.tile_math; compiled kernels only, interpret mode runs
    # "bits"), or "words" (codes as uint32 words of 8, four PTX programs a word, eight K parts:
    # no uint8 repacking; compiled kernels use PTX, interpret mode the bit decode); all exact,
    # so the same numbers
    decode: str = "bits"
    # Pallas only: compute the tile as (W @ A.T).T, so the weight (block_n rows) is the MMA's
    # M operand and the few tokens its N. Hopper's wgmma needs M >= 64 but takes N = 8..256,
    # and can read its M operand from registers, where the weight is decoded; unswapped, a
    # 16-token tile is too small for wgmma and the decoded weight goes through shared memory
    swap_ab: bool = False
    # "fused": one kernel decodes and multiplies tile by tile; "dequant": decode both operands
    # to their BF16 block values once (XLA fuses it, memory-bound) and run the dense BF16 dot
    # (cuBLAS). Same numbers up to accumulation order. The fused kernel decodes every weight
    # tile once per row tile, so at prefill sizes its decode work is T / block_m times the
    # weight, and the dot's MMA pipeline is far ahead; decode sizes move the weight once.
    path: str = "fused"
    # W4A4 activations (and residual) enter the fused kernel as "codes" (packed codes + scale
    # bits, decoded in every program) or "values" (their BF16 block values, exact, decoded once
    # by XLA before the kernel: [T, K] BF16 is small at decode sizes and read from L2)
    act_load: str = "codes"

    def __post_init__(self):
        if self.decode not in DECODES:
            raise ValueError(f"GemmConfig.decode={self.decode!r}: expected one of {DECODES}")
        if self.act_load not in ACT_LOADS:
            raise ValueError(f"GemmConfig.act_load={self.act_load!r}: expected one of {ACT_LOADS}")
        if self.path not in PATHS:
            raise ValueError(f"GemmConfig.path={self.path!r}: expected one of {PATHS}")
        if self.decode == "words" and self.block_k < 128:
            raise ValueError(f"GemmConfig.block_k={self.block_k}: decode='words' splits a K tile in 8 MMAs of block_k / 8 >= 16 channels")
        for f in ("block_m", "block_n", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{f}={v}: expected a power of two >= 16")
        if self.block_k < 32:
            raise ValueError(f"GemmConfig.block_k={self.block_k}: expected >= 32 (two 16-channel blocks)")


DECODES = ("bits", "prmt", "words")
PATHS = ("fused", "dequant")
ACT_LOADS = ("codes", "values")
PREFILL_DEQUANT_MIN_T = 512  # token count from which the dense GEMM takes path="dequant"
# the decode-size GEMMs' weight-tile decode: "words" where the K tile holds >= 128 channels
# (measured best on the H200 in run 12, 4096 x 14336 GEMM only: T=16 35 us against prmt's 48,
# T=64 54 against 76), else "prmt". NVFP4 weights are stored as code words
# (``nvfp4.code_words``), which both read.
DEFAULT_DECODE = "words"


def gemm_config(t: int, n: int, k: int, programs_per_row_tile: int = 1, stacked: bool = False,
                num_sms: int | None = None) -> GemmConfig:
    """Heuristic tiles: decode (few tokens) streams the weight in block_n x 128 tiles with
    split-K until ~2 waves of programs, with the weight as the MMA's M operand (swap_ab);
    prefill uses square MMA tiles, and from PREFILL_DEQUANT_MIN_T tokens the dense GEMM
    decodes once and runs the BF16 dot.

    Measured on the H200, GEMM only, 4096 x 14336 (benchmarks/results/...-run8, -run9,
    -run12): at T=16 the arith decode at 64 x 256 took 156 us, the bits decode at 128 x 128
    split 4 84 us, swapped 81 us, the prmt decode with BF16 activation values at block_n 64
    48 us, the word decode at block_n 128 35 us (64: 36 us); at T=64 prmt 76 us, words 54 us
    at block_n 128 (64: 65 us). The grouped GEMM (64 experts, 2048 x 768, 64 tokens) keeps
    block_n 64 (more programs over the small experts), with words and activation values
    86 us against prmt with activation codes 100 us. Run 13 (benchmarks/results/
    2026-12-04-h200-run13, tile sweep): 256-channel K tiles, 3 stages and split-K to 1.5
    waves for large dense weights (T=16 29.6 us, T=64 50 us).

    ``stacked``: the token operand holds each token's activation and residual rows (RAC with
    ``rac_sum="exact"``; the default FP16 sum needs no extra rows). The prmt decode then
    takes 64-wide tiles above 16 tokens (T=64: 122 us against 204 at 128, which spills); the
    word decode keeps 128 (97 us against 107).

    The decode tiles serve up to PREFILL_DEQUANT_MIN_T tokens (the RL rollout's batches of 64
    to 512): square tiles without split-K leave most SMs idle there (16-48 programs for the
    bench model's weights at T=256; benchmarks/results/2026-12-05-h100-rollout-scale)."""
    if t >= PREFILL_DEQUANT_MIN_T:
        bk = 64 if k % 64 == 0 else 32
        path = "dequant" if programs_per_row_tile == 1 else "fused"
        return GemmConfig(block_m=128, block_n=128, block_k=bk, num_warps=8, num_stages=3, path=path)
    grouped = programs_per_row_tile > 1
    sms = num_sms or device_sms()
    bm = 16 if t <= 16 else (32 if t <= 32 else 64)
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    decode = DEFAULT_DECODE if bk >= 128 or DEFAULT_DECODE != "words" else "prmt"
    if n < 128 or grouped:
        bn = 64
    elif decode == "words":
        bn = 128
    else:
        bn = 128 if t > 16 and not stacked else 64
    tiles = -(-t // bm) * -(-n // bn) * programs_per_row_tile
    stages = 4
    if not grouped:
        # large dense weights: 256-channel K tiles when programs of two of them still fill
        # 1.5 waves; three stages (run 13, T=16: 29.6 us against 34.8 at 128 x 4 stages;
        # T=64 with RAC 45 against 55); stacked rows: 128-channel tiles (256 overflows shared
        # memory), two stages above 16 tokens (71 us against 97)
        if k % 256 == 0 and not stacked and decode == "words" and tiles * (k // 512) >= 1.5 * sms:
            bk = 256
        stages = 2 if stacked and t > 16 else 3
    split = 1
    # split K until 1.5 waves of programs (run 13: split 2 beat 4 at 112 N tiles, T=64 49.5
    # against 53.8 us), each program keeping >= 2 K tiles
    while tiles * split < 1.5 * sms and (k // bk) % (split * 2) == 0 and k // (bk * split * 2) >= 2:
        split *= 2
    # grouped with the byte decodes: activation codes, 4x less to read than BF16 values for
    # the N / block_n programs of each row tile (run 10: 125 us against 137); the word decode
    # reads values (run 12: 86 us against 103 us with codes)
    act_load = "codes" if grouped and decode != "words" else "values"
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=stages, swap_ab=True,
                      decode=decode, act_load=act_load, path="fused")
