"""sampling.py: distributions (chi-square), exact full-vocabulary log-probs, per-request streams."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_async.rollout import sampling

# probabilities chosen so the truncated supports are easy to derive by hand
PROBS = np.array([0.05, 0.40, 0.02, 0.25, 0.15, 0.10, 0.03], np.float64)  # sorted: 1, 3, 4, 5, 0, 6, 2
LOGITS = np.log(PROBS).astype(np.float32) + 3.0  # an offset does not change the softmax
N = 20_000
V = len(PROBS)

_sample = jax.jit(sampling.sample)


def draw(temperature, top_k=0, top_p=1.0, logits=LOGITS):
    """N draws from one row of logits with N different request keys (seed 7, sample i, position 5)."""
    B = N
    full = lambda x, dt: jnp.full((B,), x, dt)  # noqa: E731
    toks, lps = _sample(jnp.broadcast_to(jnp.asarray(logits), (B, logits.shape[0])), full(temperature, jnp.float32),
                        full(top_k, jnp.int32), full(top_p, jnp.float32), full(7, jnp.uint32),
                        jnp.arange(B, dtype=jnp.int32), full(5, jnp.int32))
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
def test_temperature_distribution(T):
    toks, _ = draw(T)
    assert chi2_pvalue(toks, tempered(T)) > 1e-3


def test_chi_square_detects_a_wrong_temperature():
    toks, _ = draw(0.5)
    assert chi2_pvalue(toks, tempered(1.0)) < 1e-6


def test_top_k_distribution():
    toks, _ = draw(1.0, top_k=3)
    assert chi2_pvalue(toks, renorm(PROBS, [1, 3, 4])) > 1e-3


def test_top_p_distribution():
    # sorted probs 0.40, 0.25, 0.15, ...: exclusive mass 0, 0.40, 0.65 -> top_p=0.6 keeps {1, 3}
    toks, _ = draw(1.0, top_p=0.6)
    assert chi2_pvalue(toks, renorm(PROBS, [1, 3])) > 1e-3


def test_top_k_then_top_p_on_renormalised_top_k():
    # top-k=3 renormalises to 0.40/0.80, 0.25/0.80, 0.15/0.80 = .5, .3125, .1875;
    # exclusive mass 0, .5, .8125 -> top_p=0.85 keeps {1, 3, 4}; top_p=0.7 keeps {1, 3}.
    # (top-p on the un-renormalised probabilities would keep {1, 3, 4, 5} at 0.85: excl. mass .8)
    toks, _ = draw(1.0, top_k=3, top_p=0.85)
    assert chi2_pvalue(toks, renorm(PROBS, [1, 3, 4])) > 1e-3
    toks, _ = draw(1.0, top_k=3, top_p=0.7)
    assert chi2_pvalue(toks, renorm(PROBS, [1, 3])) > 1e-3


def test_top_p_with_temperature():
    T = 0.5  # tempered probs p^2 / sum = .619, .242, .087, ...: top_p=0.5 keeps {1}, 0.7 keeps {1, 3}
    p = tempered(T)
    toks, _ = draw(T, top_p=0.5)
    assert np.all(toks == 1)
    toks, _ = draw(T, top_p=0.7)
    keep = [1, 3]
    assert p[1] < 0.7 < p[1] + p[3]
    assert chi2_pvalue(toks, renorm(p, keep)) > 1e-3


def test_logprob_is_full_vocabulary_before_truncation():
    for T, k, tp in [(1.0, 0, 1.0), (0.7, 2, 1.0), (1.5, 0, 0.5), (0.0, 3, 0.5)]:
        toks, lps = draw(T, top_k=k, top_p=tp)
        expected = np.log(tempered(T) if T > 0 else PROBS)[toks]
        np.testing.assert_allclose(lps, expected, atol=2e-6, err_msg=str((T, k, tp)))


def test_greedy_is_argmax_and_ignores_randomness():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(N, V)).astype(np.float32)
    toks, lps = _sample(jnp.asarray(logits), jnp.zeros(N, jnp.float32), jnp.full(N, 5, jnp.int32),
                        jnp.full(N, 0.3, jnp.float32), jnp.arange(N, dtype=jnp.uint32), jnp.zeros(N, jnp.int32),
                        jnp.arange(N, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(toks), logits.argmax(-1))
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lps), ref[np.arange(N), logits.argmax(-1)], atol=1e-5)


def test_request_key_formula():
    got = jax.jit(sampling.request_key)(jnp.uint32(3_000_000_000), jnp.int32(2), jnp.int32(17))
    want = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3_000_000_000), 2), 17)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


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


def test_is_stop():
    stop_ids = jnp.asarray([[5, -1], [-1, -1], [0, 7]], jnp.int32)
    got = sampling.is_stop(jnp.asarray([5, -1, 7], jnp.int32), stop_ids)
    np.testing.assert_array_equal(np.asarray(got), [True, False, True])
