"""Agent workflows: token-in/token-out multi-turn layout, turn limits, discounting, tools off the decode
thread, context limits; and a real tiny engine: loss mask = model tokens, behaviour log-probs = score path."""
import concurrent.futures as cf
import dataclasses
import threading
import time

import numpy as np
import pytest

from fakes import DoneHandle, request, sample
from jaxrl_async.rewards.math_reward import MathReward
from jaxrl_async.rollout.agent import AgentWorkflow, EnvStep, MultiTurnMathWorkflow, discounted_return
from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.rollout.tools import CalculatorTool
from jaxrl_async.rollout.workflow import EpisodeContext, GroupRejected, GroupSampler

EOS = 2  # <|im_end|> of the project's ChatML tokenizer
FEEDBACK = "Your answer is incorrect. Try again."


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from jaxrl_async.data.tokenizer import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), kind="arithmetic")


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def math_reward():
    r = MathReward()
    yield r
    r.close()


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


# Hand-written ChatML strings the environment must insert (Qwen2.5/Qwen3 template layout).
def user_turn(content, closed=True):
    return ("" if closed else "<|im_end|>") + f"\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@dataclasses.dataclass
class Item:
    id: str
    prompt: str
    prompt_ids: list
    answer: str
    metadata: dict = dataclasses.field(default_factory=dict)


def make_item(tok, question="What is 2+3?", answer="5", id="q0"):
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return Item(id, text, enc(tok, text), answer, {"raw_prompt": question})


