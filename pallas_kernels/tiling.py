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
    # weight-tile decode: "words" (codes as uint32 words of 8, four PTX byte-permute programs a
    # word, each giving one MMA operand register: four K parts; K tiles of >= 64 channels; compiled kernels
    # use PTX, interpret mode the bit decode) or "bits" (bytes, BF16 bit patterns, one BF16
    # product by the scale: any K tile); both exact, so the same numbers
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

    def __post_init__(self):
        if self.decode not in DECODES:
            raise ValueError(f"GemmConfig.decode={self.decode!r}: expected one of {DECODES}")
        if self.path not in PATHS:
            raise ValueError(f"GemmConfig.path={self.path!r}: expected one of {PATHS}")
        if self.decode == "words" and self.block_k < 64:
            raise ValueError(f"GemmConfig.block_k={self.block_k}: decode='words' splits a K tile in 4 MMAs of block_k / 4 >= 16 channels")
        for f in ("block_m", "block_n", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{f}={v}: expected a power of two >= 16")
        if self.block_k < 32:
            raise ValueError(f"GemmConfig.block_k={self.block_k}: expected >= 32 (two 16-channel blocks)")


DECODES = ("bits", "words")
PATHS = ("fused", "dequant")
PREFILL_DEQUANT_MIN_T = 512  # token count from which the dense GEMM takes path="dequant"


def gemm_config(t: int, n: int, k: int, programs_per_row_tile: int = 1, num_sms: int | None = None) -> GemmConfig:
    """Heuristic tiles. Below PREFILL_DEQUANT_MIN_T tokens (decode, and the RL rollout's batches
    of 64 to 512) the kernel streams the weight: the weight is the MMA's M operand (swap_ab),
    decoded from code words in 128-wide N tiles, K tiles of 128 (256 for large weights that
    still fill 1.5 waves), and split-K until about 1.5 waves of programs (64-wide N tiles
    where K is too short for that to fill half the chip). The grouped GEMM
    (``programs_per_row_tile`` experts, T their mean rows) takes M tiles of about twice the
    mean, so that most experts' rows fit one tile and each weight tile is read once. From
    PREFILL_DEQUANT_MIN_T tokens the dense GEMM decodes both operands once and runs the BF16
    dot (square MMA tiles for the grouped kernel). Each choice is the fastest of the kernel
    registry's tile sweeps (the grouped and dense regimes; benchmarks/results)."""
    if t >= PREFILL_DEQUANT_MIN_T:
        bk = 64 if k % 64 == 0 else 32
        path = "dequant" if programs_per_row_tile == 1 else "fused"
        return GemmConfig(block_m=128, block_n=128, block_k=bk, num_warps=8, num_stages=3, path=path)
    grouped = programs_per_row_tile > 1
    sms = num_sms or device_sms()
    rows = 2 * t if grouped else t  # an expert's rows vary around their mean: its tile covers about twice
    bm = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    decode = "words" if bk >= 128 else "bits"  # the word decode, measured with K tiles of 128 and 256
    bn = 64 if n < 128 else 128
    warps, stages = 4, 4
    if grouped and bm == 16 and n >= 512:
        # decode-size expert items (a few rows each): the registry's fastest tiles, 8 warps and
        # 4 stages for long K (the bench model's gate/up), 4 warps and 2 stages for at most
        # four K tiles (its down projection)
        warps, stages = (8, 4) if k // bk > 4 else (4, 2)
    tiles = -(-t // bm) * -(-n // bn) * programs_per_row_tile
    if not grouped:
        if k % 256 == 0 and decode == "words" and tiles * (k // 512) >= 1.5 * sms:
            bk = 256
        stages = 3
    def split_for(tiles):  # each program keeps >= 2 K tiles
        split = 1
        while tiles * split < 1.5 * sms and (k // bk) % (split * 2) == 0 and k // (bk * split * 2) >= 2:
            split *= 2
        return split

    split = split_for(tiles)
    if not grouped and bn == 128 and tiles * split < 0.75 * sms:
        # K too short to split further and the chip under half full: 64-wide N tiles give
        # twice the programs (the registry's fastest at the bench model's q/k/v at T64)
        bn = 64
        split = split_for(-(-t // bm) * -(-n // bn))
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages, swap_ab=True,
                      decode=decode, path="fused")
