"""Suite-wide setup: one persistent XLA compilation cache for the run.

Many tests build the same engines, kernels and train steps (same shapes, same HLO) in
fresh jit closures, which XLA would compile again each time; with the cache on, a program
compiled once in the run is loaded from disk afterwards. The cache lives in a temporary
directory of this run (set QUADS_TEST_JAX_CACHE to keep one across runs), and subprocesses
started by tests inherit it through JAX_COMPILATION_CACHE_DIR."""

import os
import tempfile

import jax

_cache = os.environ.get("QUADS_TEST_JAX_CACHE") or tempfile.mkdtemp(prefix="quads-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
