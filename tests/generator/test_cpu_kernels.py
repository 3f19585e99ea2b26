"""The CPU kernels (`kernels/cpu_kernels.py`, XLA FFI calls) against the reference paths.

The decode attention:
fp32: equal to the gather reference (`paged_decode_attend`) within 1e-6 (+ 1e-6 relative) for every slot that
attends, over page tables scattered through the pool, partial last pages (rows past the length never used), grouped-
query heads, several head dims (the kernel's compile-time 64 / 128, on AVX-512 with pages of 16 / 32 the scores of 16
tokens at once, and the generic path), free slots (zeros, nothing read: NaN pages elsewhere would leak),
inside a jitted scan over layers (the engine's use), with bf16 pools and queries too. The engine runs it by
default on CPU ("auto"); the engine-level parity tests (transformers' greedy tokens, generator vs trainer
log-probs) therefore run through it, and `test_engine.py` runs both CPU attentions side by side.

The in-place layer matmul (`stacked_matmul`, `transformer.stacked_layer_matmul`): x @ w[layer] equal to XLA's dot
within fp32 rounding for row counts around its 4-row groups and column widths around its 64-column blocks; a
forward under the scope equals the plain one and calls it for every projection (no per-layer slice of those
matrices); the engine's small decode programs use it (so does every engine test with <= 16 slots).
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.generator import kv_cache
from jaxrl_async.kernels import cpu_kernels, paged_attention
from jaxrl_async.models import transformer
from jaxrl_async.models.config import ModelConfig

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the CPU kernels cannot be built")


def _case(rng, *, L=3, P=64, page=4, K=2, G=2, E=16, lens=(3, 13, 22, 9, 0), nan_free=True):
    S = len(lens)
    maxp = max(kv_cache.pages_for(n + 1, page) for n in lens) + 1
    perm = rng.permutation(P - 8)  # pages P-8..P-1 hold NaN: never part of a live slot
    page_table = np.full((S, maxp), P, np.int32)  # null entries past each length
    for s, n in enumerate(lens):
        c = kv_cache.pages_for(n + 1, page)
        page_table[s, :c] = perm[s * maxp:s * maxp + c]
    pool_k = rng.normal(size=(L, P, page, K, E)).astype(np.float32)
    pool_v = rng.normal(size=(L, P, page, K, E)).astype(np.float32)
    pool_k[:, P - 8:] = np.nan
    pool_v[:, P - 8:] = np.nan
    q = rng.normal(size=(S, 1, K * G, E)).astype(np.float32)
    k, v = (rng.normal(size=(S, 1, K, E)).astype(np.float32) for _ in range(2))
    return page_table, pool_k, pool_v, q, k, v


def _page_heads(x):
    return jnp.asarray(np.swapaxes(x, 2, 3))  # [L, P, page, K, E] -> [L, P, K, page, E]


@pytest.mark.parametrize("E,G,page", [(16, 2, 4), (32, 2, 16), (64, 2, 16), (128, 1, 8), (64, 4, 4), (128, 2, 32)])
def test_matches_the_gather_reference(E, G, page):
    rng = np.random.default_rng(E + G)
    lens = (3, 13, 22, 9, 0, page - 1, page)  # partial, whole and single pages; slot 4 free
    page_table, pk, pv, q, k, v = _case(rng, page=page, G=G, E=E, lens=lens)
    S = len(lens)
    active = np.array([n > 0 for n in lens])
    pos = jnp.asarray(lens, jnp.int32)
    P = pk.shape[1]
    write_pages = jnp.asarray(np.where(active, page_table[np.arange(S), np.asarray(lens) // page], P), jnp.int32)
    ref, (rk, rv) = kv_cache.paged_decode_attend(jnp.asarray(page_table), pos, write_pages, page, 0.3)(
        q, k, v, 1, (jnp.asarray(np.nan_to_num(pk)), jnp.asarray(np.nan_to_num(pv))))
    attend = paged_attention.decode_attend("cpu_paged", jnp.asarray(page_table), pos, jnp.asarray(active),
                                           write_pages, page, 0.3)
    out, (ck, cv) = jax.jit(attend, static_argnums=3)(q, k, v, 1, (_page_heads(pk), _page_heads(pv)))
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.isfinite(out).all()
    # two float32 paths summing in different orders: each is ~1-2e-6 from a float64 computation at E = 128 (values
    # up to ~2), so a few float32 ulps relative on top of 1e-6
    np.testing.assert_allclose(out[active], ref[active], atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(out[~active], 0)  # a free slot reads nothing
    live = np.setdiff1d(np.arange(P), np.arange(P - 8, P))
    np.testing.assert_array_equal(np.swapaxes(np.asarray(ck), 2, 3)[:, live], np.asarray(rk)[:, live])
    np.testing.assert_array_equal(np.swapaxes(np.asarray(cv), 2, 3)[:, live], np.asarray(rv)[:, live])


def test_in_a_scan_over_layers_equals_the_blocked_path():
    """The engine's use: a traced layer index inside `lax.scan`, the pools carried; every layer's output equals
    the portable blocked path's (same pool writes, bitwise)."""
    rng = np.random.default_rng(3)
    lens = (5, 31, 17, 2)
    page = 4
    page_table, pk, pv, q, k, v = _case(rng, L=4, page=page, G=3, E=64, lens=lens)
    pk, pv = np.nan_to_num(pk), np.nan_to_num(pv)
    S = len(lens)
    pos = jnp.asarray(lens, jnp.int32)
    active = jnp.ones(S, bool)
    write_pages = jnp.asarray(page_table[np.arange(S), np.asarray(lens) // page])

    def run(attention):
        attend = paged_attention.decode_attend(attention, jnp.asarray(page_table), pos, active, write_pages, page,
                                               0.125, block_pages=2)

        def body(pools, layer):
            out, pools = attend(q * (layer + 1), k, v, layer, pools)
            return pools, out

        return jax.jit(lambda pools: jax.lax.scan(body, pools, jnp.arange(4)))((_page_heads(pk), _page_heads(pv)))

    (bk, bv), ref = run("blocked")
    (ck, cv), out = run("cpu_paged")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(ck), np.asarray(bk))
    np.testing.assert_array_equal(np.asarray(cv), np.asarray(bv))


def test_rows_past_the_length_in_a_last_page_are_never_read():
    """The scores of 16 tokens at a time (pages of a multiple of 16 on AVX-512) read a partial last page's rows past
    the slot's length too: whatever they hold (NaN here) changes nothing, bitwise."""
    rng = np.random.default_rng(11)
    page = 16
    lens = (5, 19, 33, 16)
    page_table, pk, pv, q, _, _ = _case(rng, page=page, G=2, E=64, lens=lens)
    pk, pv = np.nan_to_num(pk), np.nan_to_num(pv)
    lens1 = np.asarray(lens) + 1
    dirty_k, dirty_v = pk.copy(), pv.copy()
    for s, n in enumerate(lens1):
        last = page_table[s, (n - 1) // page]
        dirty_k[:, last, n % page or page:], dirty_v[:, last, n % page or page:] = np.nan, np.nan
    call = jax.jit(lambda k, v: cpu_kernels.paged_decode(jnp.asarray(q[:, 0]), k, v, jnp.asarray(lens1),
                                                         jnp.asarray(page_table), 1, 0.125))
    clean = np.asarray(call(_page_heads(pk), _page_heads(pv)))
    dirty = np.asarray(call(_page_heads(dirty_k), _page_heads(dirty_v)))
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("page", [4, 16])
def test_bfloat16_pools_and_queries(page):
    rng = np.random.default_rng(5)
    lens = (7, 20, 1)
    page_table, pk, pv, q, _, _ = _case(rng, page=page, G=2, E=64, lens=lens)
    pk, pv = np.nan_to_num(pk), np.nan_to_num(pv)
    pos = jnp.asarray(lens, jnp.int32)
    lens1 = pos + 1
    for q_dt, kv_dt in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16)):
        qa = jnp.asarray(q[:, 0], q_dt)
        kp, vp = _page_heads(pk).astype(kv_dt), _page_heads(pv).astype(kv_dt)
        out = jax.jit(lambda a, b, c: cpu_kernels.paged_decode(a, b, c, lens1, jnp.asarray(page_table), 2, 0.125))(
            qa, kp, vp)
        assert out.dtype == q_dt
        # the reference in float32 on the same (rounded) values
        ref = cpu_kernels.paged_decode(qa.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32), lens1,
                                     jnp.asarray(page_table), 2, 0.125)
        tol = 1e-2 if q_dt == jnp.bfloat16 else 1e-6  # a bf16 output is the float32 result rounded once
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=tol, rtol=tol)


