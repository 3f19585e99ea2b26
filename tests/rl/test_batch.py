"""build_training_batch: advantages over the whole consumed batch (AReaL semantics), on multi-group batches.

The reference below is written from ``../shared/reference/areal-semantics.md`` §4.5-4.6 with plain
loops (not ``rl.advantages.normalize``): reward normalisation of the preset over [B] with groups of
consecutive rows, A_t = R_i on every response token (γ = λ = 1, V = 0, β = 0), then the token-level
batch normalisation with the loss mask when ``adv_norm`` is on. Before the fix the loop called
``compute_advantages`` once per group, so every batch-level statistic was a per-group one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxrl_async.rl.advantages import PRESETS, AdvantageConfig, compute_advantages
from jaxrl_async.rl.batch import build_training_batch
from jaxrl_async.rollout.staleness import ConsumedGroup, Ticket
from jaxrl_async.rollout.workflow import Trajectory, TrajectoryGroup

EPS = 1e-5


def _traj(rng, prompt_len: int, gen_len: int, reward: float, version: int = 0) -> Trajectory:
    T = prompt_len + gen_len
    mask = np.r_[np.zeros(prompt_len, np.int32), np.ones(gen_len, np.int32)]
    return Trajectory(tokens=rng.integers(3, 50, T).astype(np.int32), loss_mask=mask,
                      logprobs=np.where(mask > 0, -rng.random(T), 0.0).astype(np.float32),
                      versions=np.where(mask > 0, version, -1).astype(np.int32), reward=float(reward),
                      prompt_len=prompt_len, metadata={"finish_reason": "stop"})


def _batch(rng, rewards_per_group: list[list[float]]) -> list[ConsumedGroup]:
    groups = []
    for g, rewards in enumerate(rewards_per_group):
        prompt_len = int(rng.integers(2, 6))
        trajs = [_traj(rng, prompt_len, int(rng.integers(1, 9)), r) for r in rewards]
        groups.append(ConsumedGroup(ticket=Ticket(g, 0, 0.0), item=TrajectoryGroup({"id": g}, trajs, g), head_version=0,
                                    finish_time=0.0, lag=g % 2))
    return groups


def _mean_std(values: list[float], centre: list[float] | None = None) -> tuple[float, float]:
    n = len(values)
    mu = sum(values) / n
    c = centre if centre is not None else [mu] * n
    ss = sum((v - m) ** 2 for v, m in zip(values, c))
    return mu, (1.0 if n <= 1 else math.sqrt(ss / (n - 1)))


def reference_advantages(rewards_per_group: list[list[float]], gen_lens: list[int], preset: str,
                         adv_norm: bool) -> list[float]:
    """Per-trajectory advantage (constant over its response tokens) by AReaL's formulas."""
    R: list[float] = []
    for rg in rewards_per_group:
        n = len(rg)
        mu, sd = _mean_std(rg)
        if preset == "grpo":
            R += [(r - mu) / ((sd if n > 1 else 1.0) + EPS) for r in rg]
        elif preset in ("dr_grpo", "reinforce_baseline", "liteppo"):
            R += [r - mu for r in rg]  # liteppo: divided by the batch std of these residuals below
        elif preset == "rloo":
            R += [r if n <= 1 else r - (sum(rg) - r) / (n - 1) for r in rg]  # N <= 1: mu = 0 (AReaL)
        else:  # reinforce_pp, ppo, none: no reward normalisation
            R += list(rg)
    if preset == "liteppo":
        flat = [r for rg in rewards_per_group for r in rg]
        centres = [sum(rg) / len(rg) for rg in rewards_per_group for _ in rg]
        _, sd_batch = _mean_std(flat, centres)  # std of group-centred residuals over the batch
        R = [x / (sd_batch + EPS) for x in R]
    if not adv_norm:
        return R
    tokens = [a for a, L in zip(R, gen_lens) for _ in range(L)]  # token-weighted
    mu, sd = _mean_std(tokens)
    return [(a - mu) / (sd + EPS) for a in R]


