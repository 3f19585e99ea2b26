"""JAX's persistent compilation cache, on by default for the command-line tools.

XLA compilation is a fixed cost of every process (seconds per program on a CPU: the decode step, each
prefill bucket, the train step), paid again on every run of the same shapes. With the cache on, a later run
of the same model, shapes and jax/XLA version loads the compiled programs from disk instead (measured on
the generation benchmark: benchmarks/RESULTS.md). JAX keys entries by the program, the compile options and
the backend, so a stale entry is never used.

Setting: the environment variable ``JAXRL_ASYNC_COMPILE_CACHE``: unset = ``$XDG_CACHE_HOME/jaxrl_async/xla``
(``~/.cache/jaxrl_async/xla``), a path = that directory, ``off`` (or ``0``/``false``/``none``) = no cache.
A cache directory set through JAX itself (``JAX_COMPILATION_CACHE_DIR``) is left as it is.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV = "JAXRL_ASYNC_COMPILE_CACHE"
OFF = ("off", "0", "false", "none", "no")
MIN_COMPILE_TIME_S = 0.2  # programs compiling faster than this are not worth a disk entry


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxrl_async", "xla")


def enable(setting: str | None = None) -> str | None:
    """Turn the persistent cache on (see the module doc); returns its directory, or None when off."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:  # set through JAX's own option: respect it
        return current
    setting = os.environ.get(ENV, "") if setting is None else setting
    if setting.strip().lower() in OFF:
        return None
    path = os.path.expanduser(setting) if setting.strip() else default_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        logger.warning("compilation cache off: cannot create %s (%s); set %s to a writable directory or 'off'",
                       path, err, ENV)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    logger.info("compilation cache: %s (%s=off disables it)", path, ENV)
    return path


def program_cache(cache_dir: str | None):
    """The engine's program cache (``generator/program_cache.py``: executables found without tracing) under
    ``cache_dir/programs``, or None when the compilation cache is off."""
    if not cache_dir:
        return None
    from jaxrl_async.generator.program_cache import ProgramCache

    try:
        return ProgramCache(os.path.join(cache_dir, "programs"))
    except OSError as err:
        logger.warning("program cache off: %s", err)
        return None
