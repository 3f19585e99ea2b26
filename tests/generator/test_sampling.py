"""sampling.py: distributions (chi-square), exact full-vocabulary log-probs, per-request streams."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_async.generator import sampling
from jaxrl_async.kernels import cpu_kernels

# probabilities chosen so the truncated supports are easy to derive by hand
PROBS = np.array([0.05, 0.40, 0.02, 0.25, 0.15, 0.10, 0.03], np.float64)  # sorted: 1, 3, 4, 5, 0, 6, 2
LOGITS = np.log(PROBS).astype(np.float32) + 3.0  # an offset does not change the softmax
N = 20_000
V = len(PROBS)

_sample = jax.jit(sampling.sample)
# the sampler's two implementations: XLA's program, and the CPU engine's kernel (`rows_fn`, the same math row by row)
SAMPLERS = {"xla": _sample, "cpu_kernel": jax.jit(lambda *a: sampling.sample(*a, rows_fn=cpu_kernels.sample_rows))}
PATHS = ["xla", pytest.param("cpu_kernel", marks=pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C++ compiler: the CPU kernels cannot be built"))]


def draw(temperature, top_k=0, top_p=1.0, logits=LOGITS, path="xla"):
    """N draws from one row of logits with N different request keys (seed 7, sample i, position 5)."""
    B = N
    full = lambda x, dt: jnp.full((B,), x, dt)  # noqa: E731
    toks, lps = SAMPLERS[path](jnp.broadcast_to(jnp.asarray(logits), (B, logits.shape[0])),
                               full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                               full(7, jnp.uint32), jnp.arange(B, dtype=jnp.int32), full(5, jnp.int32))
    return np.asarray(toks), np.asarray(lps)


def tempered(T):
    p = PROBS ** (1.0 / T)
    return p / p.sum()


def renorm(p, support):
    q = np.zeros_like(p)
    q[support] = p[support]
    return q / q.sum()


def chi2_pvalue(tokens, expected):
    support = expected > 0
    counts = np.bincount(tokens, minlength=len(expected))
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts}"
    return stats.chisquare(counts[support], expected[support] * len(tokens)).pvalue


@pytest.mark.parametrize("T", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("path", PATHS)
def test_temperature_distribution(T, path):
    toks, _ = draw(T, path=path)
    assert chi2_pvalue(toks, tempered(T)) > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_chi_square_detects_a_wrong_temperature(path):
    toks, _ = draw(0.5, path=path)
    assert chi2_pvalue(toks, tempered(1.0)) < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_top_k_distribution(path):
    toks, _ = draw(1.0, top_k=3, path=path)
    assert chi2_pvalue(toks, renorm(PROBS, [1, 3, 4])) > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_top_p_distribution(path):
    # sorted probs 0.40, 0.25, 0.15, ...: exclusive mass 0, 0.40, 0.65 -> top_p=0.6 keeps {1, 3}
    toks, _ = draw(1.0, top_p=0.6, path=path)
    assert chi2_pvalue(toks, renorm(PROBS, [1, 3])) > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_top_k_then_top_p_on_renormalised_top_k(path):
    # top-k=3 renormalises to 0.40/0.80, 0.25/0.80, 0.15/0.80 = .5, .3125, .1875;
    # exclusive mass 0, .5, .8125 -> top_p=0.85 keeps {1, 3, 4}; top_p=0.7 keeps {1, 3}.
    # (top-p on the un-renormalised probabilities would keep {1, 3, 4, 5} at 0.85: excl. mass .8)
    toks, _ = draw(1.0, top_k=3, top_p=0.85, path=path)
    assert chi2_pvalue(toks, renorm(PROBS, [1, 3, 4])) > 1e-3
    toks, _ = draw(1.0, top_k=3, top_p=0.7, path=path)
    assert chi2_pvalue(toks, renorm(PROBS, [1, 3])) > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_top_p_with_temperature(path):
    T = 0.5  # tempered probs p^2 / sum = .619, .242, .087, ...: top_p=0.5 keeps {1}, 0.7 keeps {1, 3}
    p = tempered(T)
    toks, _ = draw(T, top_p=0.5, path=path)
    assert np.all(toks == 1)
    toks, _ = draw(T, top_p=0.7, path=path)
    keep = [1, 3]
    assert p[1] < 0.7 < p[1] + p[3]
    assert chi2_pvalue(toks, renorm(p, keep)) > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_logprob_is_full_vocabulary_before_truncation(path):
    for T, k, tp in [(1.0, 0, 1.0), (0.7, 2, 1.0), (1.5, 0, 0.5), (0.0, 3, 0.5)]:
        toks, lps = draw(T, top_k=k, top_p=tp, path=path)
        expected = np.log(tempered(T) if T > 0 else PROBS)[toks]
        np.testing.assert_allclose(lps, expected, atol=2e-6, err_msg=str((T, k, tp)))


@pytest.mark.parametrize("path", PATHS)
def test_greedy_is_argmax_and_ignores_randomness(path):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(N, V)).astype(np.float32)
    toks, lps = SAMPLERS[path](jnp.asarray(logits), jnp.zeros(N, jnp.float32), jnp.full(N, 5, jnp.int32),
                               jnp.full(N, 0.3, jnp.float32), jnp.arange(N, dtype=jnp.uint32),
                               jnp.zeros(N, jnp.int32), jnp.arange(N, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(toks), logits.argmax(-1))
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lps), ref[np.arange(N), logits.argmax(-1)], atol=1e-5)


def test_request_key_formula():
    got = jax.jit(sampling.request_key)(jnp.uint32(3_000_000_000), jnp.int32(2), jnp.int32(17))
    want = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3_000_000_000), 2), 17)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_uniform_noise_is_jax_random_bitwise(monkeypatch):
    """The unrolled threefry uniform of the sampler = jax.random's (request_key, then uniform(key, ())), bit for bit,
    over seeds up to 2**32 - 1, negative and large sample indices and positions; and so does the fallback path."""
    rng = np.random.default_rng(5)
    B = 41
    seed = jnp.asarray(np.concatenate([[0, 2**32 - 1], rng.integers(0, 2**32, B - 2, dtype=np.uint64)]).astype(np.uint32))
    idx = jnp.asarray(np.concatenate([[0, -1], rng.integers(-2**31, 2**31 - 1, B - 2)]).astype(np.int32))
    pos = jnp.asarray(np.concatenate([[0, 2**31 - 1], rng.integers(0, 2**31 - 1, B - 2)]).astype(np.int32))
    ref = jax.jit(lambda s, i, p: jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(
        jax.vmap(sampling.request_key)(s, i, p)))(seed, idx, pos)
    assert sampling._lean_stream()
    for lean in (True, False):
        monkeypatch.setattr(sampling, "_lean_stream", lambda lean=lean: lean)
        got = jax.jit(sampling.uniform_noise)(seed, idx, pos)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(ref).view(np.uint32))


@pytest.mark.parametrize("V", [1001, 1024, 130])
@pytest.mark.parametrize("path", PATHS)
def test_inverse_cdf_over_several_blocks_is_the_distribution(V, path):
    """The two-level inverse CDF (blocks of CDF_BLOCK entries) on vocabularies of several blocks, a partial last
    block included: chi-square on the tokens of mass, including mass in the first, a middle and the last
    (partial) block, and never a token outside the support (zero-mass entries around the chosen ones)."""
    rng = np.random.default_rng(V)
    hot = np.array([0, 1, sampling.CDF_BLOCK - 1, sampling.CDF_BLOCK, V // 2, V - 2, V - 1])
    probs = np.zeros(V)
    probs[hot] = rng.uniform(0.2, 1.0, len(hot))
    probs /= probs.sum()
    z = np.full(V, -1e4, np.float32)  # exp underflows to exactly 0: zero mass
    z[hot] = np.log(probs[hot])
    u = jnp.asarray(rng.uniform(size=N), jnp.float32)
    if path == "xla":
        inverse_cdf = jax.jit(sampling.inverse_cdf)
    else:  # the kernel at T = 1 (z = logits)
        inverse_cdf = jax.jit(lambda z, theta, u: cpu_kernels.sample_rows(z, jnp.ones(z.shape[0]), theta, u)[0])
    toks = np.asarray(inverse_cdf(jnp.broadcast_to(jnp.asarray(z), (N, V)), jnp.full(N, -jnp.inf), u))
    assert chi2_pvalue(toks, probs) > 1e-3
    # u at the edges: 0 gives the first token of mass, the largest float below 1 the last one
    edge = np.asarray(inverse_cdf(jnp.asarray(z)[None].repeat(2, 0), jnp.full(2, -jnp.inf),
                                  jnp.asarray([0.0, np.nextafter(np.float32(1), np.float32(0))])))
    assert edge.tolist() == [hot[0], hot[-1]]
    # a theta cuts the support: only tokens with z >= theta
    theta = float(np.sort(z[hot])[-3])
    toks = np.asarray(inverse_cdf(jnp.broadcast_to(jnp.asarray(z), (N, V)), jnp.full(N, theta), u))
    assert set(toks.tolist()) == set(hot[z[hot] >= theta].tolist())


@pytest.mark.parametrize("path", PATHS)
def test_greedy_rows_in_a_sampled_batch_take_the_first_maximum(path):
    """A batch mixing greedy and sampled rows: the greedy rows return first_argmax(logits), ties included."""
    rng = np.random.default_rng(2)
    B, V = 8, 300
    logits = rng.normal(size=(B, V)).astype(np.float32)
    logits[0, [5, 200, 299]] = 9.0  # a three-way tie across blocks
    logits[2, [150, 151]] = 9.0
    temperature = np.array([0.0, 1.0, 0.0, 0.7, 0.0, 1.0, 0.0, 2.0], np.float32)
    zeros = jnp.zeros(B, jnp.int32)
    rows_fn = cpu_kernels.sample_rows if path == "cpu_kernel" else None
    toks, _ = jax.jit(lambda *a: sampling.sample(*a, rows_fn=rows_fn))(
        jnp.asarray(logits), jnp.asarray(temperature), zeros, jnp.ones(B), jnp.arange(B, dtype=jnp.uint32), zeros,
        zeros + 3)
    greedy = temperature == 0
    np.testing.assert_array_equal(np.asarray(toks)[greedy], np.asarray(sampling.first_argmax(logits))[greedy])
    assert np.asarray(toks)[[0, 2]].tolist() == [5, 150]


def test_row_result_independent_of_batch_composition():
    """A row's token depends only on its own logits, params and key, not on its neighbours or its row.
    (All calls use the [N, V] shape of the other tests: one compilation for the module.)"""
    rng = np.random.default_rng(1)
    target = rng.normal(size=V).astype(np.float32)

    def run(batch_logits, temps, ks, ps, row):
        toks, lps = _sample(jnp.asarray(batch_logits), jnp.asarray(temps, jnp.float32), jnp.asarray(ks, jnp.int32),
                            jnp.asarray(ps, jnp.float32), jnp.full(N, 99, jnp.uint32).at[row].set(1234),
                            jnp.zeros(N, jnp.int32).at[row].set(3), jnp.full(N, 10, jnp.int32).at[row].set(42))
        return int(toks[row]), float(lps[row])

    # alone: no row uses truncation (the cheap branch), target in row 0
    alone = run(np.broadcast_to(target, (N, V)), np.full(N, 0.9), np.zeros(N), np.ones(N), 0)
    # mixed: neighbours trigger the top-k/top-p branch, the target in row 2
    batch = rng.normal(size=(N, V)).astype(np.float32)
    batch[2] = target
    temps = rng.choice([0.0, 0.5, 1.0], N)
    temps[2] = 0.9
    ks = rng.choice([0, 2, 5], N)
    ks[2] = 0
    ps = rng.choice([0.3, 1.0], N)
    ps[2] = 1.0
    assert sampling.needs_truncation(jnp.asarray(temps), jnp.asarray(ks), jnp.asarray(ps)).any()
    assert run(batch, temps, ks, ps, 2) == alone
    # and many keys really give different tokens (the stream is used)
    toks, _ = draw(1.0)
    assert len(set(toks.tolist())) == V
    assert _sample._cache_size() == 1  # every call of this module shares one compilation


def _large_vocab_rows(rng, V=2000):
    """Rows from peaked (nucleus inside the top 64) to flat (nucleus of hundreds of tokens), with
    top-k / top-p settings the prefix settles and settings it cannot (flat top-p, top_k > 64)."""
    scales = np.array([8.0, 8.0, 8.0, 4.0, 0.3, 0.3, 8.0, 0.3, 1.0, 1.0, 8.0, 0.0])
    top_k = np.array([0, 5, 64, 0, 0, 10, 100, 200, 0, 50, 0, 0])
    top_p = np.array([0.9, 1.0, 0.95, 0.5, 0.9, 0.7, 0.9, 1.0, 0.99, 0.8, 1.0, 0.9])
    z = (rng.normal(size=(len(scales), V)) * scales[:, None]).astype(np.float32)
    z[:, 7] = z.max(axis=1) + 0.5  # a clear top token in every row; row 11 is exactly flat elsewhere
    return jnp.asarray(z), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)


def test_prefilter_threshold_equals_the_full_sort_where_it_resolves():
    z, top_k, top_p = _large_vocab_rows(np.random.default_rng(3))
    theta, resolved = jax.jit(sampling.prefilter_threshold)(z, top_k, top_p)
    ref = jax.jit(sampling.truncation_threshold)(z, top_k, top_p)
    resolved = np.asarray(resolved)
    # peaked top-p, top-k <= 64 and top-k <= 64 with top-p resolve; flat top-p and top_k > 64 do not
    np.testing.assert_array_equal(resolved[[0, 1, 2, 3, 5, 9]], True)
    np.testing.assert_array_equal(resolved[[4, 6, 7, 8]], False)
    np.testing.assert_array_equal(np.asarray(theta)[resolved], np.asarray(ref)[resolved])


def test_sampling_with_prefilter_and_fallback_equals_the_full_sort():
    """End to end on V = 2000: the tokens of `sample` (prefilter, full sort only for rows it cannot
    settle) equal those of sampling from the full-sort threshold with the same keys, row by row, in
    batches that do and do not need the fallback; log-probs are the full-vocabulary ones."""
    z, top_k, top_p = _large_vocab_rows(np.random.default_rng(4))
    B = z.shape[0]
    temps = jnp.full(B, 1.0)
    seeds, idx, pos = jnp.arange(B, dtype=jnp.uint32), jnp.zeros(B, jnp.int32), jnp.full(B, 3, jnp.int32)

    @jax.jit
    def reference(rows):
        theta = sampling.truncation_threshold(z[rows], top_k[rows], top_p[rows])
        trunc = sampling.needs_truncation(temps[rows], top_k[rows], top_p[rows])
        theta = jnp.where(trunc, theta, -jnp.inf)
        keys = jax.vmap(sampling.request_key)(seeds[rows], idx[rows], pos[rows])
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
        return sampling.inverse_cdf(z[rows], theta, u)

    for rows in (np.arange(B), np.array([0, 1, 2, 3, 5, 9]), np.array([4, 6, 8])):  # mixed, resolved, fallback
        r = jnp.asarray(rows)
        toks, lps = jax.jit(sampling.sample)(z[r], temps[r], top_k[r], top_p[r], seeds[r], idx[r], pos[r])
        np.testing.assert_array_equal(np.asarray(toks), np.asarray(reference(r)))
        np.testing.assert_allclose(np.asarray(lps), np.asarray(sampling.behaviour_logprobs(z[r], temps[r], toks)),
                                   atol=1e-6)
    # the truncation is real: a narrow top-k over many keys never leaves its support
    n = 4000
    toks, _ = jax.jit(sampling.sample)(jnp.broadcast_to(z[1], (n, z.shape[1])), jnp.ones(n), jnp.full(n, 5),
                                        jnp.ones(n), jnp.full(n, 1, jnp.uint32), jnp.arange(n), jnp.full(n, 3))
    top5 = set(np.argsort(-np.asarray(z[1]))[:5].tolist())
    assert set(np.asarray(toks).tolist()) == top5


def test_first_argmax_is_argmax_with_ties():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 4, size=(50, 33)).astype(np.float32)  # many ties
    x[3] = -np.inf
    x[4, 7] = np.inf
    np.testing.assert_array_equal(np.asarray(sampling.first_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


def test_is_stop():
    stop_ids = jnp.asarray([[5, -1], [-1, -1], [0, 7]], jnp.int32)
    got = sampling.is_stop(jnp.asarray([5, -1, 7], jnp.int32), stop_ids)
    np.testing.assert_array_equal(np.asarray(got), [True, False, True])


def test_program_without_truncation_equals_the_full_one_on_untruncated_rows():
    """`truncation=False` (the engine's program for batches without top-k/top-p) returns the same tokens and
    log-probs as the full program on rows that do not truncate: greedy and pure-temperature rows mixed."""
    rng = np.random.default_rng(3)
    B, V = 16, 257
    logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
    temperature = jnp.asarray(rng.choice([0.0, 0.5, 1.0, 1.7], size=B), jnp.float32)
    zeros = jnp.zeros(B, jnp.int32)
    args = (logits, temperature, zeros, jnp.ones(B), jnp.arange(B, dtype=jnp.uint32), zeros + 2,
            jnp.arange(B, dtype=jnp.int32) + 5)
    full = jax.jit(sampling.sample)(*args)
    plain = jax.jit(lambda *a: sampling.sample(*a, truncation=False))(*args)
    np.testing.assert_array_equal(np.asarray(full[0]), np.asarray(plain[0]))
    np.testing.assert_array_equal(np.asarray(full[1]), np.asarray(plain[1]))
    assert len(set(np.asarray(plain[0])[np.asarray(temperature) > 0].tolist())) > 3  # really sampled
