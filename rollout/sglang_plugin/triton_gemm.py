"""The W4A4 + RAC GEMM as a Triton kernel, so torch (SGLang) and JAX (jax-triton) run the
same machine code on the GPU.

    out = gw * (gx * (Xq @ Wq.T) + gx / 4 * (Rq @ Wq.T))       (FP32 accumulation)

The operands are packed NVFP4: codes uint8 [rows, K/2] (channel 2j in the low nibble) and
E4M3 block-scale bit patterns uint8 [rows, K/16], for the activations (Xq), the selected
residual (Rq, optional) and the weight (Wq, the ModelOpt ``weight`` / ``weight_scale``),
with per-row activation global scales gx [T] and the weight's ``weight_scale_2`` gw [1].
It is the Pallas kernel's algorithm (``pallas_kernels/gemm.py``): a K-tile splits
into its even and odd channels, each code is decoded to BF16 from its bits and multiplied
by its block scale (exact), and one decoded weight tile feeds both BF16 MMAs. The
activation quantizer is ``numerics.packed_operands`` (torch) or ``quantize_activations_rac``
(JAX); both give the same bits.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before importing this module: the
kernel then runs in Triton's interpreter on CPU tensors (the CPU tests do this; see
``interpreting`` for the one difference). Only the GPU proves it compiles for Hopper.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from rollout.sglang_plugin.tiles import TritonTiles, pick_tiles

RESIDUAL_SCALE_FACTOR = 0.25


def _interpreter_numpy_shim():
    """Triton 3.6's interpreter turns its scalars (1-element arrays) into loop bounds with
    ``int(array)``, which numpy >= 2.5 rejects; use ``.item()`` instead (interpret mode only)."""
    from triton.runtime import interpreter as I

    if getattr(I, "_quads_shim", False):
        return
    original = I._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    I._patch_lang_tensor = patched
    I._quads_shim = True


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton's CPU interpreter. Its BF16 ``tl.dot`` reads the raw 16-bit
    patterns as integers (Triton 3.6), so there the exact block values feed a float32 MMA:
    the same products, FP32 accumulation either way."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if interpreting():
    _interpreter_numpy_shim()


@triton.jit
def _e2m1_f32(c):
    """4-bit codes (int32) -> float32 values from bits: magnitude pattern (m + 252) << 22 for
    m >= 2, m * 0x3F000000 (0 or 0.5) for m in {0, 1}; the sign bit to bit 31."""
    m = c & 7
    bits = tl.where(m < 2, m * 0x3F000000, (m + 252) << 22) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_f32(b):
    """Non-negative E4M3 bit patterns (int32) -> float32."""
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _decode(c_ptrs, s_ptrs, mask, f32: tl.constexpr):
    """A tile of packed codes and the scale of each code's block -> (even, odd) channels as
    MMA operands: BF16 (exact: E2M1 x E4M3 has at most 6 significant bits), or float32."""
    c = tl.load(c_ptrs, mask=mask, other=0).to(tl.int32)
    s = _e4m3_f32(tl.load(s_ptrs, mask=mask, other=0).to(tl.int32))
    lo = _e2m1_f32(c & 15) * s
    hi = _e2m1_f32(c >> 4) * s
    if not f32:
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _pair_dot(a, w, acc, SWAP_AB: tl.constexpr):
    """acc + a @ w.T, or with SWAP_AB acc + w @ a.T (the transposed tile)."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def w4a4_rac_gemm_kernel(
    xc_ptr, xs_ptr, gx_ptr, rc_ptr, rs_ptr, wc_ptr, ws_ptr, gw_ptr, T, N, out_ptr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_RAC: tl.constexpr, F32_OPERANDS: tl.constexpr, SWAP_AB: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_K // 2)
    row_ok = rows[:, None] < T
    col_ok = cols[:, None] < N
    k2 = K // 2
    k16 = K // 16
    # SWAP_AB accumulates W @ A.T ([BLOCK_N, BLOCK_M]): the weight is the MMA's M operand
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_r = tl.zeros_like(acc)
    k_len = K // SPLIT_K
    for i in range(0, k_len // BLOCK_K):  # K is a constexpr: a static trip count
        k0 = pid_k * k_len + i * BLOCK_K
        pc = k0 // 2 + j[None, :]
        ps = k0 // 16 + j[None, :] // 8
        w_lo, w_hi = _decode(wc_ptr + cols[:, None] * k2 + pc, ws_ptr + cols[:, None] * k16 + ps, col_ok, F32_OPERANDS)
        a_lo, a_hi = _decode(xc_ptr + rows[:, None] * k2 + pc, xs_ptr + rows[:, None] * k16 + ps, row_ok, F32_OPERANDS)
        acc = _pair_dot(a_lo, w_lo, acc, SWAP_AB)
        acc = _pair_dot(a_hi, w_hi, acc, SWAP_AB)
        if HAS_RAC:
            r_lo, r_hi = _decode(rc_ptr + rows[:, None] * k2 + pc, rs_ptr + rows[:, None] * k16 + ps, row_ok, F32_OPERANDS)
            acc_r = _pair_dot(r_lo, w_lo, acc_r, SWAP_AB)
            acc_r = _pair_dot(r_hi, w_hi, acc_r, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_r = tl.trans(acc_r)
    g = tl.load(gx_ptr + rows, mask=rows < T, other=0.0)[:, None]
    res = acc * g
    if HAS_RAC:
        res += acc_r * (g * 0.25)
    res = res * tl.load(gw_ptr)
    mask = row_ok & (cols[None, :] < N)
    ptrs = out_ptr + pid_k * T * N + rows[:, None] * N + cols[None, :]
    tl.store(ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch


def check_packed(name, codes, scales, rows, k):
    import torch

    if codes.dtype != torch.uint8 or tuple(codes.shape) != (rows, k // 2):
        raise ValueError(f"{name} codes: expected uint8 [{rows}, {k // 2}], got {codes.dtype} {tuple(codes.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (rows, k // 16):
        raise ValueError(f"{name} scales: expected uint8 E4M3 bits [{rows}, {k // 16}], got {scales.dtype} {tuple(scales.shape)}")


def w4a4_rac_gemm(x_codes, x_scales, gx, w_codes, w_scales, gw, r_codes=None, r_scales=None, *,
                  out_dtype=None, config: TritonTiles | None = None):
    """Packed NVFP4 activations [T, K] (and residual) times the packed weight [N, K] -> [T, N].

    ``gx``: [T] or [T, 1] float32 per-token global scales; ``gw``: the weight's float32 global
    scale. Scales are uint8 E4M3 bit patterns (``tensor.view(torch.uint8)``). Output BF16
    unless ``out_dtype`` says otherwise."""
    import torch

    out_dtype = out_dtype or torch.bfloat16
    t, n, k = x_codes.shape[0], w_codes.shape[0], 2 * w_codes.shape[1]
    if k % 32:
        raise ValueError(f"w codes: K={k} must be a multiple of 32")
    check_packed("x", x_codes, x_scales, t, k)
    check_packed("w", w_codes, w_scales, n, k)
    has_rac = r_codes is not None
    if has_rac:
        check_packed("r", r_codes, r_scales, t, k)
    cfg = config or pick_tiles(t, n, k)
    gx = gx.reshape(t).to(torch.float32).contiguous()
    gw = torch.as_tensor(gw, dtype=torch.float32, device=x_codes.device).reshape(1)
    dtype = out_dtype if cfg.split_k == 1 else torch.float32
    out = torch.empty((cfg.split_k, t, n), dtype=dtype, device=x_codes.device)
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    w4a4_rac_gemm_kernel[grid](
        x_codes, x_scales, gx, r_codes if has_rac else x_codes, r_scales if has_rac else x_scales,
        w_codes, w_scales, gw, t, n, out, K=k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, HAS_RAC=has_rac,
        F32_OPERANDS=interpreting(), SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out[0] if cfg.split_k == 1 else out.sum(0).to(out_dtype)


def quads_linear_triton(x, weight, weight_scale, weight_scale_2, *, rac_ratio: float = 0.5, out_dtype=None,
                        config: TritonTiles | None = None):
    """``numerics.quads_linear`` (w4a4) with the GEMM in the Triton kernel."""
    import torch

    from rollout.sglang_plugin.numerics import packed_operands

    cfg = config or pick_tiles(x.shape[0], weight.shape[0], x.shape[-1])
    if cfg.dequant:  # prefill sizes: decode once, then the dense BF16 dot (cuBLAS)
        from rollout.sglang_plugin.numerics import quads_linear

        return quads_linear(x, weight, weight_scale, weight_scale_2, rac_ratio=rac_ratio, out_dtype=out_dtype or torch.bfloat16)
    (xc, xs, gx), res = packed_operands(x, rac_ratio)
    rc, rs = (res[0], res[1]) if res is not None else (None, None)
    ws = weight_scale.view(torch.uint8) if weight_scale.dtype != torch.uint8 else weight_scale
    return w4a4_rac_gemm(xc, xs, gx, weight, ws, weight_scale_2, rc, rs, out_dtype=out_dtype, config=cfg)