def test_auto_resolves_to_the_kernel_on_cpu_and_explicit_requests_are_checked():
    assert paged_attention.resolve("auto", "cpu") == "cpu_paged"
    assert paged_attention.resolve("auto", "tpu") == "tpu_ragged"
    assert paged_attention.layout_for("cpu_paged").name == paged_attention.layout_for("blocked").name
    with pytest.raises(ValueError, match="CPU only"):
        paged_attention.resolve("cpu_paged", "gpu")


def test_no_compiler_means_blocked_with_a_logged_reason(tmp_path):
    """Without a compiler (an empty PATH, CXX unset) and an empty kernel cache: `available()` is False with the
    reason, logged once; "auto" runs the portable blocked attention and an explicit "cpu_paged" is refused."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        "from jaxrl_async.kernels import cpu_kernels, paged_attention\n"
        "print('AVAILABLE', cpu_kernels.available())\n"
        "print('AUTO', paged_attention.resolve('auto', 'cpu'))\n"
        "try:\n"
        "    paged_attention.resolve('cpu_paged', 'cpu')\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(tmp_path / "empty-bin"), JAXRL_ASYNC_KERNEL_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "AVAILABLE False" in out and "AUTO blocked" in out
    assert "REFUSED decode attention 'cpu_paged' is not available here: RuntimeError: no C++ compiler" in out
    assert out.count("the CPU kernels are not available") == 1


def test_build_is_cached_per_source_and_machine(tmp_path):
    """A second process finds the library in the cache (no compiler run); the key covers the source."""
    code = ("import logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from jaxrl_async.kernels import cpu_kernels\nprint('AVAILABLE', cpu_kernels.available())\n")
    env = dict(os.environ, JAXRL_ASYNC_KERNEL_CACHE=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 and "AVAILABLE True" in r.stdout for r in runs), runs[0].stderr[-2000:]
    assert "cpu_kernels: built" in runs[0].stdout and "cpu_kernels: built" not in runs[1].stdout
    assert len(list(tmp_path.glob("cpu_kernels-*.so"))) == 1


@pytest.mark.parametrize("M,K,N", [(1, 32, 64), (3, 48, 100), (4, 64, 128), (5, 40, 130), (16, 96, 200), (6, 300, 130),
                                   # one block narrower than 64, masked last vectors
                                   (64, 64, 32), (64, 40, 16), (13, 64, 48), (64, 130, 72), (9, 32, 7)])
def test_stacked_matmul_equals_the_dot(M, K, N):
    rng = np.random.default_rng(M * N)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, K, N)), jnp.float32)

    def scan(fn):
        return jax.jit(lambda x, w: jax.lax.scan(lambda c, l: (c, fn(x, w, l)), 0, jnp.arange(3))[1])(x, w)

    out = scan(cpu_kernels.stacked_matmul)
    ref = np.einsum("mk,lkn->lmn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    xla = scan(lambda x, w, l: x @ w[l])
    np.testing.assert_allclose(np.asarray(out), np.asarray(xla), rtol=0, atol=2e-6 * np.abs(ref).max())
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.stacked_matmul(x.astype(jnp.bfloat16), w, 0)


def test_forward_under_the_scope_reads_every_projection_in_place():
    cfg = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32")
    params = transformer.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (5, 7)), jnp.int32)
    apply = jax.jit(lambda p, t: transformer.apply(p, cfg, t))
    ref = apply(params, tokens)

    def scoped(p, t):
        with transformer.stacked_layer_matmul(cpu_kernels.stacked_matmul):
            return transformer.apply(p, cfg, t)

    out = jax.jit(scoped)(params, tokens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=2e-5)
    hlo = jax.jit(scoped).lower(params, tokens).as_text()
    assert hlo.count("jaxrl_async_stacked_matmul") == 7  # q k v o gate up down, once in the scan's body
    assert "jaxrl_async_stacked_matmul" not in jax.jit(lambda p, t: transformer.apply(p, cfg, t)).lower(
        params, tokens).as_text()


@pytest.mark.parametrize("M,K,N", [(1, 32, 64), (5, 40, 130), (16, 96, 200), (64, 130, 72), (9, 32, 7), (13, 64, 48),
                                   (16, 300, 1030)])
def test_stacked_matmul_packed_gives_the_bits_of_the_in_place_one(M, K, N):
    """The matrix packed per column block ([L, ceil(N / 64), K, 64], the last block zero-padded): the same multiply-
    adds in the same order as from the model's layout, so the same bits, at every layer of the stack."""
    rng = np.random.default_rng(M * N + K)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, K, N)), jnp.float32)
    wp = cpu_kernels.pack_columns(w)
    assert wp.shape == (3, -(-N // 64), K, 64) and (wp[:, -1, :, N - 64 * (wp.shape[1] - 1):] == 0).all()
    assert wp.ctypes.data % 64 == 0  # XLA:CPU's alignment: placed on the device without a copy
    np.testing.assert_array_equal(wp[1, 0, :, :min(N, 64)], np.asarray(w)[1, :, :min(N, 64)])

    def scan(fn, w):
        return jax.jit(lambda x, w: jax.lax.scan(lambda c, l: (c, fn(x, w, l)), 0, jnp.arange(3))[1])(x, w)

    packed = scan(lambda x, w, l: cpu_kernels.stacked_matmul_packed(x, w, l, N), jnp.asarray(wp))
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(scan(cpu_kernels.stacked_matmul, w)))
    with pytest.raises(ValueError, match="ceil"):
        cpu_kernels.stacked_matmul_packed(x, jnp.asarray(wp), 0, N + 64)


def test_forward_under_the_scope_reads_the_packed_copies():
    """With packed copies in the scope, every projection reads its copy (`stacked_matmul_packed`, 7 calls in the
    scan's body, none of the in-place kernel) and the hidden states are the in-place forward's bits."""
    from jaxrl_async.generator.packed_weights import PACKED_KEY, PackedWeights

    cfg = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32")
    params = transformer.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (5, 7)), jnp.int32)
    dparams = PackedWeights(("layers",))(params)
    assert set(dparams[PACKED_KEY]["layers"]) == {"q", "k", "v", "o", "gate", "up", "down"}

    def scoped(p, t, packed):
        with transformer.stacked_layer_matmul(cpu_kernels.stacked_matmul, p.get(PACKED_KEY) if packed else None,
                                              cpu_kernels.stacked_matmul_packed):
            return transformer.apply(p, cfg, t)

    fns = {packed: jax.jit(functools.partial(scoped, packed=packed)) for packed in (True, False)}
    np.testing.assert_array_equal(np.asarray(fns[True](dparams, tokens)), np.asarray(fns[False](params, tokens)))
    hlo = fns[True].lower(dparams, tokens).as_text()
    assert hlo.count("jaxrl_async_stacked_matmul_packed") == 7
    assert hlo.count("jaxrl_async_stacked_matmul") == 7  # the packed calls only


