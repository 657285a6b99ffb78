"""Markers: ``gpu`` tests need a CUDA device (run on the device as ``pytest -m gpu``) and skip
elsewhere; ``slow`` tests run in the full suite only (``pytest -m slow``)."""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip = pytest.mark.skip(reason="needs a GPU (run on the device: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)
