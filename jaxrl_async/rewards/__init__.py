"""Verified rewards (math, code, custom) and the code-execution sandbox.

* :mod:`.math_reward` — answer extraction + math-verify equivalence (numeric fast path in-process,
  everything else in a killable worker pool).
* :mod:`.code_reward` — fraction (or all) of test cases passed, each run in the sandbox.
* :mod:`.registry` — reward functions by built-in name or ``"module:function"``; failure accounting.
* :mod:`.sandbox` — untrusted Python in namespaces + rlimits + an unprivileged uid.
* :mod:`.pool` — process pool with per-call kill deadline, retries and worker replacement.

Reward function signature: ``fn(prompt: str, completion: str, answer: str, **metadata) -> float``.
"""
from jaxrl_async.rewards.code_reward import CodeReward, CodeRewardConfig, CodeScore, TestCase, parse_tests
from jaxrl_async.rewards.math_reward import MathReward, MathRewardConfig, MathScore, extract_answer
from jaxrl_async.rewards.pool import PoolConfig, PoolOutcome, WorkerPool
from jaxrl_async.rewards.registry import (
    BUILTIN_REWARDS,
    PooledReward,
    RewardFn,
    RewardLoadError,
    SafeReward,
    load_reward_fn,
    make_reward,
)
from jaxrl_async.rewards.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    probe_isolation,
)

__all__ = [
    "BUILTIN_REWARDS", "CodeReward", "CodeRewardConfig", "CodeScore", "MathReward", "MathRewardConfig",
    "MathScore", "PoolConfig", "PoolOutcome", "PooledReward", "RewardFn", "RewardLoadError", "SafeReward",
    "Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailableError", "TestCase", "WorkerPool",
    "extract_answer", "load_reward_fn", "make_reward", "parse_tests", "probe_isolation",
]
