"""Multi-turn agent workflows: the model alternates with tools or an environment, token-in/token-out.

One episode of :class:`AgentWorkflow` (``run_episode``)::

    tokens = prompt_ids
    for t in 0 .. max_turns-1:
        sample = ctx.generate(tokens)              # behaviour log-probs + policy version of every token
        tokens += sample.completion_ids            # trained: loss_mask 1
        step = self.step(item, state, turn_t, ctx) # the environment: run tools, check an answer, ...
        r_t = step.reward
        if step.done or t == max_turns-1: stop
        obs = encode(chat_format.observation(step.observation))   # encoded once, appended as ids
        tokens += obs                              # not trained: loss_mask 0, version -1, logprob 0
    reward = sum_t turn_discount**t * r_t          # AReaL multi-turn: a success at turn t earns gamma**t

The history is never re-tokenised: every request's prompt is exactly the tokens the policy produced
plus the ids of the inserted observations (``Trajectory.from_turns`` checks this), so the trainer
sees the same tokens, behaviour log-probs and versions the generator produced. Tool calls run off
the decode thread, concurrently, in ``ctx.reward_executor`` (or ``tool_executor``), bounded by
``tool_timeout_s``; a timed-out, failing or malformed call becomes an ``"Error: ..."`` tool response.

Writing your own agent
======================

Subclass :class:`AgentWorkflow` in one file and override :meth:`~AgentWorkflow.step` (what the
environment answers to one model turn) and, if the environment has state, :meth:`~AgentWorkflow.reset`::

    # my_project/guess.py
    import re
    from jaxrl_async.rollout.agent import AgentWorkflow, EnvStep

    class GuessNumber(AgentWorkflow):
        '''The model guesses an integer; the environment answers "higher" or "lower".'''

        def __init__(self, tokenizer, reward_fn=None):
            super().__init__(tokenizer, reward_fn, max_turns=6, turn_discount=0.9)

        def reset(self, item):                       # per-episode environment state
            return {"secret": int(item.answer)}

        def step(self, item, state, turn, ctx):      # the environment's answer to one model turn
            numbers = re.findall(r"-?\\d+", turn.text)
            guess = int(numbers[-1]) if numbers else None
            if guess == state["secret"]:
                return EnvStep(reward=1.0, done=True)
            hint = "higher" if guess is not None and guess < state["secret"] else "lower"
            return EnvStep(observation=f"Wrong, go {hint}.")   # becomes the next user turn

and select it with ``rollout.workflow=my_project.guess:GuessNumber`` (the RL loop passes
``tokenizer`` and ``reward_fn`` when the constructor takes them). The default ``step`` is a tool
agent: a turn with ``<tool_call>`` blocks gets the tools' responses, a turn without one is the final
answer, scored by ``reward_fn``. So ``AgentWorkflow(tok, reward, tools=[CalculatorTool(), PythonTool()])``
is a working calculator/Python agent; with tools, the prompt is re-rendered from the item's problem
text with the tools announced (``tools_in_prompt``). :class:`MultiTurnMathWorkflow` is the
"retry until correct" example.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import functools
import time
from typing import Any, Callable, Iterable, Sequence

from jaxrl_async.rollout.tools import (
    QWEN_CHAT_FORMAT, ChatFormat, Tool, ToolCall, ToolResult, execute_tool_call, parse_tool_calls,
    render_tool_responses, tool_schema, tools_system_prompt,
)
from jaxrl_async.rollout.workflow import EpisodeContext, RolloutWorkflow, Trajectory, item_field

__all__ = ["ModelTurn", "EnvStep", "AgentWorkflow", "MultiTurnMathWorkflow", "agent_metrics", "discounted_return",
           "encode_text", "RETRY_FEEDBACK"]

RETRY_FEEDBACK = "Your answer is incorrect. Try again."
STOP_REASONS = ("done", "max_turns", "truncated", "context_limit")


def agent_metrics(trajectories: Iterable[Trajectory]) -> dict[str, float | int | None]:
    """Per-episode and per-turn statistics of the agent episodes among ``trajectories`` (those whose metadata
    has ``model_turns``: :class:`AgentWorkflow` episodes), for a step's metrics row; ``{}`` without any::

        agent/episodes                               agent episodes in the batch
        agent/turns_mean, agent/turns_max            model turns per episode
        agent/tokens_per_turn_mean, _max             generated tokens per model turn
        agent/tool_calls_mean, agent/tool_calls_max  tool calls per episode
        agent/tool_errors_mean                       calls per episode answered with an "Error: ..."
        agent/tool_error_frac                        of all tool calls (None when there were none)
        agent/tool_parse_errors_mean                 <tool_call> blocks per episode that did not parse
        agent/stop/<reason>                          share of the episodes that ended by each STOP_REASONS
                                                     (done: the environment ended it, e.g. an answer;
                                                     max_turns: the turn limit; truncated; context_limit)
    """
    metas = [(t.metadata, t.num_generated) for t in trajectories if "model_turns" in t.metadata]
    if not metas:
        return {}
    n = len(metas)
    turns = [int(m["model_turns"]) for m, _ in metas]
    calls = [int(m.get("tool_calls", 0)) for m, _ in metas]
    errors = [int(m.get("tool_errors", 0)) for m, _ in metas]
    # turn_tokens: episodes of this version; an older checkpoint's restored ones count by their mean
    per_turn = [x for (m, g), k in zip(metas, turns) for x in (m.get("turn_tokens") or [g / max(k, 1)])]
    stops = collections.Counter(m.get("stop_reason") for m, _ in metas)
    return {
        "agent/episodes": n, "agent/turns_mean": sum(turns) / n, "agent/turns_max": max(turns),
        "agent/tokens_per_turn_mean": sum(g for _, g in metas) / max(sum(turns), 1),
        "agent/tokens_per_turn_max": max(per_turn),
        "agent/tool_calls_mean": sum(calls) / n, "agent/tool_calls_max": max(calls),
        "agent/tool_errors_mean": sum(errors) / n,
        "agent/tool_error_frac": sum(errors) / sum(calls) if sum(calls) else None,
        "agent/tool_parse_errors_mean": sum(int(m.get("tool_parse_errors", 0)) for m, _ in metas) / n,
        **{f"agent/stop/{r}": stops.get(r, 0) / n for r in STOP_REASONS},
    }


def discounted_return(rewards: Sequence[float], discount: float) -> float:
    """``sum_t discount**t * rewards[t]`` (t counts model turns from 0)."""
    return float(sum(r * discount ** t for t, r in enumerate(rewards)))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of inserted text, without the tokenizer's automatic special tokens (BOS/EOS)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a minimal tokenizer whose encode() takes no keyword
        return list(tokenizer.encode(text))


@dataclasses.dataclass
class ModelTurn:
    """One model turn as the environment sees it.

    Attributes:
      index: 0-based model turn.
      sample: the generator sample (``completion_ids``, ``logprobs``, ``versions``, ``finish_reason``).
      text: the decoded completion (special tokens skipped).
      last: no model turn follows this one (``max_turns`` reached): the environment should settle.
    """

    index: int
    sample: Any
    text: str
    last: bool

    @functools.cached_property
    def tool_calls(self) -> list[ToolCall]:
        return parse_tool_calls(self.text)

    @property
    def truncated(self) -> bool:
        """The turn ended at the token budget, not at a stop token/string."""
        return self.sample.finish_reason == "length"


@dataclasses.dataclass
class EnvStep:
    """The environment's answer to one model turn.

    Attributes:
      reward: reward of this turn (the episode reward is the ``turn_discount``-discounted sum).
      done: the environment ends the episode after this turn (``stop_reason="done"``; on the last turn
        the episode ends anyway, with ``stop_reason="max_turns"`` unless done).
      observation: content of the next user turn (wrapped by the workflow's :class:`ChatFormat`:
        end of the model's turn, user turn, generation prompt).
      observation_ids: alternatively, token ids inserted verbatim (must end with the generation prompt).
      info: free-form JSON-able values, collected into the trajectory metadata (``turn_info``; trajectories
        are checkpointed as JSON).
    """

    reward: float = 0.0
    done: bool = False
    observation: str | None = None
    observation_ids: Sequence[int] | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class AgentWorkflow(RolloutWorkflow):
    """Multi-turn workflow (see the module docstring); the default :meth:`step` is a tool agent.

    Args:
      tokenizer: HF-style tokenizer (``encode``/``decode``; ``apply_chat_template`` for ``tools_in_prompt``).
      reward_fn: ``fn(prompt, completion, answer, **metadata) -> float`` used by :meth:`score`.
      tools: tools the model may call (unique names; called from several episodes at once, so thread-safe).
      max_turns: model turns per episode (>= 1).
      turn_discount: gamma in ``reward = sum_t gamma**t r_t`` (in [0, 1]).
      chat_format: the text inserted between turns (default Qwen ChatML).
      max_context_tokens: cap on the trajectory length (prompt + all turns); each turn's token budget is
        ``min(sampling.max_new_tokens, max_context_tokens - len(tokens))``. The generator engine's
        ``max_prefill_length`` (when visible as ``ctx.generator.engine``) caps the next prompt too.
      max_tool_calls_per_turn: calls beyond this get an error response without running.
      tool_timeout_s: wall-clock limit for one turn's tool calls (also bounded by the group deadline).
      max_tool_output_chars: characters of each tool response.
      stop_on_truncation: end the episode after a turn cut by the token budget (default: continue; the
        workflow closes the turn with ``chat_format.end_of_turn`` before the observation).
      tools_in_prompt: re-render the prompt from ``item.metadata["raw_prompt"]`` with the tools
        announced (default: True when there are tools); see :meth:`prompt_ids`.
      tool_executor: where tool calls run (default ``ctx.reward_executor``).

    Trajectory metadata: ``item_id``, ``sample_index``, ``model_turns``, ``stop_reason`` (one of
    ``STOP_REASONS``), ``turn_rewards``, ``turn_texts``, ``turn_tokens`` (generated tokens of each model turn),
    ``completion_text`` (last turn), ``turn_info``, and the sums over ``turn_info`` of ``tool_calls``,
    ``tool_errors`` (calls answered with an ``"Error: ..."``) and ``tool_parse_errors`` (``<tool_call>`` blocks
    that did not parse, also counted in ``tool_errors``); ``finish_reason`` (of the last model turn). The RL
    loop's step metrics summarise them (:func:`agent_metrics`); a custom :meth:`step` that runs tools reports
    its counts under the same ``info`` keys.

    Tool calls are parsed from the decoded text (special tokens skipped), so ``<tool_call>`` must not be
    a *special* token of the tokenizer (it is an ordinary added token in Qwen2.5/Qwen3).
    """

    def __init__(self, tokenizer: Any, reward_fn: Callable[..., float] | None = None, tools: Sequence[Tool] = (), *,
                 max_turns: int = 4, turn_discount: float = 1.0, chat_format: ChatFormat = QWEN_CHAT_FORMAT,
                 max_context_tokens: int | None = None, max_tool_calls_per_turn: int = 4,
                 tool_timeout_s: float | None = 30.0, max_tool_output_chars: int = 4000,
                 stop_on_truncation: bool = False, tools_in_prompt: bool | None = None,
                 tool_executor: cf.Executor | None = None):
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs a tokenizer (to decode turns and encode observations)")
        if max_turns < 1:
            raise ValueError(f"{type(self).__name__}.max_turns must be >= 1, got {max_turns}")
        if not 0.0 <= turn_discount <= 1.0:
            raise ValueError(f"{type(self).__name__}.turn_discount must be in [0, 1], got {turn_discount}")
        if max_context_tokens is not None and max_context_tokens < 2:
            raise ValueError(f"{type(self).__name__}.max_context_tokens must be >= 2 or None, got {max_context_tokens}")
        if max_tool_calls_per_turn < 1 or max_tool_output_chars < 1:
            raise ValueError("max_tool_calls_per_turn and max_tool_output_chars must be >= 1")
        if tool_timeout_s is not None and tool_timeout_s <= 0:
            raise ValueError(f"tool_timeout_s must be > 0 or None, got {tool_timeout_s}")
        tools = list(tools)
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"{t!r} is not a Tool (needs name, description, parameters and __call__)")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self.tokenizer, self.reward_fn, self.tools = tokenizer, reward_fn, tools
        self.tools_by_name = {t.name: t for t in tools}
        self.max_turns, self.turn_discount, self.chat_format = int(max_turns), float(turn_discount), chat_format
        self.max_context_tokens = max_context_tokens
        self.max_tool_calls_per_turn, self.tool_timeout_s = int(max_tool_calls_per_turn), tool_timeout_s
        self.max_tool_output_chars, self.stop_on_truncation = int(max_tool_output_chars), bool(stop_on_truncation)
        self.tools_in_prompt = bool(tools) if tools_in_prompt is None else bool(tools_in_prompt)
        self.tool_executor = tool_executor
        self._eot_ids = encode_text(tokenizer, chat_format.end_of_turn) if chat_format.end_of_turn else []

    # -- hooks (override these) -------------------------------------------------------------
    def reset(self, item: Any) -> Any:
        """Per-episode environment state, passed to every :meth:`step` of the episode (default None)."""
        return None

    def step(self, item: Any, state: Any, turn: ModelTurn, ctx: EpisodeContext) -> EnvStep:
        """Tool agent: run the turn's tool calls and answer with their responses; a turn without tool
        calls (or the last turn) is the final answer, scored by :meth:`score`."""
        calls = turn.tool_calls
        if calls and not turn.last:
            results = self.run_tools(calls, ctx)
            return EnvStep(observation=render_tool_responses([r.text for r in results], self.chat_format),
                           info={"tool_calls": len(results), "tool_errors": sum(not r.ok for r in results),
                                 "tool_parse_errors": sum(not c.ok for c in calls)})
        return EnvStep(reward=self.score(item, turn.text, ctx), done=True)

    def prompt_ids(self, item: Any) -> list[int]:
        """The episode's first prompt: ``item.prompt_ids``, or with ``tools_in_prompt`` the item's problem
        text (``metadata["raw_prompt"]``) rendered by the chat template with ``tools=`` (or, for templates
        that ignore tools, after a system message from :func:`~.tools.tools_system_prompt`)."""
        if self.tools and self.tools_in_prompt:
            return self._prompt_with_tools(item)
        ids = item_field(item, "prompt_ids")
        if not ids:
            raise ValueError(f"data item {item_field(item, 'id')!r} has no prompt_ids")
        return list(ids)

    # -- helpers for subclasses -------------------------------------------------------------
    def score(self, item: Any, text: str, ctx: EpisodeContext) -> float:
        """``reward_fn(item.prompt, text, item.answer, **item.metadata)`` in the reward pool."""
        if self.reward_fn is None:
            raise ValueError(f"{type(self).__name__}.score needs a reward_fn")
        meta = {k: v for k, v in (item_field(item, "metadata") or {}).items()
                if k not in ("prompt", "completion", "answer")}
        return float(ctx.reward(self.reward_fn, item_field(item, "prompt", ""), text, item_field(item, "answer"),
                                **meta))

    def run_tools(self, calls: Sequence[ToolCall], ctx: EpisodeContext) -> list[ToolResult]:
        """Run ``calls`` concurrently off the decode thread; one result per call, in call order."""
        limit = self.max_tool_calls_per_turn
        executor = self.tool_executor or ctx.reward_executor
        futures = [executor.submit(execute_tool_call, c, self.tools_by_name, self.max_tool_output_chars)
                   for c in calls[:limit]]
        timeout = self.tool_timeout_s
        if ctx.deadline is not None:
            left = max(ctx.deadline - time.monotonic(), 0.0)
            timeout = left if timeout is None else min(timeout, left)
        end = None if timeout is None else time.monotonic() + timeout
        results = []
        for call, fut in zip(calls, futures):
            try:
                results.append(fut.result(None if end is None else max(end - time.monotonic(), 0.0)))
            except cf.TimeoutError:
                fut.cancel()
                results.append(ToolResult(call.name, f"Error: tool {call.name!r} timed out after {timeout:g} s", False))
        results += [ToolResult(c.name, f"Error: too many tool calls in one turn (at most {limit}); "
                                       "this call was not run", False) for c in calls[limit:]]
        return results

    def decode(self, sample: Any) -> str:
        text = getattr(sample, "text", None)
        return text if text is not None else self.tokenizer.decode(list(sample.completion_ids), skip_special_tokens=True)

    # -- the episode ------------------------------------------------------------------------
    def run_episode(self, item: Any, ctx: EpisodeContext) -> Trajectory | None:
        prompt_ids = self.prompt_ids(item)
        prefill_limit = getattr(getattr(ctx.generator, "engine", None), "max_prefill_length", None)
        too_long = [f"{what} ({limit})" for limit, what, room in (
            (self.max_context_tokens, "max_context_tokens", 1), (prefill_limit, "the engine's max_prefill_length", 0))
            if limit is not None and len(prompt_ids) + room > limit]
        if too_long:
            raise ValueError(f"data item {item_field(item, 'id')!r}: prompt of {len(prompt_ids)} tokens does not fit "
                             + " and ".join(too_long))
        state = self.reset(item)
        tokens = list(prompt_ids)
        turns: list[Any] = []
        rewards: list[float] = []
        texts: list[str] = []
        infos: list[dict[str, Any]] = []
        stop = "max_turns"
        for t in range(self.max_turns):
            max_new = ctx.sampling.max_new_tokens
            if self.max_context_tokens is not None:
                max_new = min(max_new, self.max_context_tokens - len(tokens))
            sample = ctx.generate(tokens, n=1, max_new_tokens=max_new)[0]
            if sample.finish_reason == "abort":
                raise RuntimeError(f"generation request of turn {t} was aborted")
            turns.append(sample)
            tokens += list(sample.completion_ids)
            turn = ModelTurn(t, sample, self.decode(sample), last=t == self.max_turns - 1)
            texts.append(turn.text)
            step = self.step(item, state, turn, ctx)
            if not isinstance(step, EnvStep):
                raise TypeError(f"{type(self).__name__}.step returned {type(step).__name__}, expected EnvStep")
            rewards.append(float(step.reward))
            infos.append(step.info)
            if step.done:
                stop = "done"
                break
            if turn.last:
                break
            if turn.truncated and self.stop_on_truncation:
                stop = "truncated"
                break
            obs = self._observation_ids(step, sample, t)
            nxt = len(tokens) + len(obs)
            if (self.max_context_tokens is not None and nxt >= self.max_context_tokens) or \
                    (prefill_limit is not None and nxt > prefill_limit):
                stop = "context_limit"
                break
            turns.append((obs, False))
            tokens += obs
        return Trajectory.from_turns(
            prompt_ids, turns, discounted_return(rewards, self.turn_discount),
            item_id=item_field(item, "id"), sample_index=ctx.sample_index, model_turns=len(texts),
            stop_reason=stop, turn_rewards=rewards, turn_texts=texts,
            turn_tokens=[len(s.completion_ids) for s in turns if not isinstance(s, tuple)], completion_text=texts[-1],
            turn_info=infos, **{k: sum(int(i.get(k, 0)) for i in infos)
                                for k in ("tool_calls", "tool_errors", "tool_parse_errors")})

    def _observation_ids(self, step: EnvStep, sample: Any, t: int) -> list[int]:
        if (step.observation is None) == (step.observation_ids is None):
            raise ValueError(f"{type(self).__name__}.step: turn {t} is not done, so it must give exactly one of "
                             "observation / observation_ids")
        if step.observation_ids is not None:
            ids = [int(i) for i in step.observation_ids]
        else:
            c = list(sample.completion_ids)
            k = len(self._eot_ids)
            closed = k > 0 and len(c) >= k and c[-k:] == self._eot_ids
            ids = encode_text(self.tokenizer, self.chat_format.observation(step.observation, closed))
        if not ids:
            raise ValueError(f"{type(self).__name__}.step: empty observation after turn {t}")
        return ids

    def _prompt_with_tools(self, item: Any) -> list[int]:
        tok = self.tokenizer
        question = (item_field(item, "metadata") or {}).get("raw_prompt")
        if not isinstance(question, str):
            raise ValueError(f"data item {item_field(item, 'id')!r}: tools_in_prompt needs metadata['raw_prompt'] "
                             "(the problem text; data.PromptRecord has it) or tools_in_prompt=False")
        if not getattr(tok, "chat_template", None):
            raise ValueError("tools_in_prompt needs a tokenizer with a chat template (or tools_in_prompt=False and "
                             "prompts that describe the tools)")
        msgs = [{"role": "user", "content": question}]
        kw = dict(tokenize=False, add_generation_prompt=True)
        with_tools = tok.apply_chat_template(msgs, tools=[tool_schema(t) for t in self.tools], **kw)
        if with_tools == tok.apply_chat_template(msgs, **kw):  # this template ignores `tools`
            with_tools = tok.apply_chat_template([{"role": "system", "content": tools_system_prompt(self.tools)}] + msgs,
                                                 **kw)
        return encode_text(tok, with_tools)


class MultiTurnMathWorkflow(AgentWorkflow):
    """"Retry until correct" (AReaL's multi-turn math): after a wrong answer the environment appends a
    user turn ``feedback`` and the model answers again, up to ``max_turns`` answers.

    Episode reward: ``reward_fn``'s value at the first turn t (0-based) whose reward exceeds
    ``success_threshold``, times ``turn_discount**t``; else the last turn's (incorrect) reward times
    ``turn_discount**(max_turns-1)``, i.e. 0 for :class:`~jaxrl_async.rewards.MathReward`. So a binary
    reward gives ``turn_discount**(turns-1)`` if finally correct, else 0.
    """

    def __init__(self, tokenizer: Any, reward_fn: Callable[..., float] | None = None, *, max_turns: int = 3,
                 turn_discount: float = 0.9, feedback: str = RETRY_FEEDBACK, success_threshold: float = 0.5,
                 **kwargs: Any):
        if reward_fn is None:
            from jaxrl_async.rewards.math_reward import MathReward

            reward_fn = MathReward()
        super().__init__(tokenizer, reward_fn, max_turns=max_turns, turn_discount=turn_discount, **kwargs)
        self.feedback, self.success_threshold = feedback, float(success_threshold)

    def step(self, item: Any, state: Any, turn: ModelTurn, ctx: EpisodeContext) -> EnvStep:
        r = self.score(item, turn.text, ctx)
        correct = r > self.success_threshold
        if correct:
            return EnvStep(reward=r, done=True, info={"correct": True})
        if turn.last:  # out of turns: the final (incorrect) reward, stop_reason "max_turns"
            return EnvStep(reward=r, info={"correct": False})
        return EnvStep(reward=0.0, observation=self.feedback, info={"correct": False})
