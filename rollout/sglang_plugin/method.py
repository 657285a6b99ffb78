"""SGLang quantization method ``quads_nvfp4``: NVFP4 weights (ModelOpt layout), W4A4 + RAC.

Imported only by ``rollout.sglang_plugin.register()`` where SGLang is installed; it cannot
be exercised on this project's machines (no SGLang there), so it is kept thin: parameters
named and shaped as the export writes them, and ``apply`` calling ``numerics``, whose
numbers are tested against the JAX reference. On CUDA, W4A4 linears run the fused Triton
GEMM (``triton_gemm``: packed weights decoded in registers, both MMAs from one decoded
tile); elsewhere, and for w4a16, the torch reference dequantizes the weight on each call.

Written against SGLang's quantization interfaces (``QuantizationConfig``,
``LinearMethodBase``, ``FusedMoEMethodBase`` in ``sglang.srt.layers.quantization``); the
MoE ``apply`` takes the router's top-k ids and weights as SGLang's fused MoE passes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter

from sglang.srt.layers.quantization import base_config as _bc  # noqa: E402  (sglang required)

from rollout.sglang_plugin import numerics as N

QuantizationConfig = _bc.QuantizationConfig
LinearMethodBase = _bc.LinearMethodBase
FusedMoEMethodBase = getattr(_bc, "FusedMoEMethodBase", object)


def _linear(x, w, s, gw, *, rac_ratio, mode, out_dtype):
    """The fused Triton GEMM on CUDA for W4A4, the torch reference otherwise (same numbers)."""
    if mode == "w4a4" and x.is_cuda and x.shape[-1] % 32 == 0:
        from rollout.sglang_plugin.triton_gemm import quads_linear_triton

        return quads_linear_triton(x, w, s, gw, rac_ratio=rac_ratio, out_dtype=out_dtype)
    return N.quads_linear(x, w, s, gw, rac_ratio=rac_ratio, mode=mode, out_dtype=out_dtype)


def _loader_attrs(param, attrs: dict):
    for k, v in attrs.items():
        setattr(param, k, v)
    return param


class QuadsNVFP4Config(QuantizationConfig):
    def __init__(self, rac_ratio: float = 0.5, exclude_modules: list[str] | None = None, activations: str = "nvfp4"):
        super().__init__()
        self.rac_ratio = float(rac_ratio)
        self.exclude_modules = list(exclude_modules or [])
        self.mode = "w4a4" if activations == "nvfp4" else "w4a16"

    @classmethod
    def get_name(cls) -> str:
        return "quads_nvfp4"

    @classmethod
    def get_supported_act_dtypes(cls):
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # BF16 MMA after decoding in registers; Blackwell FP4 cores are not required

    @staticmethod
    def get_config_filenames():
        return ["hf_quant_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        q = config.get("quads", {})
        return cls(rac_ratio=q.get("rac_ratio", 0.5), exclude_modules=config.get("exclude_modules"),
                   activations=q.get("activations", "nvfp4"))

    def _excluded(self, prefix: str) -> bool:
        import fnmatch

        return any(fnmatch.fnmatch(prefix, p) or prefix.endswith(p.strip("*")) for p in self.exclude_modules)

    def get_quant_method(self, layer, prefix: str):
        from sglang.srt.layers.linear import LinearBase, UnquantizedLinearMethod

        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod() if self._excluded(prefix) else QuadsLinearMethod(self)
        try:
            from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
        except ImportError:
            FusedMoE = ()
        if FusedMoE and isinstance(layer, FusedMoE):
            return QuadsMoEMethod(self)
        return None

    def get_scaled_act_names(self):
        return []


class QuadsLinearMethod(LinearMethodBase):
    def __init__(self, cfg: QuadsNVFP4Config):
        self.cfg = cfg

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype, **extra_weight_attrs):
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if k % N.BLOCK:
            raise ValueError(f"{type(layer).__name__}: input size {k} is not a multiple of {N.BLOCK}")
        attrs = dict(extra_weight_attrs)
        layer.register_parameter("weight", _loader_attrs(Parameter(torch.empty(n, k // 2, dtype=torch.uint8), requires_grad=False),
                                                         {"input_dim": 1, "output_dim": 0, **attrs}))
        layer.register_parameter("weight_scale", _loader_attrs(
            Parameter(torch.empty(n, k // N.BLOCK, dtype=torch.float8_e4m3fn), requires_grad=False),
            {"input_dim": 1, "output_dim": 0, **attrs}))
        # one global scale per fused shard (q/k/v or gate/up are separate tensors on disk)
        layer.register_parameter("weight_scale_2", _loader_attrs(
            Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32), requires_grad=False), attrs))
        layer.output_partition_sizes = list(output_partition_sizes)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        outs, row = [], 0
        for i, size in enumerate(layer.output_partition_sizes):
            w, s = layer.weight[row:row + size], layer.weight_scale[row:row + size]
            outs.append(_linear(x2, w, s, layer.weight_scale_2[i], rac_ratio=self.cfg.rac_ratio, mode=self.cfg.mode,
                                out_dtype=x.dtype))
            row += size
        out = torch.cat(outs, dim=-1).reshape(*shape[:-1], -1)
        return out if bias is None else out + bias


class QuadsMoEMethod(FusedMoEMethodBase):
    """Experts as per-expert QUADS linears (rows grouped by expert, reference path)."""

    def __init__(self, cfg: QuadsNVFP4Config):
        self.cfg = cfg

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype, **extra_weight_attrs):
        e, d, f = num_experts, hidden_size, intermediate_size_per_partition
        mk = lambda *shape, dt: Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)
        for name, p in {"w13_weight": mk(e, 2 * f, d // 2, dt=torch.uint8),
                        "w13_weight_scale": mk(e, 2 * f, d // N.BLOCK, dt=torch.float8_e4m3fn),
                        "w13_weight_scale_2": mk(e, 2, dt=torch.float32),
                        "w2_weight": mk(e, d, f // 2, dt=torch.uint8),
                        "w2_weight_scale": mk(e, d, f // N.BLOCK, dt=torch.float8_e4m3fn),
                        "w2_weight_scale_2": mk(e, dt=torch.float32)}.items():
            layer.register_parameter(name, _loader_attrs(p, dict(extra_weight_attrs)))

    def apply(self, layer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, **_) -> torch.Tensor:
        e = layer.w13_weight.shape[0]
        f = layer.w2_weight.shape[2] * 2
        gate = [(layer.w13_weight[i, :f], layer.w13_weight_scale[i, :f], layer.w13_weight_scale_2[i, 0]) for i in range(e)]
        up = [(layer.w13_weight[i, f:], layer.w13_weight_scale[i, f:], layer.w13_weight_scale_2[i, 1]) for i in range(e)]
        down = [(layer.w2_weight[i], layer.w2_weight_scale[i], layer.w2_weight_scale_2[i]) for i in range(e)]
        return N.quads_moe(x, topk_ids, topk_weights, gate, up, down, rac_ratio=self.cfg.rac_ratio)


def register_with_sglang(name: str):
    from sglang.srt.layers import quantization as q

    if hasattr(q, "register_quantization_config"):
        q.register_quantization_config(name)(QuadsNVFP4Config)
    else:  # older SGLang: a name -> config class dict
        table = getattr(q, "QUANTIZATION_METHODS", None)
        if not isinstance(table, dict):
            raise RuntimeError("this SGLang version exposes neither register_quantization_config nor a QUANTIZATION_METHODS dict")
        table[name] = QuadsNVFP4Config
    return QuadsNVFP4Config
