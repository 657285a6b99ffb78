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
differentiable. ``tiles`` (a ``GroupedTiles``) sets tokamax's tiles for the forward product,
dx and dW separately; None fields keep tokamax's heuristic.

Inference (the rollout) stores expert weights once in the layout each GEMM reads, so a step
does no transpose or cast of a weight: BF16 as [E, K, N] (``ExpertsKN``, ``grouped_dot_kn``),
the layout of tokamax's BF16 kernel; FP8 (E4M3) as [E, N, K] (``grouped_dot_fp8``), the
layout of its sm90 quantized kernel, which reads one byte a weight and converts in registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.config import DwTiles, GroupedTiles, KernelConfig, Tiles
from pallas_kernels.grouped_weight_grad import DIMS as DW_DIMS, grouped_dw

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


def _tokamax_config(t: Tiles | None, kernel: str):
    if t is None:
        return None
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common
    return common.Config(block_m=t.block_m, block_n=t.block_n, block_k=t.block_k, num_stages=t.num_stages, split_k=1,
                         persistent=t.persistent and kernel != "dw", grid_minor_dim=common.MatmulDimension.M,
                         grid_tile_width=1)


def _pallas_dw(x, dy, *, group_sizes, ragged_dot_dimension_numbers, preferred_element_type=None, tiles, **_):
    """tokamax's dW call signature (x [M, K], dy [M, N], contracting the ragged rows) on our
    Pallas kernel."""
    if ragged_dot_dimension_numbers != DW_DIMS:
        raise NotImplementedError(f"grouped_dw: dimension numbers {ragged_dot_dimension_numbers}")
    gs = jnp.array(group_sizes)  # tokamax passes its GroupSizes wrapper, which converts to an array
    return grouped_dw(x, dy, gs, out_dtype=preferred_element_type or x.dtype, config=tiles)



