"""Advantage-pipeline tests against hand-derived values."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.rl.advantages import (
    PRESETS,
    AdvantageConfig,
    compute_advantages,
    dr_grpo_advantages,
    gae,
    group_has_signal,
    grpo_advantages,
    kl_estimate,
    kl_token_rewards,
    liteppo_advantages,
    loglinear_proximal_logprobs,
    normalize,
    overlong_penalty,
    preset_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    transform_rewards,
)

EPS = 1e-5


def test_transform_rewards():
    # gsm8k recipe: b = -0.5, s = 10: {0, 1} → {-5, +5}; clip 20 → 3 at c = 3.
    np.testing.assert_allclose(transform_rewards([0.0, 1.0], bias=-0.5, scale=10.0), [-5.0, 5.0])
    np.testing.assert_allclose(transform_rewards([0.0, 1.0], bias=-0.5, scale=10.0, clip=3.0), [-3.0, 3.0])
    np.testing.assert_allclose(transform_rewards([100.0, -100.0]), [20.0, -20.0])
    np.testing.assert_allclose(transform_rewards([100.0], clip=None), [100.0])
    with pytest.raises(ValueError, match="clip"):
        transform_rewards([1.0], clip=0.0)


def test_overlong_penalty():
    # L_max = 10, L_ov = 4, φ = 2: free up to 6 tokens, then -(L - 6)/4 · 2.
    p = overlong_penalty([3, 6, 7, 8, 10], max_new_tokens=10, overlong_tokens=4, penalty_factor=2.0)
    np.testing.assert_allclose(p, [0.0, 0.0, -0.5, -1.0, -2.0])
    with pytest.raises(ValueError, match="overlong_tokens"):
        overlong_penalty([1], 10, 0, 1.0)
    with pytest.raises(ValueError, match="overlong_tokens"):
        overlong_penalty([1], 10, 11, 1.0)


# x = [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], Σd² = 14,
# unbiased std sqrt(14/3) = 2.160247, biased std sqrt(14/4) = 1.870829.
X = np.array([1.0, 2.0, 3.0, 6.0])


def test_normalize_batch():
    s = math.sqrt(14 / 3)
    np.testing.assert_allclose(normalize(X), (X - 3) / (s + EPS), rtol=1e-12)
    np.testing.assert_allclose(normalize(X, unbiased=False), (X - 3) / (math.sqrt(3.5) + EPS), rtol=1e-12)
    np.testing.assert_allclose(normalize(X, std_level=None), X - 3, rtol=1e-12)
    # mean None, batch std: RMS around 0 = sqrt((1+4+9+36)/3).
    np.testing.assert_allclose(normalize(X, mean_level=None), X / (math.sqrt(50 / 3) + EPS), rtol=1e-12)
    np.testing.assert_allclose(normalize(X, mean_level=None, std_level=None), X)
    np.testing.assert_allclose(normalize(X, eps=0.5, unbiased=False), (X - 3) / (math.sqrt(3.5) + 0.5), rtol=1e-12)


def test_normalize_group_levels():
    # groups [1, 2] and [3, 6]: means 1.5, 4.5; residuals [-.5, .5, -1.5, 1.5];
    # group unbiased stds sqrt(0.5) and sqrt(4.5); batch std of residuals sqrt(5/3).
    g = normalize(X, mean_level="group", std_level="group", group_size=2)
    np.testing.assert_allclose(g, [-0.5 / (math.sqrt(0.5) + EPS), 0.5 / (math.sqrt(0.5) + EPS),
                                   -1.5 / (math.sqrt(4.5) + EPS), 1.5 / (math.sqrt(4.5) + EPS)], rtol=1e-12)
    lite = normalize(X, mean_level="group", std_level="batch", group_size=2)
    np.testing.assert_allclose(lite, np.array([-0.5, 0.5, -1.5, 1.5]) / (math.sqrt(5 / 3) + EPS), rtol=1e-12)
    # batch mean, group std: std of (x - 3) within each group around the batch mean.
    bg = normalize(X, mean_level="batch", std_level="group", group_size=2)
    s1, s2 = math.sqrt((4 + 1) / 1), math.sqrt((0 + 9) / 1)
    np.testing.assert_allclose(bg, [-2 / (s1 + EPS), -1 / (s1 + EPS), 0.0, 3 / (s2 + EPS)], rtol=1e-12)


def test_normalize_leave_one_out():
    # group [1, 2, 3, 6] (size 4): μ_j = (12 - x_j)/3 = [11/3, 10/3, 3, 2] → x - μ = [-8/3, -4/3, 0, 4].
    np.testing.assert_allclose(normalize(X, mean_level="group", std_level=None, leave_one_out=True, group_size=4),
                               [-8 / 3, -4 / 3, 0.0, 4.0], rtol=1e-12)
    # batch level leave-one-out is the same here.
    np.testing.assert_allclose(normalize(X, std_level=None, leave_one_out=True), [-8 / 3, -4 / 3, 0.0, 4.0], rtol=1e-12)
    # group size 2: μ = the other element: [2, 1, 6, 3] → [-1, 1, -3, 3].
    np.testing.assert_allclose(normalize(X, mean_level="group", std_level=None, leave_one_out=True, group_size=2),
                               [-1.0, 1.0, -3.0, 3.0])
    # group size 1: the leave-one-out mean is 0.
    np.testing.assert_allclose(normalize(X, mean_level="group", std_level=None, leave_one_out=True, group_size=1), X)


def test_normalize_group_size_one_and_degenerate_cases():
    # group_size 1 with group mean and unbiased group std: μ = x, σ = 1 → zeros.
    np.testing.assert_allclose(normalize(X, mean_level="group", std_level="group", group_size=1), 0.0)
    # biased group std with group_size 1: σ = 0 → (x - x)/(0 + eps) = 0.
    np.testing.assert_allclose(normalize(X, mean_level="group", std_level="group", group_size=1, unbiased=False), 0.0)
    # Batch of one element, unbiased: σ = 1.
    np.testing.assert_allclose(normalize([4.0]), [0.0])
    np.testing.assert_allclose(normalize([4.0], mean_level=None), [4.0 / (1 + EPS)])


def test_normalize_token_level_with_mask():
    # Token values are weighted by their count: row 0 value 1 on 3 tokens, row 1 value 4 on 1 token.
    x = np.array([[1.0, 1.0, 1.0, 9.0], [4.0, 7.0, 7.0, 7.0]])
    m = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    mu = (3 * 1 + 4) / 4  # 1.75
    sd = math.sqrt((3 * 0.75 ** 2 + 2.25 ** 2) / 3)
    out = normalize(x, m)
    exp = np.where(m, (x - mu) / (sd + EPS), 0.0)
    np.testing.assert_allclose(out, exp, rtol=1e-12)
    # all-masked input is returned unchanged.
    np.testing.assert_array_equal(normalize(x, np.zeros_like(m)), x)


def test_normalize_errors():
    with pytest.raises(ValueError, match="mean_level"):
        normalize(X, mean_level="token")
    with pytest.raises(ValueError, match="std_level"):
        normalize(X, std_level="row")
    with pytest.raises(ValueError, match="group_size"):
        normalize(X, mean_level="group", group_size=3)
    with pytest.raises(ValueError, match="mask shape"):
        normalize(X, np.ones(3))


R8 = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])


def test_presets_hand_values():
    # group 1 [1,0,0,1]: mean 0.5, unbiased std sqrt(1/3); group 2 [1,1,1,0]: mean .75, std 0.5.
    s1, s2 = math.sqrt(1 / 3), 0.5
    np.testing.assert_allclose(grpo_advantages(R8, 4), [0.5 / (s1 + EPS), -0.5 / (s1 + EPS), -0.5 / (s1 + EPS),
                                                        0.5 / (s1 + EPS), 0.25 / (s2 + EPS), 0.25 / (s2 + EPS),
                                                        0.25 / (s2 + EPS), -0.75 / (s2 + EPS)], rtol=1e-12)
    centred = np.array([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    np.testing.assert_allclose(dr_grpo_advantages(R8, 4), centred, rtol=1e-12)
    np.testing.assert_allclose(preset_advantages(R8, "reinforce_baseline", 4), centred, rtol=1e-12)
    sb = math.sqrt((centred ** 2).sum() / 7)
    np.testing.assert_allclose(liteppo_advantages(R8, 4), centred / (sb + EPS), rtol=1e-12)
    # RLOO: 1 in [1,0,0,1] → 1 - 1/3; 0 → 0 - 2/3; group 2: 1 → 1 - 2/3; 0 → 0 - 1.
    np.testing.assert_allclose(rloo_advantages(R8, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0],
                               rtol=1e-12)
    for p in ("reinforce_pp", "ppo", "none"):
        np.testing.assert_array_equal(preset_advantages(R8, p, 4), R8)
    with pytest.raises(ValueError, match="preset"):
        preset_advantages(R8, "grpo2", 4)
    assert set(PRESETS) >= {"grpo", "dr_grpo", "liteppo", "rloo", "reinforce_pp"}


def test_reinforce_pp_token_batch_norm():
    m = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    out = reinforce_pp_advantages([1.0, 4.0], m)
    mu = 1.75
    sd = math.sqrt((3 * 0.75 ** 2 + 2.25 ** 2) / 3)
    np.testing.assert_allclose(out, np.where(m, (np.array([[1.0], [4.0]]) - mu) / (sd + EPS), 0.0), rtol=1e-12)


def test_kl_estimates():
    lp = np.array([-1.0, -2.0, -0.1, -30.0])
    ref = np.array([-1.5, -1.0, -0.1, -1.0])
    d = lp - ref  # [0.5, -1, 0, -29]
    np.testing.assert_allclose(kl_estimate(lp, ref, "k1"), [0.5, -1.0, 0.0, -10.0])
    np.testing.assert_allclose(kl_estimate(lp, ref, "k1", clamp=None), d)
    np.testing.assert_allclose(kl_estimate(lp, ref, "k2"), [0.125, 0.5, 0.0, 10.0])
    k3 = np.exp(-d) - 1 + d
    np.testing.assert_allclose(kl_estimate(lp, ref, "k3"), [k3[0], k3[1], 0.0, 10.0], rtol=1e-12)
    np.testing.assert_allclose(kl_estimate(lp, ref, "k3", clamp=None), k3, rtol=1e-12)
    with pytest.raises(ValueError, match="kind"):
        kl_estimate(lp, ref, "k4")
    # jax path: jax in → jax out, differentiable: d k3 / d lp = 1 - e^{-d}.
    g = jax.grad(lambda x: jnp.sum(kl_estimate(x, jnp.asarray(ref[:3], jnp.float32), "k3")))(
        jnp.asarray(lp[:3], jnp.float32))
    assert isinstance(g, jax.Array)
    np.testing.assert_allclose(np.asarray(g), 1 - np.exp(-d[:3]), rtol=1e-5)
    # KL folded into token rewards with coefficient β: r = -β k · m.
    m = np.array([1, 1, 0, 1], bool)
    np.testing.assert_allclose(kl_token_rewards(lp, ref, m, 0.1, "k1"), [-0.05, 0.1, 0.0, 1.0])


def test_gae_hand_values():
    # One sequence, 3 valid tokens, γ = 0.9, λ = 0.8, V = [1, 2, 3], r = [0, 0, 1], terminal.
    # δ = [0 + .9·2 - 1, 0 + .9·3 - 2, 1 + 0 - 3] = [0.8, 0.7, -2]
    # A2 = -2; A1 = .7 + .72·(-2) = -0.74; A0 = .8 + .72·(-0.74) = 0.2672.
    r = np.array([[0.0, 0.0, 1.0, 0.0]])
    v = np.array([[1.0, 2.0, 3.0, 9.0]])
    m = np.array([[1, 1, 1, 0]], bool)
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv, [[0.2672, -0.74, -2.0, 0.0]], rtol=1e-12)
    np.testing.assert_allclose(ret, [[1.2672, 1.26, 1.0, 0.0]], rtol=1e-12)
    # bootstrap value 5 after the last token: δ2 = 1 + .9·5 - 3 = 2.5.
    adv_b, _ = gae(r, v, m, gamma=0.9, lam=0.8, bootstrap=[5.0])
    assert adv_b[0, 2] == pytest.approx(2.5)
    # γ = λ = 1, V = 0: every token gets the sum of future rewards.
    adv1, _ = gae(np.array([[1.0, 2.0, 3.0]]), None, np.ones((1, 3), bool))
    np.testing.assert_allclose(adv1, [[6.0, 5.0, 3.0]])


def _gae_loop(r, v, m, gamma, lam):
    """Independent reference: per row, GAE on the compacted valid positions only."""
    out = np.zeros_like(r)
    for b in range(r.shape[0]):
        idx = list(np.nonzero(m[b])[0])
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(idx):
            delta = r[b, t] + gamma * nxt_v - v[b, t]
            nxt_a = delta + gamma * lam * nxt_a
            out[b, t] = nxt_a
            nxt_v = v[b, t]
    return out


def test_gae_against_loop_with_holes():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(4, 9))
    v = rng.normal(size=(4, 9))
    m = rng.random((4, 9)) < 0.6  # holes in the middle (multi-turn tool outputs) and padding
    m[2] = False
    adv, ret = gae(r, v, m, gamma=0.95, lam=0.9)
    exp = _gae_loop(r, v, m, 0.95, 0.9)
    np.testing.assert_allclose(adv, exp, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ret, np.where(m, exp + v, 0.0), rtol=1e-12, atol=1e-14)


def test_group_has_signal():
    assert group_has_signal([1.0, 0.0, 1.0]) is True
    assert group_has_signal([1.0, 1.0, 1.0]) is False
    assert group_has_signal([0.5]) is False
    np.testing.assert_array_equal(group_has_signal(R8, 4), [True, True])
    np.testing.assert_array_equal(group_has_signal([1, 1, 0, 0, 0.3, 0.3], 2), [False, False, False])
    np.testing.assert_array_equal(group_has_signal([1.0, 1.05], 2, atol=0.1), [False])
    with pytest.raises(ValueError, match="groups of 4"):
        group_has_signal([1.0, 2.0, 3.0], 4)


def test_loglinear_proximal_logprobs():
    # current version 6 (π_prox = v5); token versions [-1, 5, 4, 3, 6, 0]:
    # α = [0 (prompt), (5-5)/1 = 0, (5-4)/2 = 1/2, (5-3)/3 = 2/3, 0 (v_b = v_θ), 5/6].
    lb = np.array([[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]])
    lt = np.array([[-2.0, -1.0, -1.0, -1.0, -1.0, 0.0]])
    ver = np.array([[-1, 5, 4, 3, 6, 0]])
    alpha = np.array([0.0, 0.0, 0.5, 2 / 3, 0.0, 5 / 6])
    exp = lb + alpha * (lt - lb)
    np.testing.assert_allclose(loglinear_proximal_logprobs(lb, lt, ver, 6), exp, rtol=1e-12)
    out = jax.jit(loglinear_proximal_logprobs)(jnp.asarray(lb, jnp.float32), jnp.asarray(lt, jnp.float32),
                                               jnp.asarray(ver, jnp.int32), 6)
    np.testing.assert_allclose(np.asarray(out), exp, rtol=1e-6)
    # ℓθ is detached.
    g = jax.grad(lambda t: jnp.sum(loglinear_proximal_logprobs(jnp.asarray(lb, jnp.float32), t,
                                                               jnp.asarray(ver), 6)))(jnp.asarray(lt, jnp.float32))
    np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_compute_advantages_grpo_pipeline():
    # 2 groups × 2 samples. rewards {0,1} → b = -0.5, s = 10 → ±5; group mean/std then token norm.
    rewards = np.array([1.0, 0.0, 1.0, 1.0])
    m = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], bool)
    cfg = AdvantageConfig(preset="grpo", reward_bias=-0.5, reward_scale=10.0)
    out = compute_advantages(rewards, m, cfg, group_size=2)
    # group 1: [5, -5] → mean 0, unbiased std sqrt(50) → ±5/(sqrt(50)+eps); group 2 identical → 0.
    a = 5 / (math.sqrt(50) + EPS)
    np.testing.assert_allclose(out.seq_rewards, [a, -a, 0.0, 0.0], rtol=1e-12)
    tok = np.where(m, np.array([[a], [-a], [0.0], [0.0]]), 0.0)
    np.testing.assert_allclose(out.token_rewards, np.where(m & (np.cumsum(m, 1) == m.sum(1, keepdims=True)),
                                                           tok, 0.0), rtol=1e-12)
    # Before adv_norm, A_t = R_i on every token (γ = λ = 1, V = 0): token mean over 10 tokens.
    mu = (2 * a - 3 * a) / 10
    sd = math.sqrt(((2 * (a - mu) ** 2) + 3 * (-a - mu) ** 2 + 5 * mu ** 2) / 9)
    np.testing.assert_allclose(out.advantages, np.where(m, (tok - mu) / (sd + EPS), 0.0), rtol=1e-6)
    assert out.advantages.dtype == np.float32
    raw = compute_advantages(rewards, m, AdvantageConfig(preset="grpo", reward_bias=-0.5, reward_scale=10.0,
                                                         adv_norm=False), group_size=2)
    np.testing.assert_allclose(raw.advantages, tok, rtol=1e-6)
    np.testing.assert_allclose(raw.returns, tok, rtol=1e-6)


def test_compute_advantages_overlong_kl_and_truncation():
    # max_new_tokens 4, overlong 2, φ 1: lengths [2, 3, 4] → penalties [0, -0.5, -1].
    rewards = np.array([1.0, 1.0, 1.0])
    m = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], bool)
    cfg = AdvantageConfig(preset="none", overlong_penalty=True, overlong_tokens=2, overlong_penalty_factor=1.0,
                          max_new_tokens=4, adv_norm=False, kl_coef=0.5, kl_estimator="k1",
                          mask_no_eos_with_zero=True)
    lp = np.full((3, 4), -1.0)
    ref = np.full((3, 4), -1.2)  # k1 = 0.2 per token → token reward -0.1
    out = compute_advantages(rewards, m, cfg, group_size=1, logprobs=lp, ref_logprobs=ref,
                             truncated=[False, False, True])
    np.testing.assert_allclose(out.seq_rewards, [1.0, 0.5, 0.0])
    # A_t = Σ_{s ≥ t} r_s: row 0: [-.1+(-.1+1), -.1+1] = [0.8, 0.9]; row 2 truncated: final reward 0.
    np.testing.assert_allclose(out.advantages[0], [0.8, 0.9, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(out.advantages[1], [0.2, 0.3, 0.4, 0], rtol=1e-6)
    np.testing.assert_allclose(out.advantages[2], [-0.4, -0.3, -0.2, -0.1], rtol=1e-6)
    # explicit response lengths override the mask count.
    out2 = compute_advantages(rewards, m, cfg, group_size=1, logprobs=lp, ref_logprobs=ref,
                              response_lengths=[4, 4, 4])
    np.testing.assert_allclose(out2.seq_rewards, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_advantages(rewards, m, cfg, group_size=1)


def test_compute_advantages_with_critic_gae():
    rewards = np.array([1.0])
    m = np.array([[1, 1, 1, 0]], bool)
    v = np.array([[1.0, 2.0, 3.0, 9.0]])
    cfg = AdvantageConfig(preset="ppo", adv_norm=False, gamma=0.9, lam=0.8)
    out = compute_advantages(rewards, m, cfg, group_size=1, values=v)
    np.testing.assert_allclose(out.advantages, [[0.2672, -0.74, -2.0, 0.0]], rtol=1e-6)  # as test_gae_hand_values
    np.testing.assert_allclose(out.returns, [[1.2672, 1.26, 1.0, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("kwargs, field", [
    (dict(preset="ppo2"), "preset"),
    (dict(reward_clip=0.0), "reward_clip"),
    (dict(overlong_penalty=True, overlong_penalty_factor=1.0, max_new_tokens=8), "overlong_tokens"),
    (dict(overlong_penalty=True, overlong_tokens=4, max_new_tokens=8), "overlong_penalty_factor"),
    (dict(overlong_penalty=True, overlong_tokens=9, overlong_penalty_factor=1.0, max_new_tokens=8), "overlong_tokens"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(kl_coef=-1.0), "kl_coef"),
    (dict(gamma=1.5), "gamma"),
    (dict(lam=-0.1), "lam"),
    (dict(norm_eps=-1.0), "norm_eps"),
])
def test_invalid_advantage_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdvantageConfig(**kwargs)
