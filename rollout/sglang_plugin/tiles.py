"""Tiles of the plugin's Triton W4A4 + RAC GEMM: a frozen config and the heuristic that picks
it. The plugin's own (it imports nothing from JAX or the rest of the project).

Decode sizes (T < 256) stream the weight in block_n x block_k tiles with the weight as the
MMA's M operand (``swap_ab``: Hopper's wgmma wants M >= 64, and a few tokens fill N), and
split K until about 1.5 waves of programs fill the device. Prefill sizes use square 128 x 128
tiles; from 512 tokens the layer decodes the weight once and runs the dense BF16 product.
"""

from __future__ import annotations

import dataclasses

PREFILL_DEQUANT_MIN_T = 512


@dataclasses.dataclass(frozen=True)
class TritonTiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    dequant: bool = False  # decode the weight once and run the dense BF16 product instead

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TritonTiles.{f}={v}: expected a power of two >= 16")
        if self.block_k < 32:
            raise ValueError(f"TritonTiles.block_k={self.block_k}: expected >= 32 (two 16-channel blocks)")


def device_sms(default: int = 132) -> int:
    """The multiprocessor count of the current CUDA device (``default`` without one)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    except Exception:  # noqa: BLE001 - no torch or no CUDA: plan for the default
        pass
    return default


def pick_tiles(t: int, n: int, k: int, num_sms: int | None = None) -> TritonTiles:
    """Tiles for T tokens times an [N, K] weight."""
    if t >= 256:
        return TritonTiles(128, 128, 64 if k % 64 == 0 else 32, num_warps=8, dequant=t >= PREFILL_DEQUANT_MIN_T)
    sms = num_sms or device_sms()
    bm = 16 if t <= 16 else (32 if t <= 32 else 64)
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    bn = 64 if n < 128 or t <= 16 else 128
    tiles = -(-t // bm) * -(-n // bn)
    split = 1
    while tiles * split < 1.5 * sms and (k // bk) % (split * 2) == 0 and k // (bk * split * 2) >= 2:
        split *= 2
    return TritonTiles(bm, bn, bk, split_k=split, num_warps=4, num_stages=4, swap_ab=True)
