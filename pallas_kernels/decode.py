"""NVFP4 -> BF16 block values (E2M1 code times its E4M3 block scale; exact in BF16): the
operand decode of the prefill GEMM path (``GemmConfig.path="dequant"``).

    v = nvfp4_block_values(t)                     # [..., K] BF16, global scale not applied
    v = nvfp4_block_values(t, backend="xla")      # nvfp4.block_values, the reference

A memory-bound elementwise kernel: each program reads a [block_rows, block_bytes] tile of
packed codes and its scale bytes, decodes it in registers (the GEMM's ``decode_tile``, so
the same bits) and writes the low and high nibbles to the even and odd output columns with
two strided stores. XLA's fusion of the same decode ran at about a third of the copy
bandwidth on the H200 (61 us for a 4096 x 4096 operand, run 9): it unpacks and
interleaves through an intermediate. Tensors quantized along a non-last axis take the XLA
path (the kernel streams rows of the quantized axis).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from quads_jax import nvfp4
from pallas_kernels.config import interpret_mode, resolve_backend
from pallas_kernels.tile_math import decode_tile, pad_axis, store_even_odd


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_rows: int = 32
    block_bytes: int = 128  # packed bytes per program row (2x as many values)
    num_warps: int = 4
    decode: str = "prmt"  # as GemmConfig.decode: "bits" | "prmt" (interpret mode runs "bits")

    def __post_init__(self):
        for f in ("block_rows", "block_bytes"):
            v = getattr(self, f)
            if v < 8 or v & (v - 1):
                raise ValueError(f"DecodeConfig.{f}={v}: expected a power of two >= 8")
        if self.decode not in ("bits", "prmt"):
            raise ValueError(f"DecodeConfig.decode={self.decode!r}: expected 'bits' or 'prmt'")


def _decode_kernel(c_ref, s_ref, o_ref, *, rows, cfg, interpret):
    bm, bb = cfg.block_rows, cfg.block_bytes
    i, j = pl.program_id(0), pl.program_id(1)
    row_sl = pl.ds(i * bm, bm)
    row_ok = (i * bm + jnp.arange(bm) < rows)[:, None]
    c = plgpu.load(c_ref.at[row_sl, pl.ds(j * bb, bb)], mask=row_ok, other=0)
    s = plgpu.load(s_ref.at[row_sl, pl.ds(j * (bb // 8), bb // 8)], mask=row_ok, other=0)
    lo, hi = decode_tile(c, s, bm, 2 * bb, cfg.decode, interpret)
    store_even_odd(o_ref, row_sl, 2 * j * bb, 2 * bb, row_ok, lo, hi, interpret)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _decode_call(codes, scale_bits, *, cfg, interpret):
    r, kp = codes.shape
    if interpret:  # interpret mode clamps out-of-range slices instead of masking them
        r_pad = pl.cdiv(r, cfg.block_rows) * cfg.block_rows
        codes, scale_bits = pad_axis(codes, 0, r_pad), pad_axis(scale_bits, 0, r_pad)
    out = pl.pallas_call(
        functools.partial(_decode_kernel, rows=r, cfg=cfg, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((codes.shape[0], 2 * kp), jnp.bfloat16),
        grid=(pl.cdiv(r, cfg.block_rows), kp // cfg.block_bytes),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="nvfp4_block_values",
    )(codes, scale_bits)
    return out[:r]


def nvfp4_block_values_xla(t: nvfp4.NVFP4Tensor, *, dtype=jnp.bfloat16):
    """The XLA reference: ``nvfp4.block_values``."""
    return nvfp4.block_values(t, dtype)


def nvfp4_block_values(t: nvfp4.NVFP4Tensor, *, dtype=jnp.bfloat16, backend=None, config: DecodeConfig | None = None):
    """``code * block scale`` of every element of ``t`` (shape ``t.shape``), without the
    global scale; bit-identical to ``nvfp4.block_values``."""
    if not isinstance(t, nvfp4.NVFP4Tensor):
        raise ValueError(f"t: expected an NVFP4Tensor, got {type(t).__name__}")
    if resolve_backend(backend) == "xla" or t.axis != t.ndim - 1:
        return nvfp4_block_values_xla(t, dtype=dtype)
    codes = nvfp4.code_bytes(t.codes)  # word codes (prepared weights) are read as bytes here
    kp = codes.shape[-1]
    cfg = config or DecodeConfig(block_bytes=next(b for b in (128, 64, 32, 16, 8) if kp % b == 0))
    if kp % cfg.block_bytes:
        raise ValueError(f"config: block_bytes={cfg.block_bytes} does not divide the {kp} packed bytes per row")
    codes = codes.reshape(-1, kp)
    bits = jax.lax.bitcast_convert_type(t.scales, jnp.uint8).reshape(-1, kp // 8)
    v = _decode_call(codes, bits, cfg=cfg, interpret=interpret_mode())
    return v.reshape(t.shape).astype(dtype)
