"""The engine's warm-up (split out of ``engine.py``): every program a job runs compiled before its first request,
all at once from abstract arguments on a pool of threads (`compile_ahead`), then run once on scratch states; the
compacted steps start compiling after them (`compaction.CompactSteps.start_all`). ``eng`` is the
`engine.PagedEngine` (not imported here: the engine imports this module).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any

import jax
import numpy as np

from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.generator.program_cache import Program
from jaxrl_async.models.transformer import Params

__all__ = ["warmup", "compile_ahead", "dispatch_lengths"]


def warmup(eng: Any, params: Params, max_samples: int | None, parallel: bool, truncation: bool,
           max_live: int | None) -> None:
    """`PagedEngine.warmup`."""
    max_samples = max_samples or eng._S
    variants = (False, True) if truncation else (False,)
    # sample_first's padded row counts for every n <= max_samples (powers of two up to it, and itself)
    sample_rows = sorted({eng._sample_rows(n)
                         for n in [1 << i for i in range((max_samples - 1).bit_length())] + [max_samples]})
    if parallel:
        compile_ahead(eng, params, variants, sample_rows, max_live)
    state = eng.init_decode_state()
    arrays = state.arrays
    no_pages = jax.device_put(np.full(eng._S, -1, np.int32), eng.slot_sharding)
    dparams = eng._decode_params(params)
    for t in variants:  # no live slot: runs the step, changes nothing
        arrays, step = eng._steps[t](dparams, arrays, no_pages)
        if eng.max_decode_steps > 1:  # and the multi-step dispatch
            arrays, step = eng._multi_step_fn(t, eng.max_decode_steps)(dparams, arrays, no_pages, no_pages)
    jax.block_until_ready(step)
    state = type(state)(arrays, state.host)  # (engine.DecodeState)
    sps = [SamplingParams(temperature=1.0, max_new_tokens=2, top_k=t) for t in (0, 1)[:len(variants)]]
    for b in eng.buckets:
        prefix = eng.prefill(params, np.ones(b, np.int32), sps[0])
        state = eng.insert(prefix, state, 0)
        state = eng.release(state, 0)
    for sp in sps:
        for nb in sample_rows:  # one sample_first program per padded row count
            eng.prefill(params, [1], sp, num_samples=nb)
    # the compacted steps compile while generation starts (already started by `compile_ahead` when parallel)
    eng._compacts.start_all(dparams, state.arrays, no_pages, variants, live_per_replica(eng, max_live),
                            dispatch_lengths(eng))


def compile_job(eng: Any, fn, args: tuple) -> None:
    """Compile one of `compile_ahead`'s programs: with a program cache, an engine `Program` gets its executable
    from the cache (or compiles and stores it) and runs it from now on; else JAX's in-memory cache keeps it for
    the jitted function's first call."""
    if eng.program_cache is not None and isinstance(fn, Program):
        fn.install(eng.program_cache.compile(fn.name, fn.jitted, args, eng._program_context))
    else:
        fn.lower(*args).compile()


def prefill_shapes(eng: Any, params_a, tokens_a, lengths_a):
    """(k, logits) abstract outputs of the prefill program (with a program cache, remembered beside its
    executables: tracing the prefill costs ~0.1 s)."""
    fn = eng._prefill.jitted if isinstance(eng._prefill, Program) else eng._prefill
    shapes = lambda: tuple((tuple(x.shape), x.dtype) for x in jax.eval_shape(fn, params_a, tokens_a,  # noqa: E731
                                                                             lengths_a)[:3:2])
    if eng.program_cache is None:
        shapes = shapes()
    else:
        shapes = eng.program_cache.memo("prefill_shapes", shapes, (params_a, tokens_a, lengths_a),
                                        eng._program_context)
    return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes)


