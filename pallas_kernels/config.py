"""Which implementation each op runs: one frozen value, passed down explicitly.

    kc = KernelConfig(backend="pallas", grouped="tokamax", attention="cudnn")
    prec = dataclasses.replace(precision.train_policy("bf16"), kernels=kc)

Fields (each validated here, with a one-line error naming the field):

    backend    the NVFP4 / FP8 kernels: "pallas" (the Pallas kernels; interpreted on a CPU),
               "xla" (their XLA references), or "auto" (pallas on a GPU, xla elsewhere).
    grouped    float grouped matmuls (the trainer's expert GEMMs, the BF16 rollout's MoE):
               "tokamax" (tokamax.ragged_dot: Mosaic GPU kernels with a VJP), "xla"
               (``jax.lax.ragged_dot_general``, the reference; XLA:GPU expands it densely over
               all experts, so it is slow and large there), or "auto" (tokamax on a GPU,
               xla elsewhere).
    attention  attention without a KV cache (training, scoring, prefill): "cudnn" (flash
               attention through ``jax.nn.dot_product_attention``), "tokamax" (tokamax's
               Mosaic GPU flash attention and its VJP), "xla" (the reference: the full score
               tensor), or "auto" (cudnn on a GPU, xla elsewhere).
    decode_attention  attention of one new token per row over a KV cache (the rollout's decode
               steps): "pallas" (``pallas_kernels.cache_attention``: reads only each row's
               live keys), "xla" (the reference: scores over the whole cache, masked), or
               "auto" (pallas on a GPU, xla elsewhere).
    grouped_tiles  the tiles of the three expert GEMMs, ``GroupedTiles(fwd, dx, dw)``: each a
               tokamax ``Tiles`` or None for tokamax's own heuristic (a 64 x 64 tile on sm90);
               dw may instead be a ``DwTiles``, which runs our Pallas dW kernel. The default
               is the fastest measured at the bench model's shapes on an H100
               (benchmarks/results/2026-12-05-h100-train-tiles).
    decode_attention_tiles  the Pallas decode attention's ``DecodeAttentionConfig`` (or a dict
               of its fields).
    command_buffers  how the rollout engine's compiled programs (prefill, decode steps)
               launch their kernels, as XLA compiler options of those programs
               (``compiler_options()``): "kernels", the default (CUDA graphs around runs of
               at least two fusions, cuBLASLt GEMMs and custom calls, the Pallas kernels among
               them; the decode loop itself stays on the host), "xla" (XLA's defaults), "off"
               (each kernel launched from the host) or "loops" (the decode loop and
               conditionals captured too). A decode step of a small MoE is hundreds of short
               kernels whose launches are a large part of its time; "kernels" measured fastest
               on an H100 (benchmarks/results), and ``bench_rollout.py --recipes
               name@command_buffers=...`` compares them on another device. A CPU compile
               ignores the options.

"auto" resolves from the platform the computation is traced for, never from process state,
so the same config gives the same program on the same machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

BACKENDS = ("pallas", "xla")
GROUPED = ("tokamax", "xla")
ATTENTION = ("cudnn", "tokamax", "xla")
DECODE_ATTENTION = ("pallas", "xla")
_GRAPHED = "FUSION,CUBLASLT,CUSTOM_CALL"
COMMAND_BUFFERS = {
    "xla": None,
    "off": {"xla_gpu_enable_command_buffer": ""},
    "kernels": {"xla_gpu_enable_command_buffer": _GRAPHED, "xla_gpu_graph_min_graph_size": 2},
    "loops": {"xla_gpu_enable_command_buffer": _GRAPHED + ",WHILE,CONDITIONAL", "xla_gpu_graph_min_graph_size": 2},
}


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _pick(field: str, value: str, allowed: tuple[str, ...], gpu_choice: str) -> str:
    if value == "auto":
        return gpu_choice if _on_gpu() else "xla"
    if value not in allowed:
        raise ValueError(f"kernels.{field}={value!r}: expected one of {('auto',) + allowed}")
    return value


def _check_tiles(t, where: str, positive: tuple[str, ...], blocks: tuple[str, ...], multiple: int) -> None:
    for name in positive:
        v = getattr(t, name)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{where}: {name}={v!r}, expected a positive integer")
    if any(getattr(t, b) % multiple for b in blocks):
        raise ValueError(f"{where}: {', '.join(blocks)} must be multiples of {multiple}, got "
                         f"{', '.join(str(getattr(t, b)) for b in blocks)}")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One tile config of tokamax's sm90 grouped GEMM: an output tile of ``block_m`` x
    ``block_n``, ``block_k`` deep, ``num_stages`` copies in flight; ``persistent`` keeps one
    program per SM looping over tiles (the forward and dx kernels only)."""
    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_stages: int = 2
    persistent: bool = False

    def __post_init__(self):
        _check_tiles(self, "kernels.grouped_tiles", ("block_m", "block_n", "block_k", "num_stages"),
                     ("block_m", "block_n", "block_k"), 64)


