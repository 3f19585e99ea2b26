"""Consumed groups -> the trainer's trajectories with advantages (pure host code, no JAX)."""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np

__all__ = ["build_training_batch"]

def build_training_batch(groups: Sequence[Any], adv_cfg: Any, group_size: int) -> tuple[list[Any], dict[str, Any]]:
    """Consumed groups → trainer trajectories with GRPO-family advantages, and rollout statistics.

    Advantages are computed ONCE over the whole consumed batch (``compute_advantages`` with the
    group structure passed in), as AReaL does: group-level statistics (GRPO's mean/std, RLOO's
    leave-one-out mean) are per group, batch-level ones (LitePPO's std, REINFORCE++ and ``adv_norm``)
    are over all B·n trajectories of the step. A group with fewer than ``group_size`` trajectories
    (``allow_partial_groups``) is a group of its own size; so is one whose episodes gave several samples
    each (``rollout.workflow=openai_agent``'s per-turn samples: statistics over all of the group's samples).
    Token conventions: trajectory arrays are token-aligned (``loss_mask[t] = 1`` on generated token t),
    which is what ``compute_advantages`` and the trainer's packing expect. A trajectory's ``images`` (its
    prompt's ``ImageInputs``) are passed on by reference: the samples of a prompt keep sharing one object.
    """
    from jaxrl_async.rl.advantages import compute_advantages
    from jaxrl_async.trainer.packing import TrainSequence

    trajs = [t for cg in groups for t in cg.item.trajectories]
    sizes = [len(cg.item.trajectories) for cg in groups]
    if not trajs:
        raise ValueError("build_training_batch: no trajectories")
    for cg, n in zip(groups, sizes):  # more only when episodes gave several samples (one per agent turn)
        episodes = (getattr(cg.item, "metadata", None) or {}).get("episodes", n)
        if episodes > group_size:
            raise ValueError(f"a group has {episodes} episodes, more than group_size {group_size}")
    T = max(t.length for t in trajs)
    mask = np.zeros((len(trajs), T), np.int32)
    logprobs = np.zeros((len(trajs), T), np.float32)
    for i, t in enumerate(trajs):
        mask[i, : t.length] = t.loss_mask
        logprobs[i, : t.length] = t.logprobs
    rewards = np.asarray([t.reward for t in trajs], np.float64)
    truncated = np.asarray([t.finish_reason == "length" for t in trajs])
    adv = compute_advantages(rewards, mask, adv_cfg, group_size=sizes, truncated=truncated, logprobs=logprobs)
    out = [TrainSequence(tokens=t.tokens, loss_mask=t.loss_mask, behaviour_logprobs=t.logprobs,
                           advantages=adv.advantages[i, : t.length].astype(np.float32), versions=t.versions,
                           routing=getattr(t, "routing", None), images=getattr(t, "images", None))
           for i, t in enumerate(trajs)]
    lengths = np.asarray([t.num_generated for t in trajs], np.float64)
    lags = [cg.lag for cg in groups]
    stats = {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "reward/accuracy": float((rewards > 0.5).mean()),
        "response/length_mean": float(lengths.mean()), "response/length_max": int(lengths.max()),
        "response/truncated_frac": float(truncated.mean()),
        "staleness/max": int(max(lags)), "staleness/mean": float(np.mean(lags)),
        "staleness/hist": {str(k): v for k, v in sorted(collections.Counter(lags).items())},
    }
    return out, stats
