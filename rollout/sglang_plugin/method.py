"""SGLang quantization method ``quads_nvfp4``: NVFP4 weights (ModelOpt layout), W4A4 + RAC.

Imported only by ``rollout.sglang_plugin.register()`` where SGLang is installed (tested on
the CPU against the real sglang 0.5.23 package: tests/test_sglang_plugin.py). Parameters are
named and shaped as ``rollout.bridge.export_modelopt_nvfp4`` writes them and made of SGLang's
own parameter classes, so its loaders fill them: ``ModelWeightParameter`` for the packed codes
and block scales, ``PerTensorScaleParameter`` for the per-shard global scales of fused q/k/v
and gate/up (the linears' v2 loader writes each shard's scalar into its slot). ``apply`` calls
``numerics``, whose numbers are tested against the JAX reference; on CUDA, W4A4 linears run the
fused Triton GEMM (``triton_gemm``), elsewhere (and for w4a16) the torch reference.

The MoE method follows SGLang's runner interface: ``create_moe_runner`` keeps the runner
config (no runner of SGLang's: the experts are computed here, from standard top-k output
with local expert ids), ``apply(layer, dispatch_output)`` returns a ``StandardCombineInput``.

Registration (``register_with_sglang``) adds the method to SGLang's method table ahead of
its own (so that its ``override_quantization_method`` claims our exports before
``modelopt_fp4`` does), to the ``--quantization`` choices, and to the linear methods that
take the v2 weight loader.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.parameter import ModelWeightParameter, PerTensorScaleParameter
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from rollout.sglang_plugin import numerics as N

EXPORT_MARK = "quads"  # the block rollout.bridge.quantization_config writes into an export's quantization_config


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
    def __init__(self, rac_ratio: float = 0.5, exclude_modules: list[str] | None = None, activations: str = "nvfp4",
                 group_size: int = N.BLOCK):
        super().__init__()
        if activations not in ("nvfp4", "bf16"):
            raise ValueError(f"quantization_config.quads.activations={activations!r}: expected 'nvfp4' or 'bf16'")
        if int(group_size) != N.BLOCK:
            raise ValueError(f"quantization_config.group_size={group_size!r}: NVFP4 has blocks of {N.BLOCK}")
        if not 0.0 <= float(rac_ratio) <= 1.0:
            raise ValueError(f"quantization_config.quads.rac_ratio={rac_ratio!r}: expected a number in [0, 1]")
        self.rac_ratio = float(rac_ratio)
        self.exclude_modules = list(exclude_modules or [])
        self.mode = "w4a4" if activations == "nvfp4" else "w4a16"

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant):
        """Claim a QUADS export (its quantization_config carries our block) unless the user
        asked for another method by name: SGLang would otherwise serve it as modelopt_fp4,
        without RAC."""
        if not isinstance(hf_quant_cfg, dict) or EXPORT_MARK not in hf_quant_cfg:
            return None
        return cls.get_name() if user_quant in (None, "", "modelopt", cls.get_name()) else None

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
        config = config.get("quantization", config)  # hf_quant_config.json nests it
        q = config.get(EXPORT_MARK, {})
        return cls(rac_ratio=q.get("rac_ratio", 0.5), exclude_modules=config.get("exclude_modules"),
                   activations=q.get("activations", "nvfp4"), group_size=config.get("group_size", N.BLOCK))

    def _excluded(self, prefix: str) -> bool:
        import fnmatch

        return any(fnmatch.fnmatch(prefix, p) or prefix.endswith(p.strip("*")) for p in self.exclude_modules)

    def get_quant_method(self, layer, prefix: str):
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod() if self._excluded(prefix) else QuadsLinearMethod(self)
        if isinstance(layer, FusedMoE):
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
        loader = extra_weight_attrs.get("weight_loader")
        layer.register_parameter("weight", ModelWeightParameter(data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1,
                                                                output_dim=0, weight_loader=loader))
        layer.register_parameter("weight_scale", ModelWeightParameter(
            data=torch.empty(n, k // N.BLOCK, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0, weight_loader=loader))
        # one global scale per fused shard (q/k/v or gate/up are separate tensors on disk)
        gs = PerTensorScaleParameter(data=torch.empty(len(output_partition_sizes), dtype=torch.float32), weight_loader=loader)
        gs.needs_scalar_to_array = True
        layer.register_parameter("weight_scale_2", gs)
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
    """Experts as per-expert QUADS linears over the rows routed to them (the torch reference)."""

    def __init__(self, cfg: QuadsNVFP4Config):
        super().__init__()
        self.cfg = cfg
        self.moe_runner_config = None

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype, **extra_weight_attrs):
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoeWeightScaleSupported

        e, d, f = num_experts, hidden_size, intermediate_size_per_partition
        if d % N.BLOCK or f % N.BLOCK:
            raise ValueError(f"{type(layer).__name__}: hidden ({d}) and expert ({f}) sizes must be multiples of {N.BLOCK}")
        mk = lambda *shape, dt: torch.nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)
        kinds = {"": None, "_scale": FusedMoeWeightScaleSupported.BLOCK.value, "_scale_2": FusedMoeWeightScaleSupported.TENSOR.value}
        shapes = {"w13_weight": (mk(e, 2 * f, d // 2, dt=torch.uint8), ""),
                  "w13_weight_scale": (mk(e, 2 * f, d // N.BLOCK, dt=torch.float8_e4m3fn), "_scale"),
                  "w13_weight_scale_2": (mk(e, 2, dt=torch.float32), "_scale_2"),
                  "w2_weight": (mk(e, d, f // 2, dt=torch.uint8), ""),
                  "w2_weight_scale": (mk(e, d, f // N.BLOCK, dt=torch.float8_e4m3fn), "_scale"),
                  "w2_weight_scale_2": (mk(e, dt=torch.float32), "_scale_2")}
        for name, (p, kind) in shapes.items():
            attrs = dict(extra_weight_attrs)
            if kinds[kind] is not None:
                attrs["quant_method"] = kinds[kind]
            layer.register_parameter(name, _loader_attrs(p, attrs))

    def create_moe_runner(self, layer, moe_runner_config):
        """No SGLang runner: ``apply`` computes the experts itself; the config says how."""
        if getattr(moe_runner_config, "activation", "silu") != "silu" or not getattr(moe_runner_config, "is_gated", True):
            raise ValueError(f"quads_nvfp4 MoE: only gated SiLU experts (SwiGLU), got activation="
                             f"{getattr(moe_runner_config, 'activation', None)!r}")
        self.moe_runner_config = moe_runner_config

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        topk_weights, topk_ids = dispatch_output.topk_output[0], dispatch_output.topk_output[1]
        rc = self.moe_runner_config
        if rc is not None and getattr(rc, "apply_router_weight_on_input", False):
            raise ValueError("quads_nvfp4 MoE: apply_router_weight_on_input is not supported")
        e = layer.w13_weight.shape[0]
        f = layer.w2_weight.shape[2] * 2
        gate = [(layer.w13_weight[i, :f], layer.w13_weight_scale[i, :f], layer.w13_weight_scale_2[i, 0]) for i in range(e)]
        up = [(layer.w13_weight[i, f:], layer.w13_weight_scale[i, f:], layer.w13_weight_scale_2[i, 1]) for i in range(e)]
        down = [(layer.w2_weight[i], layer.w2_weight_scale[i], layer.w2_weight_scale_2[i]) for i in range(e)]
        y = N.quads_moe(x, topk_ids, topk_weights, gate, up, down, rac_ratio=self.cfg.rac_ratio)
        scale = getattr(rc, "routed_scaling_factor", None) if rc is not None else None
        if scale not in (None, 1.0):
            y = y * scale
        return StandardCombineInput(hidden_states=y)


def register_with_sglang(name: str):
    """Make ``name`` a quantization method of this process's SGLang: in its method table
    first (our override is asked before modelopt_fp4's), in the ``--quantization`` choices,
    and among the linear methods loaded by the v2 weight loader. Idempotent."""
    from sglang.srt.layers import linear
    from sglang.srt.layers import quantization as q
    from sglang.srt.server_args import QUANTIZATION_CHOICES

    table = q.QUANTIZATION_METHODS  # the dict model_config and get_quantization_config read
    rest = {k: v for k, v in table.items() if k != name}
    table.clear()
    table[name] = QuadsNVFP4Config
    table.update(rest)
    if name not in QUANTIZATION_CHOICES:
        QUANTIZATION_CHOICES.append(name)
    if QuadsLinearMethod.__name__ not in linear.WEIGHT_LOADER_V2_SUPPORTED:
        linear.WEIGHT_LOADER_V2_SUPPORTED.append(QuadsLinearMethod.__name__)
    return QuadsNVFP4Config