@dataclasses.dataclass(frozen=True)
class DwTiles:
    """Tiles of our Pallas dW kernel (``pallas_kernels.grouped_weight_grad``): an output tile of
    ``block_k`` x ``block_n`` accumulated over ``block_r`` rows a step. ``expert_outer``: the
    expert is the slowest grid axis, so the programs running at once share a few experts'
    rows of x and dy through L2 (False: the fastest axis, so the programs running at once
    each read a different expert's rows from HBM)."""
    block_k: int = 128
    block_n: int = 128
    block_r: int = 64
    num_warps: int = 8
    num_stages: int = 3
    expert_outer: bool = True

    def __post_init__(self):
        _check_tiles(self, "kernels.grouped_tiles.dw", ("block_k", "block_n", "block_r", "num_warps", "num_stages"),
                     ("block_k", "block_n", "block_r"), 16)
        if not isinstance(self.expert_outer, bool):
            raise ValueError(f"kernels.grouped_tiles.dw: expert_outer={self.expert_outer!r}, expected true or false")

    def check(self, k: int, n: int) -> None:
        if k % self.block_k or n % self.block_n:
            raise ValueError(f"kernels.grouped_tiles.dw: tiles ({self.block_k}, {self.block_n}) must divide K={k} and N={n}")


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """Tiles of the forward product (x @ W_e), dx (dy @ W_e.T) and dW (x_e.T @ dy_e). The dW
    entry's type picks its kernel: ``Tiles`` tokamax's, ``DwTiles`` ours (grouped_dw).
    ``infer``: the forward product of inference weights (``ExpertsKN``: the rollout's BF16
    and FP8 experts, a few rows an expert at decode)."""
    fwd: Tiles | None = None
    dx: Tiles | None = None
    dw: Tiles | DwTiles | None = None
    infer: Tiles | None = None

    @classmethod
    def from_dict(cls, d) -> "GroupedTiles":
        if isinstance(d, GroupedTiles):
            return d
        if not isinstance(d, dict) or set(d) - {"fwd", "dx", "dw", "infer"}:
            raise ValueError(f"kernels.grouped_tiles: expected a mapping with keys among fwd, dx, dw, infer, got {d!r}")
        def one(k, v):
            if v is None or isinstance(v, (Tiles, DwTiles)):
                return v
            if not isinstance(v, dict):
                raise ValueError(f"kernels.grouped_tiles.{k}: expected a mapping of tile sizes, got {v!r}")
            if k == "dw" and "block_r" in v:
                return DwTiles(**v)
            return Tiles(**v)
        return cls(**{k: one(k, v) for k, v in d.items()})


# The fastest measured at the bench model's expert shapes (benchmarks/results/2026-12-05-h100-
# train-tiles). fwd and dx: tokamax with 128 x 128 tiles, bit-identical to its heuristic's
# output. dW: our kernel, where tokamax's was slower and, at larger tiles, wrong.
_TILE = Tiles(block_m=128, block_n=128, block_k=64, num_stages=4, persistent=True)
DEFAULT_GROUPED_TILES = GroupedTiles(fwd=_TILE, dx=_TILE, dw=DwTiles(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3))


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """The live-KV decode attention's tiles (``cache_attention``): ``block_k`` keys a loop
    step; ``splits`` parts of each row's live keys (None: from the batch); ``num_warps`` /
    ``num_stages`` of the Triton program."""
    block_k: int = 64
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not isinstance(self.block_k, int) or self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"decode attention block_k={self.block_k!r}: expected a power of two >= 16")
        if self.splits is not None and (not isinstance(self.splits, int) or self.splits < 1):
            raise ValueError(f"decode attention splits={self.splits!r}: expected None or an integer >= 1")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    backend: str = "auto"
    grouped: str = "auto"
    attention: str = "auto"
    decode_attention: str = "auto"
    grouped_tiles: GroupedTiles = DEFAULT_GROUPED_TILES
    decode_attention_tiles: DecodeAttentionConfig = DecodeAttentionConfig()
    command_buffers: str = "kernels"

    def __post_init__(self):
        for name, allowed in (("backend", BACKENDS), ("grouped", GROUPED), ("attention", ATTENTION),
                              ("decode_attention", DECODE_ATTENTION)):
            v = getattr(self, name)
            if v != "auto" and v not in allowed:
                raise ValueError(f"kernels.{name}={v!r}: expected one of {('auto',) + allowed}")
        if not isinstance(self.grouped_tiles, GroupedTiles):
            object.__setattr__(self, "grouped_tiles", GroupedTiles.from_dict(self.grouped_tiles))
        if isinstance(self.decode_attention_tiles, dict):
            object.__setattr__(self, "decode_attention_tiles", DecodeAttentionConfig(**self.decode_attention_tiles))
        if not isinstance(self.decode_attention_tiles, DecodeAttentionConfig):
            raise ValueError(f"kernels.decode_attention_tiles={self.decode_attention_tiles!r}: expected a DecodeAttentionConfig or a dict of its fields")
        if self.command_buffers not in COMMAND_BUFFERS:
            raise ValueError(f"kernels.command_buffers={self.command_buffers!r}: expected one of {tuple(COMMAND_BUFFERS)}")

    def compiler_options(self) -> dict | None:
        """The XLA compiler options of ``command_buffers`` for ``jax.jit(compiler_options=...)``
        (None: XLA's defaults). GPU options: a CPU compile accepts and ignores them."""
        opts = COMMAND_BUFFERS[self.command_buffers]
        return None if opts is None else dict(opts)

    def resolved_backend(self) -> str:
        return _pick("backend", self.backend, BACKENDS, "pallas")

    def resolved_grouped(self) -> str:
        return _pick("grouped", self.grouped, GROUPED, "tokamax")

    def resolved_attention(self) -> str:
        return _pick("attention", self.attention, ATTENTION, "cudnn")

    def resolved_decode_attention(self) -> str:
        return _pick("decode_attention", self.decode_attention, DECODE_ATTENTION, "pallas")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "KernelConfig":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"kernels: unknown keys {unknown}; expected some of {sorted(names)}")
        return cls(**d)


def resolve_backend(backend: str | None) -> str:
    """An op's ``backend=`` argument: None or "auto" means pallas on a GPU, xla elsewhere."""
    return KernelConfig(backend=backend or "auto").resolved_backend()


def interpret_mode() -> bool:
    """True when Pallas kernels must be interpreted (no GPU backend present)."""
    return not _on_gpu()
