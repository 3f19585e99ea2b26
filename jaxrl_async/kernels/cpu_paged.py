"""Paged decode attention for XLA:CPU as an XLA FFI call (``cpu_paged``, the CPU default; issue 28).

XLA:CPU's dots read contiguous operands, so the portable ``blocked`` path copies every block of a slot's pages out
of the pool before it attends: on a 2-core CPU those copies were ~40% of a decode step (NOTES, session 15). This
kernel (``cpu/paged_decode.cc``) reads each page's keys and values in place, once, on XLA's intra-op thread pool,
and skips free slots. Same contract and result as ``paged.blocked_decode_attend`` (float32 scores, online
softmax; equal up to summation order), on the same ``page_heads`` pool layout, so the engine switches between
them with nothing else changed.

The kernel is C++ compiled on first use with the machine's compiler (``$CXX``, else ``c++`` / ``g++`` /
``clang++``) against the headers jaxlib ships (``jax.ffi.include_dir()``), for this CPU (``-march=native``), and
cached under ``$JAXRL_ASYNC_KERNEL_CACHE`` (default ``~/.cache/jaxrl_async/kernels``), keyed by the source, the
headers, the compiler and the CPU's flags (a few seconds once per machine). Where it cannot be built (no
compiler), `available()` is False, `unavailable_reason()` says why (logged once), and the engine's "auto" picks
``blocked``; asking for ``cpu_paged`` explicitly is then an error, never a silent fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "jaxrl_async_paged_decode"
_SOURCE = "paged_decode.cc"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")
_BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "reason": str, "path": Path, "lib": ctypes.CDLL


def cache_dir() -> Path:
    env = os.environ.get("JAXRL_ASYNC_KERNEL_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxrl_async" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", "").strip(), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _build() -> Path:
    source = resources.files("jaxrl_async.kernels").joinpath("cpu", _SOURCE).read_bytes()
    include = Path(jax.ffi.include_dir())
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    for part in (source, (include / "xla/ffi/api/ffi.h").read_bytes(), (include / "xla/ffi/api/api.h").read_bytes(),
                 version.encode(), _cpu_flags().encode(), " ".join(_FLAGS).encode()):
        key.update(hashlib.sha256(part).digest())
    out_dir = cache_dir()
    out = out_dir / f"paged_decode-{key.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / _SOURCE
        src.write_bytes(source)
        lib = Path(tmp) / out.name
        proc = subprocess.run([cxx, *_FLAGS, f"-I{include}", "-o", str(lib), str(src)], capture_output=True,
                              text=True, timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{cxx} failed ({proc.returncode}): {' | '.join(tail)}")
        os.replace(lib, out)  # atomic: concurrent builders (processes of one run) agree on the result
    logger.info("cpu_paged: built %s with %s", out, cxx)
    return out


def available() -> bool:
    """Build (once per machine), load and register the kernel; False with a logged reason where that fails."""
    with _lock:
        if "ok" not in _state:
            try:
                path = _build()
                lib = ctypes.cdll.LoadLibrary(str(path))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxrlPagedDecode), platform="cpu")
                _state.update(ok=True, reason="", path=path, lib=lib)
            except Exception as e:  # noqa: BLE001 - any failure to build or load means: not available, said once
                _state.update(ok=False, reason=f"{type(e).__name__}: {e}")
                logger.warning("cpu_paged: the CPU decode-attention kernel is not available (%s); the portable "
                               "'blocked' attention runs instead", _state["reason"])
        return _state["ok"]


def unavailable_reason() -> str:
    available()
    return _state["reason"]


def paged_decode(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, lens: jax.Array, pages: jax.Array,
                 layer_idx, scale: float) -> jax.Array:
    """q [S, H, E] attends over keys 0..lens[s]-1 of slot s, read from pages[s] of layer `layer_idx` of the pools
    [L, P, K, page, E] (``page_heads``); lens[s] <= 0: zeros. -> [S, H, E] in q's dtype."""
    if not available():
        raise RuntimeError(f"the cpu_paged kernel is not available: {unavailable_reason()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pool, v_pool, lens.astype(jnp.int32), pages.astype(jnp.int32),
                jnp.asarray(layer_idx, jnp.int32), scale=np.float32(scale))
