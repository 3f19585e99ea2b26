"""Test-wide setup: 8 simulated CPU devices (set before jax is imported) and fp32 matmuls."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the CLIs turn JAX's persistent compilation cache on (compile_cache.py); tests run in-process and must not
# write under the user's cache directory (the cache itself is tested with a temporary one)
os.environ.setdefault("JAXRL_ASYNC_COMPILE_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