class ScriptedGenerator:
    """Turn k of sample s answers script[s][k] = (text, finish_reason); "stop" appends EOS. Token j of a
    turn gets logprob -(k + 1) - j / 100 and the generator's version at that turn (version = k + 10)."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script
        self.requests = []
        self.lock = threading.Lock()

    def submit(self, prompt_ids, sampling=None, request_id=None, metadata=None):
        s, k = (int(part[1:]) for part in request_id.split("-")[1:])
        with self.lock:
            self.requests.append((s, k, list(prompt_ids), sampling))
        text, finish = self.script[s][k]
        ids = enc(self.tok, text) + ([EOS] if finish == "stop" else [])
        lps = [-(k + 1) - j / 100 for j in range(len(ids))]
        return DoneHandle(request([sample(0, list(prompt_ids), ids, lps, [k + 10] * len(ids), finish)]))


def make_ctx(gen, max_new_tokens=64, **kw):
    return EpisodeContext(generator=gen, sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=1),
                          reward_executor=cf.ThreadPoolExecutor(2, thread_name_prefix="reward"),
                          episode_executor=cf.ThreadPoolExecutor(4, thread_name_prefix="episode"), **kw)


def segments(mask):
    """[(start, end)] of the runs of ones in mask."""
    m = np.concatenate([[0], np.asarray(mask), [0]])
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


# -- pure ---------------------------------------------------------------------------------------------
def test_discounted_return():
    assert discounted_return([0, 0, 1], 0.5) == 0.25
    assert discounted_return([1, 2, 4], 0.5) == 1 + 1 + 1
    assert discounted_return([], 0.9) == 0.0


# -- retry until correct: exact token layout --------------------------------------------------------
def test_multi_turn_math_layout_rewards_and_token_in_token_out(tok, math_reward):
    script = {0: [("The answer is \\boxed{3}.", "stop"), ("Hmm \\boxed{4}", "length"), ("So \\boxed{5}", "stop")]}
    gen = ScriptedGenerator(tok, script)
    wf = MultiTurnMathWorkflow(tok, math_reward, max_turns=3, turn_discount=0.5)
    item = make_item(tok)
    (traj,) = GroupSampler(wf, 1).run(item, make_ctx(gen)).trajectories

    c = [enc(tok, t) + ([EOS] if f == "stop" else []) for t, f in script[0]]
    fb_closed, fb_open = enc(tok, user_turn(FEEDBACK)), enc(tok, user_turn(FEEDBACK, closed=False))
    P = item.prompt_ids
    expected = P + c[0] + fb_closed + c[1] + fb_open + c[2]  # turn 1 hit the length limit: closed by the env
    np.testing.assert_array_equal(traj.tokens, expected)
    mask = [0] * len(P) + [1] * len(c[0]) + [0] * len(fb_closed) + [1] * len(c[1]) + [0] * len(fb_open) + [1] * len(c[2])
    np.testing.assert_array_equal(traj.loss_mask, mask)
    vers = [-1] * len(P) + [10] * len(c[0]) + [-1] * len(fb_closed) + [11] * len(c[1]) + [-1] * len(fb_open) + [12] * len(c[2])
    np.testing.assert_array_equal(traj.versions, vers)
    for k, (a, b) in enumerate(segments(traj.loss_mask)):
        np.testing.assert_allclose(traj.logprobs[a:b], [-(k + 1) - j / 100 for j in range(b - a)], rtol=0, atol=1e-6)
    assert (traj.logprobs[np.asarray(mask) == 0] == 0).all()
    # token-in/token-out: every request's prompt is the exact token history so far
    reqs = sorted(gen.requests, key=lambda r: r[1])
    assert [r[2] for r in reqs] == [P, P + c[0] + fb_closed, P + c[0] + fb_closed + c[1] + fb_open]
    assert traj.reward == 0.25 and traj.prompt_len == len(P)  # 0.5 ** (3 - 1)
    m = traj.metadata
    assert (m["model_turns"], m["stop_reason"], m["turn_rewards"]) == (3, "done", [0.0, 0.0, 1.0])
    assert m["turn_texts"][1] == "Hmm \\boxed{4}" and m["completion_text"] == "So \\boxed{5}"
    assert [i["correct"] for i in m["turn_info"]] == [False, False, True] and m["item_id"] == "q0"


def test_turn_limit_respected_and_first_turn_success(tok, math_reward):
    wrong = {s: [("\\boxed{7}", "stop")] * 5 for s in range(3)}
    gen = ScriptedGenerator(tok, wrong)
    wf = MultiTurnMathWorkflow(tok, math_reward, max_turns=2, turn_discount=0.9)
    group = GroupSampler(wf, 3).run(make_item(tok), make_ctx(gen))
    assert len(gen.requests) == 6 and sorted((s, k) for s, k, *_ in gen.requests) == [(s, k) for s in range(3) for k in range(2)]
    for t in group.trajectories:
        assert t.reward == 0.0 and t.metadata["model_turns"] == 2 and t.metadata["stop_reason"] == "max_turns"
        assert len(segments(t.loss_mask)) == 2 and t.loss_mask[-1] == 1  # nothing appended after the last turn
    seeds = {r[3].seed for r in gen.requests}
    assert len(seeds) == 3  # each sample of the group has its own seed (same across its turns)

    gen = ScriptedGenerator(tok, {0: [("\\boxed{5}", "stop")]})
    (t,) = GroupSampler(MultiTurnMathWorkflow(tok, math_reward, max_turns=3), 1).run(make_item(tok), make_ctx(gen)).trajectories
    assert t.reward == 1.0 and len(gen.requests) == 1 and t.metadata["model_turns"] == 1


# -- tools ------------------------------------------------------------------------------------------
def call(name, args_json):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args_json}}}\n</tool_call>'


class RecordingCalculator(CalculatorTool):
    def __init__(self):
        self.threads = []

    def __call__(self, expression):
        self.threads.append(threading.current_thread().name)
        return super().__call__(expression)


def test_tool_agent_runs_tools_off_thread_and_feeds_responses_back(tok, math_reward):
    calc = RecordingCalculator()
    script = {0: [("Let me compute. " + call("calculator", '{"expression": "6*7"}'), "stop"),
                  ("The answer is \\boxed{42}.", "stop")]}
    gen = ScriptedGenerator(tok, script)
    wf = AgentWorkflow(tok, math_reward, tools=[calc], max_turns=4, turn_discount=0.8, tools_in_prompt=False)
    item = make_item(tok, "What is 6 times 7?", "42")
    (traj,) = GroupSampler(wf, 1).run(item, make_ctx(gen)).trajectories
    c0 = enc(tok, script[0][0][0]) + [EOS]
    obs = enc(tok, user_turn("<tool_response>\n42\n</tool_response>"))
    assert gen.requests[1][2] == item.prompt_ids + c0 + obs
    assert traj.reward == pytest.approx(0.8) and traj.metadata["tool_calls"] == 1 and traj.metadata["tool_errors"] == 0
    assert calc.threads and all(n.startswith("reward") for n in calc.threads)  # not the episode/decode thread


def test_tool_errors_are_fed_back_not_raised(tok, math_reward):
    bad_json = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}\n</tool_call>'
    three = "".join(call("calculator", f'{{"expression": "{e}"}}') for e in ("1+1", "1/0", "2*3"))
    script = {0: [(bad_json, "stop"), (three, "stop"), (call("nope", "{}"), "stop"), ("no answer", "stop")]}
    gen = ScriptedGenerator(tok, script)
    wf = AgentWorkflow(tok, math_reward, tools=[CalculatorTool()], max_turns=4, max_tool_calls_per_turn=2,
                       tools_in_prompt=False)
    (traj,) = GroupSampler(wf, 1).run(make_item(tok), make_ctx(gen)).trajectories
    inserted = [tok.decode(traj.tokens[a:b]) for a, b in segments(1 - traj.loss_mask)[1:]]
    assert "Error: invalid JSON in <tool_call>" in inserted[0]
    assert inserted[1] == user_turn("<tool_response>\n2\n</tool_response>\n<tool_response>\nError: division by zero\n"
                                    "</tool_response>\n<tool_response>\nError: too many tool calls in one turn (at most "
                                    "2); this call was not run\n</tool_response>")
    assert "Error: unknown tool 'nope'; available tools: ['calculator']" in inserted[2]
    m = traj.metadata
    assert (m["tool_calls"], m["tool_errors"], m["model_turns"], traj.reward) == (5, 4, 4, 0.0)
    assert m["tool_parse_errors"] == 1  # the invalid JSON block (the unknown tool parsed; it is a tool error)
    assert len(m["turn_tokens"]) == 4 and sum(m["turn_tokens"]) == traj.num_generated


def test_agent_metrics_summarise_turns_tools_and_how_episodes_ended(tok, math_reward):
    """The step metrics of agent episodes (``agent_metrics``): a tool episode that answered (4 turns, 5 calls, 4
    failed, 1 unparsable) and a retry episode out of turns (2 turns, no tools); single-turn trajectories are
    left out, and a batch without agent episodes adds nothing."""
    from jaxrl_async.rollout.agent import STOP_REASONS, agent_metrics
    from jaxrl_async.rollout.workflow import Trajectory

    bad_json = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}\n</tool_call>'
    three = "".join(call("calculator", f'{{"expression": "{e}"}}') for e in ("1+1", "1/0", "2*3"))
    script = {0: [(bad_json, "stop"), (three, "stop"), (call("nope", "{}"), "stop"), ("\\boxed{5}", "stop")]}
    wf = AgentWorkflow(tok, math_reward, tools=[CalculatorTool()], max_turns=4, max_tool_calls_per_turn=2,
                       tools_in_prompt=False)
    (tools,) = GroupSampler(wf, 1).run(make_item(tok), make_ctx(ScriptedGenerator(tok, script))).trajectories
    gen = ScriptedGenerator(tok, {0: [("\\boxed{7}", "stop")] * 2})
    (retry,) = GroupSampler(MultiTurnMathWorkflow(tok, math_reward, max_turns=2), 1).run(make_item(tok),
                                                                                      make_ctx(gen)).trajectories
    assert (tools.metadata["stop_reason"], retry.metadata["stop_reason"]) == ("done", "max_turns")
    single = Trajectory.from_completion([1, 2], [3, 4, 5], [-1.0] * 3, [0] * 3, 1.0, "stop")
    m = agent_metrics([tools, single, retry])
    assert m["agent/episodes"] == 2 and (m["agent/turns_mean"], m["agent/turns_max"]) == (3.0, 4)
    assert (m["agent/tool_calls_mean"], m["agent/tool_calls_max"], m["agent/tool_errors_mean"]) == (2.5, 5, 2.0)
    assert m["agent/tool_error_frac"] == pytest.approx(0.8) and m["agent/tool_parse_errors_mean"] == 0.5
    assert m["agent/tokens_per_turn_mean"] == pytest.approx((tools.num_generated + retry.num_generated) / 6)
    turn_tokens = tools.metadata["turn_tokens"] + retry.metadata["turn_tokens"]
    assert m["agent/tokens_per_turn_max"] == max(turn_tokens) and len(turn_tokens) == 6
    assert {r: m[f"agent/stop/{r}"] for r in STOP_REASONS} == {"done": 0.5, "max_turns": 0.5, "truncated": 0.0,
                                                                "context_limit": 0.0}
    assert agent_metrics([retry])["agent/tool_error_frac"] is None  # no calls: no error share
    assert agent_metrics([single]) == {}


class SlowTool:
    name, description = "slow", "sleeps"
    parameters = {"type": "object", "properties": {}}

    def __call__(self):
        time.sleep(1.0)
        return "late"


def test_tool_timeout_reported_as_text(tok, math_reward):
    script = {0: [(call("slow", "{}"), "stop"), ("\\boxed{5}", "stop")]}
    gen = ScriptedGenerator(tok, script)
    wf = AgentWorkflow(tok, math_reward, tools=[SlowTool()], tool_timeout_s=0.1, tools_in_prompt=False)
    t0 = time.monotonic()
    (traj,) = GroupSampler(wf, 1).run(make_item(tok), make_ctx(gen)).trajectories
    assert time.monotonic() - t0 < 0.9
    assert "Error: tool 'slow' timed out after 0.1 s" in tok.decode(gen.requests[1][2])
    assert traj.reward == 1.0 and traj.metadata["tool_errors"] == 1


def test_tools_announced_in_prompt_when_template_ignores_them(tok, math_reward):
    gen = ScriptedGenerator(tok, {0: [("\\boxed{5}", "stop")]})
    wf = AgentWorkflow(tok, math_reward, tools=[CalculatorTool()])
    (traj,) = GroupSampler(wf, 1).run(make_item(tok), make_ctx(gen)).trajectories
    text = tok.decode(traj.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '"name": "calculator"' in text and text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert gen.requests[0][2] == list(traj.prompt_ids)


def test_context_limit_caps_budget_and_stops(tok, math_reward):
    script = {0: [("\\boxed{1}", "stop")] * 3}
    item = make_item(tok)
    c0 = enc(tok, "\\boxed{1}") + [EOS]
    limit = len(item.prompt_ids) + len(c0) + 5  # room for turn 0, not for the feedback
    gen = ScriptedGenerator(tok, script)
    wf = MultiTurnMathWorkflow(tok, math_reward, max_turns=3, max_context_tokens=limit)
    (traj,) = GroupSampler(wf, 1).run(item, make_ctx(gen, max_new_tokens=500)).trajectories
    assert gen.requests[0][3].max_new_tokens == limit - len(item.prompt_ids)
    assert traj.metadata["stop_reason"] == "context_limit" and traj.metadata["model_turns"] == 1
    with pytest.raises(GroupRejected, match="does not fit max_context_tokens"):
        GroupSampler(MultiTurnMathWorkflow(tok, math_reward, max_context_tokens=len(item.prompt_ids)), 1).run(
            item, make_ctx(gen))


def test_engine_prefill_limit_and_stop_on_truncation(tok, math_reward):
    import types

    item = make_item(tok)
    c0 = enc(tok, "\\boxed{1}") + [EOS]
    fb = enc(tok, user_turn(FEEDBACK))
    gen = ScriptedGenerator(tok, {0: [("\\boxed{1}", "stop")] * 3})
    gen.engine = types.SimpleNamespace(max_prefill_length=len(item.prompt_ids) + len(c0) + len(fb))  # turn 1 fits
    (traj,) = GroupSampler(MultiTurnMathWorkflow(tok, math_reward, max_turns=3), 1).run(item, make_ctx(gen)).trajectories
    assert traj.metadata["model_turns"] == 2 and traj.metadata["stop_reason"] == "context_limit"
    gen.engine.max_prefill_length = len(item.prompt_ids) - 1
    with pytest.raises(GroupRejected, match="does not fit the engine's max_prefill_length"):
        GroupSampler(MultiTurnMathWorkflow(tok, math_reward), 1).run(item, make_ctx(gen))

    gen = ScriptedGenerator(tok, {0: [("\\boxed{1", "length")] * 3})
    wf = MultiTurnMathWorkflow(tok, math_reward, max_turns=3, stop_on_truncation=True)
    (traj,) = GroupSampler(wf, 1).run(item, make_ctx(gen)).trajectories
    assert (traj.metadata["model_turns"], traj.metadata["stop_reason"], traj.finish_reason) == (1, "truncated", "length")


class Countdown(AgentWorkflow):
    """Custom environment: state from reset, verbatim observation ids, reward per turn."""

    def reset(self, item):
        return {"left": int(item.answer)}

    def step(self, item, state, turn, ctx):
        state["left"] -= 1
        if state["left"] == 0:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(reward=0.5, observation_ids=[7, 8, 9])


class Broken(AgentWorkflow):
    def step(self, item, state, turn, ctx):
        return EnvStep(reward=1.0)  # neither done nor an observation


def test_custom_subclass_and_contract_errors(tok):
    gen = ScriptedGenerator(tok, {0: [("a", "stop")] * 5})
    item = make_item(tok, answer="3")
    (traj,) = GroupSampler(Countdown(tok, max_turns=5, turn_discount=0.5), 1).run(item, make_ctx(gen)).trajectories
    assert traj.reward == 0.5 + 0.25 + 0.25 and traj.metadata["model_turns"] == 3
    P, c = len(item.prompt_ids), len(enc(tok, "a")) + 1
    np.testing.assert_array_equal(traj.tokens[P + c:P + c + 3], [7, 8, 9])
    with pytest.raises(GroupRejected) as e:
        GroupSampler(Broken(tok, max_turns=2), 1).run(item, make_ctx(ScriptedGenerator(tok, {0: [("a", "stop")] * 2})))
    assert e.value.reason == "error:ValueError" and "exactly one of observation" in e.value.detail
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        AgentWorkflow(tok, max_turns=0)
    with pytest.raises(ValueError, match="tool names must be unique"):
        AgentWorkflow(tok, tools=[CalculatorTool(), CalculatorTool()])
    with pytest.raises(TypeError, match="is not a Tool"):
        AgentWorkflow(tok, tools=[object()])


def test_module_docstring_example_runs(tok):
    import textwrap

    from jaxrl_async.rollout import agent

    doc = agent.__doc__
    code = textwrap.dedent(doc[doc.index("    # my_project/guess.py"):doc.index("and select it with")])
    ns = {}
    exec(compile(code, "guess.py", "exec"), ns)
    gen = ScriptedGenerator(tok, {0: [("I guess 5", "stop"), ("maybe 9", "stop"), ("it is 7", "stop")]})
    item = make_item(tok, "Guess my number.", answer="7")
    (traj,) = GroupSampler(ns["GuessNumber"](tok), 1).run(item, make_ctx(gen)).trajectories
    assert traj.reward == pytest.approx(0.9 ** 2) and traj.metadata["model_turns"] == 3
    assert tok.decode(gen.requests[1][2]).endswith(user_turn("Wrong, go higher."))
    assert tok.decode(gen.requests[2][2]).endswith(user_turn("Wrong, go lower."))


# -- real tiny engine: mask, versions and behaviour log-probs vs the trainer's score path --------------
@pytest.fixture(scope="module")
def tiny_generator(tok_dir, tok):
    from jaxrl_async.models import load_hf
    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.generator.orchestrator import Generator
    from jaxrl_async.testing import make_tiny_hf_model

    make_tiny_hf_model(tok_dir, "qwen3", vocab_size=len(tok))
    cfg, params = load_hf(tok_dir)
    engine = build_engine(EngineConfig(max_concurrent_decodes=4, max_sequence_length=192, prefill_buckets=(160,),
                                       page_size=16, num_pages=64), cfg)
    gen = Generator(engine, engine.place_params(params), tokenizer=tok).start()
    yield gen, cfg, params
    gen.stop()


def test_multi_turn_on_real_engine_matches_score_path(tok, tiny_generator):
    from jaxrl_async.cli.score import ScoreItem, score_items

    gen, cfg, params = tiny_generator
    wf = MultiTurnMathWorkflow(tok, lambda *a, **k: 0.0, max_turns=3, turn_discount=0.5)  # never correct
    ctx = EpisodeContext(generator=gen, sampling=SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(EOS,),
                                                                seed=3),
                         reward_executor=cf.ThreadPoolExecutor(2), episode_executor=cf.ThreadPoolExecutor(2),
                         timeout_s=300)
    item = make_item(tok)
    group = GroupSampler(wf, 2).run(item, ctx)
    fb = {True: enc(tok, user_turn(FEEDBACK)), False: enc(tok, user_turn(FEEDBACK, closed=False))}
    P = len(item.prompt_ids)
    for t in group.trajectories:
        assert t.metadata["model_turns"] == 3 and t.reward == 0.0 and t.metadata["stop_reason"] == "max_turns"
        segs = segments(t.loss_mask)
        assert len(segs) == 3 and segs[0][0] == P
        for (a, b), (a2, _) in zip(segs, segs[1:]):  # between two model turns: exactly the feedback turn
            assert 1 <= b - a <= 8
            closed = t.tokens[b - 1] == EOS
            np.testing.assert_array_equal(t.tokens[b:a2], fb[closed])
        assert segs[-1][1] == t.length
        assert (t.versions[t.loss_mask == 1] == 0).all() and (t.versions[t.loss_mask == 0] == -1).all()
        scored = score_items(params, cfg, [ScoreItem(0, t.tokens[:P].tolist(), t.tokens[P:].tolist())])[0][0]
        trained = t.loss_mask[P:] == 1
        np.testing.assert_allclose(t.logprobs[P:][trained], np.asarray(scored)[trained], rtol=0, atol=1e-5)
    a, b = group.trajectories
    assert a.tokens.tolist() != b.tokens.tolist()  # two samples, two seeds
