"""Precision policies: which quantizer each kind of linear layer gets, trainer and rollout side.

Kinds of linear: ``attn`` (q/k/v/o), ``experts`` (routed experts), ``shared`` (shared
experts), ``dense`` (MLP of dense layers), ``router``, ``lm_head``. Embeddings and norms
always stay in the compute dtype / float32.

Modes, acting on float (master) weights, used by the trainer:

    bf16      plain matmul in the compute dtype
    fp8       FP8 E4M3 fake-quant of weights (per output channel) and activations (per token)
    nvfp4_w   QUADS asymmetric QAT: NVFP4 weight fake-quant with a straight-through
              gradient, activations untouched
    nvfp4_wa  symmetric W4A4 fake-quant (weights and per-token activations): the ablation

Modes acting on weights prepared once by ``prepare_weight`` (the rollout engine):

    w4a4      NVFP4 weights and activations through ``pallas_kernels.gemm``;
              with ``rac_ratio > 0`` the residual activation compensation of QUADS
    w4a16     NVFP4 weights, BF16 activations
    fp8       real FP8 weights and activations through the FP8 dot

The trainer's ``nvfp4_w`` and the rollout's ``w4a4`` quantize weights through the same
``nvfp4.quantize`` call (``weight_quant_kwargs``), so the weight error is identical on
both sides. Activations in the rollout use per-token global scales so that a sequence's
numbers do not depend on what it is batched with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from quads_jax import fp8, nvfp4
from quads_jax.config_util import build

KINDS = ("attn", "experts", "shared", "dense", "router", "lm_head")
TRAIN_MODES = ("bf16", "fp8", "nvfp4_w", "nvfp4_wa")
ROLLOUT_MODES = ("bf16", "fp8", "w4a4", "w4a16")


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mode per kind of linear plus the RAC ratio and kernel backend of the rollout."""

    attn: str = "bf16"
    experts: str = "bf16"
    shared: str = "bf16"
    dense: str = "bf16"
    router: str = "bf16"
    lm_head: str = "bf16"
    rac_ratio: float = 0.0
    rac_sum: str = "fp16"  # how W4A4 GEMMs add RAC's product: "fp16" or "exact" (pallas_kernels.rac)
    kernels: pk.KernelConfig = pk.KernelConfig()  # which implementation each op runs

    @property
    def backend(self) -> str:
        """The NVFP4 / FP8 kernels' backend as ops take it ("auto", "pallas" or "xla")."""
        return self.kernels.backend

    def __post_init__(self):
        for k in KINDS:
            m = getattr(self, k)
            if m not in TRAIN_MODES + ROLLOUT_MODES:
                raise ValueError(f"precision.{k}={m!r}: expected one of {sorted(set(TRAIN_MODES + ROLLOUT_MODES))}")
        if not 0.0 <= float(self.rac_ratio) <= 1.0:
            raise ValueError(f"precision.rac_ratio={self.rac_ratio!r}: expected a number in [0, 1]")
        if self.rac_sum not in pk.RAC_SUMS:
            raise ValueError(f"precision.rac_sum={self.rac_sum!r}: expected one of {pk.RAC_SUMS}")
        if not isinstance(self.kernels, pk.KernelConfig):
            raise ValueError(f"precision.kernels={self.kernels!r}: expected a pallas_kernels.KernelConfig")

    def mode(self, kind: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
        return getattr(self, kind)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "Precision":
        return build(cls, d, "precision")


_QUANTIZED = ("attn", "experts", "shared", "dense")

# Trainer policies (float weights) and rollout recipes (prepared weights), by name.
TRAIN_POLICIES = {
    "bf16": Precision(),
    "fp8": Precision(**{k: "fp8" for k in _QUANTIZED}),
    "nvfp4_w": Precision(**{k: "nvfp4_w" for k in _QUANTIZED}),
    "nvfp4_wa": Precision(**{k: "nvfp4_wa" for k in _QUANTIZED}),
}
ROLLOUT_RECIPES = {
    "bf16": Precision(),
    "fp8": Precision(**{k: "fp8" for k in _QUANTIZED}),
    "nvfp4_naive": Precision(**{k: "w4a4" for k in _QUANTIZED}),
    "quads": Precision(**{k: "w4a4" for k in _QUANTIZED}, rac_ratio=0.5),
    "w4a16": Precision(**{k: "w4a16" for k in _QUANTIZED}),  # weight-only serving (no job recipe trains for it)
}
# The recipes of RL jobs, by the one set of names every command uses: (trainer policy,
# rollout recipe). A rollout engine or server given a job recipe runs its rollout side.
RECIPES = {
    "bf16": ("bf16", "bf16"),
    "fp8": ("fp8", "fp8"),
    "nvfp4_naive": ("bf16", "nvfp4_naive"),
    "quads": ("nvfp4_w", "quads"),
    "w4a16_qat": ("nvfp4_w", "nvfp4_naive"),
    "quads_symmetric_qat": ("nvfp4_wa", "quads"),
}
RECIPE_NAMES = tuple(RECIPES) + ("w4a16",)


def train_policy(name: str) -> Precision:
    if name not in TRAIN_POLICIES:
        raise ValueError(f"trainer precision {name!r}: expected one of {sorted(TRAIN_POLICIES)}")
    return TRAIN_POLICIES[name]


def train_policy_with(name: str, kernels: pk.KernelConfig | None = None) -> Precision:
    """The named trainer policy with its kernel config replaced."""
    p = train_policy(name)
    return p if kernels is None else dataclasses.replace(p, kernels=kernels)


def rollout_recipe(name: str, rac_ratio: float | None = None, backend: str | None = None, rac_sum: str | None = None,
                   kernels: pk.KernelConfig | None = None) -> Precision:
    """The named rollout recipe, optionally with its RAC ratio, RAC sum and kernel config (or
    only its NVFP4/FP8 kernel backend) replaced."""
    if name in RECIPES:
        name = RECIPES[name][1]
    if name not in ROLLOUT_RECIPES:
        raise ValueError(f"recipe {name!r}: expected one of {list(RECIPE_NAMES)}")
    p = ROLLOUT_RECIPES[name]
    if rac_ratio is not None:
        p = dataclasses.replace(p, rac_ratio=float(rac_ratio))
    if rac_sum is not None:
        p = dataclasses.replace(p, rac_sum=rac_sum)
    if kernels is not None:
        p = dataclasses.replace(p, kernels=kernels)
    if backend is not None:
        p = dataclasses.replace(p, kernels=dataclasses.replace(p.kernels, backend=backend))
    return p


# ----------------------------------------------------------------------------- weights


def weight_quant_kwargs(ndim: int) -> dict:
    """The one NVFP4 weight quantization of the project: along the input (last) axis,
    with a separate global scale per expert for stacked [E, N, K] expert weights."""
    return dict(axis=-1, keep_axes=(0,) if ndim == 3 else ())


def quantize_weight(w) -> nvfp4.NVFP4Tensor:
    return nvfp4.quantize(w, **weight_quant_kwargs(w.ndim))


def fake_quant_weight(w, dtype=None, backend=None):
    """The QAT weight: dq(q(w)) in ``dtype`` (default w's; the product's operand type) with
    a straight-through gradient in w's dtype, quantized as ``quantize_weight`` does
    (``pk.weight_fake_quant``: one pass over the weight on a GPU)."""
    return pk.weight_fake_quant(w, dtype=dtype, backend=backend)


def prepare_weight(w, mode: str, dtype=None):
    """Convert a float weight once for the rollout mode, into what its GEMM reads, so that a
    step does no work on weights: ``w4a4``/``w4a16`` -> NVFP4Tensor (codes as uint32 words of
    8, ``nvfp4.code_words``: the same bytes), ``fp8`` -> FP8Tensor per output channel ([N, K] or
    [E, N, K]: the layout tokamax's FP8 kernel reads); float modes -> cast to ``dtype`` (the type the product reads
    it in; None keeps it), stacked experts as ``pk.ExpertsKN`` [E, K, N]."""
    if mode in ("w4a4", "w4a16"):
        t = quantize_weight(jnp.asarray(w, jnp.float32))
        return dataclasses.replace(t, codes=nvfp4.code_words(t.codes))
    if mode == "fp8":
        return fp8.quantize(jnp.asarray(w, jnp.float32), axis=-1)
    dtype = dtype or jnp.asarray(w).dtype
    return pk.ExpertsKN.from_enk(w, dtype) if w.ndim == 3 else jnp.asarray(w).astype(dtype)


def _act_fq(x):
    return nvfp4.fake_quant(x, axis=-1, keep_axes=tuple(range(x.ndim - 1)))


def _float_operands(x, w, mode: str, backend=None):
    if mode == "fp8":
        return fp8.fake_quant(x, axis=-1), fp8.fake_quant(w, axis=-1)
    if mode == "nvfp4_w":
        return x, fake_quant_weight(w, x.dtype, backend)
    if mode == "nvfp4_wa":
        return _act_fq(x), fake_quant_weight(w, x.dtype, backend)
    if mode in ("bf16", "w4a4", "w4a16"):  # rollout modes on an unprepared weight: plain
        return x, w
    raise ValueError(f"mode={mode!r}: expected one of {TRAIN_MODES + ROLLOUT_MODES}")


# ----------------------------------------------------------------------------- linears


def _weights(w):
    return (tuple(w), True) if isinstance(w, (tuple, list)) else ((w,), False)


def _nvfp4_launches(ws):
    """The groups of NVFP4 weights launched together: weights that read one input (q/k/v,
    gate/up) go to the NVFP4 GEMM in one launch. None when the weights are not NVFP4."""
    if not all(isinstance(wi, nvfp4.NVFP4Tensor) for wi in ws):
        return None
    return [ws]


def linear(x, w, mode: str, *, dtype=jnp.bfloat16, rac_ratio: float = 0.0, rac_sum: str = "fp16", backend=None,
           operand_dtype=None):
    """``x @ W.T`` for x [..., K] (or QuantizedRows [T, K]) and W [N, K] (float, NVFP4Tensor
    or FP8Tensor). ``w`` may be a list of weights that read the same x (q/k/v, gate/up):
    the list of their outputs, from one kernel launch when they are NVFP4. Float products take
    their operands in ``operand_dtype`` (default ``dtype``) and accumulate in FP32: the head
    reads BF16 operands and returns FP32 logits."""
    ws, many = _weights(w)
    lead = x.shape[:-1]
    x2 = x if isinstance(x, pk.QuantizedRows) else x.reshape(-1, x.shape[-1])
    launches = _nvfp4_launches(ws)
    if launches is not None:
        ys = sum((pk.nvfp4_matmul(_bf16(x2), g, rac_ratio=rac_ratio if mode == "w4a4" else 0.0, rac_sum=rac_sum, act_scale="token",
                                  mode="w4a16" if mode == "w4a16" else "w4a4", backend=backend, out_dtype=dtype)
                  for g in launches), ())
    else:
        ys = tuple(_linear_one(x2, wi, mode, dtype=dtype, backend=backend, operand_dtype=operand_dtype or dtype) for wi in ws)
    ys = [y.reshape(*lead, y.shape[-1]) for y in ys]
    return ys if many else ys[0]


def _linear_one(x2, w, mode, *, dtype, backend, operand_dtype):
    if isinstance(w, nvfp4.NVFP4Tensor):
        raise ValueError("w: NVFP4 weights mixed with other weights in one linear call")
    if isinstance(w, fp8.FP8Tensor):
        return pk.fp8_matmul(x2.astype(jnp.bfloat16), w, backend=backend, out_dtype=dtype)
    od = operand_dtype
    a, b = _float_operands(x2.astype(od), w, mode, backend)
    return _dot_nt(a.astype(od), b.astype(od)).astype(dtype)


@jax.custom_vjp
def _dot_nt(a, b):
    """a [T, K] @ b [N, K].T with FP32 accumulation and an FP32 result, whose backward
    products read the cotangent in the operands' type. With low-precision operands JAX's own
    transpose multiplies the FP32 cotangent by them in FP32, which XLA runs as TF32 GEMMs on
    Hopper, at half the BF16 rate. Rounding the cotangent to BF16 is the usual mixed-precision
    backward; accumulation stays FP32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nt_fwd(a, b):
    return _dot_nt(a, b), (a, b)


def _dot_nt_bwd(res, g):
    a, b = res
    g = g.astype(jnp.promote_types(a.dtype, b.dtype))
    da = jax.lax.dot_general(g, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(a.dtype)
    db = jax.lax.dot_general(g, a, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(b.dtype)
    return da, db


_dot_nt.defvjp(_dot_nt_fwd, _dot_nt_bwd)


def quantize_rows_for(x, w, mode: str, *, rac_ratio: float = 0.0, rac_sum: str = "fp16", backend=None):
    """x [T, K] quantized once (``pk.QuantizedRows``) for the GEMMs with weight ``w`` (or
    weights quantized like it) in ``mode``: what ``linear`` / ``grouped_linear`` would
    compute, shared by several weights or gathered by rows (the MoE dispatch). Other modes
    and weights, and RAC summed exactly (QuantizedRows hold the FP16 sum), get x back."""
    if isinstance(w, nvfp4.NVFP4Tensor) and mode == "w4a4" and not (rac_ratio > 0 and rac_sum == "exact"):
        return pk.quantize_rows(x.astype(jnp.bfloat16), rac_ratio=rac_ratio, backend=backend)
    return x


def take_rows(x, rows):
    """x[rows] for an array or QuantizedRows."""
    return x.take(rows) if isinstance(x, pk.QuantizedRows) else x[rows]


def _bf16(x):
    return x if isinstance(x, pk.QuantizedRows) else x.astype(jnp.bfloat16)


def grouped_linear(x, w, group_sizes, mode: str, *, dtype=jnp.bfloat16, rac_ratio: float = 0.0, rac_sum: str = "fp16", backend=None,
                   grouped: str = "auto", tiles=None):
    """Per-expert ``x_e @ W_e.T`` for rows of x [M, K] (or QuantizedRows) sorted by expert and
    W [E, N, K]; ``w`` may be a list of expert weights that read the same rows (gate/up): the
    list of outputs, from one kernel launch when they are NVFP4. Rollout float weights
    (``pk.ExpertsKN``, stored [E, K, N]) and FP8 weights (stored [E, N, K]) run the forward GEMM
    in their stored layout (with ``tiles.infer``). Float weights go through ``pk.grouped_dot`` (``grouped``: "tokamax", "xla" or "auto"; ``tiles``: its
    ``pk.GroupedTiles``), in their stored layout."""
    ws, many = _weights(w)
    launches = _nvfp4_launches(ws)
    if launches is not None:
        ys = sum((pk.nvfp4_grouped_matmul(_bf16(x), g, group_sizes, rac_ratio=rac_ratio if mode == "w4a4" else 0.0,
                                          rac_sum=rac_sum, act_scale="token", mode="w4a16" if mode == "w4a16" else "w4a4", backend=backend,
                                          out_dtype=dtype)
                  for g in launches), ())
    elif all(isinstance(wi, fp8.FP8Tensor) for wi in ws):
        t = (tiles or pk.KernelConfig().grouped_tiles).infer
        ys = tuple(pk.fp8_grouped_matmul(x.astype(jnp.bfloat16), wi, group_sizes, backend=backend, out_dtype=dtype,
                                         grouped=grouped, tiles=t) for wi in ws)
    elif all(isinstance(wi, pk.ExpertsKN) for wi in ws):  # rollout weights: one forward GEMM each, no concatenation
        ys = tuple(pk.grouped_dot(x.astype(wi.dtype), wi, group_sizes, impl=grouped, out_dtype=dtype, tiles=tiles)
                   for wi in ws)
    elif any(isinstance(wi, (nvfp4.NVFP4Tensor, fp8.FP8Tensor, pk.ExpertsKN)) for wi in ws):
        raise ValueError("w: quantized or inference expert weights mixed with other weights in one grouped call")
    else:
        ys = _grouped_float(x, ws, group_sizes, mode, dtype=dtype, grouped=grouped, tiles=tiles, backend=backend)
    return list(ys) if many else ys[0]


def _grouped_float(x, ws, group_sizes, mode, *, dtype, grouped, tiles, backend):
    """Float expert weights that read the same rows (gate/up) as one GEMM over their outputs
    concatenated: one read of x, and in the backward pass one dx product instead of a sum
    of several. Each weight is fake-quantized on its own (its own tensor scale) first."""
    ops = [_float_operands(x.astype(dtype), wi, mode, backend) for wi in ws]
    a = ops[0][0]
    b = ops[0][1] if len(ops) == 1 else jnp.concatenate([bi.astype(dtype) for _, bi in ops], axis=1)
    y = pk.grouped_dot(a.astype(dtype), b.astype(dtype), group_sizes, impl=grouped, out_dtype=dtype, tiles=tiles)
    if len(ops) == 1:
        return (y,)
    cuts = [sum(wi.shape[1] for wi in ws[:i + 1]) for i in range(len(ws) - 1)]
    return tuple(jnp.split(y, cuts, axis=1))
