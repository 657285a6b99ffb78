"""QUADS W4A4 + RAC numerics in torch: the reference the SGLang method computes.

The same recipe as ``quads_jax.nvfp4`` and ``pallas_kernels`` (tested against them on the
CPU, see tests/test_sglang_plugin.py):

- activations get one dynamic float32 global scale per token, ``amax / (6 * 448)``;
- block scales ``clamp((amax16 / 6) / gs, 2**-6, 448)`` rounded to E4M3, elements rounded
  to E2M1 with ties to even; every division is done in float64 and rounded once to float32
  (exact, like ``nvfp4.ieee_div``);
- RAC: the residual ``r = x - dq(q(x))``; per token the fraction ``rac_ratio`` of 16-blocks
  with the largest energy ``sum(r**2)``; those blocks quantized again with global scale
  ``gs / 4``; output ``(dq(q(x)) + dq(q(r_sel))) @ dq(W).T``, FP32 accumulation: the two
  products summed in FP32, what ``pallas_kernels`` computes with ``rac_sum="exact"`` (the JAX
  engine's default ``"fp16"`` rounds the compensated activation once to FP16, <= 2**-11
  relative; see ``pallas_kernels.rac``).

Weights arrive in the ModelOpt layout that ``rollout.bridge.export_modelopt_nvfp4`` writes:
``weight`` uint8 [N, K/2] (low nibble = lower index), ``weight_scale`` E4M3 [N, K/16],
``weight_scale_2`` float32.
"""

from __future__ import annotations

import math

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
RESIDUAL_SCALE_FACTOR = 0.25
E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def div(a, b):
    """Correctly rounded float32 a / b (through float64)."""
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return (a.double() / b.double()).float()


def round_e2m1(a):
    """|values| in [0, 6] -> nearest E2M1 magnitude, ties to even."""
    _, ex = torch.frexp(a)  # a = m * 2**ex, m in [0.5, 1)
    e = torch.clamp(ex - 1, min=0) - 1  # one mantissa bit, subnormal step 0.5
    return torch.ldexp(torch.round(torch.ldexp(a, -e)), e)  # torch.round: half to even


def global_scale(x):
    """[T, 1] per-token float32 global scales; an all-zero token gets 1.0."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    gs = div(amax, E2M1_MAX * E4M3_MAX)
    return torch.where(gs == 0, torch.ones_like(gs), gs)


def quantize(x, gs):
    """x [T, K] float32 -> (E2M1 values [T, K] float32, block scales [T, K/16] float32 on the E4M3 grid)."""
    t, k = x.shape
    if k % BLOCK:
        raise ValueError(f"x: K={k} must be a multiple of {BLOCK}")
    xb = x.float().reshape(t, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    s = torch.clamp(div(div(amax, E2M1_MAX), gs), 2.0**-6, E4M3_MAX)
    s = s.to(torch.float8_e4m3fn).float()
    inv = div(div(torch.ones_like(gs), gs), s)
    v = torch.clamp(xb * inv[..., None], -E2M1_MAX, E2M1_MAX)
    q = torch.copysign(round_e2m1(v.abs()), v)
    return q.reshape(t, k), s


def block_values(q, s):
    """E2M1 values times their block scales ([T, K] float32, exact in BF16)."""
    t, k = q.shape
    return (q.reshape(t, k // BLOCK, BLOCK) * s[..., None]).reshape(t, k)


def num_selected(rac_ratio: float, count: int) -> int:
    return min(count, max(0, math.ceil(rac_ratio * count - 1e-9)))


def encode_e2m1(q):
    """E2M1 values (float32) -> 4-bit codes (uint8): the magnitude's index in the grid, sign in bit 3."""
    a = q.abs()
    idx = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4)).to(torch.uint8)
    return idx | (torch.signbit(q).to(torch.uint8) << 3)


def pack(q, s):
    """(E2M1 values [T, K], block scales [T, K/16]) -> (codes uint8 [T, K/2] with channel 2j in
    the low nibble, E4M3 scale bit patterns uint8 [T, K/16]): the kernels' operand layout."""
    c = encode_e2m1(q)
    return c[:, 0::2] | (c[:, 1::2] << 4), s.to(torch.float8_e4m3fn).view(torch.uint8)


def packed_operands(x, rac_ratio: float):
    """x [T, K] -> ((codes, scale bits, gx), (codes, scale bits, gr) or None): the packed
    operands of q(x) and of the selected residual, for the Triton GEMM."""
    (q, s, gx), res = _quantized(x, rac_ratio)
    return (*pack(q, s), gx), (None if res is None else (*pack(res[0], res[1]), res[2]))


