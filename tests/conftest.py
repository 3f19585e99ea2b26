"""Test-wide setup: 8 simulated CPU devices (set before jax is imported) and fp32 matmuls."""
import os

# The tests' programs are tiny, so XLA:CPU's compile time dominates the suite: LLVM at -O0 compiles them ~30 %
# faster (measured: tests/trainer/test_routing_replay.py 65 -> 46 s). The arithmetic is IEEE either way (no
# fast-math), but -O0 does not contract a * b + c into fused multiply-adds, so sums round a little differently:
# a test whose tolerance is about the production compiler's rounding (`@pytest.mark.default_xla_opt`) runs in a
# process of its own at XLA's default level (`pytest_pyfunc_call` below). The CLIs, benchmarks and users keep the
# default; the processes tests start inherit the suite's flags (`testing.subprocess_xla_flags`).
_O0 = "--xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {_O0}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the CLIs turn JAX's persistent compilation cache on (compile_cache.py); tests must not write under the user's
# cache directory (the session's own cache is below; the CLI cache itself is tested with a temporary one)
os.environ.setdefault("JAXRL_ASYNC_COMPILE_CACHE", "off")

import atexit  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole session (a temporary directory, removed at exit): the many tests
# that build the same tiny models compile each program once, in-process and in the subprocesses they start (role
# processes, CLIs: through the environment; a test that measures the cache itself sets its own). Tests that count
# backend compiles turn it off around the count (tests/generator/test_engine.py).
# Under pytest-xdist the workers inherit the controller's directory (one cache for the whole run); whoever created
# the directory removes it.
_XLA_CACHE = os.environ.get("JAXRL_ASYNC_TEST_XLA_CACHE", "")
if not _XLA_CACHE:
    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl_async_test_xla_")
    os.environ["JAXRL_ASYNC_TEST_XLA_CACHE"] = _XLA_CACHE
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
# The CPU decode-attention kernel (kernels/cpu_kernels.py) is built once per session into a temporary cache the
# same way (workers and subprocesses inherit it), not into the user's ~/.cache.
if not os.environ.get("JAXRL_ASYNC_KERNEL_CACHE"):
    os.environ["JAXRL_ASYNC_KERNEL_CACHE"] = os.path.join(_XLA_CACHE, "kernels")
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")


def pytest_configure(config):
    config.addinivalue_line("markers", "default_xla_opt: numerics checked at XLA's default optimisation level (the "
                                       "suite compiles at -O0: run in a process of its own)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A ``default_xla_opt`` test, while this process compiles at -O0, runs as its own pytest process at XLA's
    default level (same test id, same fixtures); it passes or fails as that process does."""
    if pyfuncitem.get_closest_marker("default_xla_opt") is None or _O0 not in os.environ.get("XLA_FLAGS", ""):
        return None
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"].replace(_O0, "").strip())
    env.pop("JAXRL_ASYNC_TEST_XLA_CACHE", None)  # (its own cache: entries are keyed by the flags anyway)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           pyfuncitem.nodeid], cwd=str(pyfuncitem.config.rootpath), env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{pyfuncitem.nodeid} at XLA's default optimisation level:\n{proc.stdout[-4000:]}"
    return True
