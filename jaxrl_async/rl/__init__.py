"""RL math: policy losses (decoupled PPO / GSPO / CISPO / M2PO) and advantage estimation."""
from jaxrl_async.rl.advantages import (
    PRESETS,
    AdvantageConfig,
    AdvantageOutput,
    NormSpec,
    compute_advantages,
    gae,
    group_has_signal,
    kl_estimate,
    kl_token_rewards,
    loglinear_proximal_logprobs,
    normalize,
    overlong_penalty,
    preset_advantages,
    transform_rewards,
)
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

__all__ = [
    "PRESETS", "AdvantageConfig", "AdvantageOutput", "NormSpec", "compute_advantages", "gae",
    "group_has_signal", "kl_estimate", "kl_token_rewards", "loglinear_proximal_logprobs", "normalize",
    "overlong_penalty", "preset_advantages", "transform_rewards",
    "BehaviourWeightConfig", "PolicyLossConfig", "aggregation_count", "behaviour_weights",
    "combine_stats", "kl_penalty", "m2po_mask", "policy_loss",
]
