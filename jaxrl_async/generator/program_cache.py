"""The engine's compiled programs on disk, found without tracing (issue 28: a process's start-up).

JAX's persistent compilation cache (``cli/compile_cache.py``) saves the XLA compile, but its key is the lowered
program, so every process still traces and lowers every program first: on the generation benchmark that is ~1 s
of Python per `generate` process (the decode step and its compacted sizes, prefill, insert, the samplers, ...),
more than loading the executables, and the compacted steps' lowering competes with the first decode steps for the
GIL. This cache keys each program by what determines it before tracing: the program's name, the engine's settings
(``context``: model config, slots, sequence length, buckets, attention, shardings, ...), the abstract arguments
(tree structure, shapes, dtypes, weak types, shardings with their devices), and the process (jax and jaxlib
versions, the devices, ``XLA_FLAGS``, JAX's configuration, a digest of this package's sources, so any change of the
code that traces the programs is a different key, and on a CPU the CPU kernels' build, which names the machine's
CPU flags and compiler). A hit deserializes the executable
(`jax.experimental.serialize_executable`) and the engine calls it directly (`engine._Program`); a miss lowers and
compiles (itself served by JAX's cache where it has the entry) and writes the entry (atomically).

Entries are pickled executables, loaded with the trust JAX's own cache gets: the directory is the user's own
(``<compilation cache>/programs``). An entry that does not load is counted, logged once and replaced.

Only a freshly compiled executable is written: XLA:CPU's executables loaded from JAX's persistent cache serialize
without their kernels' code (measured with jax 0.10.2: the reloaded program fails with "Function ... not found"),
so a miss compiles with JAX's persistent cache bypassed (`_fresh_compiles`, its one process-wide switch, held by a
count while any miss compiles), and an executable that still came from JAX's cache (its cache-hit event in the
compiling thread) is used but not written.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import tempfile
import threading
from typing import Any, Callable

import jax

__all__ = ["ProgramCache", "args_signature", "source_digest"]

logger = logging.getLogger(__name__)

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_digest_lock = threading.Lock()
_digest: str | None = None


def source_digest() -> str:
    """sha256 over this package's Python and kernel sources (relative path and bytes, in path order)."""
    global _digest
    with _digest_lock:
        if _digest is None:
            h = hashlib.sha256()
            files = []
            for d, _, names in os.walk(_PKG):
                files += [os.path.join(d, n) for n in names if n.endswith((".py", ".cc", ".h"))]
            for path in sorted(files):
                h.update(os.path.relpath(path, _PKG).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
            _digest = h.hexdigest()
        return _digest


def _process_identity() -> str:
    from importlib import metadata

    try:
        jaxlib_version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        jaxlib_version = None
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    machine = None
    if devices[0][0] == "cpu":  # XLA:CPU code is built for this CPU, and names the CPU kernels' build (FFI targets)
        from jaxrl_async.kernels import cpu_kernels

        machine = cpu_kernels.machine_key()
    return repr((sys.version_info[:3], jax.__version__, jaxlib_version, devices, os.environ.get("XLA_FLAGS", ""),
                 config, source_digest(), machine))


def _sharding_key(s: Any) -> Any:
    if s is None:
        return None
    devices = getattr(s, "_device_assignment", None)
    return repr(s), tuple(d.id for d in devices) if devices is not None else None


def args_signature(args: Any) -> str:
    """The abstract arguments' structure, shapes, dtypes, weak types and shardings (with device ids)."""
    leaves, treedef = jax.tree.flatten(args)
    return repr((str(treedef), [(tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                                 _sharding_key(getattr(x, "sharding", None))) for x in leaves]))


_fresh_lock = threading.Lock()
_fresh_count = 0
_fresh_saved = False
_jax_cache_hits = threading.local()  # per thread: JAX persistent-cache hits seen (the listener below)
_listener_lock = threading.Lock()
_listening = False


def _count_jax_cache_hit(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _jax_cache_hits.n = getattr(_jax_cache_hits, "n", 0) + 1


class _fresh_compiles:
    """While held (by any thread), JAX's persistent compilation cache is bypassed for every compile in the process
    (JAX decides it once per process in ``compilation_cache._cache_used``); the last holder restores it."""

    def __enter__(self):
        global _fresh_count, _fresh_saved
        from jax._src import compilation_cache as cc

        cc.is_cache_used(jax.devices()[0].client)  # (settles JAX's one-time decision first)
        with _fresh_lock:
            if _fresh_count == 0:
                _fresh_saved = cc._cache_used
                cc._cache_used = False
            _fresh_count += 1
        return self

    def __exit__(self, *exc):
        global _fresh_count
        from jax._src import compilation_cache as cc

        with _fresh_lock:
            _fresh_count -= 1
            if _fresh_count == 0:
                cc._cache_used = _fresh_saved


def _device_ids(compiled: jax.stages.Compiled) -> list[int]:
    """The devices the executable runs on, in its order (loading must name the same ones)."""
    shardings = jax.tree.leaves(compiled.input_shardings) + jax.tree.leaves(compiled.output_shardings)
    return [d.id for d in shardings[0]._device_assignment]


class ProgramCache:
    """Compiled programs under ``directory`` (see the module docstring). Thread-safe; ``hits`` / ``misses`` /
    ``errors`` count this process's lookups."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.hits = self.misses = self.errors = 0
        self._lock = threading.Lock()
        self._identity: str | None = None

    def key(self, name: str, context: str, args: Any) -> str:
        if self._identity is None:
            self._identity = _process_identity()
        return hashlib.sha256(repr((self._identity, name, context, args_signature(args))).encode()).hexdigest()

    def memo(self, name: str, compute: Callable[[], Any], args: Any, context: str) -> Any:
        """``compute()`` (a small picklable value derived from tracing, e.g. output shapes), or its cached value."""
        path = os.path.join(self.directory, f"{name}-{self.key(name, context, args)[:40]}.pkl")
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    return pickle.load(f)
            except Exception:  # noqa: BLE001 - recomputed and rewritten
                pass
        value = compute()
        self._write(path, pickle.dumps(value), name)
        return value

    def _write(self, path: str, blob: bytes, name: str) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as err:  # not writing an entry costs the next process a compile only
            logger.info("program cache: %s not written (%s)", name, err)

    def compile(self, name: str, fn: Callable, args: tuple, context: str) -> jax.stages.Compiled:
        """``fn.lower(*args).compile()``, or its executable from the cache."""
        from jax.experimental import serialize_executable

        path = os.path.join(self.directory, f"{name}-{self.key(name, context, args)[:40]}.jaxexe")
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    payload, in_tree, out_tree, device_ids = pickle.load(f)
                by_id = {d.id: d for d in jax.devices()}
                compiled = serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
                with self._lock:
                    self.hits += 1
                return compiled
            except Exception as err:  # noqa: BLE001 - a bad entry is replaced, never fatal
                with self._lock:
                    self.errors += 1
                    first = self.errors == 1
                if first:
                    logger.warning("program cache: %s did not load (%s: %s); compiling it again", path,
                                   type(err).__name__, err)
        global _listening
        with _listener_lock:
            if not _listening:
                jax.monitoring.register_event_listener(_count_jax_cache_hit)
                _listening = True
        hits_before = getattr(_jax_cache_hits, "n", 0)
        with _fresh_compiles():
            compiled = fn.lower(*args).compile()
        with self._lock:
            self.misses += 1
        if getattr(_jax_cache_hits, "n", 0) != hits_before:  # loaded from JAX's cache after all: not re-serializable
            logger.info("program cache: %s came from JAX's compilation cache; not written", name)
            return compiled
        try:
            blob = pickle.dumps((*serialize_executable.serialize(compiled), _device_ids(compiled)))
        except Exception as err:  # noqa: BLE001 - a program that cannot be serialized is compiled each time
            logger.info("program cache: %s not serializable (%s: %s)", name, type(err).__name__, err)
        else:
            self._write(path, blob, name)
        return compiled


class Program:
    """A jitted engine function and, once installed, the executable compiled ahead of time for the engine's
    arguments: calls run the executable directly (no trace); arguments of another signature (a weight set of
    another layout) go to the jitted function, counted in ``fallbacks`` and logged once."""

    def __init__(self, name: str, jitted: Callable):
        self.name, self.jitted = name, jitted
        self.compiled: jax.stages.Compiled | None = None
        self.fallbacks = 0

    def install(self, compiled: jax.stages.Compiled) -> None:
        self.compiled = compiled

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return self.jitted._cache_size() + (self.compiled is not None)

    def __call__(self, *args):
        compiled = self.compiled
        if compiled is not None:
            try:
                return compiled(*args)
            except TypeError:  # raised before running (argument types differ): nothing donated yet
                self.fallbacks += 1
                if self.fallbacks == 1:
                    logger.info("program cache: %s called with arguments of another signature; the jitted function "
                                "serves them", self.name)
        return self.jitted(*args)
