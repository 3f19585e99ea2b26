"""Test-wide setup: 8 simulated CPU devices (set before jax is imported) and fp32 matmuls."""
import os

# The tests' programs are tiny, so XLA:CPU's compile time dominates the suite: LLVM at -O0 compiles them ~30 %
# faster (measured: tests/trainer/test_routing_replay.py 65 -> 46 s). Results are the same IEEE arithmetic (XLA:CPU
# has no fast-math by default; matmuls are library calls either way); the CLIs and benchmarks keep XLA's default.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the CLIs turn JAX's persistent compilation cache on (compile_cache.py); tests must not write under the user's
# cache directory (the session's own cache is below; the CLI cache itself is tested with a temporary one)
os.environ.setdefault("JAXRL_ASYNC_COMPILE_CACHE", "off")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole session (a temporary directory, removed at exit): the many tests
# that build the same tiny models compile each program once, in-process and in the subprocesses they start (role
# processes, CLIs: through the environment; a test that measures the cache itself sets its own). Tests that count
# backend compiles turn it off around the count (tests/rollout/test_engine.py).
_XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl_async_test_xla_")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
