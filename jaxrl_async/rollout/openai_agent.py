"""RL on agents written with any OpenAI client (``rollout.workflow=openai_agent``).

The user's agent is an ordinary function of an OpenAI client and a dataset row::

    # my_pkg/my_agent.py
    async def run(client, row):                     # client: openai.AsyncOpenAI (a def gets openai.OpenAI)
        r = await client.chat.completions.create(model="policy", messages=row["messages"])
        return r.choices[0].message.content         # a str: scored by rollout.reward against row["answer"]
        # or return a number (the reward), or None after POSTing it to /v1/sessions/{id}/reward

    python -m jaxrl_async.main rollout.workflow=openai_agent rollout.agent=my_pkg.my_agent:run

Each episode gets its own *session* on the run's agent endpoint (``serve/endpoint.py``: the OpenAI-compatible
server on the run's own generator, so agent calls share the continuous batch with everything else, under the
same weights and policy versions). The client's base URL is the session's (``/sessions/{id}/v1``), so every
call the agent makes, through any framework (OpenAI Agents SDK, LangChain, ...), is recorded by the server as
the engine ran it: the prompt token ids the server built, the completion ids, the behaviour log-probs and the
policy version of every token. Text is never re-tokenised for training.

Training samples from an episode's calls (``rollout.agent_samples``):

* ``per_turn`` (default; AReaL's "individual" export): one trajectory per call (and per sample of an ``n`` > 1
  call), its reward discounted back over the turns: the call of turn t of T gets ``reward * gamma**(T-1-t)``
  (``rollout.agent_turn_discount`` = gamma, the last turn gets the full reward).
* ``stitched`` (AReaL's "concat"): one trajectory per conversation, the completions trained and the tokens the
  framework put between them (tool results, user turns) not, when every call's prompt ids extend the previous
  call's prompt + completion ids exactly (checked on token ids). A history the framework re-rendered differently
  (a template that drops earlier reasoning, re-serialised tool-call JSON, trimmed whitespace) does not extend:
  that episode falls back to per-turn samples, counted in ``agent/stitch_fallbacks`` and logged once per run.

The group of a dataset row holds the samples of its ``rollout.n_samples`` episodes (GRPO statistics over them).

Online agents (``rollout.agent=online``): the agents run elsewhere. Each episode is *offered* (its row, under a
staleness ticket like any rollout) and waits until an external process claims it (``POST /v1/sessions`` on
``rollout.agent_host:agent_port`` with ``rollout.agent_api_key``: the session id, base URL and row; 429 when
nothing is offered, i.e. the run's eta budget is spent), makes its calls and reports its reward (``POST
/v1/sessions/{id}/reward``). An episode nobody claims within the group timeout is rejected (its prompt replayed).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from typing import Any, Callable, Sequence

from jaxrl_async.rollout.workflow import EpisodeContext, RolloutWorkflow, Trajectory, TrajectoryGroup, item_field

__all__ = ["OpenAIAgentWorkflow", "agent_function", "episode_samples", "AGENT_MODEL_NAME"]

log = logging.getLogger(__name__)
AGENT_MODEL_NAME = "policy"  # the model name the endpoint serves (any OpenAI ``model`` must name it)
SAMPLE_MODES = ("per_turn", "stitched")
RECORD_WAIT_S = 10.0  # at an episode's end, the longest wait for the records of its calls


def agent_function(spec: str) -> Callable[..., Any]:
    """``rollout.agent``'s ``module:function`` -> the function (a ``ValueError`` saying what is wrong otherwise)."""
    import importlib

    mod, sep, attr = spec.partition(":")
    if not (sep and mod and attr):
        raise ValueError(f"{spec!r} is neither 'online' nor a 'module:function' string")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except Exception as e:  # noqa: BLE001 - the user's module: one line
        raise ValueError(f"cannot import {spec!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    return fn


def _stitch(calls: Sequence[Any]) -> tuple[list[Any] | None, str]:
    """The turns of ``Trajectory.from_turns`` if the calls form one conversation whose every prompt extends the
    previous prompt + completion token for token; else (None, why)."""
    if any(c.sample_index != 0 for c in calls) or len({c.seq for c in calls}) != len(calls):
        return None, "a call asked for several samples (n > 1) or prompts"
    turns: list[Any] = [calls[0]]
    tokens = list(calls[0].prompt_ids) + list(calls[0].completion_ids)
    for c in calls[1:]:
        p = list(c.prompt_ids)
        if p[:len(tokens)] != tokens:
            k = next((i for i, (a, b) in enumerate(zip(p, tokens)) if a != b), min(len(p), len(tokens)))
            return None, f"call {c.seq}'s prompt departs from the conversation's tokens at position {k}"
        if len(p) > len(tokens):
            turns.append((p[len(tokens):], False))
        turns.append(c)
        tokens = p + list(c.completion_ids)
    return turns, ""


def episode_samples(calls: Sequence[Any], reward: float, *, mode: str = "per_turn", turn_discount: float = 1.0,
                    **metadata: Any) -> tuple[list[Trajectory], dict[str, Any]]:
    """An episode's recorded calls (``serve.sessions.Call``) -> its training trajectories and facts about them
    (``stitched``: bool, ``fallback``: why stitching was not possible, or None). See the module docstring."""
    if mode not in SAMPLE_MODES:
        raise ValueError(f"rollout.agent_samples must be one of {SAMPLE_MODES}, got {mode!r}")
    calls = sorted([c for c in calls if c.completion_ids], key=lambda c: (c.seq, c.sample_index))
    if not calls:
        return [], {"stitched": False, "fallback": None, "turns": 0}
    seqs = sorted({c.seq for c in calls})
    turn_of = {s: i for i, s in enumerate(seqs)}
    T = len(seqs)
    meta = dict(metadata, agent_turns=T, episode_reward=float(reward))
    fallback = None
    if mode == "stitched":
        turns, why = _stitch(calls)
        if turns is not None:
            tr = Trajectory.from_turns(calls[0].prompt_ids, turns, reward, agent_sample="stitched", **meta)
            return [tr], {"stitched": True, "fallback": None, "turns": T}
        fallback = why
    out = [Trajectory.from_completion(c.prompt_ids, c.completion_ids, c.logprobs, c.versions,
                                      reward * turn_discount ** (T - 1 - turn_of[c.seq]), c.finish_reason,
                                      agent_sample="per_turn", turn=turn_of[c.seq], call_sample=c.sample_index,
                                      **meta)
           for c in calls]
    return out, {"stitched": False, "fallback": fallback, "turns": T}


def _row(item: Any, system: str | None = None) -> dict[str, Any]:
    """What the agent gets: the dataset row as plain JSON-able values (``system``: the data's system prompt)."""
    meta = dict(item_field(item, "metadata") or {})
    question = meta.pop("raw_prompt", None)
    if question is None:
        question = item_field(item, "prompt", "")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"id": item_field(item, "id"), "question": question, "messages": messages,
            "answer": item_field(item, "answer"), "metadata": meta}


