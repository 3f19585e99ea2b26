"""An agent written with the OpenAI Agents SDK, trained by jaxrl_async (``rollout.workflow=openai_agent``).

The agent is ordinary Agents-SDK code: an ``Agent`` with a ``calculator`` function tool, run by ``Runner.run`` on
the OpenAI client the RL run hands it (its base URL is one session of the run's agent endpoint, so every model call
is recorded token for token for training). It returns its final answer as text; the run scores it with
``rollout.reward`` (``math``: the ``\\boxed{}`` answer against the row's answer). Nothing in this file knows about
RL. Run it with ``python -m jaxrl_async.main --config configs/agent_calculator.py`` (``pip install
'jaxrl_async[agent]' openai-agents``).
"""
from __future__ import annotations

import ast
import operator

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

MAX_TOKENS = 64  # per model call (the embedded default's context is 128 tokens, prompts up to 64)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """An integer expression of + - * and parentheses (nothing else is evaluated)."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not an integer expression: {expression!r}")
    return ev(ast.parse(expression, mode="eval"))


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression with +, - and *, e.g. "47 + 18 - 5"."""
    try:
        return str(evaluate(expression))
    except (ValueError, SyntaxError) as e:
        return f"Error: {e}"


async def run(client, row) -> str:
    """One episode: the row's question in, the agent's final answer out."""
    agent = Agent(name="calculator", instructions=None, tools=[calculator],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(temperature=1.0, max_tokens=MAX_TOKENS))
    try:
        result = await Runner.run(agent, row["question"], max_turns=3, run_config=RunConfig(tracing_disabled=True))
    except (MaxTurnsExceeded, ModelBehaviorError):  # the policy kept calling tools / wrote a malformed call: no answer
        return ""
    return str(result.final_output or "")