def dispatch_lengths(eng: Any) -> tuple[int, ...]:
    """Decode steps per dispatch the generator runs: `max_decode_steps` while nothing waits (first: its compacted
    programs compile first), and 1 (`orchestrator.Generator._dispatch_steps`)."""
    return (eng.max_decode_steps, 1) if eng.max_decode_steps > 1 else (1,)


def live_per_replica(eng: Any, max_live: int | None) -> int | None:
    """The most live slots per decode replica of a job of at most `max_live` at once (None: unknown)."""
    return None if max_live is None else -(-int(max_live) // eng.kv_replicas)


def compile_ahead(eng: Any, params: Params, variants: tuple[bool, ...], sample_rows: list[int],
                  max_live: int | None = None) -> None:
    """Compile the programs `warmup` runs from abstract arguments, all at once on a pool of threads (the
    decode step first: the largest), and start the compacted steps' compiles after them. The later calls
    with concrete arguments of the same shapes and shardings reuse these compilations (JAX's in-memory
    cache), which `tests/generator/test_engine.py` checks by counting backend compiles."""
    sds = jax.ShapeDtypeStruct
    committed = lambda x: sds(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
    host = lambda shape, dt: sds(shape, np.dtype(dt))  # noqa: E731  (numpy arguments: uncommitted)
    params_a = jax.tree.map(committed, params)
    dparams = eng._decode_params(params)
    dparams_a = jax.tree.map(committed, dparams)  # the decode programs' (with the packed copy, if any)
    arrays_a = {k: sds(v.shape, v.dtype, sharding=eng.state_shardings[k])
                for k, v in jax.eval_shape(eng._init_arrays).items()}
    new_pages_a = sds((eng._S,), np.int32, sharding=eng.slot_sharding)
    jobs = [(eng._steps[t], (dparams_a, arrays_a, new_pages_a)) for t in variants] + [(eng._init, ())]
    if eng.max_decode_steps > 1:
        jobs += [(eng._multi_step_fn(t, eng.max_decode_steps), (dparams_a, arrays_a, new_pages_a, new_pages_a))
                 for t in variants]
    N = eng.max_prefill_pack
    for b in eng.buckets:
        tokens_a, lengths_a = host((1, b), np.int32), host((N,), np.int32)
        k_a, logits_a = prefill_shapes(eng, params_a, tokens_a, lengths_a)
        kv_a = sds(k_a.shape, k_a.dtype, sharding=eng._kv_sharding)
        jobs.append((eng._prefill, (params_a, tokens_a, lengths_a)) if eng.vision is None else
                    eng.vision.prefill_job(params_a, tokens_a, lengths_a, b))  # VL: its own prefill program
        jobs.append((eng._insert, (arrays_a, kv_a, kv_a, host((b,), np.int32), host((b,), np.int32),
                                   host((eng.max_pages_per_seq,), np.int32), host((), np.int32),
                                   host((len(eng.slot_ints),), np.int32), host((2,), np.float32),
                                   host((), np.uint32), host((eng.max_stop_tokens,), np.int32),
                                   host((), np.int32))))
    logits_a = sds(logits_a.shape, logits_a.dtype, sharding=eng.replicated)
    for t in variants:
        for nb in sample_rows:
            col = lambda dt: host((nb,), dt)  # noqa: B023, E731
            jobs.append((eng._sample_firsts[t], (logits_a, col(np.int32), col(np.float32), col(np.int32),
                                                 col(np.float32), col(np.uint32), col(np.int32), col(np.int32))))
    jobs.append((eng._release, (arrays_a, host((), np.int32))))
    workers = max(2, min(len(jobs), os.cpu_count() or 2))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="engine-compile") as pool:
        futures = [pool.submit(functools.partial(compile_job, eng), fn, a) for fn, a in jobs]
        for f in futures:
            f.result(timeout=3600)  # re-raises a compile error
    # then the compacted steps, on their own thread, beside the rest of warmup and generation
    eng._compacts.start_all(dparams, arrays_a, new_pages_a, variants, live_per_replica(eng, max_live),
                            dispatch_lengths(eng))
