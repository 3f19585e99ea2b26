"""The CPU kernels, C++ behind XLA FFI calls (issue 28): what XLA:CPU's own code generation pays for in copies.

* ``paged_decode`` (``cpu/paged_decode.cc``): the decode attention ``cpu_paged``, the CPU default. XLA:CPU's dots
  read contiguous operands, so the portable ``blocked`` path copies every block of a slot's pages out of the pool
  before it attends: on a 2-core CPU those copies were ~40% of a decode step (NOTES, session 15). The kernel reads
  each page's keys and values in place, once, on XLA's intra-op thread pool, and skips free slots. Same contract and
  result as ``paged.blocked_decode_attend`` (float32 scores and softmax; equal up to summation order), on the
  same ``page_heads`` pool layout, so the engine switches between them with nothing else changed.
* ``stacked_matmul`` (``cpu/stacked_matmul.cc``): ``x @ w[layer]`` reading the layer's matrix in place from the
  stacked ``[L, K, N]`` weights, for decode programs of a few rows (`models.transformer.stacked_layer_matmul`):
  inside the scan over layers XLA:CPU copies every layer's matrices out of the stack each step.
  ``stacked_matmul_packed`` (same file): the same product from a copy of the stack packed per column block of 64
  (`pack_columns`: [L, ceil(N / 64), K, 64], each block contiguous), which the hardware prefetchers stream at a few
  rows where the model's layout starts a new page every row (the engine's ``packed_weights``; same bits).
* ``matmul_nt`` (same file): ``x @ w.T`` for a row-major ``w`` [N, K], the tied embedding as the LM head of those
  programs (XLA:CPU's transposed dot at a few rows runs at about half the rate).
* ``sample_rows`` (``cpu/sample_rows.cc``): the decode step's sampler (`generator/sampling.py`'s inverse CDF and
  the logsumexp of its log-probs) in two passes over each row of logits, where XLA's program makes about ten.

The kernels are compiled on first use with the machine's compiler (``$CXX``, else ``c++`` / ``g++`` / ``clang++``)
against the headers jaxlib ships (``jax.ffi.include_dir()``), for this CPU (``-march=native``), into one library
cached under ``$JAXRL_ASYNC_KERNEL_CACHE`` (default ``~/.cache/jaxrl_async/kernels``), keyed by the sources, the
headers, the compiler and the CPU's flags (a few seconds once per machine). Where they cannot be built (no
compiler), `available()` is False, `unavailable_reason()` says why (logged once), and the engine's "auto" picks
``blocked`` and XLA's dots; asking for ``cpu_paged`` explicitly is then an error, never a silent fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
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

TARGETS = {"jaxrl_async_paged_decode": "JaxrlPagedDecode", "jaxrl_async_stacked_matmul": "JaxrlStackedMatmul",
           "jaxrl_async_stacked_matmul_packed": "JaxrlStackedMatmulPacked",
           "jaxrl_async_matmul_nt": "JaxrlMatmulNt", "jaxrl_async_sample_rows": "JaxrlSampleRows"}
_SOURCES = ("paged_decode.cc", "stacked_matmul.cc", "sample_rows.cc")
_HEADERS = ("parallel.h", "fast_math.h")
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


def has_avx512() -> bool:
    """This CPU has AVX-512 (F): the kernels' builds (``-march=native``) take their 512-bit paths."""
    return "avx512f" in _cpu_flags().split()


