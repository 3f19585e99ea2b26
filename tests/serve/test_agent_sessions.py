"""RL on agents through the OpenAI endpoint (``rollout.workflow=openai_agent``, issue 25 part 2), on a scripted
engine (no model, nothing to compile): every call of an episode is recorded as the engine generated it; per-turn
samples carry the engine's tokens, behaviour log-probs and versions with the reward discounted back over turns;
a conversation whose prompts extend each other token for token is stitched into one trajectory; a template that
drops earlier reasoning or re-serialises tool calls falls back to per-turn samples, counted and said once; online
agents claim offered episodes and report rewards over HTTP."""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading

import httpx
import numpy as np
import pytest
from serve_helpers import CHAT_TEMPLATE, ScriptEngine

from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.rollout.openai_agent import OpenAIAgentWorkflow, episode_samples
from jaxrl_async.rollout.workflow import EpisodeContext, GroupSampler
from jaxrl_async.serve.sessions import Call

TOOL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
# Qwen3's habit: earlier assistant turns are rendered without their <think> block
THINK_DROPPING_TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>"
    "{%- if m.role == 'assistant' %}{{ (m.content or '').split('</think>')[-1] }}{% else %}{{ m.content or '' }}{% endif %}"
    "{%- endfor -%}{%- if add_generation_prompt %}<|assistant|>{% endif %}")


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class Item:
    def __init__(self, id, question, answer="3"):
        self.id, self.prompt, self.answer = id, question, answer
        self.prompt_ids = [5, 6, 7]
        self.metadata = {"raw_prompt": question, "completion": "a gold completion column", "source": "t.jsonl:1"}


def run_group(workflow, generator, item, n=1, timeout=60.0, seed=0):
    ctx = EpisodeContext(generator=generator, sampling=SamplingParams(max_new_tokens=64, seed=seed),
                         reward_executor=cf.ThreadPoolExecutor(2), episode_executor=cf.ThreadPoolExecutor(4),
                         timeout_s=timeout)
    return GroupSampler(workflow, n).run(item, ctx)


def tool_script(tok, think=False):
    """First turn: a tool call (or reasoning then an answer); after a tool/user turn: the answer."""
    def script(prompt, k, sp):
        text = tok.decode(prompt)
        if "<|tool|>" in text or text.count("<|user|>") > 1:
            return ids(tok, "the sum is 3") + [2]
        return ids(tok, "<think>hmm</think>ok" if think else TOOL_TEXT) + [2]
    return script


def generator_of(tok, script, **kw):
    from jaxrl_async.generator.orchestrator import Generator

    return Generator(ScriptEngine(script, num_slots=4, **kw), params=None, tokenizer=tok)


# -- the sample builder on its own -------------------------------------------------------------------
def call(seq, prompt, completion, sample=0, version=0):
    return Call(seq, "chat", sample, list(prompt), list(completion), [-0.5] * len(completion),
                [version] * len(completion), "stop")


def test_episode_samples_per_turn_stitched_and_fallback():
    calls = [call(0, [1, 2], [3, 4]), call(1, [1, 2, 3, 4, 9], [5], version=1), call(2, [1, 2, 3, 4, 9, 5, 8], [6, 7])]
    per, info = episode_samples(calls, 1.0, mode="per_turn", turn_discount=0.5)
    assert [t.reward for t in per] == [0.25, 0.5, 1.0] and info == {"stitched": False, "fallback": None, "turns": 3}
    assert [list(t.tokens) for t in per] == [[1, 2, 3, 4], [1, 2, 3, 4, 9, 5], [1, 2, 3, 4, 9, 5, 8, 6, 7]]
    assert list(per[1].versions) == [-1] * 5 + [1] and list(per[1].loss_mask) == [0] * 5 + [1]
    (st,), info = episode_samples(calls, 1.0, mode="stitched", turn_discount=0.5)
    assert info["stitched"] and st.reward == 1.0
    assert list(st.tokens) == [1, 2, 3, 4, 9, 5, 8, 6, 7]
    assert list(st.loss_mask) == [0, 0, 1, 1, 0, 1, 0, 1, 1]  # the inserted 9 and 8 are not trained
    assert list(st.versions) == [-1, -1, 0, 0, -1, 1, -1, 0, 0]
    np.testing.assert_array_equal(st.logprobs, np.where(st.loss_mask == 1, -0.5, 0.0).astype(np.float32))
    # a prompt that does not extend the conversation (token 4 re-rendered as 44): per-turn samples, said why
    broken = [calls[0], call(1, [1, 2, 3, 44, 9], [5])]
    out, info = episode_samples(broken, 1.0, mode="stitched")
    assert len(out) == 2 and info["fallback"] == "call 1's prompt departs from the conversation's tokens at position 3"
    # n > 1 in a call: per-turn samples, both samples of turn 0 get turn 0's reward
    out, info = episode_samples([call(0, [1], [2], 0), call(0, [1], [3], 1), call(1, [1, 2, 7], [4])], 2.0,
                                mode="stitched", turn_discount=0.5)
    assert [t.reward for t in out] == [1.0, 1.0, 2.0]
    assert info["fallback"] == "a call asked for several samples (n > 1) or prompts"
    with pytest.raises(ValueError, match="agent_samples"):
        episode_samples(calls, 1.0, mode="concat")