def tokamax_op(tiles: GroupedTiles | None, kernel: str):
    """One of the three expert-GEMM kernels, ``kernel`` "fwd", "dx" or "dw", with our tiles,
    as a callable of tokamax's ragged-dot signature (no VJP of its own): tokamax's Mosaic GPU
    kernel, or for a ``DwTiles`` dw entry our Pallas dW kernel."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as mgpu
    tiles = tiles or GroupedTiles()
    if kernel == "dw" and isinstance(tiles.dw, DwTiles):
        return functools.partial(_pallas_dw, tiles=tiles.dw)
    return mgpu.PallasMosaicGpuRaggedDot(config=_tokamax_config(getattr(tiles, kernel), kernel))


# the three products in the layouts tokamax's sm90 kernels read without a transpose:
# fwd  x [M, K] @ Wt [E, K, N] (tokamax's default numbers)
# dx   dy [M, N] @ W [E, N, K]: the stored weight is already that kernel's [E, K', N'] layout
# dw   dy_e.T @ x_e -> [E, N, K]: the stored weight's layout, so dW needs no transpose back
_FWD_DX = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _product(kernel, a, b, group_sizes, dims, tiles, on_gpu):
    """One of the three products in ``a``'s dtype, FP32 accumulation: tokamax / our dW kernel on
    a GPU, ``lax.ragged_dot_general`` with the same numbers elsewhere."""
    if not on_gpu:
        return jax.lax.ragged_dot_general(a, b, group_sizes, dims, preferred_element_type=jnp.float32).astype(a.dtype)
    if kernel == "dw" and isinstance(tiles.dw, DwTiles):  # tiles name x's K and dy's N: a = dy, b = x here
        tiles = dataclasses.replace(tiles, dw=dataclasses.replace(tiles.dw, block_k=tiles.dw.block_n, block_n=tiles.dw.block_k))
    return tokamax_op(tiles, kernel)(a, b, group_sizes=group_sizes, ragged_dot_dimension_numbers=dims,
                                     preferred_element_type=a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_tokamax(x, w, group_sizes, tiles, on_gpu):
    return _product("fwd", x, jnp.swapaxes(w, 1, 2), group_sizes, _FWD_DX, tiles, on_gpu)


def _grouped_tokamax_fwd(x, w, group_sizes, tiles, on_gpu):
    return _grouped_tokamax(x, w, group_sizes, tiles, on_gpu), (x, w, group_sizes)


def _grouped_tokamax_bwd(tiles, on_gpu, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)  # the kernels take operands of one dtype
    dx = _product("dx", dy, w, group_sizes, _FWD_DX, tiles, on_gpu)
    dw = _product("dw", dy, x, group_sizes, DW_DIMS, tiles, on_gpu)
    return dx, dw.astype(w.dtype), None


_grouped_tokamax.defvjp(_grouped_tokamax_fwd, _grouped_tokamax_bwd)


def grouped_dot_tokamax(x, w, group_sizes, *, out_dtype=None, tiles: GroupedTiles | None = None):
    """tokamax's grouped GEMMs (Mosaic GPU on sm90) and our dW kernel, FP32 accumulation, with
    ``tiles``; off the GPU the same three products run through XLA.

    The gradient is ours (a custom VJP), so that the weight is transposed once a step, not
    twice: tokamax's kernels read the forward weight as [E, K, N], so the forward transposes
    the stored [E, N, K] once; its VJP would then give dW as [E, K, N] and transpose it back
    (each transpose a full pass over the weight's gradient). Here dx reads the stored weight as it
    is and dW is computed as dy_e.T @ x_e, which comes out [E, N, K]."""
    _check(x, w, group_sizes)
    try:
        import tokamax  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("kernels.grouped='tokamax' needs tokamax (pip install 'quads-jax[gpu]'), "
                          "or set kernels.grouped='xla'") from e
    y = _grouped_tokamax(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), tiles or GroupedTiles(),
                         jax.default_backend() == "gpu")
    return y.astype(out_dtype or x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertsKN:
    """Stacked float expert weights stored [E, K, N] for inference. ``shape`` is the logical [E, N, K] of the model's
    weight it was made from (``from_enk``)."""
    values: jax.Array

    @classmethod
    def from_enk(cls, w, dtype) -> "ExpertsKN":
        if w.ndim != 3:
            raise ValueError(f"w: expected stacked expert weights [E, N, K], got shape {w.shape}")
        return cls(jnp.swapaxes(jnp.asarray(w).astype(dtype), 1, 2))

    @property
    def shape(self):
        e, k, n = self.values.shape
        return (e, n, k)

    @property
    def dtype(self):
        return self.values.dtype


# tokamax's quantized kernel dequantizes w * scale in the scale's type; a unit FP16 scale
# keeps the FP8 values exact, and the caller applies the real per-channel scales to the output
FP8_UNIT_SCALE = jnp.float16


def quantized_weight_tiles(k: int, subchannel: int | None = None) -> Tiles:
    """Tiles for tokamax's sm90 quantized kernel with a weight passed as [E, N, K]: what its
    own heuristic picks for the same weight passed as [E, K, N] (64 x 64, block_k = the scale's
    K tile up to 256, 2 stages, persistent). Its heuristic reads the scale tile's axis 1 as K,
    which for [E, N, K] is N's tile (1), so it cannot be used with this layout."""
    sub = k if subchannel is None else subchannel
    bk = 256 if sub % 256 == 0 and k % 256 == 0 else 128
    return Tiles(block_m=64, block_n=64, block_k=bk, num_stages=2, persistent=True)


def grouped_dot_fp8(x, values, group_sizes, *, impl: str = "auto", tiles: Tiles | None = None):
    """``x_e @ V_e.T`` per group for FP8 E4M3 expert values [E, N, K] (the layout they are
    quantized in, one scale per output channel, applied by the caller), forward only: the
    unscaled product in FP32. x must be BF16 with exact FP8 values (E4M3 is a subset of BF16).

    On a GPU ``impl`` "tokamax" (or "auto") runs tokamax's sm90 quantized kernel with unit
    scales. That kernel reads the weight as [E, N, K] in memory: its API takes [E, K, N] and
    transposes it back, so [E, N, K] goes in with the transposed dimension numbers, and the
    two transposes cancel in XLA (a [E, K, N] weight would be transposed on every call). It
    writes BF16 (its epilogue needs ``block_n`` output elements to fill one 128-byte swizzle,
    which FP32 output at block_n = 64 does not), rounded once, as a BF16 GEMM's output is.
    ``tiles`` None: ``quantized_weight_tiles``."""
    if values.ndim != 3 or values.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"values: expected float8_e4m3fn [E, N, K], got {values.dtype}{tuple(values.shape)}")
    _check(x, values, group_sizes)
    e, n, k = values.shape
    gs = group_sizes.astype(jnp.int32)
    x = x.astype(jnp.bfloat16)
    if KernelConfig(grouped=impl).resolved_grouped() == "xla" or jax.default_backend() != "gpu":
        return jax.lax.ragged_dot_general(x, values.astype(jnp.bfloat16), gs, DIMS, preferred_element_type=jnp.float32)
    import qwix
    import tokamax
    # FP16 operands: Mosaic GPU on sm90 converts E4M3 only to FP16 (it rejects a conversion
    # to BF16); E4M3 values are exact in FP16 as in BF16
    q = qwix.QArray(qvalue=values, scale=jnp.ones((e, n, 1), FP8_UNIT_SCALE), qtype=values.dtype)
    y = tokamax.ragged_dot_general(x.astype(jnp.float16), q, gs, DIMS, preferred_element_type=jnp.bfloat16,
                                   implementation=[tokamax_op(GroupedTiles(fwd=tiles or quantized_weight_tiles(k)), "fwd")])
    return y.astype(jnp.float32)


