"""Pallas GPU kernels for NVFP4 rollouts, each with an XLA reference of the same signature.

    from pallas_kernels import nvfp4_matmul
    y = nvfp4_matmul(x, w_nvfp4, rac_ratio=0.5)            # backend "auto": pallas on a GPU, xla elsewhere
    y = nvfp4_matmul(x, w_nvfp4, rac_ratio=0.5, backend="xla")

Which implementation runs is a value (``KernelConfig``, or an op's ``backend=`` / ``impl=``
argument), never process state.
"""

from pallas_kernels.attention import attention_xla, causal_attention, causal_attention_xla
from pallas_kernels.cache_attention import DecodeAttentionConfig, decode_attention, decode_attention_xla, write_rows
from pallas_kernels.config import BACKENDS, DwTiles, GroupedTiles, KernelConfig, Tiles
from pallas_kernels.grouped_weight_grad import grouped_dw, grouped_dw_xla
from pallas_kernels.float_grouped import ExpertsKN, grouped_dot, grouped_dot_fp8, grouped_dot_kn, grouped_dot_xla
from pallas_kernels.fp8_gemm import fp8_grouped_matmul, fp8_matmul
from pallas_kernels.grouped_gemm import nvfp4_grouped_matmul, nvfp4_grouped_matmul_xla
from pallas_kernels.gemm import GemmConfig, gemm_config, nvfp4_matmul, nvfp4_matmul_xla
from pallas_kernels.rac import RAC_MODES, RAC_SUMS
from pallas_kernels.weight_quant import FakeQuantConfig, fake_quant_config, weight_fake_quant
from pallas_kernels.quantizer import (RAC_SELECTS, RANK_COUNTS, PAIRS_MAX_BLOCKS, QuantConfig, QuantizedRows, default_order, quant_config, quantize_activations,
                                      quantize_activations_rac, quantize_operand, quantize_rows)

__all__ = [
    "BACKENDS", "KernelConfig", "GroupedTiles", "Tiles", "DwTiles", "grouped_dw", "grouped_dw_xla", "grouped_dot", "grouped_dot_xla", "ExpertsKN", "grouped_dot_kn", "grouped_dot_fp8", "causal_attention", "causal_attention_xla",
    "attention_xla", "decode_attention", "decode_attention_xla", "write_rows", "DecodeAttentionConfig",
    "QuantConfig", "quant_config", "quantize_activations", "quantize_activations_rac", "QuantizedRows", "quantize_rows",
    "quantize_operand", "default_order", "PAIRS_MAX_BLOCKS", "RANK_COUNTS",
    "nvfp4_matmul", "nvfp4_matmul_xla", "nvfp4_grouped_matmul", "nvfp4_grouped_matmul_xla",
    "fp8_matmul", "fp8_grouped_matmul", "GemmConfig", "gemm_config",
    "RAC_MODES", "RAC_SUMS", "RAC_SELECTS", "FakeQuantConfig", "fake_quant_config", "weight_fake_quant",
]