CASES = [[[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]],
         [[0.3, 0.9, 0.1, 0.5], [2.0, -1.0, 0.5, 0.25], [1.0, 1.0, 1.0, 1.0]]]


@pytest.mark.parametrize("adv_norm", [False, True])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_preset_matches_areal_semantics_on_a_multi_group_batch(preset, adv_norm, case):
    rewards = CASES[case]
    groups = _batch(np.random.default_rng(case), rewards)
    trajs, stats = build_training_batch(groups, AdvantageConfig(preset=preset, adv_norm=adv_norm), 4)
    gen_lens = [t.num_generated for g in groups for t in g.item.trajectories]
    want = reference_advantages(rewards, gen_lens, preset, adv_norm)
    assert len(trajs) == len(want) == 12
    for tt, w in zip(trajs, want):
        on = tt.loss_mask > 0
        np.testing.assert_allclose(tt.advantages[on], w, rtol=1e-5, atol=1e-6)
        assert np.all(tt.advantages[~on] == 0)
    assert stats["reward/mean"] == pytest.approx(np.mean([r for g in rewards for r in g]))
    assert stats["staleness/max"] == 1


def test_batch_statistics_are_over_the_batch_not_per_group():
    """The regression: with adv_norm (every AReaL preset's default) the token-weighted mean of the
    advantages over the batch is 0 and their std 1; per-group normalisation made every group's
    own mean 0 instead (and the previous loop produced exactly that)."""
    rewards = CASES[0]
    groups = _batch(np.random.default_rng(7), rewards)
    trajs, _ = build_training_batch(groups, AdvantageConfig(preset="grpo", adv_norm=True), 4)
    tok = np.concatenate([t.advantages[t.loss_mask > 0] for t in trajs])
    assert abs(tok.mean()) < 1e-6 and tok.std(ddof=1) == pytest.approx(1.0, rel=1e-4)
    # what the per-group computation gives: each group token-normalised on its own
    per_group = []
    for g in groups:
        T = max(t.length for t in g.item.trajectories)
        m = np.stack([np.pad(t.loss_mask, (0, T - t.length)) for t in g.item.trajectories])
        a = compute_advantages([t.reward for t in g.item.trajectories], m,
                               AdvantageConfig(preset="grpo", adv_norm=True), group_size=4).advantages
        per_group += [a[i, : t.length] for i, t in enumerate(g.item.trajectories)]
    assert max(float(np.abs(p - t.advantages).max()) for p, t in zip(per_group, trajs)) > 1e-2


def test_partial_groups_are_groups_of_their_own_size():
    rewards = [[1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.5]]  # allow_partial_groups: 4 + 3 + 1
    groups = _batch(np.random.default_rng(3), rewards)
    for preset in ("grpo", "rloo", "liteppo"):
        trajs, _ = build_training_batch(groups, AdvantageConfig(preset=preset, adv_norm=True), 4)
        gen_lens = [t.num_generated for g in groups for t in g.item.trajectories]
        want = reference_advantages(rewards, gen_lens, preset, True)
        for tt, w in zip(trajs, want):
            np.testing.assert_allclose(tt.advantages[tt.loss_mask > 0], w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="more than group_size"):
        build_training_batch(groups, AdvantageConfig(), 2)


def test_group_sizes_in_normalize():
    from jaxrl_async.rl.advantages import normalize

    x = np.array([1.0, 3.0, 2.0, 4.0, 9.0, 5.0])
    got = normalize(x, mean_level="group", std_level=None, group_size=[2, 3, 1])
    np.testing.assert_allclose(got, [-1, 1, -3, -1, 4, 0])
    np.testing.assert_allclose(normalize(x, mean_level="group", std_level="group", group_size=[3, 3]),
                               normalize(x, mean_level="group", std_level="group", group_size=3))
    for bad in ([2, 2], [0, 6], [7]):
        with pytest.raises(ValueError, match="sum to the batch size"):
            normalize(x, mean_level="group", group_size=bad)