def test_in_place_matrices_leave_adapted_and_non_float32_ones_to_xla():
    stack = {"q": jnp.zeros((2, 4, 2, 2)), "k": jnp.zeros((2, 4, 1, 2)), "q_lora_a": jnp.zeros((2, 4, 1)),
             "up": jnp.zeros((2, 4, 8), jnp.bfloat16), "attn_norm": jnp.zeros((2, 4))}
    assert transformer._in_place_matrices(stack, 2) == {}  # outside the scope: none
    with transformer.stacked_layer_matmul(cpu_kernels.stacked_matmul):
        assert list(transformer._in_place_matrices(stack, 2)) == ["k"]  # q has adapters, up is bf16
        assert transformer._in_place_matrices(stack, 1) == {}  # a run over part of the stack
        assert transformer._in_place_matrices({**stack, "router": jnp.zeros((2, 4, 3))}, 2) == {}


def test_engine_uses_the_in_place_matmul_for_small_programs_only_on_one_cpu_device():
    from jaxrl_async.generator.engine import (STACKED_MATMUL_ROWS, STACKED_MATMUL_ROWS_AVX512, PagedEngine,
                                              default_stacked_matmul_rows)
    from jaxrl_async.sharding.mesh import make_mesh

    cfg = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32")
    kw = dict(max_concurrent_decodes=4, max_sequence_length=64, prefill_buckets=(32,), page_size=8, num_pages=40)
    assert PagedEngine(cfg, **kw).stacked_matmul_rows == default_stacked_matmul_rows() == (
        STACKED_MATMUL_ROWS_AVX512 if cpu_kernels.has_avx512() else STACKED_MATMUL_ROWS)
    assert PagedEngine(cfg, attention="blocked", **kw).stacked_matmul_rows == 0
    mesh = make_mesh({"data": 1, "tensor": 2}, devices=jax.devices()[:2])
    assert PagedEngine(cfg, mesh=mesh, **kw).stacked_matmul_rows == 0
    assert PagedEngine(cfg, stacked_matmul_rows=0, **kw).stacked_matmul_rows == 0
    with pytest.raises(ValueError, match="stacked_matmul_rows needs"):
        PagedEngine(cfg, attention="blocked", stacked_matmul_rows=16, **kw)


