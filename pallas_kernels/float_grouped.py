"""Float grouped matmul for rows sorted by expert: the trainer's expert GEMMs.

    y = grouped_dot(x, w, group_sizes, impl="tokamax")   # x [M, K], w [E, N, K] -> y [M, N]

Row block e of x (``group_sizes[e]`` rows, in order) is multiplied by ``w[e].T``. The weight
stays in the layout the model stores it in, [E, N, K] (Hugging Face's [out, in]); the XLA
reference contracts its last axis directly (``ragged_dot_general``).

Implementations, picked by ``impl`` (``KernelConfig.grouped``):

    "tokamax"  tokamax.ragged_dot_general: Mosaic GPU (sm90) grouped GEMM kernels, with a VJP
               whose dx and per-expert dW are grouped GEMMs too. Needs the ``gpu`` extra.
    "xla"      ``jax.lax.ragged_dot_general``: the reference. XLA:GPU lowers it to dense
               products over all experts (memory and time grow with tokens x experts).

Both return ``out_dtype`` (default: x's dtype) from FP32 accumulation, and both are
differentiable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.config import KernelConfig

# rows of x ragged over the groups, w's group axis 0, x's axis 1 contracted with w's axis 2
DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _check(x, w, group_sizes):
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    if w.ndim != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"w: expected [E, N, K] with K={x.shape[1]}, got shape {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes: expected shape ({w.shape[0]},), got {group_sizes.shape}")


def grouped_dot_xla(x, w, group_sizes, *, out_dtype=None):
    """The reference: ``jax.lax.ragged_dot_general`` with FP32 accumulation."""
    _check(x, w, group_sizes)
    y = jax.lax.ragged_dot_general(x, w, group_sizes.astype(jnp.int32), DIMS, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def grouped_dot_tokamax(x, w, group_sizes, *, out_dtype=None):
    """tokamax's grouped GEMM (Mosaic GPU on sm90), FP32 accumulation."""
    _check(x, w, group_sizes)
    try:
        import tokamax
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("kernels.grouped='tokamax' needs tokamax (pip install 'quads-jax[gpu]'), "
                          "or set kernels.grouped='xla'") from e
    impl = None if jax.default_backend() == "gpu" else "xla"  # tokamax's own XLA path off the GPU
    # The kernel accumulates in FP32 and writes x's dtype; its VJP needs the cotangent in that
    # dtype too (its backward GEMMs take operands of one dtype). The weight goes in as [E, K, N]
    # with the default dimension numbers: tokamax 0.0.17 transposes a [E, N, K] weight itself
    # in the forward pass, but its VJP then returns dW in the [E, K, N] shape (seen on an H100,
    # 2026-12-05), so the transpose is ours, where JAX differentiates it.
    y = tokamax.ragged_dot(x, jnp.swapaxes(w.astype(x.dtype), 1, 2), group_sizes.astype(jnp.int32),
                           preferred_element_type=x.dtype, implementation=impl)
    return y.astype(out_dtype or x.dtype)


def grouped_dot(x, w, group_sizes, *, impl: str = "auto", out_dtype=None):
    """``x_e @ w[e].T`` per group, by ``impl`` ("tokamax", "xla" or "auto")."""
    which = KernelConfig(grouped=impl).resolved_grouped()
    fn = grouped_dot_tokamax if which == "tokamax" else grouped_dot_xla
    return fn(x, w, group_sizes, out_dtype=out_dtype)