def _build() -> Path:
    sources = {name: resources.files("jaxrl_async.kernels").joinpath("cpu", name).read_bytes()
               for name in _SOURCES + _HEADERS}
    include = Path(jax.ffi.include_dir())
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    for part in (*sources.values(), (include / "xla/ffi/api/ffi.h").read_bytes(), (include / "xla/ffi/api/api.h").read_bytes(),
                 version.encode(), _cpu_flags().encode(), " ".join(_FLAGS).encode()):
        key.update(hashlib.sha256(part).digest())
    out_dir = cache_dir()
    out = out_dir / f"cpu_kernels-{key.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        srcs = []
        for name, text in sources.items():
            srcs.append(Path(tmp) / name)
            srcs[-1].write_bytes(text)
        lib = Path(tmp) / out.name
        units = [str(f) for f in srcs if f.suffix == ".cc"]  # the headers beside them are found by #include "..."
        proc = subprocess.run([cxx, *_FLAGS, f"-I{include}", "-o", str(lib), *units], capture_output=True,
                              text=True, timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{cxx} failed ({proc.returncode}): {' | '.join(tail)}")
        os.replace(lib, out)  # atomic: concurrent builders (processes of one run) agree on the result
    logger.info("cpu_kernels: built %s with %s", out, cxx)
    return out


def available() -> bool:
    """Build (once per machine), load and register the kernels; False with a logged reason where that fails."""
    with _lock:
        if "ok" not in _state:
            try:
                path = _build()
                lib = ctypes.cdll.LoadLibrary(str(path))
                tag = path.stem.rsplit("-", 1)[-1]  # the build's key: two builds (trees) in one process coexist
                for target, symbol in TARGETS.items():
                    try:
                        jax.ffi.register_ffi_target(f"{target}_{tag}", jax.ffi.pycapsule(getattr(lib, symbol)),
                                                    platform="cpu")
                    except Exception as e:  # noqa: BLE001
                        # another copy of this package in the process (a benchmark's baseline tree) registered
                        # the same build (the key covers sources, compiler and flags): the same code, use it
                        if "Duplicate FFI handler registration" not in str(e):
                            raise
                _state.update(ok=True, reason="", path=path, lib=lib, tag=tag)
            except Exception as e:  # noqa: BLE001 - any failure to build or load means: not available, said once
                _state.update(ok=False, reason=f"{type(e).__name__}: {e}")
                logger.warning("cpu_kernels: the CPU kernels are not available (%s); the portable 'blocked' "
                               "decode attention and XLA's dots run instead", _state["reason"])
        return _state["ok"]


def machine_key() -> str:
    """What compiled CPU code of this process is specific to: the kernels' build key (sources, compiler, CPU flags)
    when they are built, else a hash of the CPU's flags (`generator/program_cache.py` keys executables with it)."""
    if available():
        return f"kernels-{_state['tag']}"
    return "cpu-" + hashlib.sha256(_cpu_flags().encode()).hexdigest()[:20]


def _target(name: str) -> str:
    """The FFI target `name` as this process registered it (suffixed with the library's build key, so that the
    kernels of two source trees, e.g. a benchmark's baseline beside the current tree, never collide)."""
    return f"{name}_{_state['tag']}"


def unavailable_reason() -> str:
    available()
    return _state["reason"]


def paged_decode(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, lens: jax.Array, pages: jax.Array,
                 layer_idx, scale: float) -> jax.Array:
    """q [S, H, E] attends over keys 0..lens[s]-1 of slot s, read from pages[s] of layer `layer_idx` of the pools
    [L, P, K, page, E] (``page_heads``); lens[s] <= 0: zeros. -> [S, H, E] in q's dtype."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
    call = jax.ffi.ffi_call(_target("jaxrl_async_paged_decode"), jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pool, v_pool, lens.astype(jnp.int32), pages.astype(jnp.int32),
                jnp.asarray(layer_idx, jnp.int32), scale=np.float32(scale))


def stacked_matmul(x: jax.Array, w: jax.Array, layer_idx) -> jax.Array:
    """x [M, K] @ w[layer_idx] with w [L, K, N] read in place (float32 only) -> [M, N] float32."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"stacked_matmul: float32 x [M, K] and w [L, K, N], got {x.dtype}{x.shape}, {w.dtype}{w.shape}")
    call = jax.ffi.ffi_call(_target("jaxrl_async_stacked_matmul"),
                            jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))
    return call(x, w, jnp.asarray(layer_idx, jnp.int32))