class OpenAIAgentWorkflow(RolloutWorkflow):
    """``rollout.workflow=openai_agent`` (module docstring).

    Args:
      agent: ``fn(client, row)`` (async or not), or ``"online"``.
      tokenizer: the model's tokenizer (the endpoint renders chat templates with it).
      reward_fn: scores an agent that returns its final text (``fn(prompt, text, answer, **metadata)``).
      samples: ``per_turn`` or ``stitched``.
      turn_discount: gamma of the per-turn rewards.
      host, port, api_key: the endpoint's address (port 0: any free port) and key (default random; required
        for a non-loopback host).
      eos_ids: stop token ids of the run.
      default_max_tokens: new tokens of a call that sets no ``max_tokens`` (the run: ``rollout.sampling.max_new_tokens``).
      system_prompt: the data's system prompt (``data.system_prompt``): the first message of ``row["messages"]``.
    """

    def __init__(self, agent: Callable[..., Any] | str, tokenizer: Any, reward_fn: Callable[..., float] | None = None,
                 *, samples: str = "per_turn", turn_discount: float = 1.0, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, eos_ids: Sequence[int] = (), say: Callable[[str], None] | None = None,
                 default_max_tokens: int | None = None, system_prompt: str | None = None):
        if samples not in SAMPLE_MODES:
            raise ValueError(f"rollout.agent_samples must be one of {SAMPLE_MODES}, got {samples!r}")
        self.online = agent == "online"
        self.agent = None if self.online else (agent_function(agent) if isinstance(agent, str) else agent)
        self.tokenizer, self.reward_fn = tokenizer, reward_fn
        self.samples, self.turn_discount = samples, float(turn_discount)
        self.host, self.port, self.api_key, self.eos_ids = host, int(port), api_key, tuple(eos_ids)
        self.default_max_tokens, self.system_prompt = default_max_tokens, system_prompt
        self.say = say or (lambda msg: log.warning("%s", msg))
        self.endpoint: Any = None
        self._lock = threading.Lock()
        self.stitch_fallbacks = 0
        self.stitched_episodes = 0
        self._fallback_said = False

    # -- the endpoint -----------------------------------------------------------------------------
    def ensure_endpoint(self, generator: Any) -> Any:
        """The run's agent endpoint (started on the first episode, on the run's generator)."""
        with self._lock:
            if self.endpoint is None:
                from jaxrl_async.serve.endpoint import AgentEndpoint

                self.endpoint = AgentEndpoint(generator, self.tokenizer, eos_ids=self.eos_ids, host=self.host,
                                              port=self.port, api_key=self.api_key,
                                              model_name=AGENT_MODEL_NAME,
                                              default_max_tokens=self.default_max_tokens).start()
                if self.online:
                    self.say(f"agent endpoint for online agents: {self.endpoint.url} (POST /v1/sessions to claim an "
                             "episode; rollout.agent_api_key is the key)")
            return self.endpoint

    def close(self) -> None:
        """Stop the endpoint (the run's end)."""
        with self._lock:
            ep, self.endpoint = self.endpoint, None
        if ep is not None:
            ep.stop()

    def step_metrics(self, groups: Sequence[Any]) -> dict[str, float | int]:
        """A step's agent metrics: ``agent/episodes``, ``agent/turns_mean`` / ``_max`` (model calls per episode),
        ``agent/samples_per_episode``, ``agent/aborted_calls`` (calls the agent never got an answer to), and the
        run's totals ``agent/stitched_episodes`` and ``agent/stitch_fallbacks``."""
        eps: dict[tuple, dict] = {}
        samples = 0
        for g in groups:
            for t in (g if isinstance(g, TrajectoryGroup) else g.item).trajectories:  # a ConsumedGroup's item
                m = t.metadata
                if "agent_turns" in m:
                    eps.setdefault((m.get("session"),), m)
                    samples += 1
        with self._lock:
            row: dict[str, float | int] = {"agent/stitched_episodes": self.stitched_episodes,
                                           "agent/stitch_fallbacks": self.stitch_fallbacks}
        if eps:
            turns = [int(m["agent_turns"]) for m in eps.values()]
            row.update({"agent/episodes": len(eps), "agent/turns_mean": sum(turns) / len(turns),
                        "agent/turns_max": max(turns), "agent/samples_per_episode": samples / len(eps),
                        "agent/aborted_calls": sum(int(m.get("aborted_calls", 0)) for m in eps.values())})
        return row

    # -- an episode ---------------------------------------------------------------------------------
    def run_episode(self, item: Any, ctx: EpisodeContext) -> list[Trajectory] | None:
        ep = self.ensure_endpoint(ctx.generator)
        row = _row(item, self.system_prompt)
        session = ep.sessions.open(row=row, online=self.online)
        t0 = time.monotonic()
        try:
            if self.online:
                reward = self._wait_online(session, ctx)
            else:
                reward = self._run_agent(session, row, ep, ctx)
            # the records of calls whose (streamed) answer reached the agent first: moments away; a call still
            # running after the bound (the agent did not wait for it) is not trained
            if not session.wait(lambda s: s.pending == 0, RECORD_WAIT_S):
                log.warning("session %s ended with %d call(s) unrecorded after %.0f s; not trained", session.id,
                            session.pending, RECORD_WAIT_S)
            calls = session.ordered_calls()
        finally:
            ep.sessions.end(session)
        trajs, info = episode_samples(calls, reward, mode=self.samples, turn_discount=self.turn_discount,
                                      item_id=item_field(item, "id"), sample_index=ctx.sample_index,
                                      session=session.id, aborted_calls=session.aborted_calls,
                                      episode_s=round(time.monotonic() - t0, 3))
        if not trajs:
            raise ValueError(f"the agent's episode on row {row['id']!r} made no model call that generated tokens")
        with self._lock:
            self.stitched_episodes += int(info["stitched"])
            if info["fallback"] is not None:
                self.stitch_fallbacks += 1
                first = not self._fallback_said
                self._fallback_said = True
            else:
                first = False
        if first:
            self.say(f"agent episodes fall back to per-turn samples: {info['fallback']} (the chat template or the agent "
                     "re-rendered the history; counted in agent/stitch_fallbacks, said once)")
        return trajs

    def _run_agent(self, session: Any, row: dict, ep: Any, ctx: EpisodeContext) -> float:
        import openai

        timeout = ctx._remaining()
        base = ep.session_url(session.id)
        fn = self.agent
        if inspect.iscoroutinefunction(fn):
            async def main() -> Any:
                client = openai.AsyncOpenAI(base_url=base, api_key=ep.api_key, timeout=timeout or 600.0, max_retries=0)
                try:
                    return await asyncio.wait_for(fn(client, dict(row, session_id=session.id)), timeout)
                finally:
                    await client.close()

            try:
                result = asyncio.run(main())
            except asyncio.TimeoutError:
                from jaxrl_async.rollout.workflow import EpisodeTimeout

                raise EpisodeTimeout(f"the agent did not finish within {timeout:.1f} s") from None
        else:
            with openai.OpenAI(base_url=base, api_key=ep.api_key, timeout=timeout or 600.0, max_retries=0) as client:
                result = fn(client, dict(row, session_id=session.id))
        return self._reward(result, session, row, ctx)

    def _reward(self, result: Any, session: Any, row: dict, ctx: EpisodeContext) -> float:
        if isinstance(result, bool) or (result is not None and not isinstance(result, (int, float, str))):
            raise TypeError(f"the agent returned {type(result).__name__}; return a reward (number), the final answer "
                            "(str, scored by rollout.reward) or None after reporting the reward")
        if isinstance(result, (int, float)):
            return float(result)
        if isinstance(result, str):
            if self.reward_fn is None:
                raise ValueError("the agent returned text but the workflow has no reward function")
            meta = {k: v for k, v in row["metadata"].items() if k not in ("prompt", "completion", "answer")}
            return float(ctx.reward(self.reward_fn, row["question"], result, row["answer"], **meta))
        if session.reward is None:
            raise ValueError("the agent returned None and reported no reward (POST /v1/sessions/{id}/reward)")
        return float(session.reward)

    def _wait_online(self, session: Any, ctx: EpisodeContext) -> float:
        from jaxrl_async.rollout.workflow import EpisodeTimeout

        timeout = ctx._remaining()
        if not session.wait(lambda s: s.reward is not None, timeout):
            what = "claimed" if not session.claimed else "given a reward"
            raise EpisodeTimeout(f"online episode {session.id} was not {what} within {timeout:.1f} s")
        return float(session.reward)
