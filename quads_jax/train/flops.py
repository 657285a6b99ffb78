"""Model FLOPs per token and MFU (model FLOPs utilisation) against the device's peak.

Training FLOPs per token = 6 * active parameters (forward + backward matmuls) plus the
attention scores and values, 12 * layers * heads * head_dim * context (the PaLM appendix
convention; causal masking is not discounted). Peak: the dense BF16 tensor-core rate of
known devices, or the ``peak`` a caller passes (e.g. one measured in the same process).
"""

from __future__ import annotations

import jax

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12, "GB200": 2500e12, "L40S": 362e12}


def flops_per_token(cfg, seq_len: int, *, training: bool = True) -> float:
    attn = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    dense = 6 * cfg.param_counts()["active"]
    return float(dense + attn) if training else float(dense + attn) / 3


def peak_flops(device=None) -> float | None:
    """The datasheet dense BF16 rate of a known device, None elsewhere (a CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    for name, v in PEAK_BF16.items():
        if name.lower() in kind.lower():
            return v
    return None


def mfu(tokens_per_s: float, cfg, seq_len: int, device=None, peak: float | None = None) -> float:
    """Fraction of ``peak`` (default: the device's datasheet rate); NaN where it is unknown."""
    peak = peak or peak_flops(device)
    return float("nan") if not peak else tokens_per_s * flops_per_token(cfg, seq_len) / peak
