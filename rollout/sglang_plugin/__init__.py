"""QUADS for clusters that serve with real SGLang.

- ``numerics``: the W4A4 + RAC linear in torch, bit-identical to the JAX reference (tested).
- ``method``: SGLang quantization method ``quads_nvfp4`` (linear + MoE) on top of it, which
  loads the ModelOpt-layout export of ``rollout.bridge.export_modelopt_nvfp4``.
- ``launcher``: builds the ``sglang.launch_server`` command with the method registered.

SGLang is not installed on this project's machines (its kernel wheel is too large to carry and
it has no CPU build here), so ``register()`` raises ImportError with that reason there.
"""

from rollout.sglang_plugin.numerics import quads_grouped_linear, quads_linear

METHOD_NAME = "quads_nvfp4"


def sglang_available() -> bool:
    try:
        import sglang  # noqa: F401
    except ImportError:
        return False
    return True


def register():
    """Register ``quads_nvfp4`` with SGLang (the ``sglang.srt.plugins`` entry point calls this)."""
    if not sglang_available():
        raise ImportError("sglang is not installed: the quads_nvfp4 method can only be registered where SGLang runs")
    from rollout.sglang_plugin.method import register_with_sglang

    return register_with_sglang(METHOD_NAME)


__all__ = ["METHOD_NAME", "register", "sglang_available", "quads_linear", "quads_grouped_linear"]
