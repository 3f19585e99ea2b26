"""Policy-loss tests: hand-derived values and an independent float64 loop reference."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.rl.losses import (
    BehaviourWeightConfig,
    PolicyLossConfig,
    aggregation_count,
    behaviour_weights,
    combine_stats,
    kl_penalty,
    m2po_mask,
    policy_loss,
)

OFF = BehaviourWeightConfig(action="off")


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def arr(x):
    return jnp.asarray(np.asarray(x, np.float64))


def _loss_only(lp, prox, beh, adv, mask, seq_ids=None, normaliser=None, *, cfg, num_seqs=None):
    return policy_loss(lp, prox, beh, adv, mask, cfg, seq_ids=seq_ids, num_seqs=num_seqs, normaliser=normaliser)[0]


# Gradients are jitted (one small compile per cfg/shape beats eager autodiff on CPU); values
# and stats run eagerly (the eager per-primitive caches are shared by all configurations).
grad_jit = jax.jit(jax.grad(_loss_only), static_argnames=("cfg", "num_seqs"))


def run_jax(lp, prox, beh, adv, mask, cfg, **kw):
    return policy_loss(arr(lp), arr(prox), arr(beh), arr(adv), jnp.asarray(mask), cfg, **kw)


def run(lp, prox, beh, adv, mask, cfg, **kw):
    loss, stats = run_jax(lp, prox, beh, adv, mask, cfg, **kw)
    return float(loss), {k: float(v) for k, v in stats.items()}


def grad(lp, prox, beh, adv, mask, cfg, **kw):
    return np.asarray(grad_jit(arr(lp), arr(prox), arr(beh), arr(adv), jnp.asarray(mask), cfg=cfg, **kw))


def vg(lp, prox, beh, adv, mask, cfg, **kw):
    """((loss, stats), dL/dlogprobs) for numpy inputs."""
    return run_jax(lp, prox, beh, adv, mask, cfg, **kw), grad(lp, prox, beh, adv, mask, cfg, **kw)


# ---------------------------------------------------------------------------------------
# Independent reference: python loops over sequences and tokens, math module only.
# ---------------------------------------------------------------------------------------
def ref_behaviour(prox, beh, valid, sid, bw):
    """Per-token (w, keep, filtered) for flat lists. valid: list of bool; sid: list of ints."""
    n = len(prox)
    lr = []
    for i in range(n):
        d = prox[i] - beh[i]
        lr.append(d if math.isfinite(d) else 0.0)

    def met(x):
        if bw.metric == "ratio":
            return math.exp(x)
        if bw.metric == "k1":
            return x
        if bw.metric == "k2":
            return 0.5 * x * x
        return math.exp(-x) - 1 + x

    def inb(v):
        return v <= bw.upper and (bw.lower is None or v >= bw.lower)

    w = [0.0] * n
    keep = [False] * n
    filt = [False] * n
    if bw.action == "off":
        return [1.0 if valid[i] else 0.0 for i in range(n)], list(valid), filt
    lo = 0.0 if bw.lower is None else bw.lower
    if bw.level == "token":
        for i in range(n):
            if not valid[i]:
                continue
            rho = math.exp(lr[i])
            if bw.action == "mask":
                ok = inb(met(lr[i])) and math.isfinite(prox[i] - beh[i])
                keep[i], filt[i], w[i] = ok, not ok, (rho if ok else 0.0)
            else:
                wi = min(max(rho, lo), bw.upper)
                keep[i], filt[i], w[i] = True, wi != rho, wi
        return w, keep, filt
    for s in sorted(set(sid)):
        idx = [i for i in range(n) if sid[i] == s and valid[i]]
        if not idx:
            continue
        vals = [lr[i] if bw.metric == "ratio" else met(lr[i]) for i in idx]
        a = {"sum": sum(vals), "mean": sum(vals) / len(vals), "max": max(vals)}[bw.agg]
        stat = math.exp(a) if bw.metric == "ratio" else a
        ok = inb(stat)
        if bw.action == "mask":
            ok = ok and all(math.isfinite(prox[i] - beh[i]) for i in idx)
        geo = math.exp(sum(lr[i] for i in idx) / len(idx))
        for i in idx:
            wi = geo if bw.metric == "ratio" else math.exp(lr[i])
            if bw.action == "mask":
                keep[i], filt[i], w[i] = ok, not ok, (wi if ok else 0.0)
            else:
                wt = wi if ok else min(max(wi, lo), bw.upper)
                keep[i], filt[i], w[i] = True, wt != wi, wt
    return w, keep, filt


def ref_m2po(d2, valid, thr):
    idx = sorted([i for i in range(len(d2)) if valid[i]], key=lambda i: (-d2[i], i))
    n = len(idx)
    k_star = n - 1
    for k in range(n):
        rest = [d2[i] for i in idx[k:]]
        if sum(rest) / len(rest) < thr:
            k_star = k
            break
    keep = [False] * len(d2)
    for i in idx[k_star:]:
        keep[i] = True
    return keep


def ref_loss(lp, prox, beh, adv, mask, cfg: PolicyLossConfig, sid=None, normaliser=None):
    lp, prox, beh, adv = (np.asarray(x, np.float64).ravel().tolist() for x in (lp, prox, beh, adv))
    m0 = np.asarray(mask).astype(bool).ravel().tolist()
    n = len(lp)
    if sid is None:
        B, T = np.shape(mask)
        sid = [i // T for i in range(n)]
    else:
        sid = np.asarray(sid).ravel().tolist()
    m1 = list(m0)
    if cfg.m2_threshold is not None:
        m1 = ref_m2po([(beh[i] - prox[i]) ** 2 for i in range(n)], m0, cfg.m2_threshold)
    w, mp, _ = ref_behaviour(prox, beh, m1, sid, cfg.behaviour_weight)
    r = [math.exp(lp[i] - prox[i]) if m0[i] else 1.0 for i in range(n)]
    a = [adv[i] if m0[i] else 0.0 for i in range(n)]
    if cfg.importance_sampling_level == "sequence":
        for s in set(sid):
            idx = [i for i in range(n) if sid[i] == s and mp[i]]
            c = max(len(idx), 1)
            rs = math.exp(sum(lp[i] - prox[i] for i in idx) / c)
            As = sum(adv[i] for i in idx) / c
            for i in range(n):
                if sid[i] == s:
                    r[i], a[i] = rs, As
    eh = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    tl = [0.0] * n
    for i in range(n):
        rc = min(max(r[i], 1 - cfg.eps_clip), 1 + eh)
        if cfg.policy_loss == "ppo":
            li = max(-a[i] * r[i], -a[i] * rc)
            if cfg.c_clip is not None:
                li = min(li, cfg.c_clip * abs(a[i]))
        else:
            li = -rc * a[i] * lp[i]
        tl[i] = li * w[i] if mp[i] else 0.0
    if cfg.aggregation == "token_mean":
        return sum(tl) / (normaliser if normaliser is not None else max(sum(m0), 1))
    if cfg.aggregation == "constant":
        return sum(tl) / cfg.constant_normaliser
    tot, ns = 0.0, 0
    for s in set(sid):
        idx = [i for i in range(n) if sid[i] == s]
        c = sum(m0[i] for i in idx)
        if c:
            ns += 1
            tot += sum(tl[i] for i in idx) / c
    return tot / (normaliser if normaliser is not None else max(ns, 1))


def random_batch(seed, B=4, T=5, spread=0.6):
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.2, 3.0, size=(B, T))
    prox = lp + rng.normal(0, 0.25, size=(B, T))
    beh = prox + rng.normal(0, spread, size=(B, T))
    adv = rng.normal(0, 1.0, size=(B, T))
    lengths = rng.integers(1, T + 1, size=B)
    mask = np.arange(T)[None, :] < lengths[:, None]
    return lp, prox, beh, adv, mask


# ---------------------------------------------------------------------------------------
# Hand-derived PPO values
# ---------------------------------------------------------------------------------------
# r = [1.5, 0.5, 1.5, 0.5], A = [1, 1, -1, -1], ε = 0.2:
#   A=+1, r=1.5: max(-1.5, -1.2) = -1.2 (clipped)   A=+1, r=0.5: max(-0.5, -0.8) = -0.5
#   A=-1, r=1.5: max( 1.5,  1.2) =  1.5             A=-1, r=0.5: max( 0.5,  0.8) =  0.8 (clipped)
R4 = np.log([[1.5, 0.5, 1.5, 0.5]])
A4 = np.array([[1.0, 1.0, -1.0, -1.0]])
Z4 = np.zeros((1, 4))
M4 = np.ones((1, 4), bool)


def test_ppo_clip_hand_values():
    loss, st = run(R4, Z4, Z4, A4, M4, PolicyLossConfig(behaviour_weight=OFF))
    assert loss == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4, abs=1e-12)
    assert st["clip_frac"] == pytest.approx(0.5)
    assert st["clip_frac_sum"] == pytest.approx(2.0)
    assert st["dual_clip_frac"] == 0.0
    assert st["ratio"] == pytest.approx(1.0)
    assert st["approx_kl"] == pytest.approx(np.log([1.5, 0.5, 1.5, 0.5]).mean())
    assert st["n_tokens"] == 4 and st["n_seqs"] == 1
    # The full function (loss + stats) is jit-able with the config static.
    cfg = PolicyLossConfig(behaviour_weight=OFF)
    loss_j, st_j = jax.jit(policy_loss, static_argnames=("cfg",))(arr(R4), arr(Z4), arr(Z4), arr(A4), jnp.asarray(M4),
                                                                  cfg=cfg)
    assert float(loss_j) == pytest.approx(loss, rel=1e-12)
    assert {k: pytest.approx(float(v), rel=1e-12) for k, v in st_j.items()} == st


def test_ppo_eps_clip_higher_hand_values():
    # ε_h = 0.6: r=1.5 is inside [0.8, 1.6]: A=+1 → -1.5 (unclipped); the rest as before.
    loss, st = run(R4, Z4, Z4, A4, M4, PolicyLossConfig(eps_clip_higher=0.6, behaviour_weight=OFF))
    assert loss == pytest.approx((-1.5 - 0.5 + 1.5 + 0.8) / 4, abs=1e-12)
    assert st["clip_frac"] == pytest.approx(0.25)


def test_ppo_dual_clip_hand_values():
    # c = 1.4: A=-1, r=1.5 has l = 1.5 > c|A| = 1.4 → 1.4 (dual clipped); A=-1, r=0.5: 0.8 < 1.4.
    loss, st = run(R4, Z4, Z4, A4, M4, PolicyLossConfig(c_clip=1.4, behaviour_weight=OFF))
    assert loss == pytest.approx((-1.2 - 0.5 + 1.4 + 0.8) / 4, abs=1e-12)
    assert st["dual_clip_frac"] == pytest.approx(0.25)
    assert st["clip_frac"] == pytest.approx(0.5)


def test_behaviour_token_mask_and_truncate_hand_values():
    # ρ = exp(ℓp - ℓb) = [1, 2, 6, 0.1]; r = 1 everywhere, so l_t = -A_t; A = [1, 2, 3, 4].
    beh = -np.log([[1.0, 2.0, 6.0, 0.1]])
    A = np.array([[1.0, 2.0, 3.0, 4.0]])
    # mask, upper 5: token 3 rejected (weight 0, still counted in the denominator).
    loss, st = run(Z4, Z4, beh, A, M4, PolicyLossConfig())
    assert loss == pytest.approx(-(1 * 1 + 2 * 2 + 4 * 0.1) / 4)
    assert st["behave_mask_frac"] == pytest.approx(0.25)
    assert st["behave_weight"] == pytest.approx((1 + 2 + 0.1) / 4)
    assert st["behave_weight_max"] == pytest.approx(2.0)
    assert st["behave_ratio_max"] == pytest.approx(6.0)
    assert st["behave_approx_kl"] == pytest.approx(np.log([1, 2, 6, 0.1]).mean())
    # mask with lower 0.5 as well: token 4 rejected too.
    bw = BehaviourWeightConfig(lower=0.5, upper=5.0)
    loss, st = run(Z4, Z4, beh, A, M4, PolicyLossConfig(behaviour_weight=bw))
    assert loss == pytest.approx(-(1 + 4) / 4)
    assert st["behave_mask_frac"] == pytest.approx(0.5)
    # truncate (TIS) at [0, 5]: w = [1, 2, 5, 0.1].
    bw = BehaviourWeightConfig(action="truncate", upper=5.0)
    loss, st = run(Z4, Z4, beh, A, M4, PolicyLossConfig(behaviour_weight=bw))
    assert loss == pytest.approx(-(1 + 4 + 15 + 0.4) / 4)
    assert st["behave_mask_frac"] == pytest.approx(0.25)
    # truncate at [0.5, 5]: w = [1, 2, 5, 0.5].
    bw = BehaviourWeightConfig(action="truncate", lower=0.5, upper=5.0)
    loss, _ = run(Z4, Z4, beh, A, M4, PolicyLossConfig(behaviour_weight=bw))
    assert loss == pytest.approx(-(1 + 4 + 15 + 2) / 4)
    # off: w ≡ 1.
    loss, _ = run(Z4, Z4, beh, A, M4, PolicyLossConfig(behaviour_weight=OFF))
    assert loss == pytest.approx(-10 / 4)


def test_behaviour_sequence_ratio_hand_values():
    # Row 0: ρ = [2, 8] → geometric mean 4; row 1: ρ = [0.5, 2] → geometric mean 1.
    beh = -np.log([[2.0, 8.0], [0.5, 2.0]])
    z = np.zeros((2, 2))
    A = np.ones((2, 2))
    m = np.ones((2, 2), bool)
    # agg mean (decision = geometric mean): 4 ≤ 5 and 1 ≤ 5 → w = [4, 4, 1, 1].
    bw = BehaviourWeightConfig(level="sequence", agg="mean")
    loss, _ = run(z, z, beh, A, m, PolicyLossConfig(behaviour_weight=bw))
    assert loss == pytest.approx(-(4 + 4 + 1 + 1) / 4)
    # agg max: exp(max log ρ) = 8 > 5 → row 0 rejected.
    bw = BehaviourWeightConfig(level="sequence", agg="max")
    loss, st = run(z, z, beh, A, m, PolicyLossConfig(behaviour_weight=bw))
    assert loss == pytest.approx(-(1 + 1) / 4)
    assert st["behave_mask_frac"] == pytest.approx(0.5)
    # agg sum: row 0 product 16 > 5 rejected; row 1 product 1 kept.
    bw = BehaviourWeightConfig(level="sequence", agg="sum")
    assert run(z, z, beh, A, m, PolicyLossConfig(behaviour_weight=bw))[0] == pytest.approx(-0.5)
    # truncate with decision max: row 0 out of bounds → its tokens get clip(4, 0, 3) = 3.
    bw = BehaviourWeightConfig(action="truncate", level="sequence", agg="max", upper=3.0)
    assert run(z, z, beh, A, m, PolicyLossConfig(behaviour_weight=bw))[0] == pytest.approx(-(3 + 3 + 1 + 1) / 4)
    # k1 metric, sum agg: row 0 Σ log ρ = log 16 = 2.77 > 2 rejected; w is per token ρ.
    bw = BehaviourWeightConfig(level="sequence", metric="k1", agg="sum", upper=2.0)
    assert run(z, z, beh, A, m, PolicyLossConfig(behaviour_weight=bw))[0] == pytest.approx(-(0.5 + 2) / 4)


def test_behaviour_token_kl_metrics_hand_values():
    # log ρ = [0.1, -0.5, 1.0]; k1 = log ρ; k2 = ½ log²ρ = [0.005, 0.125, 0.5];
    # k3 = e^{-x} - 1 + x = [0.004837, 0.148721, 0.367879].
    x = np.array([[0.1, -0.5, 1.0]])
    z = np.zeros((1, 3))
    A = np.ones((1, 3))
    m = np.ones((1, 3), bool)
    rho = np.exp(x[0])
    cases = [
        (BehaviourWeightConfig(metric="k1", lower=-0.2, upper=0.5), [1, 0, 0]),
        (BehaviourWeightConfig(metric="k2", upper=0.2), [1, 1, 0]),
        (BehaviourWeightConfig(metric="k3", upper=0.1), [1, 0, 0]),
        (BehaviourWeightConfig(metric="k3", upper=0.2), [1, 1, 0]),
    ]
    for bw, keep in cases:
        loss, st = run(z, z, -x, A, m, PolicyLossConfig(behaviour_weight=bw))
        assert loss == pytest.approx(-(rho * np.array(keep)).sum() / 3), bw
        assert st["behave_mask_frac"] == pytest.approx(1 - sum(keep) / 3)


def _bw_cases():
    out = []
    bounds = {"ratio": (0.6, 1.8), "k1": (-0.4, 0.4), "k2": (None, 0.08), "k3": (None, 0.08)}
    for level in ("token", "sequence"):
        for metric, (lo, up) in bounds.items():
            aggs = ("mean", "sum", "max") if level == "sequence" else ("mean",)
            for agg in aggs:
                out.append(BehaviourWeightConfig("mask", level, metric, agg, lo, up))
                out.append(BehaviourWeightConfig("mask", level, metric, agg, None, up))
                if metric == "ratio":
                    out.append(BehaviourWeightConfig("truncate", level, metric, agg, lo, up))
                    out.append(BehaviourWeightConfig("truncate", level, metric, agg, None, up))
    return out


@pytest.mark.parametrize("bw", _bw_cases(), ids=lambda b: f"{b.action}-{b.level}-{b.metric}-{b.agg}-{b.lower}")
def test_behaviour_weight_modes_against_reference(bw):
    hits = set()
    for seed in range(4):
        lp, prox, beh, adv, mask = random_batch(seed, spread=0.3)
        beh = beh - np.array([[0.8], [0.0], [-0.3], [-0.9]])  # per-row mean log ρ offsets
        cfg = PolicyLossConfig(behaviour_weight=bw)
        loss, st = run(lp, prox, beh, adv, mask, cfg)
        assert loss == pytest.approx(ref_loss(lp, prox, beh, adv, mask, cfg), rel=1e-10, abs=1e-12)
        w, keep, filt = ref_behaviour(prox.ravel().tolist(), beh.ravel().tolist(), mask.ravel().tolist(),
                                      [i // 5 for i in range(20)], bw)
        assert st["behave_mask_frac_sum"] == sum(filt)
        assert st["behave_weight_sum"] == pytest.approx(sum(w))
        hits.add(0 < sum(filt) < mask.sum())
    assert True in hits, "test data never partially filtered: the case is not exercised"


def test_nonfinite_log_ratio():
    # Valid token with ℓb = -inf: mask mode rejects it; truncate treats log ρ as 0 (ρ = 1).
    beh = np.array([[0.0, -np.inf, 0.0]])
    z = np.zeros((1, 3))
    A = np.array([[1.0, 2.0, 4.0]])
    m = np.ones((1, 3), bool)
    loss, st = run(z, z, beh, A, m, PolicyLossConfig())
    assert loss == pytest.approx(-(1 + 4) / 3)
    assert st["behave_mask_frac"] == pytest.approx(1 / 3)
    bw = BehaviourWeightConfig(action="truncate")
    assert run(z, z, beh, A, m, PolicyLossConfig(behaviour_weight=bw))[0] == pytest.approx(-7 / 3)
    bw = BehaviourWeightConfig(level="sequence")
    assert run(z, z, beh, A, m, PolicyLossConfig(behaviour_weight=bw))[0] == 0.0


def test_padding_garbage_and_all_masked_row_are_ignored():
    lp, prox, beh, adv, mask = random_batch(7)
    mask[1] = False  # an all-masked row
    g_lp, g_prox, g_beh, g_adv = lp.copy(), prox.copy(), beh.copy(), adv.copy()
    for a, v in ((g_lp, np.nan), (g_prox, -np.inf), (g_beh, np.inf), (g_adv, np.nan)):
        a[~mask] = v
    for cfg in (PolicyLossConfig(), PolicyLossConfig(importance_sampling_level="sequence", c_clip=3.0),
                PolicyLossConfig(policy_loss="cispo", aggregation="seq_mean_token_mean"),
                PolicyLossConfig(m2_threshold=0.05, behaviour_weight=BehaviourWeightConfig(level="sequence"))):
        (clean, _), g_clean = vg(lp, prox, beh, adv, mask, cfg)
        (dirty, st), g_dirty = vg(g_lp, g_prox, g_beh, g_adv, mask, cfg)
        assert np.isfinite(float(dirty)) and np.all(np.isfinite(np.asarray(g_dirty)))
        assert float(dirty) == pytest.approx(float(clean), rel=1e-12)
        np.testing.assert_allclose(np.asarray(g_dirty), np.asarray(g_clean), rtol=1e-12)
        np.testing.assert_array_equal(np.asarray(g_dirty)[~mask], 0.0)
        assert all(np.isfinite(float(v)) for v in st.values())
        assert float(st["n_seqs"]) == 3  # the all-masked row is not a sequence


def test_fully_masked_batch_is_finite_zero():
    lp, prox, beh, adv, _ = random_batch(1)
    mask = np.zeros_like(lp, bool)
    for agg in ("token_mean", "seq_mean_token_mean", "constant"):
        cfg = PolicyLossConfig(aggregation=agg, m2_threshold=0.1)
        loss, st = run(lp, prox, beh, adv, mask, cfg)
        assert loss == 0.0
        assert all(np.isfinite(v) for v in st.values())
        np.testing.assert_array_equal(grad(lp, prox, beh, adv, mask, cfg), 0.0)


@pytest.mark.parametrize("cfg", [
    PolicyLossConfig(),
    PolicyLossConfig(eps_clip=0.1, eps_clip_higher=0.3, c_clip=2.0),
    PolicyLossConfig(importance_sampling_level="sequence"),
    PolicyLossConfig(importance_sampling_level="sequence", behaviour_weight=BehaviourWeightConfig(level="sequence")),
    PolicyLossConfig(policy_loss="cispo", eps_clip=1.0, eps_clip_higher=0.28),
    PolicyLossConfig(m2_threshold=0.05),
    PolicyLossConfig(aggregation="seq_mean_token_mean"),
    PolicyLossConfig(aggregation="constant", constant_normaliser=7.0),
], ids=["ppo", "ppo-asym-dual", "gspo", "gspo-seqbw", "cispo", "m2po", "seqmean", "constant"])
def test_policy_loss_against_reference(cfg):
    for seed in range(5):
        lp, prox, beh, adv, mask = random_batch(100 + seed)
        loss, _ = run(lp, prox, beh, adv, mask, cfg)
        assert loss == pytest.approx(ref_loss(lp, prox, beh, adv, mask, cfg), rel=1e-10, abs=1e-12)
    loss_jit = jax.jit(_loss_only, static_argnames=("cfg",))(arr(lp), arr(prox), arr(beh), arr(adv),
                                                             jnp.asarray(mask), cfg=cfg)
    assert float(loss_jit) == pytest.approx(loss, rel=1e-12)


def test_gspo_hand_values():
    # One sequence, log r = [0.1, 0.3] → s = exp(0.2) = 1.2214 (clipped at 1.2 for ε=0.2);
    # Ā = (1 + 3)/2 = 2 → l_t = max(-2·1.2214, -2·1.2) = -2.4 on both tokens.
    lp = np.array([[0.1, 0.3]])
    z = np.zeros((1, 2))
    m = np.ones((1, 2), bool)
    cfg = PolicyLossConfig(importance_sampling_level="sequence", behaviour_weight=OFF)
    loss, st = run(lp, z, z, np.array([[1.0, 3.0]]), m, cfg)
    assert loss == pytest.approx(-2.4)
    assert st["clip_frac"] == 1.0
    assert st["ratio"] == pytest.approx(math.exp(0.2))
    # Inside the band (ε = 0.5): L = (1/N) Σ_t (-Ā s) = -Ā s, ds/dℓθ_t = s/|i| → dL/dℓθ_t = -2 s/2 = -s.
    cfg = PolicyLossConfig(importance_sampling_level="sequence", eps_clip=0.5, behaviour_weight=OFF)
    np.testing.assert_allclose(grad(lp, z, z, [[1.0, 3.0]], m, cfg), -math.exp(0.2), rtol=1e-12)


def test_cispo_value_and_gradient():
    # r = [1.5, 0.5, 1.0], ε = 0.2, ε_h = 0.28 → sg(clip(r)) = [1.28, 0.8, 1.0];
    # l_t = -ĉ_t A_t ℓθ_t; ∇_{ℓθ_t} L = -ĉ_t A_t / N (also for the clipped tokens).
    lp = np.array([[-1.0, -2.0, -0.5]])
    prox = lp - np.log([[1.5, 0.5, 1.0]])
    A = np.array([[2.0, -1.0, 1.0]])
    m = np.ones((1, 3), bool)
    c = np.array([1.28, 0.8, 1.0])
    cfg = PolicyLossConfig(policy_loss="cispo", eps_clip_higher=0.28, behaviour_weight=OFF)
    loss, st = run(lp, prox, prox, A, m, cfg)
    assert loss == pytest.approx(-(c * A[0] * lp[0]).sum() / 3)
    assert st["clip_frac"] == pytest.approx(2 / 3)
    np.testing.assert_allclose(grad(lp, prox, prox, A, m, cfg)[0], -c * A[0] / 3, rtol=1e-12)
    # PPO on the same data: clipped tokens (r=1.5, A>0 and r=0.5, A<0) get zero gradient.
    g_ppo = grad(lp, prox, prox, A, m, PolicyLossConfig(eps_clip_higher=0.28, behaviour_weight=OFF))
    np.testing.assert_allclose(g_ppo[0], [0.0, 0.0, -1.0 / 3], atol=1e-12)
    # With a behaviour weight ρ = 2 on token 0 (truncate at 5): gradient scales by 2.
    beh = prox - np.log([[2.0, 1.0, 1.0]])
    cfg = PolicyLossConfig(policy_loss="cispo", eps_clip_higher=0.28, behaviour_weight=BehaviourWeightConfig("truncate"))
    np.testing.assert_allclose(grad(lp, prox, beh, A, m, cfg)[0], -c * A[0] * [2, 1, 1] / 3, rtol=1e-12)


def test_m2po_hand_values():
    # δ² = [0.25, 0.01, 0.04, 0.0, 0.09] (+ a padded token with a huge δ).
    # Sorted: .25 .09 .04 .01 0 → suffix means: .078, .035, .0167 < .03 → mask the 2 largest.
    d = np.array([[0.5, 0.1, -0.2, 0.0, 0.3, 9.0]])
    mask = np.array([[1, 1, 1, 1, 1, 0]], bool)
    z = np.zeros((1, 6))
    m2 = jax.jit(m2po_mask)  # threshold traced: one compile
    keep = np.asarray(m2(arr(d), arr(z), jnp.asarray(mask), 0.03))
    np.testing.assert_array_equal(keep, [[False, True, True, True, False, False]])
    # threshold below every suffix mean except the last → keep exactly the smallest.
    keep = np.asarray(m2(arr(d + 1.0), arr(z), jnp.asarray(mask), 1e-6))
    np.testing.assert_array_equal(keep, [[False, False, True, False, False, False]])  # (0.8)² smallest
    # threshold above the full mean → nothing masked.
    keep = np.asarray(m2(arr(d), arr(z), jnp.asarray(mask), 0.1))
    np.testing.assert_array_equal(keep, mask)
    # jit + loss: masked tokens still count in the denominator (5), M2PO fraction 2/5.
    A = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    cfg = PolicyLossConfig(m2_threshold=0.03, behaviour_weight=OFF)
    loss, st = run(z, z, d, A, mask, cfg)
    assert loss == pytest.approx(-(2 + 3 + 4) / 5)
    assert st["m2po_mask_frac"] == pytest.approx(0.4)
    keep_eager = m2po_mask(arr(d), arr(z), jnp.asarray(mask), 0.03)
    np.testing.assert_array_equal(np.asarray(keep_eager), [[False, True, True, True, False, False]])


def test_m2po_against_reference_random():
    rng = np.random.default_rng(3)
    m2 = jax.jit(m2po_mask)
    for _ in range(20):
        d = rng.normal(0, 0.3, size=(4, 5))
        mask = rng.random((4, 5)) < 0.7
        thr = float(rng.uniform(0.005, 0.1))
        keep = np.asarray(m2(arr(d), arr(np.zeros_like(d)), jnp.asarray(mask), thr))
        exp = ref_m2po((d ** 2).ravel().tolist(), mask.ravel().tolist(), thr)
        np.testing.assert_array_equal(keep.ravel(), exp)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "constant"])
def test_microbatch_sum_with_global_normaliser_equals_full_batch(agg):
    lp, prox, beh, adv, mask = random_batch(11)
    mask[2] = False
    cfg = PolicyLossConfig(aggregation=agg, constant_normaliser=9.0, c_clip=3.0)

    (full, full_st), g_full = vg(lp, prox, beh, adv, mask, cfg)
    slices = [slice(0, 2), slice(2, 3), slice(3, 4)]
    norm = sum(float(aggregation_count(jnp.asarray(mask[s]), cfg)) for s in slices)
    expected_norm = {"token_mean": mask.sum(), "seq_mean_token_mean": 3, "constant": mask.sum()}[agg]
    assert norm == expected_norm
    parts = [vg(lp[s], prox[s], beh[s], adv[s], mask[s], cfg, normaliser=jnp.asarray(norm)) for s in slices]
    assert sum(float(p[0][0]) for p in parts) == pytest.approx(float(full), rel=1e-12)
    g_parts = np.concatenate([np.asarray(p[1]) for p in parts])
    np.testing.assert_allclose(g_parts, np.asarray(g_full), rtol=1e-12, atol=1e-15)
    comb = combine_stats([p[0][1] for p in parts])
    for k, v in full_st.items():
        assert float(comb[k]) == pytest.approx(float(v), rel=1e-12, abs=1e-15), k


def test_normaliser_overrides_local_count():
    lp, prox, beh, adv, mask = random_batch(5)
    cfg = PolicyLossConfig()
    local, _ = run(lp, prox, beh, adv, mask, cfg)
    ext, _ = run(lp, prox, beh, adv, mask, cfg, normaliser=4 * mask.sum())
    assert ext == pytest.approx(local / 4)


def _fd_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        g[idx] = (f(x + e) - f(x - e)) / (2 * h)
    return g


@pytest.mark.parametrize("cfg", [
    PolicyLossConfig(c_clip=3.0),
    PolicyLossConfig(importance_sampling_level="sequence", aggregation="seq_mean_token_mean"),
    PolicyLossConfig(behaviour_weight=BehaviourWeightConfig("truncate", "sequence", upper=1.5), eps_clip_higher=0.3),
], ids=["ppo-dual", "gspo-seqmean", "tis-seq"])
def test_grad_matches_central_finite_differences(cfg):
    lp, prox, beh, adv, mask = random_batch(21)
    prox = lp + np.random.default_rng(0).normal(0, 0.4, size=lp.shape)  # some tokens clipped
    f = lambda l: run(l, prox, beh, adv, mask, cfg)[0]  # noqa: E731
    g = grad(lp, prox, beh, adv, mask, cfg)
    np.testing.assert_allclose(g, _fd_grad(f, lp), atol=1e-8)
    assert np.abs(g).max() > 1e-3


@pytest.mark.parametrize("cfg", [
    PolicyLossConfig(),
    PolicyLossConfig(importance_sampling_level="sequence", behaviour_weight=BehaviourWeightConfig(level="sequence", agg="max")),
    PolicyLossConfig(aggregation="seq_mean_token_mean", m2_threshold=0.05),
    PolicyLossConfig(policy_loss="cispo", behaviour_weight=BehaviourWeightConfig("truncate", "sequence")),
], ids=["ppo", "gspo-seqbw", "seqmean-m2po", "cispo"])
def test_packed_equals_padded(cfg):
    # Padded: 4 sequences, one per row (lengths 2, 3, 5, 4). Packed into the same [4, 5] shape:
    # row 0 = seq 0 + seq 1, row 1 = seq 2, row 2 = seq 3 (+1 pad), row 3 = padding (seq id -1).
    lp, prox, beh, adv, mask = random_batch(31)
    lens = [2, 3, 5, 4]
    mask[:] = np.arange(5)[None, :] < np.array(lens)[:, None]
    layout = [[(0, 0, 2), (1, 0, 3)], [(2, 0, 5)], [(3, 0, 4)], []]  # (seq, start, length) per packed row

    def pack(x, fill):
        out = np.full((4, 5), fill, dtype=np.asarray(x).dtype)
        for row, items in enumerate(layout):
            pos = 0
            for seq, start, n in items:
                out[row, pos: pos + n] = x[seq, start: start + n]
                pos += n
        return out

    sid = pack(np.repeat(np.arange(4)[:, None], 5, 1), -1)
    assert sid.tolist()[0] == [0, 0, 1, 1, 1] and sid.tolist()[3] == [-1] * 5
    P = {k: pack(v, 0.0) for k, v in dict(lp=lp, prox=prox, beh=beh, adv=adv).items()}
    pm = pack(mask, False)
    (l_pad, s_pad), g_pad = vg(lp, prox, beh, adv, mask, cfg)
    (l_pack, s_pack), g_pack = vg(P["lp"], P["prox"], P["beh"], P["adv"], pm, cfg, seq_ids=jnp.asarray(sid), num_seqs=4)
    assert float(l_pack) == pytest.approx(float(l_pad), rel=1e-12)
    np.testing.assert_allclose(np.asarray(g_pack), pack(np.asarray(g_pad), 0.0), rtol=1e-12, atol=1e-15)
    for k in s_pad:
        assert float(s_pack[k]) == pytest.approx(float(s_pad[k]), rel=1e-12, abs=1e-15), k
    # And the reference agrees on the packed layout.
    assert float(l_pack) == pytest.approx(ref_loss(P["lp"], P["prox"], P["beh"], P["adv"], pm, cfg, sid=sid), rel=1e-10)


def test_single_minibatch_gradient_is_behaviour_weighted_policy_gradient():
    # ppo_n_minibatches = 1: π_prox = π_θ in value, so r ≡ 1, clipping never binds and
    # ∇L = -Σ_t w_t A_t ∇ℓθ_t / Σ m  with w = ρ masked at 5.
    lp, _, beh, adv, mask = random_batch(41, spread=1.0)
    beh[0, 0] = lp[0, 0] - 2.0  # ρ = e² > 5: rejected
    cfg = PolicyLossConfig()
    g = np.asarray(jax.jit(jax.grad(lambda l: policy_loss(l, l, arr(beh), arr(adv), jnp.asarray(mask), cfg)[0]))(arr(lp)))
    rho = np.exp(lp - beh)
    w = np.where(mask & (rho <= 5.0), rho, 0.0)
    assert (mask & (rho > 5.0)).any() and (w > 0).any()
    np.testing.assert_allclose(g, -w * adv / mask.sum(), rtol=1e-12, atol=1e-15)
    _, st = run(lp, lp, beh, adv, mask, cfg)
    assert st["clip_frac"] == 0.0 and st["ratio"] == 1.0 and st["approx_kl"] == 0.0


def test_entropy_and_kl_stats():
    lp, prox, beh, adv, mask = random_batch(51)
    ent = np.random.default_rng(1).uniform(0, 2, size=lp.shape)
    _, st = run(lp, prox, beh, adv, mask, PolicyLossConfig(behaviour_weight=OFF), entropy=arr(ent))
    n = mask.sum()
    assert st["entropy"] == pytest.approx(ent[mask].sum() / n)
    d = (lp - prox)[mask]
    assert st["approx_kl"] == pytest.approx(d.mean())
    assert st["approx_kl_k3"] == pytest.approx((np.exp(-d) - 1 + d).mean())
    e = (prox - beh)[mask]
    assert st["behave_approx_kl"] == pytest.approx(e.mean())
    assert st["behave_approx_kl_k3"] == pytest.approx((np.exp(-e) - 1 + e).mean())
    assert st["ratio"] == pytest.approx(np.exp(d).mean())
    assert st["behave_weight"] == 1.0 and st["behave_mask_frac"] == 0.0


def test_float32_inputs_and_bool_or_int_mask():
    lp, prox, beh, adv, mask = random_batch(61)
    with jax.enable_x64(False):
        f32 = [jnp.asarray(x, jnp.float32) for x in (lp, prox, beh, adv)]
        l_bool, _ = policy_loss(*f32, jnp.asarray(mask), PolicyLossConfig())
        l_int, _ = policy_loss(*f32, jnp.asarray(mask.astype(np.int32)), PolicyLossConfig())
        assert l_bool.dtype == jnp.float32
        assert float(l_bool) == float(l_int)
    assert float(l_bool) == pytest.approx(ref_loss(lp, prox, beh, adv, mask, PolicyLossConfig()), rel=1e-5)


def test_behaviour_weights_direct_api():
    prox = np.array([[0.0, 0.0, 0.0]])
    beh = -np.log([[2.0, 7.0, 1.0]])
    w, keep, filt, log_rho = behaviour_weights(arr(prox), arr(beh), jnp.ones((1, 3), bool), BehaviourWeightConfig())
    np.testing.assert_allclose(np.asarray(w), [[2.0, 0.0, 1.0]], rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(keep), [[True, False, True]])
    np.testing.assert_array_equal(np.asarray(filt), [[False, True, False]])
    np.testing.assert_allclose(np.asarray(log_rho), np.log([[2.0, 7.0, 1.0]]), rtol=1e-12)


def test_kl_penalty_term():
    lp = np.array([[-1.0, -2.0, 0.0]])
    ref = np.array([[-1.5, -1.0, 5.0]])
    m = np.array([[1, 1, 0]], bool)
    d = np.array([0.5, -1.0])
    k3 = np.exp(-d) - 1 + d
    assert float(kl_penalty(arr(lp), arr(ref), jnp.asarray(m))) == pytest.approx(k3.mean())
    assert float(kl_penalty(arr(lp), arr(ref), jnp.asarray(m), kind="k1", normaliser=4.0)) == pytest.approx(-0.5 / 4)
    g = jax.grad(lambda l: kl_penalty(l, arr(ref), jnp.asarray(m), kind="k2"))(arr(lp))
    np.testing.assert_allclose(np.asarray(g), [[0.5 / 2, -1.0 / 2, 0.0]], rtol=1e-12)


@pytest.mark.parametrize("kwargs, field", [
    (dict(policy_loss="grpo"), "policy_loss"),
    (dict(eps_clip=-0.1), "eps_clip"),
    (dict(eps_clip_higher=-0.1), "eps_clip_higher"),
    (dict(c_clip=1.0), "c_clip"),
    (dict(c_clip=3.0, policy_loss="cispo"), "c_clip"),
    (dict(importance_sampling_level="batch"), "importance_sampling_level"),
    (dict(importance_sampling_level="sequence", policy_loss="cispo"), "importance_sampling_level"),
    (dict(m2_threshold=0.0), "m2_threshold"),
    (dict(aggregation="seq_mean"), "aggregation"),
    (dict(aggregation="constant", constant_normaliser=0.0), "constant_normaliser"),
    (dict(behaviour_weight="mask"), "behaviour_weight"),
])
def test_invalid_policy_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(action="clamp"), "behaviour_weight.action"),
    (dict(level="batch"), "behaviour_weight.level"),
    (dict(metric="kl_k1"), "behaviour_weight.metric"),
    (dict(agg="min"), "behaviour_weight.agg"),
    (dict(upper=None), "behaviour_weight.upper"),
    (dict(upper=1.0), "behaviour_weight.upper"),
    (dict(lower=0.0), "behaviour_weight.lower"),
    (dict(action="truncate", metric="k1", upper=1.0), "behaviour_weight.action"),
    (dict(metric="k2", upper=0.0), "behaviour_weight.upper"),
    (dict(metric="k3", upper=-1.0), "behaviour_weight.upper"),
    (dict(metric="k1", lower=0.5, upper=0.1), "behaviour_weight.lower"),
    (dict(lower=6.0, upper=5.0), "behaviour_weight.lower"),
])
def test_invalid_behaviour_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        BehaviourWeightConfig(**kwargs)
    BehaviourWeightConfig(action="off", **{k: v for k, v in kwargs.items() if k in ("upper", "lower")})


def test_call_errors():
    lp, prox, beh, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match="num_seqs"):
        policy_loss(arr(lp), arr(prox), arr(beh), arr(adv), jnp.asarray(mask), PolicyLossConfig(),
                    seq_ids=jnp.zeros(lp.shape, jnp.int32))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(arr(lp), arr(prox), arr(beh), arr(adv[:, :2]), jnp.asarray(mask), PolicyLossConfig())