def _quantized(x, rac_ratio: float):
    """((E2M1 values, block scales, gx), (same for the selected residual, gr) or None)."""
    if not 0.0 <= rac_ratio <= 1.0:
        raise ValueError(f"rac_ratio={rac_ratio!r}: expected a number in [0, 1]")
    xf = x.float()
    gx = global_scale(xf)
    q, s = quantize(xf, gx)
    if rac_ratio == 0:
        return (q, s, gx), None
    t, k = xf.shape
    r = xf - block_values(q, s) * gx
    energy = (r * r).reshape(t, k // BLOCK, BLOCK).sum(-1)
    n = num_selected(rac_ratio, k // BLOCK)
    if n == 0:
        return (q, s, gx), None
    tau = torch.topk(energy, n, dim=-1).values[:, n - 1 : n]
    sel = (energy >= tau).repeat_interleave(BLOCK, dim=1)
    gr = gx * RESIDUAL_SCALE_FACTOR
    rq, rs = quantize(torch.where(sel, r, torch.zeros_like(r)), gr)
    return (q, s, gx), (rq, rs, gr)


def rac_operands(x, rac_ratio: float):
    """x [T, K] -> ((xv, gx), (rv, gr) or None): block values and [T, 1] global scales of
    q(x) and of the second-pass residual on the selected blocks."""
    (q, s, gx), res = _quantized(x, rac_ratio)
    xv = (block_values(q, s), gx)
    return xv, (None if res is None else (block_values(res[0], res[1]), res[2]))


def dequantize_weight(weight, weight_scale, weight_scale_2=None):
    """ModelOpt arrays -> block values [N, K] float32 (times ``weight_scale_2`` if given)."""
    if weight.dtype != torch.uint8:
        raise ValueError(f"weight: expected uint8 packed codes, got {weight.dtype}")
    n, half = weight.shape
    codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).reshape(n, 2 * half).long()
    vals = E2M1_TABLE.to(weight.device)[codes]
    s = weight_scale.float()
    if s.shape != (n, 2 * half // BLOCK):
        raise ValueError(f"weight_scale: expected shape {(n, 2 * half // BLOCK)}, got {tuple(s.shape)}")
    out = block_values(vals, s)
    return out if weight_scale_2 is None else out * torch.as_tensor(weight_scale_2, dtype=torch.float32)


def dot_nt_f32(a, b):
    """a @ b.T in float32 for operands whose values are exact in BF16 (block values): on
    CUDA the BF16 cuBLAS GEMM with FP32 output (``torch.mm(out_dtype=)``), elsewhere float32."""
    if a.is_cuda:
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16).T, out_dtype=torch.float32)
    return a.float() @ b.float().T


def quads_linear(x, weight, weight_scale, weight_scale_2, *, rac_ratio: float = 0.5, mode: str = "w4a4",
                 out_dtype=torch.bfloat16):
    """x [T, K] @ W.T with NVFP4 weights (ModelOpt layout) and W4A4 + RAC activations."""
    wv = dequantize_weight(weight, weight_scale)
    gw = torch.as_tensor(weight_scale_2, dtype=torch.float32)
    if mode == "w4a16":
        return (dot_nt_f32(x.to(torch.bfloat16), wv) * gw).to(out_dtype)
    if mode != "w4a4":
        raise ValueError(f"mode={mode!r}: expected 'w4a4' or 'w4a16'")
    (xv, gx), res = rac_operands(x, rac_ratio)
    out = dot_nt_f32(xv, wv) * gx
    if res is not None:
        rv, gr = res
        out = out + dot_nt_f32(rv, wv) * gr
    return (out * gw).to(out_dtype)


def quads_grouped_linear(x, group_sizes, weights, *, rac_ratio: float = 0.5, out_dtype=torch.bfloat16):
    """Rows of x sorted by expert; ``weights`` a list of (weight, weight_scale, weight_scale_2)
    per expert. Empty groups are skipped. Activation scales are per token, so this equals
    quantizing all rows at once."""
    outs, start = [], 0
    for e, size in enumerate(group_sizes.tolist() if hasattr(group_sizes, "tolist") else group_sizes):
        if size:
            outs.append(quads_linear(x[start:start + size], *weights[e], rac_ratio=rac_ratio, out_dtype=out_dtype))
        start += size
    n = weights[0][0].shape[0]
    return torch.cat(outs) if outs else x.new_zeros((0, n), dtype=out_dtype)


def quads_moe(x, topk_ids, topk_weights, gate, up, down, *, rac_ratio: float = 0.5):
    """Dropless SwiGLU MoE with QUADS expert linears, as ``quads_jax.model.moe.moe_ffn``
    computes it: rows sorted by expert (stable), gate/up/down outputs in x's dtype, SiLU
    and the product in float32, the top-k combine in float32.

    x [T, d]; topk_ids / topk_weights [T, k]; gate, up, down: per-expert lists of ModelOpt
    (weight, weight_scale, weight_scale_2) triples."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // k]
    sizes = torch.bincount(flat, minlength=len(gate))
    gl = lambda a, ws: quads_grouped_linear(a, sizes, ws, rac_ratio=rac_ratio, out_dtype=x.dtype)
    h = (torch.nn.functional.silu(gl(rows, gate).float()) * gl(rows, up).float()).to(x.dtype)
    y = gl(h, down).float() * topk_weights.reshape(-1)[order][:, None].float()
    out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, y)
    return out.to(x.dtype)