PACK_COLUMNS = 64  # the kernel's column block


def _aligned_empty(shape: tuple[int, ...], align: int = 64) -> np.ndarray:
    """An uninitialised float32 array whose data starts on an `align`-byte boundary: XLA:CPU's alignment, at which
    `jax.device_put` on a CPU device takes numpy's memory as it is instead of copying it."""
    n = math.prod(shape)
    buf = np.empty(n + align // 4, np.float32)
    start = (-buf.ctypes.data % align) // 4
    return buf[start:start + n].reshape(shape)


def pack_columns(w) -> np.ndarray:
    """w [L, K, N] (any array) -> [L, ceil(N / 64), K, 64] float32 numpy, block b holding columns [64 b, 64 b + 64)
    (the last block zero-padded): `stacked_matmul_packed`'s layout. One copy, into 64-byte aligned memory, so that
    placing it on a CPU device copies nothing more (a new weight set's copy is made per push: NOTES, session 25)."""
    w = np.asarray(w, np.float32)
    L, K, N = w.shape
    C = PACK_COLUMNS
    full, nb = N // C, -(-N // C)
    out = _aligned_empty((L, nb, K, C))
    if full:
        np.copyto(out[:, :full], w[:, :, :full * C].reshape(L, K, full, C).transpose(0, 2, 1, 3))
    if nb > full:  # the last block: the remaining columns, then zeros
        out[:, full, :, :N - full * C] = w[:, :, full * C:]
        out[:, full, :, N - full * C:] = 0.0
    return out


def stacked_matmul_packed(x: jax.Array, wp: jax.Array, layer_idx, n: int) -> jax.Array:
    """x [M, K] @ w[layer_idx][:, :n] from wp = `pack_columns(w)` [L, ceil(n / 64), K, 64] read in place (float32) ->
    [M, n] float32: the bits of `stacked_matmul(x, w, layer_idx)`."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
    if (x.dtype != jnp.float32 or wp.dtype != jnp.float32 or x.ndim != 2 or wp.ndim != 4 or x.shape[1] != wp.shape[2]
            or wp.shape[3] != PACK_COLUMNS or wp.shape[1] != -(-n // PACK_COLUMNS)):
        raise ValueError(f"stacked_matmul_packed: float32 x [M, K] and w [L, ceil({n} / 64), K, 64], got "
                         f"{x.dtype}{x.shape}, {wp.dtype}{wp.shape}")
    call = jax.ffi.ffi_call(_target("jaxrl_async_stacked_matmul_packed"), jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, wp, jnp.asarray(layer_idx, jnp.int32))


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w.T with w [N, K] read in place (float32, M <= 64) -> [M, N] float32."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
    if (x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]
            or x.shape[0] > 64):
        raise ValueError(f"matmul_nt: float32 x [M <= 64, K] and w [N, K], got {x.dtype}{x.shape}, {w.dtype}{w.shape}")
    call = jax.ffi.ffi_call(_target("jaxrl_async_matmul_nt"),
                            jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return call(x.T, w)


def sample_rows(logits: jax.Array, temperature: jax.Array, theta: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of logits [B, V]: the token `sampling.inverse_cdf` draws from softmax(z) on the support {z >= theta}
    at u, z = logits * (1 / T) (T <= 0: z = logits and the first maximal logit), and the normaliser lse =
    logsumexp(z) over the full vocabulary. temperature, theta, u [B]. -> (tokens [B] int32, lse [B] float32)."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
    if logits.ndim != 2:
        raise ValueError(f"sample_rows: logits [B, V], got {logits.shape}")
    B = logits.shape[0]
    f32 = jnp.float32
    call = jax.ffi.ffi_call(_target("jaxrl_async_sample_rows"),
                            (jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), f32)))
    return call(logits.astype(f32), temperature.astype(f32), theta.astype(f32), u.astype(f32))
