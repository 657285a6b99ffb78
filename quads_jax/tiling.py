"""GEMM tile configurations and the heuristic that picks them, shared by the Pallas kernels
(``pallas_kernels.nvfp4_matmul``) and the SGLang plugin's Triton kernel. Plain Python: the
plugin imports it where JAX is not installed."""

from __future__ import annotations

import dataclasses
import os

NUM_SMS = 132  # H200


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Pallas only (the Triton kernel always decodes from bits with per-column scale pointers):
    # weight-tile decode: "arith" (float32 select chain, then BF16) or "bits" (BF16 bit
    # patterns, one BF16 product by the scale) or "prmt" (four code bytes at a time through
    # PTX byte permutes, pallas_kernels.tile_math; compiled kernels only, interpret mode runs
    # "bits"), or "words" (codes as uint32 words of 8, four PTX programs a word, eight K parts:
    # no uint8 repacking; compiled kernels use PTX, interpret mode the bit decode); all exact,
    # so the same numbers
    decode: str = "bits"
    # block scales: "reshape" (load [rows, bk/16], broadcast + reshape in registers) or
    # "gather" (load each scale byte once per channel pair: [rows, bk/2], no reshape)
    scale_load: str = "reshape"
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
        if self.scale_load not in SCALE_LOADS:
            raise ValueError(f"GemmConfig.scale_load={self.scale_load!r}: expected one of {SCALE_LOADS}")
        if self.decode == "words" and self.scale_load != "reshape":
            raise ValueError("GemmConfig.decode='words' loads one scale per 16 channels: it needs scale_load='reshape'")
        if self.decode == "words" and self.block_k < 128:
            raise ValueError(f"GemmConfig.block_k={self.block_k}: decode='words' splits a K tile in 8 MMAs of block_k / 8 >= 16 channels")
        for f in ("block_m", "block_n", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{f}={v}: expected a power of two >= 16")
        if self.block_k < 32:
            raise ValueError(f"GemmConfig.block_k={self.block_k}: expected >= 32 (two 16-channel blocks)")


DECODES = ("arith", "bits", "prmt", "words")
SCALE_LOADS = ("reshape", "gather")
PATHS = ("fused", "dequant")
ACT_LOADS = ("codes", "values")
PREFILL_DEQUANT_MIN_T = 512  # token count from which the dense GEMM takes path="dequant"
# the decode-size GEMMs' weight-tile decode: "prmt" (measured best on the H200, run 9-11) or
# "words" (fewer instructions in the offline SASS, run 11; not measured on the device yet).
# With "words" the rollout engine stores its NVFP4 weights as code words. A benchmark switch:
# QUADS_GEMM_DECODE=words. Read at call time.
DEFAULT_DECODE = os.environ.get("QUADS_GEMM_DECODE", "prmt")
if DEFAULT_DECODE not in ("prmt", "words"):
    raise ValueError(f"QUADS_GEMM_DECODE={DEFAULT_DECODE!r}: expected 'prmt' or 'words'")


def gemm_config(t: int, n: int, k: int, programs_per_row_tile: int = 1, rac: bool = False) -> GemmConfig:
    """Heuristic tiles: decode (few tokens) streams the weight in 128 x 128 tiles with
    split-K until ~2 waves of programs, with the weight as the MMA's M operand (swap_ab);
    prefill uses square MMA tiles, and from PREFILL_DEQUANT_MIN_T tokens the dense GEMM
    decodes once and runs the BF16 dot. Measured on the H200, GEMM only, 4096 x 14336
    (benchmarks/results/2026-12-03-h200-run8 and -run9): at T=16 the arith decode at 64 x 256
    took 156 us, the bits decode at 128 x 128 split 4 84 us, swapped 81 us, swapped with
    block_n 64 66-75 us, with the prmt decode and BF16 activation values 64 us (rho 0.5:
    76 us); at T=64 swapping took 128 x 128 from 271 to 127 us, prmt + values 84 us.

    ``rac``: the Pallas GEMM's MMA then takes each token's activation and residual rows (2t
    operand rows, one FP32 accumulator of [block_n, 2 block_m]); above 16 tokens the tile
    is 64 wide so that the accumulator stays at 64 registers a thread (offline SASS, T=64
    rho 0.5: 128-wide tiles spill ~300 values a K-tile, 64-wide none)."""
    if t >= 256:
        bk = 64 if k % 64 == 0 else 32
        path = "dequant" if t >= PREFILL_DEQUANT_MIN_T and programs_per_row_tile == 1 else "fused"
        return GemmConfig(block_m=128, block_n=128, block_k=bk, num_warps=8, num_stages=3, path=path)
    bm = 16 if t <= 16 else (32 if t <= 32 else 64)
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    bn = 128 if n >= 128 and t > 16 and not rac else 64
    tiles = -(-t // bm) * -(-n // bn) * programs_per_row_tile
    split = 1
    while tiles * split < 2 * NUM_SMS and (k // bk) % (split * 2) == 0 and k // (bk * split * 2) >= 2:
        split *= 2
    # grouped (programs_per_row_tile > 1): activation codes, 4x less to read than BF16 values
    # for the N / block_n programs of each row tile (run 10, 64 experts, 2048 x 768, 64 tokens:
    # 125 us against 137)
    decode = DEFAULT_DECODE if bk >= 128 or DEFAULT_DECODE != "words" else "prmt"
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=4, swap_ab=True,
                      decode=decode, act_load="values" if programs_per_row_tile == 1 else "codes")