# -- through the endpoint ------------------------------------------------------------------------------
async def tool_agent(client, row):
    """An ordinary OpenAI-SDK tool loop: call the model, run the tool it asks for, answer."""
    msgs = list(row["messages"])
    r = await client.chat.completions.create(model="policy", messages=msgs, tools=[ADD_TOOL])
    m = r.choices[0].message
    assert m.tool_calls and m.tool_calls[0].function.name == "add"
    args = json.loads(m.tool_calls[0].function.arguments)
    msgs += [{"role": "assistant", "content": m.content, "tool_calls": [tc.model_dump() for tc in m.tool_calls]},
             {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": str(args["a"] + args["b"])}]
    r2 = await client.chat.completions.create(model="policy", messages=msgs, tools=[ADD_TOOL])
    tool_agent.responses.append((r, r2))
    return 1.0 if "3" in r2.choices[0].message.content else 0.0


tool_agent.responses = []


def test_tool_calling_episode_trains_on_exactly_the_engine_tokens(tok):
    """Two tool-calling turns through the openai client: two per-turn samples whose tokens, log-probs and versions
    are what the engine generated (the response's own token-id fields agree), rewards discounted back."""
    tool_agent.responses.clear()
    wf = OpenAIAgentWorkflow(tool_agent, tok, samples="per_turn", turn_discount=0.9, eos_ids=(2,))
    with generator_of(tok, tool_script(tok)) as gen:
        try:
            group = run_group(wf, gen, Item("r0", "add 1 and 2"), n=2)
        finally:
            wf.close()
    assert len(group.trajectories) == 4 and group.metadata["episodes"] == 2
    assert sorted(t.reward for t in group.trajectories) == pytest.approx([0.9, 0.9, 1.0, 1.0])
    first = ids(tok, TOOL_TEXT) + [2]
    answer = ids(tok, "the sum is 3") + [2]
    for (r1, r2) in tool_agent.responses:
        assert r1.choices[0].token_ids == first and r2.choices[0].token_ids == answer
    by_turn = {}
    for t in group.trajectories:
        by_turn.setdefault(t.metadata["turn"], []).append(t)
    for t in by_turn[0]:
        assert list(t.completion_ids) == first and t.metadata["agent_turns"] == 2
        assert list(t.prompt_ids) == tool_agent.responses[0][0].prompt_token_ids
        np.testing.assert_allclose(t.logprobs[t.prompt_len:], [-0.1 * (j + 1) for j in range(len(first))], rtol=1e-6)
        assert set(t.versions[t.prompt_len:]) == {0} and t.loss_mask[t.prompt_len:].all()
    for t in by_turn[1]:
        assert list(t.completion_ids) == answer
        assert list(t.prompt_ids) == tool_agent.responses[0][1].prompt_token_ids
        # the server rendered the tool result into the second prompt (the recorded prompt, not a re-tokenisation)
        assert "<|tool|>3" in tok.decode(list(t.prompt_ids))
    m = wf.step_metrics([group])
    assert m["agent/episodes"] == 2 and m["agent/turns_mean"] == 2 and m["agent/samples_per_episode"] == 2


@pytest.mark.parametrize("case", ["think_dropped", "tool_json_reserialised"])
def test_a_rerendered_history_falls_back_to_per_turn_samples_counted_and_said_once(tok, case):
    said = []
    think = case == "think_dropped"

    async def agent(client, row):
        msgs = list(row["messages"])
        r = await client.chat.completions.create(model="policy", messages=msgs, **({} if think else {"tools": [ADD_TOOL]}))
        m = r.choices[0].message
        if think:
            msgs += [{"role": "assistant", "content": m.content}, {"role": "user", "content": "sure?"}]
        else:
            msgs += [{"role": "assistant", "content": None, "tool_calls": [tc.model_dump() for tc in m.tool_calls]},
                     {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "3"}]
        await client.chat.completions.create(model="policy", messages=msgs)
        return 1.0

    tok.chat_template = THINK_DROPPING_TEMPLATE if think else CHAT_TEMPLATE
    try:
        wf = OpenAIAgentWorkflow(agent, tok, samples="stitched", eos_ids=(2,), say=said.append)
        with generator_of(tok, tool_script(tok, think=think)) as gen:
            try:
                group = run_group(wf, gen, Item("r1", "q"), n=2)
            finally:
                wf.close()
    finally:
        tok.chat_template = CHAT_TEMPLATE
    assert len(group.trajectories) == 4 and all(t.metadata["agent_sample"] == "per_turn" for t in group.trajectories)
    assert wf.stitch_fallbacks == 2 and wf.stitched_episodes == 0
    assert len(said) == 1 and "per-turn samples" in said[0] and "departs" in said[0]
    assert wf.step_metrics([group])["agent/stitch_fallbacks"] == 2


def test_token_id_prompts_that_extend_the_conversation_are_stitched(tok):
    """An agent that builds each prompt from the previous call's token ids (completions API): one trajectory, the
    completions trained, the inserted observation not."""
    obs = ids(tok, "<|user|>again")

    async def agent(client, row):
        r = await client.completions.create(model="policy", prompt=row["question"], max_tokens=16)
        c = r.choices[0]
        prompt2 = c.prompt_token_ids + c.token_ids + obs
        r2 = await client.completions.create(model="policy", prompt=prompt2, max_tokens=16)
        agent.calls = (c, r2.choices[0])
        return 0.5

    script = lambda p, k, sp: ids(tok, "ab" if len(p) < 10 else "xyz") + [2]  # noqa: E731
    wf = OpenAIAgentWorkflow(agent, tok, samples="stitched", eos_ids=(2,))
    with generator_of(tok, script) as gen:
        try:
            group = run_group(wf, gen, Item("r2", "hi"))
        finally:
            wf.close()
    (t,) = group.trajectories
    c1, c2 = agent.calls
    assert t.metadata["agent_sample"] == "stitched" and t.reward == 0.5 and wf.stitched_episodes == 1
    assert list(t.tokens) == c1.prompt_token_ids + c1.token_ids + obs + c2.token_ids
    P = len(c1.prompt_token_ids)
    assert list(t.loss_mask) == [0] * P + [1] * len(c1.token_ids) + [0] * len(obs) + [1] * len(c2.token_ids)
    assert list(t.logprobs[t.loss_mask == 1]) == pytest.approx(c1.token_logprobs + c2.token_logprobs)


def test_rewards_text_answers_and_missing_rewards(tok):
    script = lambda p, k, sp: ids(tok, "7") + [2]  # noqa: E731
    seen = []

    def reward_fn(prompt, text, answer, **meta):
        seen.append((prompt, text, answer, meta))
        return 1.0 if text == answer else 0.0

    def sync_agent(client, row):  # a plain function gets the synchronous client
        r = client.chat.completions.create(model="policy", messages=row["messages"])
        return r.choices[0].message.content

    async def reporting_agent(client, row):
        await client.chat.completions.create(model="policy", messages=row["messages"])
        base = str(client.base_url).split("/sessions/")[0]
        r = httpx.post(f"{base}/v1/sessions/{row['session_id']}/reward", json={"reward": 0.25},
                       headers={"Authorization": f"Bearer {client.api_key}"})
        assert r.status_code == 200 and r.json()["calls"] == 1
        bad = httpx.post(f"{base}/v1/sessions/{row['session_id']}/reward", json={"reward": "x"},
                         headers={"Authorization": f"Bearer {client.api_key}"})
        assert bad.status_code == 409  # the reward is in: the session is finished
        return None

    async def silent_agent(client, row):
        await client.chat.completions.create(model="policy", messages=row["messages"])

    with generator_of(tok, script) as gen:
        for agent, expect in ((sync_agent, 1.0), (reporting_agent, 0.25)):
            wf = OpenAIAgentWorkflow(agent, tok, reward_fn, eos_ids=(2,))
            try:
                (t,) = run_group(wf, gen, Item("r3", "what is 3+4", answer="7")).trajectories
            finally:
                wf.close()
            assert t.reward == expect
        assert seen == [("what is 3+4", "7", "7", {"source": "t.jsonl:1"})]  # the row's columns, as RLVR passes them
        wf = OpenAIAgentWorkflow(silent_agent, tok, reward_fn, eos_ids=(2,))
        from jaxrl_async.rollout.workflow import GroupRejected

        with pytest.raises(GroupRejected, match="reported no reward"):
            try:
                run_group(wf, gen, Item("r4", "q"))
            finally:
                wf.close()


def test_online_agents_claim_offered_episodes_and_report_rewards(tok):
    """``rollout.agent=online``: an external client claims the offered episode (its row), calls the model under the
    session's base URL and reports the reward; with nothing offered a claim is 429; errors name their field."""
    import openai

    script = lambda p, k, sp: ids(tok, "5") + [2]  # noqa: E731
    wf = OpenAIAgentWorkflow("online", tok, eos_ids=(2,), api_key="k3y", say=lambda m: None)
    with generator_of(tok, script) as gen:
        ep = wf.ensure_endpoint(gen)
        h = {"Authorization": "Bearer k3y"}
        try:
            r = httpx.post(f"{ep.url}/v1/sessions", headers=h)
            assert r.status_code == 429 and r.json()["error"]["code"] == "no_episode"
            assert httpx.post(f"{ep.url}/v1/sessions").status_code == 401
            box = {}
            t = threading.Thread(target=lambda: box.update(g=run_group(wf, gen, Item("r5", "2+3", answer="5"))))
            t.start()
            for _ in range(200):
                r = httpx.post(f"{ep.url}/v1/sessions", headers=h)
                if r.status_code == 200:
                    break
                threading.Event().wait(0.05)
            claim = r.json()
            assert claim["row"]["answer"] == "5" and claim["row"]["question"] == "2+3"
            client = openai.OpenAI(base_url=claim["base_url"], api_key="k3y", max_retries=0)
            out = client.chat.completions.create(model="policy", messages=claim["row"]["messages"])
            sid = claim["session_id"]
            bad = httpx.post(f"{ep.url}/v1/sessions/{sid}/reward", content=b'{"reward": NaN}', headers=h)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
            missing = httpx.post(f"{ep.url}/v1/sessions/nope/reward", json={"reward": 1}, headers=h)
            assert missing.status_code == 404
            info = httpx.get(f"{ep.url}/v1/sessions/{sid}", headers=h).json()
            assert info["calls"] == 1 and info["completion_tokens"] == 2
            assert httpx.post(f"{ep.url}/v1/sessions/{sid}/reward", json={"reward": 1}, headers=h).status_code == 200
            t.join(30)
            (traj,) = box["g"].trajectories
            assert traj.reward == 1.0 and list(traj.completion_ids) == out.choices[0].token_ids
            # the session ended with the episode: its URL is gone
            gone = httpx.post(f"{claim['base_url']}/chat/completions", headers=h,
                              json={"model": "policy", "messages": [{"role": "user", "content": "x"}]})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
        finally:
            wf.close()


def test_versions_follow_a_weight_update_mid_episode(tok):
    """A weight update between two calls of an episode: the recorded versions say which weights produced which
    turn (per-turn samples: turn 0 at version 0, turn 1 at version 1)."""
    script = lambda p, k, sp: ids(tok, "ok") + [2]  # noqa: E731

    with generator_of(tok, script) as gen:
        async def agent(client, row):
            await client.chat.completions.create(model="policy", messages=row["messages"])
            gen.update_params(None, 1, wait=True, timeout=30)
            msgs = row["messages"] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            await client.chat.completions.create(model="policy", messages=msgs)
            return 1.0

        wf = OpenAIAgentWorkflow(agent, tok, eos_ids=(2,))
        try:
            group = run_group(wf, gen, Item("r6", "q"))
        finally:
            wf.close()
    v = {t.metadata["turn"]: set(t.versions[t.prompt_len:].tolist()) for t in group.trajectories}
    assert v == {0: {0}, 1: {1}}


@pytest.mark.parametrize("overrides,field,says", [
    (["rollout.workflow=openai_agent"], "rollout.agent", "needs rollout.agent"),
    (["rollout.workflow=openai_agent", "rollout.agent=no_such_module:run"], "rollout.agent", "cannot import"),
    (["rollout.agent=online"], "rollout.agent", "is for rollout.workflow=openai_agent"),
    (["rollout.workflow=openai_agent", "rollout.agent=online", "rollout.agent_host=0.0.0.0"], "rollout.agent_api_key",
     "not a loopback address"),
    (["rollout.workflow=openai_agent", "rollout.agent=online", "rollout.agent_turn_discount=1.5"],
     "rollout.agent_turn_discount", "[0, 1]"),
    (["rollout.workflow=openai_agent", "rollout.agent=online", "rollout.agent_samples=concat"], "rollout.agent_samples",
     "concat"),
])
def test_agent_settings_are_checked_at_validation(overrides, field, says):
    from jaxrl_async.config import ConfigError, apply_overrides, validate
    from jaxrl_async.config.default import get_config

    with pytest.raises(ConfigError) as e:
        validate(apply_overrides(get_config(), overrides))
    assert e.value.field == field and says in str(e.value)


def test_an_endpoint_needs_the_generator_in_this_process(tok):
    from jaxrl_async.serve.endpoint import AgentEndpoint

    class Remote:  # what a multi-process run's RemoteGenerator offers: no engine, no slots
        version = 0

    with pytest.raises(ValueError, match="multi-process"):
        AgentEndpoint(Remote(), tok)
    with pytest.raises(ValueError, match="API key"):
        AgentEndpoint(Remote(), tok, host="0.0.0.0")


def test_the_agents_sdk_calculator_example_runs_as_a_workflow(tok, monkeypatch):
    """``examples/calculator_agent.py`` (an OpenAI Agents SDK ``Agent`` with a ``calculator`` tool) as the
    ``openai_agent`` workflow's agent, on a scripted model that calls the tool and then answers: the tool ran, the
    answer was scored, and both model calls are the episode's per-turn samples."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import calculator_agent

    monkeypatch.setattr(calculator_agent, "MAX_TOKENS", 128)  # the test's character-level tokenizer: a token per char
    def script(prompt, k, sp):
        text = tok.decode(prompt)
        if "<|tool|>" in text:
            return ids(tok, "\\boxed{" + text.rsplit("<|tool|>", 1)[1].split("<|")[0] + "}") + [2]
        return ids(tok, '<tool_call>{"name": "calculator", "arguments": {"expression": "47 + 18 - 5"}}</tool_call>') + [2]

    scored = []

    def reward_fn(prompt, text, answer, **meta):
        scored.append(text)
        return float(text == "\\boxed{60}")

    wf = OpenAIAgentWorkflow(calculator_agent.run, tok, reward_fn, eos_ids=(2,))
    with generator_of(tok, script) as gen:
        try:
            group = run_group(wf, gen, Item("r7", "47+18-5", answer="60"))
        finally:
            wf.close()
    assert scored == ["\\boxed{60}"] and calculator_agent.evaluate("2*(3-5)") == -4
    assert sorted(t.metadata["turn"] for t in group.trajectories) == [0, 1]
    assert all(t.reward == 1.0 for t in group.trajectories)


def test_a_streamed_call_is_recorded_before_the_episode_ends(tok):
    """An agent that streams: its episode's sample is the streamed tokens (the record may arrive just after the
    last chunk; the episode waits for it, bounded)."""
    script = lambda p, k, sp: ids(tok, "streamed words") + [2]  # noqa: E731
    got = []

    async def agent(client, row):
        stream = await client.chat.completions.create(model="policy", messages=row["messages"], stream=True)
        async for chunk in stream:
            if chunk.choices:
                got.extend(chunk.choices[0].model_extra.get("token_ids") or [])
        return 1.0

    wf = OpenAIAgentWorkflow(agent, tok, eos_ids=(2,))
    with generator_of(tok, script) as gen:
        try:
            (t,) = run_group(wf, gen, Item("r8", "q")).trajectories
        finally:
            wf.close()
    assert list(t.completion_ids) == got == ids(tok, "streamed words") + [2]


def test_a_call_without_max_tokens_gets_the_runs_budget(tok):
    script = lambda p, k, sp: ids(tok, "a long answer") + [2]  # noqa: E731

    async def agent(client, row):
        r = await client.chat.completions.create(model="policy", messages=row["messages"])  # no max_tokens
        assert r.choices[0].finish_reason == "length"
        return 1.0

    wf = OpenAIAgentWorkflow(agent, tok, eos_ids=(2,), default_max_tokens=3)
    with generator_of(tok, script) as gen:
        try:
            (t,) = run_group(wf, gen, Item("r9", "q")).trajectories
        finally:
            wf.close()
    assert list(t.completion_ids) == ids(tok, "a l")


@pytest.mark.parametrize("system", [None, "be brief"])
def test_the_agents_first_prompt_is_the_data_recipes_prompt(tok, system):
    """``row["messages"]`` rendered by the endpoint gives the prompt ids the data recipe builds for the row (so the
    warm start and the held-out evaluation see what the agent's first call sends), with or without a system prompt."""
    from jaxrl_async.data.datasets import encode_prompts, render_prompt

    script = lambda p, k, sp: ids(tok, "x") + [2]  # noqa: E731

    async def agent(client, row):
        r = await client.chat.completions.create(model="policy", messages=row["messages"])
        agent.prompt = r.prompt_token_ids
        return 1.0

    question = "what is 2+2"
    want = encode_prompts([render_prompt(question, tok, system_prompt=system)], tok, templated=True)[0]
    wf = OpenAIAgentWorkflow(agent, tok, eos_ids=(2,), system_prompt=system)
    with generator_of(tok, script) as gen:
        try:
            run_group(wf, gen, Item("r10", question))
        finally:
            wf.close()
    assert agent.prompt == want


def test_every_request_of_a_session_gets_one_record_multi_prompt_and_refused_calls(tok):
    """A completions call with two prompts is one call of two requests (both recorded, nothing left pending); a call
    the server refuses (429: the queue is full) leaves nothing pending either (no 10 s wait at the episode's end)."""
    import time

    script = lambda p, k, sp: ids(tok, "ok") + [2]  # noqa: E731

    async def agent(client, row):
        r = await client.completions.create(model="policy", prompt=["one", "two"], max_tokens=4)
        assert len(r.choices) == 2
        ep = agent.wf.endpoint
        ep.backend.max_queue = -ep.backend.slots  # refuse everything from now on
        try:
            await client.chat.completions.create(model="policy", messages=row["messages"])
        except Exception as e:  # noqa: BLE001 - openai.RateLimitError
            agent.refused = type(e).__name__
        return 1.0

    wf = agent.wf = OpenAIAgentWorkflow(agent, tok, eos_ids=(2,))
    with generator_of(tok, script) as gen:
        try:
            t0 = time.monotonic()
            group = run_group(wf, gen, Item("r11", "q"))
            took = time.monotonic() - t0
        finally:
            wf.close()
    assert agent.refused == "RateLimitError" and took < 5.0, took
    assert len(group.trajectories) == 2 and {t.metadata["call_sample"] for t in group.trajectories} == {0}
    assert group.trajectories[0].metadata["aborted_calls"] == 1  # the refused call, counted