@pytest.mark.parametrize("M,K,N", [(1, 32, 64), (5, 40, 130), (8, 64, 100), (16, 48, 200), (32, 96, 70),
                                   (64, 48, 70)])
def test_matmul_nt_equals_the_dot(M, K, N):
    """x @ w.T with w [N, K] read in place (the tied LM head): equal to float64 and to XLA's dot (at the row
    counts the engine uses it for, the same order of sums: bitwise here)."""
    rng = np.random.default_rng(M * N + K)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(N, K)), jnp.float32)
    out = np.asarray(jax.jit(cpu_kernels.matmul_nt)(x, w))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(out, np.asarray(jax.jit(lambda x, w: x @ w.T)(x, w)), rtol=0,
                               atol=2e-6 * np.abs(ref).max())
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.matmul_nt(x.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match="64"):
        cpu_kernels.matmul_nt(jnp.zeros((65, K), jnp.float32), w)


def test_decode_programs_of_8_to_32_rows_read_the_tied_embedding_in_place():
    """The decode step at NT_LOGITS_ROWS slots computes a tied float32 LM head with `matmul_nt`; its tokens and
    log-probs equal the XLA path's (stacked_matmul_rows=0) over a few steps of sampled and greedy slots."""
    from jaxrl_async.generator.engine import PagedEngine
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.engine_steps import NT_LOGITS_ROWS
    from jaxrl_async.models.transformer import init_params

    cfg = ModelConfig(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32",
                      tie_word_embeddings=True)
    kw = dict(max_concurrent_decodes=8, max_sequence_length=48, prefill_buckets=(16,), page_size=8, num_pages=48)
    assert 8 in NT_LOGITS_ROWS and 4 not in NT_LOGITS_ROWS
    fast, plain = PagedEngine(cfg, **kw), PagedEngine(cfg, stacked_matmul_rows=0, **kw)
    params = fast.place_params(init_params(cfg, jax.random.key(3)))
    no_pages = np.full(8, -1, np.int32)
    hlo = fast._steps[False].lower(params, fast.init_decode_state().arrays, no_pages).as_text()
    assert "jaxrl_async_matmul_nt" in hlo
    assert "jaxrl_async_matmul_nt" not in plain._steps[False].lower(params, plain.init_decode_state().arrays,
                                                                    no_pages).as_text()
    four = PagedEngine(cfg, **{**kw, "max_concurrent_decodes": 4, "num_pages": 24})
    assert "jaxrl_async_matmul_nt" not in four._steps[False].lower(params, four.init_decode_state().arrays,
                                                                   np.full(4, -1, np.int32)).as_text()
    rng = np.random.default_rng(0)
    runs = []
    for eng in (fast, plain):
        state, toks, lps = eng.init_decode_state(), [], []
        for s in range(8):
            sp = SamplingParams(temperature=0.0 if s % 2 else 1.0, max_new_tokens=12, seed=s)
            state = eng.insert(eng.prefill(params, rng.integers(3, 300, 4 + s).tolist(), sp), state, s)
        rng = np.random.default_rng(0)
        for _ in range(8):
            state, step = eng.generate(params, state)
            step = step.to_host()
            toks.append(np.asarray(step.tokens))
            lps.append(np.asarray(step.logprobs))
        runs.append((np.stack(toks), np.stack(lps)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=0, atol=1e-5)


def test_packed_weights_decode_the_bits_of_the_in_place_engine_and_follow_new_weights():
    """The engine's packed copy (`packed_weights`, on by default where the in-place matmul runs): the decode programs
    read it (`stacked_matmul_packed`), the tokens and log-probs are the unpacked engine's bits, and a new weight set
    mid-run is repacked at its first dispatch (so no step decodes with a stale copy), the same one is not."""
    from jaxrl_async.generator.engine import PagedEngine
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.packed_weights import packed_bytes
    from jaxrl_async.models.transformer import init_params

    cfg = ModelConfig(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32")
    kw = dict(max_concurrent_decodes=8, max_sequence_length=48, prefill_buckets=(16,), page_size=8, num_pages=48)
    packed, plain = PagedEngine(cfg, **kw), PagedEngine(cfg, packed_weights=False, **kw)
    assert packed.packed_weights and not plain.packed_weights
    assert not PagedEngine(cfg, stacked_matmul_rows=0, **kw).packed_weights
    with pytest.raises(ValueError, match="packed_weights needs"):
        PagedEngine(cfg, stacked_matmul_rows=0, packed_weights=True, **kw)
    # q k v o gate up down of 2 layers, columns padded to 64 (96 -> 128 for gate / up; 32 -> 64 for k / v)
    assert packed_bytes(cfg) == 4 * 2 * (64 * 64 + 2 * 64 * 64 + 64 * 64 + 2 * 64 * 128 + 96 * 64)
    p1, p2 = (packed.place_params(init_params(cfg, jax.random.key(s))) for s in (3, 4))
    no_pages = np.full(8, -1, np.int32)
    hlo = packed._steps[False].lower(packed._decode_params(p1), packed.init_decode_state().arrays, no_pages).as_text()
    assert hlo.count("jaxrl_async_stacked_matmul_packed") == 7
    runs = []
    for eng in (packed, plain):
        rng = np.random.default_rng(0)
        state, toks, lps = eng.init_decode_state(), [], []
        for s in range(8):
            sp = SamplingParams(temperature=0.0 if s % 2 else 1.0, max_new_tokens=16, seed=s)
            state = eng.insert(eng.prefill(p1, rng.integers(3, 300, 4 + s).tolist(), sp), state, s)
        for i in range(10):  # a weight update after 4 steps
            state, step = eng.generate(p1 if i < 4 else p2, state)
            step = step.to_host()
            toks.append(np.asarray(step.tokens))
            lps.append(np.asarray(step.logprobs))
        runs.append((np.stack(toks), np.stack(lps)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert packed._packed.packs == 2  # p1 (for the lowering above, reused by the first 4 steps), then p2 once
    assert plain._packed is None


def test_a_new_weight_set_is_packed_off_the_decode_thread():
    """`PagedEngine.prepare_params` (what `Generator.update_params` calls on its caller's thread) makes the new weight
    set's packed copy before the decode thread swaps the weights in: dispatches with the old weights keep the old
    copy meanwhile, the first one with the new weights packs nothing, and the tokens and log-probs stay the unpacked
    engine's bits. Through the generator: every pack runs on the thread that handed the weights over."""
    import threading

    from jaxrl_async.generator.engine import PagedEngine
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.orchestrator import Generator
    from jaxrl_async.models.transformer import init_params

    cfg = ModelConfig(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32")
    kw = dict(max_concurrent_decodes=4, max_sequence_length=64, prefill_buckets=(16,), page_size=8, num_pages=32)
    packed, plain = PagedEngine(cfg, **kw), PagedEngine(cfg, packed_weights=False, **kw)
    assert packed.packed_weights
    p1, p2 = (packed.place_params(init_params(cfg, jax.random.key(s))) for s in (5, 6))
    pw = packed._packed
    runs = []
    for eng in (packed, plain):
        rng = np.random.default_rng(1)
        state, out = eng.init_decode_state(), []
        for s in range(4):
            sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=s)
            state = eng.insert(eng.prefill(p1, rng.integers(3, 300, 5 + s).tolist(), sp), state, s)
        for i in range(8):
            if i == 2:
                eng.prepare_params(p2)  # the push arrives; the decode thread still serves p1 for two steps
                if eng is packed:
                    assert (pw.packs, pw.staged_packs) == (2, 1)
            state, step = eng.generate(p1 if i < 4 else p2, state)
            step = step.to_host()
            out.append((np.asarray(step.tokens), np.asarray(step.logprobs)))
        runs.append(out)
    for (t1, l1), (t2, l2) in zip(*runs):
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_array_equal(l1, l2)
    assert (pw.packs, pw.staged_packs) == (2, 1)  # p1 at its first dispatch; p2 staged, then taken as is
    assert pw._staged is None and not pw.stage(p2)  # promoted; staging the serving set again makes nothing
    from jaxrl_async.generator.packed_weights import PackedWeights

    with jax.transfer_guard("disallow"):  # as under the weight push's guard: on the CPU device packing moves nothing
        assert PackedWeights(pw.stacks).stage(p1)

    eng = PagedEngine(cfg, **kw)
    threads = []
    make = eng._packed._make
    eng._packed._make = lambda *a: (threads.append(threading.current_thread()), make(*a))[1]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    with Generator(eng, p1) as gen:
        first = gen.submit([7, 8, 9], sp).result(120)  # decoded with p1
        gen.update_params(p2, version=1, wait=True, timeout=120)
        second = gen.submit([7, 8, 9], sp).result(120)  # with p2
    assert set(first.samples[0].versions) == {0} and set(second.samples[0].versions) == {1}
    assert first.samples[0].completion_ids != second.samples[0].completion_ids
    assert threads == [threading.main_thread()] * 2 and eng._packed.packs == eng._packed.staged_packs == 2


def test_the_packed_copy_is_what_the_kv_sizing_counts():
    """`packed_bytes(cfg)` (what the engine's KV sizing sets aside) equals the bytes of the copy `PackedWeights`
    makes, with and without LoRA adapters on some matrices (a generator holding unmerged adapters: those matrices
    stay in XLA's dots and are not packed)."""
    from jaxrl_async.generator.engine import PagedEngine
    from jaxrl_async.generator.packed_weights import PACKED_KEY, packed_bytes
    from jaxrl_async.models import lora
    from jaxrl_async.models.transformer import init_params

    base = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32")
    kw = dict(max_concurrent_decodes=4, max_sequence_length=48, prefill_buckets=(16,), page_size=8, num_pages=24)
    for cfg, packed in ((base, {"q", "k", "v", "o", "gate", "up", "down"}),
                        (base.replace(lora=lora.LoraSpec(rank=4, alpha=8.0, targets=("q", "v"))),
                         {"k", "o", "gate", "up", "down"})):
        eng = PagedEngine(cfg, **kw)
        assert eng.packed_weights
        copy = eng._decode_params(eng.place_params(init_params(cfg, jax.random.key(0))))[PACKED_KEY]
        assert set(copy["layers"]) == packed
        assert packed_bytes(cfg) == sum(x.nbytes for x in jax.tree.leaves(copy)) > 0


@pytest.mark.parametrize("B,V", [(1, 5), (7, 1000), (64, 1024), (16, 4096 + 37)])
def test_sample_rows_equals_the_xla_sampler(B, V):
    """The decode step's sampler as one kernel (`sampling.sample`'s rows_fn): the same tokens as XLA's program on
    greedy, tempered, top-k and top-p rows (theta comes from the same z bits), and log-probs within float32 rounding
    of the result (1-2 ulp: other sum order, `fast_math.h`'s exp)."""
    from jaxrl_async.generator import sampling

    rng = np.random.default_rng(B * V)
    logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
    temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.0, 1.5], size=B), jnp.float32)
    seed, index, pos = jnp.arange(B, dtype=jnp.uint32), jnp.zeros(B, jnp.int32), jnp.full(B, 7, jnp.int32)
    for top_k, top_p in ((rng.choice([0, 0, 5, 50], size=B), rng.choice([1.0, 0.9, 0.5], size=B)),
                         (np.zeros(B), np.ones(B))):
        args = (logits, temperature, jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32), seed, index, pos)
        for truncation in (True, False) if not top_k.any() else (True,):
            ref = jax.jit(functools.partial(sampling.sample, truncation=truncation))(*args)
            got = jax.jit(functools.partial(sampling.sample, truncation=truncation,
                                            rows_fn=cpu_kernels.sample_rows))(*args)
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
            np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=3e-7, atol=1e-6)
    ties = jnp.asarray(np.tile([0.0, 2.0, 1.0, 2.0, 2.0], (2, 1)), jnp.float32)  # greedy: the first maximum
    toks, lse = cpu_kernels.sample_rows(ties, jnp.zeros(2), jnp.full(2, -jnp.inf), jnp.zeros(2))
    assert np.asarray(toks).tolist() == [1, 1]
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jax.nn.logsumexp(ties, axis=-1)), rtol=0, atol=1e-6)
    # the normaliser returned for the top log-probs is the one of the sampled token's log-prob: its entry among
    # them is that log-prob bitwise (with_lse; the engine's top log-probs)
    z = sampling.scale_logits(logits, temperature)
    tok, lp, lse = jax.jit(functools.partial(sampling.sample, rows_fn=cpu_kernels.sample_rows, with_lse=True))(
        logits, temperature, jnp.zeros(B, jnp.int32), jnp.ones(B), seed, index, pos)
    np.testing.assert_array_equal(np.asarray(jnp.take_along_axis(z, tok[:, None], axis=1)[:, 0] - lse),
                                  np.asarray(lp))


def test_engine_samples_with_the_kernel_only_on_one_cpu_device():
    from jaxrl_async.generator.engine import PagedEngine
    from jaxrl_async.models.transformer import init_params
    from jaxrl_async.sharding.mesh import make_mesh

    cfg = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", param_dtype="float32")
    kw = dict(max_concurrent_decodes=4, max_sequence_length=64, prefill_buckets=(32,), page_size=8, num_pages=40)
    params = init_params(cfg, jax.random.key(0))
    no_pages = np.full(4, -1, np.int32)

    def step_hlo(eng):
        return eng._steps[True].lower(eng.place_params(params), eng.init_decode_state().arrays, no_pages).as_text()

    kernel, blocked = PagedEngine(cfg, **kw), PagedEngine(cfg, attention="blocked", **kw)
    assert kernel.cpu_sampler and "jaxrl_async_sample_rows" in step_hlo(kernel)
    assert not blocked.cpu_sampler and "jaxrl_async_sample_rows" not in step_hlo(blocked)
    mesh = make_mesh({"data": 1, "tensor": 2}, devices=jax.devices()[:2])
    assert not PagedEngine(cfg, mesh=mesh, **kw).cpu_sampler
