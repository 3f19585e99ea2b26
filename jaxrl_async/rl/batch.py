"""Consumed groups -> the trainer's trajectories with advantages (pure host code, no JAX)."""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np

__all__ = ["build_training_batch"]

def build_training_batch(groups: Sequence[Any], adv_cfg: Any, group_size: int) -> tuple[list[Any], dict[str, Any]]:
    """Consumed groups → trainer trajectories with GRPO-family advantages, and rollout statistics.

    Rewards of the B·n trajectories are normalised per group by ``adv_cfg`` (``rl.advantages``);
    a group with fewer than n trajectories (``allow_partial_groups``) is padded for normalisation
    by nothing: it is normalised on its own trajectories. Token conventions: trajectory arrays are
    token-aligned (``loss_mask[t] = 1`` on generated token t), which is what ``compute_advantages``
    and the trainer's packing expect.
    """
    from jaxrl_async.rl.advantages import compute_advantages
    from jaxrl_async.trainer.packing import Trajectory as TrainTrajectory

    out: list[Any] = []
    rewards_all, lengths, truncated, heads, lags = [], [], [], [], []
    for cg in groups:
        trajs = cg.item.trajectories
        T = max(t.length for t in trajs)
        mask = np.zeros((len(trajs), T), np.int32)
        for i, t in enumerate(trajs):
            mask[i, : t.length] = t.loss_mask
        r = np.asarray([t.reward for t in trajs], np.float64)
        trunc = np.asarray([t.finish_reason == "length" for t in trajs])
        adv = compute_advantages(r, mask, adv_cfg, group_size=len(trajs), truncated=trunc,
                                 logprobs=np.stack([np.pad(t.logprobs, (0, T - t.length)) for t in trajs]))
        for i, t in enumerate(trajs):
            out.append(TrainTrajectory(tokens=t.tokens, loss_mask=t.loss_mask, behaviour_logprobs=t.logprobs,
                                       advantages=adv.advantages[i, : t.length].astype(np.float32),
                                       versions=t.versions))
            lengths.append(t.num_generated)
            truncated.append(bool(trunc[i]))
        rewards_all.extend(r.tolist())
        heads.append(cg.head_version)
        lags.append(cg.lag)
    rw = np.asarray(rewards_all, np.float64)
    ln = np.asarray(lengths, np.float64)
    stats = {
        "reward/mean": float(rw.mean()), "reward/std": float(rw.std()), "reward/accuracy": float((rw > 0.5).mean()),
        "response/length_mean": float(ln.mean()), "response/length_max": int(ln.max()),
        "response/truncated_frac": float(np.mean(truncated)),
        "staleness/max": int(max(lags)), "staleness/mean": float(np.mean(lags)),
        "staleness/hist": {str(k): v for k, v in sorted(collections.Counter(lags).items())},
    }
    return out, stats
