"""The engine's program cache (`generator/program_cache.py`): executables found without tracing, keyed by the
program, the engine's settings, the abstract arguments and the process. Real engines on a tiny model."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.generator.engine import PagedEngine
from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.generator.program_cache import Program, ProgramCache, args_signature
from jaxrl_async.models import load_hf
from jaxrl_async.testing import make_tiny_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_hf_model(d, "qwen3")
    return load_hf(d)


def _engine(cfg, cache, **kw):
    args = dict(max_concurrent_decodes=8, max_sequence_length=48, prefill_buckets=(16,), page_size=8, num_pages=48,
                compact_decode=True, compact_min_rows=2, compact_levels=1, program_cache=cache)
    args.update(kw)
    return PagedEngine(cfg, **args)


def _generate(engine, params, n_new=10, k=1):
    """Greedy and sampled tokens of 3 prompts, each through prefill, insert, decode (full and compacted), release."""
    rng = np.random.default_rng(0)
    state, outs = engine.init_decode_state(), {}
    sps = [SamplingParams(temperature=t, max_new_tokens=n_new, seed=7) for t in (0.0, 1.0, 0.7)]
    for s, sp in enumerate(sps):
        pre = engine.prefill(params, rng.integers(3, 200, 5 + 3 * s).tolist(), sp)
        state = engine.insert(pre, state, s)
        outs[s] = [int(pre.first_tokens[0])]
    for _ in range(-(-n_new // k)):
        state, step = engine.generate(params, state, k) if k > 1 else engine.generate(params, state)
        for row in step.to_host().rows():
            for s in outs:
                if row.valid[s]:
                    outs[s].append(int(row.tokens[s]))
    for s in outs:
        state = engine.release(state, s)
    return outs


def test_a_second_engine_runs_the_cached_executables_without_tracing(model, tmp_path):
    cfg, raw = model
    cache = ProgramCache(str(tmp_path / "programs"))
    first = _engine(cfg, cache)
    params = first.place_params(raw)
    first.warmup(params, max_samples=1, truncation=False)
    ref = _generate(first, params)
    assert cache.hits == 0 and cache.misses >= 6 and cache.errors == 0
    written = sorted(os.listdir(cache.directory))
    assert any(n.startswith("decode_step_False-") for n in written) and any(n.startswith("decode_rows_4_") for n in
                                                                            written)
    second_cache = ProgramCache(cache.directory)  # a new process's view of the same directory
    second = _engine(cfg, second_cache)
    second.warmup(params, max_samples=1, truncation=False)
    assert _generate(second, params) == ref  # the same tokens
    assert second_cache.misses == 0 and second_cache.hits == cache.misses  # (the compacted step's load included)
    assert second.compact_steps > 0  # the compacted program (from the cache) ran
    programs = [second._prefill, second._insert, second._release, second._init, second._steps[False],
                *second._sample_firsts.values()]
    assert all(isinstance(p, Program) for p in programs)
    # no program was traced in this engine: every call ran an installed executable (the truncating sampler was
    # not needed by these requests and never compiled)
    assert [p.jitted._cache_size() for p in programs] == [0] * len(programs)
    assert all(p.fallbacks == 0 for p in programs)
    # an engine of other settings finds nothing of the first's
    other_cache = ProgramCache(cache.directory)
    other = _engine(cfg, other_cache, max_sequence_length=56)
    other.warmup(params, max_samples=1, truncation=False)
    assert other_cache.hits == 0


def test_the_same_tokens_as_an_engine_without_the_cache(model, tmp_path):
    cfg, raw = model
    plain = _engine(cfg, None)
    params = plain.place_params(raw)
    plain.warmup(params, max_samples=1, truncation=False)
    cached = _engine(cfg, ProgramCache(str(tmp_path / "p")))
    cached.warmup(params, max_samples=1, truncation=False)
    assert _generate(plain, params) == _generate(cached, params)
    assert not isinstance(plain._steps[False], Program)  # without a cache the engine is as before


def test_arguments_of_another_signature_go_to_the_jitted_function(model, tmp_path):
    cfg, raw = model
    eng = _engine(cfg, ProgramCache(str(tmp_path / "p")), compact_decode=False)
    params = eng.place_params(raw)
    eng.warmup(params, max_samples=1, truncation=False)
    ref = _generate(eng, params)
    # weights of another tree are another signature for the executable: served by the jitted function
    state = eng.init_decode_state()
    step_fn = eng._steps[False]
    before = step_fn.fallbacks
    no_pages = jax.device_put(np.full(8, -1, np.int32), eng.slot_sharding)
    dparams = eng._decode_params(params)  # what the decode programs take (with the packed copy, if the engine packs)
    arrays, _ = step_fn(jax.tree.map(lambda x: x.astype(jnp.float32), dparams), state.arrays, no_pages)
    assert step_fn.fallbacks == before  # same signature: the executable
    arrays, _ = step_fn({"extra": jnp.zeros(1), **dparams}, arrays, no_pages)  # another tree: the jitted function
    assert step_fn.fallbacks == before + 1 and step_fn.jitted._cache_size() == 1
    assert _generate(eng, params) == ref


def test_keys_entries_and_bad_entries(tmp_path):
    cache = ProgramCache(str(tmp_path))
    f = jax.jit(lambda x, y: x * 2 + y)
    a = (jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    c1 = cache.compile("f", f, a, "ctx")
    assert (cache.hits, cache.misses) == (0, 1)
    c2 = cache.compile("f", f, a, "ctx")
    assert (cache.hits, cache.misses) == (1, 1)
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(np.asarray(c1(x, jnp.float32(1))), np.asarray(c2(x, jnp.float32(1))))
    assert cache.key("f", "ctx", a) != cache.key("f", "other", a)
    assert cache.key("f", "ctx", a) != cache.key("g", "ctx", a)
    b = (jax.ShapeDtypeStruct((4,), jnp.float32), a[1])
    assert args_signature(a) != args_signature(b) and cache.key("f", "ctx", a) != cache.key("f", "ctx", b)
    (entry,) = [p for p in os.listdir(tmp_path) if p.endswith(".jaxexe")]
    with open(tmp_path / entry, "wb") as fh:
        fh.write(b"not an executable")
    c3 = cache.compile("f", f, a, "ctx")  # counted, compiled again, the entry replaced
    assert cache.errors == 1 and cache.misses == 2
    np.testing.assert_array_equal(np.asarray(c3(x, jnp.float32(1))), np.asarray(c1(x, jnp.float32(1))))
    assert cache.compile("f", f, a, "ctx") is not None and cache.hits == 2
    assert cache.memo("m", lambda: (1, 2), a, "ctx") == (1, 2)
    assert cache.memo("m", lambda: pytest.fail("recomputed"), a, "ctx") == (1, 2)


def test_an_executable_from_jax_s_persistent_cache_is_compiled_fresh_before_it_is_written(tmp_path):
    """XLA:CPU executables loaded from JAX's persistent cache do not re-serialize whole; a program-cache miss
    compiles with JAX's cache bypassed, so its entry runs in a process that loads it (a subprocess)."""
    import subprocess
    import sys

    code = f"""
import jax, jax.numpy as jnp, sys
jax.config.update("jax_compilation_cache_dir", {str(tmp_path / 'xla')!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jaxrl_async.generator.program_cache import ProgramCache
cache = ProgramCache({str(tmp_path / 'programs')!r})
f = jax.jit(lambda t, i: (jnp.take(t, i, axis=0) * 2).sum(axis=1))
a = (jax.ShapeDtypeStruct((100, 64), jnp.float32), jax.ShapeDtypeStruct((10,), jnp.int32))
if sys.argv[1] == "jax":  # only JAX's cache gets the program
    f.lower(*a).compile()
else:
    c = cache.compile("f", f, a, "ctx")
    print(sys.argv[1], cache.hits, cache.misses, float(c(jnp.ones((100, 64)), jnp.arange(10, dtype=jnp.int32))[0]))
"""
    outs = []
    for stage in ("jax", "miss", "hit"):
        r = subprocess.run([sys.executable, "-c", code, stage], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.strip())
    assert outs[1:] == ["miss 0 1 128.0", "hit 1 0 128.0"]


def test_multi_step_programs_come_from_the_cache(model, tmp_path):
    """With multi-step decode (K = 4), the K-step program and its compacted form are cached too: a second engine
    on the same directory loads them and decodes the same tokens without tracing the K-step program."""
    cfg, raw = model
    cache = ProgramCache(str(tmp_path / "programs"))
    first = _engine(cfg, cache, max_decode_steps=4)
    params = first.place_params(raw)
    first.warmup(params, max_samples=1, truncation=False)
    ref = _generate(first, params, k=4)
    written = sorted(os.listdir(cache.directory))
    assert any(n.startswith("decode_multi_False_k4-") for n in written), written
    assert any(n.startswith("decode_rows_4_False_k4-") for n in written), written
    second_cache = ProgramCache(cache.directory)
    second = _engine(cfg, second_cache, max_decode_steps=4)
    second.warmup(params, max_samples=1, truncation=False)
    assert _generate(second, params, k=4) == ref
    assert second_cache.misses == 0 and second_cache.hits == cache.misses
    assert second.compact_steps > 0 and second.compact_steps % 4 == 0
    multi = second._multi_steps[(False, 4)]
    assert isinstance(multi, Program) and multi.jitted._cache_size() == 0 and multi.fallbacks == 0