def grouped_dot_kn(x, w: ExpertsKN, group_sizes, *, impl: str = "auto", out_dtype=None, tiles: Tiles | None = None):
    """``x_e @ W_e`` per group for float weights stored [E, K, N] (``ExpertsKN``), forward
    only, FP32 accumulation. ``impl`` "tokamax" (``tiles``: None for its heuristic) or "xla"
    (``lax.ragged_dot``)."""
    if not isinstance(w, ExpertsKN):
        raise ValueError(f"w: expected an ExpertsKN ([E, K, N] values), got {type(w).__name__}")
    v = w.values
    e, k, n = v.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x: expected [M, {k}], got shape {x.shape}")
    if group_sizes.shape != (e,):
        raise ValueError(f"group_sizes: expected shape ({e},), got {group_sizes.shape}")
    if not jnp.issubdtype(v.dtype, jnp.floating) or v.dtype == jnp.float8_e4m3fn:
        raise ValueError(f"w: expected BF16/FP16/FP32 values (FP8 goes through grouped_dot_fp8), got {v.dtype}")
    gs = group_sizes.astype(jnp.int32)
    out_dtype = out_dtype or x.dtype
    if KernelConfig(grouped=impl).resolved_grouped() == "xla" or jax.default_backend() != "gpu":
        y = jax.lax.ragged_dot(x, v.astype(x.dtype), gs, preferred_element_type=jnp.float32)
        return y.astype(out_dtype)
    import tokamax
    y = tokamax.ragged_dot(x, v.astype(x.dtype), gs, preferred_element_type=x.dtype,
                           implementation=[tokamax_op(GroupedTiles(fwd=tiles), "fwd")])
    return y.astype(out_dtype)


def grouped_dot(x, w, group_sizes, *, impl: str = "auto", out_dtype=None, tiles: GroupedTiles | None = None):
    """``x_e @ w[e].T`` per group, by ``impl`` ("tokamax", "xla" or "auto"); ``tiles`` for
    tokamax (default: ``KernelConfig().grouped_tiles``). An ``ExpertsKN`` weight goes to
    ``grouped_dot_kn`` (forward only) with the tiles' ``infer`` entry."""
    if isinstance(w, ExpertsKN):
        t = KernelConfig().grouped_tiles if tiles is None else tiles
        return grouped_dot_kn(x, w, group_sizes, impl=impl, out_dtype=out_dtype, tiles=t.infer)
    which = KernelConfig(grouped=impl).resolved_grouped()
    if which == "tokamax":
        return grouped_dot_tokamax(x, w, group_sizes, out_dtype=out_dtype,
                                   tiles=KernelConfig().grouped_tiles if tiles is None else tiles)
    return grouped_dot_xla(x, w, group_sizes, out_dtype=out_dtype)
