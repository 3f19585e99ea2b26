"""The command-line tools, one module each: ``main`` (the RL run), ``generate``, ``evaluate``, ``score``,
``export``, ``plan``; ``common`` holds what they share (the one-line error style, parsers, path checks),
``jsonl`` the row reader of ``generate`` / ``score`` and ``compile_cache`` the persistent compilation cache
they turn on. Run them as ``python -m jaxrl_async.<tool>`` (the top-level modules of those names are the
entry points and hold nothing else). No library module imports a CLI module.
"""

import glob as _glob
import importlib.util as _importlib_util
import logging as _logging
import os as _os
import tempfile as _tempfile


def quiet_cuda_probe() -> None:
    """Where the CUDA plugin is installed (the ``aot-gpu`` extra: deviceless compiles for H100) on a machine
    without an NVIDIA GPU, JAX's plugin discovery writes ~20 lines of CUDA errors (C++ logs and a Python
    traceback) before every tool's output. Here the discovery runs once with stderr captured, so the tools
    start quietly; the capture is kept in a log record (``logging`` at DEBUG) and written out if the discovery
    itself fails. Nothing changes where a GPU device node exists, the plugin is absent, or
    ``JAXRL_ASYNC_PLUGIN_LOGS=1``."""
    if (_glob.glob("/dev/nvidia[0-9]*") or _os.path.exists("/dev/dxg") or _os.environ.get("JAXRL_ASYNC_PLUGIN_LOGS")
            or _importlib_util.find_spec("jax_plugins") is None
            or not any(_importlib_util.find_spec(m) for m in ("jax_plugins.xla_cuda12", "jax_cuda12_plugin"))):
        return
    import sys

    if "jax" in sys.modules:  # its GPU modules already loaded (and logged): only the discovery is left to quiet
        from jax._src import xla_bridge as xb

        if getattr(xb, "_plugins_registered", True) or not hasattr(xb, "discover_pjrt_plugins"):
            return
    with _tempfile.TemporaryFile(mode="w+b") as buf:
        sys.stderr.flush()
        saved = _os.dup(2)
        _os.dup2(buf.fileno(), 2)
        try:
            import jax  # noqa: F401 - jaxlib's GPU modules (solver, prng, sparse, ...) log as they load
            from jax._src import xla_bridge as xb

            with xb._plugin_lock:
                if not getattr(xb, "_plugins_registered", True) and hasattr(xb, "discover_pjrt_plugins"):
                    # the plugin stays registered (plan/aot.py compiles for H100 through it) without the CUDA
                    # version check, which needs a driver this machine does not have
                    skip = _os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
                    _os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
                    try:
                        xb.discover_pjrt_plugins()
                    finally:
                        if skip is None:
                            del _os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
                    xb._plugins_registered = True
            import jax.experimental.pallas  # noqa: F401 - and Pallas's GPU lowering modules
            import jax.experimental.pallas.triton  # noqa: F401
        except BaseException:
            sys.stderr.flush()
            _os.dup2(saved, 2)
            buf.seek(0)
            sys.stderr.write(buf.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            _os.dup2(saved, 2)
            _os.close(saved)
        buf.seek(0)
        _logging.getLogger(__name__).debug("JAX plugin discovery without an NVIDIA GPU (stderr captured):\n%s",
                                           buf.read().decode(errors="replace"))


quiet_cuda_probe()
