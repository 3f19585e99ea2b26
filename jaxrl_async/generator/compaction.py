"""Compacted decode's programs (split out of ``engine.py``; the technique is in the engine's module docstring):
which compiled program a step runs, and their compiles.

A compacted step runs the decode step on ``b`` rows per decode replica (``b`` in ``sizes``, descending: S/2,
S/4, ... per replica) gathered from the live slots; one program per (weights' signature, sampler, b, K), compiled
on one background thread. K is the dispatch's decode steps (multi-step decode: a compacted dispatch runs K steps
of the ``b`` rows chosen at its start, `engine_steps.decode_rows_fn`). Synchronously (the default) a step always
takes the smallest size that holds every replica's live slots, waiting for its compile (so the choice depends on
the live slots only, never on compile timing); ``in_background``: the smallest one compiled by now, else the full
step.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CompactSteps", "params_signature"]

logger = logging.getLogger(__name__)


def params_signature(params: Any) -> tuple:
    """What a compiled program is specific to in its weights: tree structure, shapes, dtypes, shardings (a LoRA
    generator's params, a resharded weight set compile their own compacted steps)."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves)


class CompactSteps:
    """The compacted steps of one engine.

    Args:
      rows_step: ``rows_step(truncation, K)``: the jitted compacted program of K decode steps per dispatch,
          ``(params, *args, rows)`` with args = (arrays, new_pages) at K = 1, (arrays, new_pages, new_index) else.
      sizes: rows per replica, descending (empty: compaction off).
      replicas: decode replicas (KV pools); ``num_slots`` slots in all.
      rows_sharding: the sharding of the rows argument.
      in_background: see the module docstring.
      program_cache, program_context: the engine's `program_cache.ProgramCache` (None: none) and its settings' key.
    """

    def __init__(self, rows_step: Callable[[bool, int], Callable], sizes: tuple[int, ...], replicas: int, num_slots: int,
                 rows_sharding: Any, in_background: bool, program_cache: Any = None, program_context: str | None = None):
        self.rows_step, self.sizes, self.replicas, self.num_slots = rows_step, tuple(sizes), replicas, num_slots
        self.rows_sharding, self.in_background = rows_sharding, bool(in_background)
        self.program_cache, self.program_context = program_cache, program_context  # (program_cache.py)
        self._programs: dict = {}  # (params signature, truncation, rows per replica, K) -> Future / Compiled / None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def count(self) -> int:
        """Programs compiled or compiling."""
        return sum(1 for c in self._programs.values() if c is not None)

    def choose(self, params: Any, args: tuple, trunc: bool, live: np.ndarray, k: int = 1):
        """(program, rows) of the compacted dispatch of ``k`` steps to run (``program(params, *args, rows)``), or
        None (the full program runs). Starts the compile of the size that fits if nothing did yet."""
        D = self.replicas
        per = self.num_slots // D
        by_replica = live.reshape(D, per)
        n = int(by_replica.sum(axis=1).max())
        fits = [b for b in self.sizes if b >= n]  # descending
        if not fits:
            return None
        sig = params_signature(params)
        if (sig, trunc, fits[-1], k) not in self._programs:
            self.start(params, args, (sig, trunc, fits[-1], k))
        for b in reversed(fits):
            prog = self._programs.get((sig, trunc, b, k))
            if prog is not None and not isinstance(prog, jax.stages.Compiled):
                prog = self.finish((sig, trunc, b, k), wait=not self.in_background)
            if prog is not None:
                rows = []
                for r in range(D):
                    mine = np.flatnonzero(by_replica[r])
                    free = np.flatnonzero(~by_replica[r])  # non-empty: n <= b < per
                    rows.append(r * per + np.concatenate([mine, np.full(b - len(mine), free[0])]))
                return prog, jax.device_put(np.concatenate(rows).astype(np.int32), self.rows_sharding)
        return None

    def start(self, params: Any, args: tuple, key: tuple) -> None:
        """Start compiling the program of ``key`` (from abstract arguments) on the compile thread."""
        _, trunc, b, k = key
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        args = jax.tree.map(abstract, (params, *args))
        rows = jax.ShapeDtypeStruct((b * self.replicas,), jnp.int32, sharding=self.rows_sharding)
        fn = self.rows_step(trunc, k)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-compact")
        logger.info("PagedEngine: compiling the compacted decode step (%d rows per replica, %s sampler, %d step%s per "
                    "dispatch)%s", b, "full" if trunc else "lean", k, "s" if k > 1 else "",
                    " in the background" if self.in_background else "")
        if self.program_cache is not None:
            name = f"decode_rows_{b}_{trunc}" + (f"_k{k}" if k > 1 else "")
            self._programs[key] = self._pool.submit(self.program_cache.compile, name, fn, (*args, rows),
                                                    self.program_context)
        else:
            self._programs[key] = self._pool.submit(lambda: fn.lower(*args, rows).compile())

    def start_all(self, params: Any, arrays: Any, new_pages: Any, variants: tuple[bool, ...],
                  max_live: int | None = None, steps: tuple[int, ...] = (1,)) -> None:
        """Start every size's compile (each sampler in ``variants``, each dispatch length in ``steps``, in that
        order: the generator's usual one first) not started yet: the first step that needs one waits for it
        (compacting never depends on compile timing). ``max_live``: the most live slots per replica the job will
        have; the sizes it can use compile first (the one that holds ``max_live``, then the smaller ones), the
        larger ones after them (for later jobs, through the compilation cache). ``new_pages`` also stands for a
        K-step program's ``new_index`` (same shape and sharding)."""
        sig = params_signature(params)
        sizes = self.sizes
        if max_live is not None:
            used = [b for b in sizes if b >= max_live][-1:] + [b for b in sizes if b < max_live]
            sizes = tuple(used) + tuple(sorted(set(sizes) - set(used)))
        for k in steps:
            args = (arrays, new_pages) + ((new_pages,) if k > 1 else ())
            for t in variants:
                for b in sizes:
                    if (sig, t, b, k) not in self._programs:
                        self.start(params, args, (sig, t, b, k))

    def finish(self, key: tuple, wait: bool):
        """The compiled program once its compile is done (``wait``: block for it, up to an hour); None while it runs
        (not waiting), or if it failed (logged; the full step keeps serving that size)."""
        fut = self._programs[key]
        if fut is None or (not wait and not fut.done()):
            return None
        try:
            prog = fut.result(timeout=3600)
        except Exception:  # noqa: BLE001 - a compile error must not stop generation: the full step still runs
            logger.exception("PagedEngine: the compacted decode step (%d rows per replica) failed to compile; the "
                             "full step serves that size", key[2])
            prog = None
        self._programs[key] = prog
        return prog
