"""The embedded default's arithmetic task, trained through an OpenAI Agents SDK agent (``examples/calculator_agent.py``).

Everything is the embedded default (``jaxrl_async/config/default.py``: tiny Qwen3 policy, local tokenizer, SFT warm
start, async GRPO with eta = 2 on two simulated CPU devices) except the rollout: each of the 8 episodes of a prompt
is one ``Runner.run`` of the agent on the run's agent endpoint (``rollout.workflow=openai_agent``), its model calls
recorded as the engine generated them and trained as per-turn samples. The agent sets its own sampling (temperature
1, 64 tokens; ``rollout.sampling`` only gives calls without ``max_tokens`` their budget). 60 RL steps (the
default's accuracy settles by step ~25). Held-out accuracy is the run's usual greedy evaluation of the policy on
the same prompt the agent's first call sends. Needs ``pip install 'jaxrl_async[agent]' openai-agents``.

    python -m jaxrl_async.main --config configs/agent_calculator.py
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from jaxrl_async.config.default import get_config as default_config  # noqa: E402


def get_config():
    cfg = default_config()
    return dataclasses.replace(
        cfg, name="agent_calculator",
        rollout=dataclasses.replace(cfg.rollout, workflow="openai_agent", agent="calculator_agent:run"),
        trainer=dataclasses.replace(cfg.trainer, total_steps=60),
        eval=dataclasses.replace(cfg.eval, every_steps=20))
