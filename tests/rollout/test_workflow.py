"""Workflow API: trajectories, RLVR workflow, group sampling, failure isolation, the dispatcher."""
import dataclasses
import threading
import time

import numpy as np
import pytest

from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.rollout.staleness import StalenessManager
from jaxrl_async.rollout.workflow import (
    EpisodeContext, GroupRejected, GroupSampler, RLVRWorkflow, RolloutDispatcher, RolloutWorkflow, Trajectory,
    TrajectoryGroup, derive_seed,
)
import concurrent.futures as cf

from fakes import DoneHandle, request, sample


class FakeGenerator:
    """Deterministic completions: sample i of a request with seed s -> [s % 50 + 10 + i, 2]."""

    def __init__(self, version=0, never=False):
        self.version, self.never = version, never
        self.requests, self.handles = [], []
        self.lock = threading.Lock()

    def submit(self, prompt_ids, sampling=None, request_id=None, metadata=None):
        with self.lock:
            self.requests.append((list(prompt_ids), sampling, request_id))
        samples = [sample(i, list(prompt_ids), [sampling.seed % 50 + 10 + i, 2], [-0.5, -0.25],
                          [self.version, self.version], "stop") for i in range(sampling.n)]
        h = DoneHandle(request(samples), never=self.never)
        self.handles.append(h)
        return h


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 2))


@dataclasses.dataclass
class Item:
    id: str
    prompt_ids: list
    prompt: str = "p"
    answer: str = "12"
    metadata: dict = dataclasses.field(default_factory=dict)


def make_ctx(gen, **kw):
    return EpisodeContext(generator=gen, sampling=SamplingParams(max_new_tokens=4, seed=7),
                          reward_executor=cf.ThreadPoolExecutor(2, thread_name_prefix="reward"),
                          episode_executor=cf.ThreadPoolExecutor(4, thread_name_prefix="episode"), **kw)


# --------------------------------------------------------------------------------------------
def test_trajectory_from_completion_layout():
    t = Trajectory.from_completion([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], [3, 3, 4], 1.0, "stop", sample_index=2)
    np.testing.assert_array_equal(t.tokens, [5, 6, 7, 8, 9])
    np.testing.assert_array_equal(t.loss_mask, [0, 0, 1, 1, 1])
    np.testing.assert_allclose(t.logprobs, [0, 0, -0.1, -0.2, -0.3])
    np.testing.assert_array_equal(t.versions, [-1, -1, 3, 3, 4])
    assert (t.head_version, t.num_generated, t.finish_reason, t.metadata["sample_index"]) == (3, 3, "stop", 2)
    np.testing.assert_array_equal(t.completion_ids, [7, 8, 9])


@pytest.mark.parametrize("kw, match", [
    (dict(loss_mask=[1, 0, 1]), "loss_mask must be 0 on the prompt"),
    (dict(versions=[-1, -1]), "versions has length 2"),
    (dict(versions=[-1, -1, -1]), "versions must be >= 0 on trained"),
    (dict(reward=float("nan")), "reward must be finite"),
    (dict(prompt_len=0), "prompt_len must be in"),
])
def test_trajectory_validation(kw, match):
    base = dict(tokens=[1, 2, 3], loss_mask=[0, 0, 1], logprobs=[0, 0, -1], versions=[-1, -1, 0], reward=0.0,
                prompt_len=2)
    with pytest.raises(ValueError, match=match):
        Trajectory(**{**base, **kw})


def test_trajectory_from_turns():
    s1 = sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 1], "stop")
    s2 = sample(0, [1, 2, 3, 4, 9, 9], [5], [-0.3], [2], "length")
    t = Trajectory.from_turns([1, 2], [s1, ([9, 9], False), s2], reward=1.0)
    np.testing.assert_array_equal(t.tokens, [1, 2, 3, 4, 9, 9, 5])
    np.testing.assert_array_equal(t.loss_mask, [0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(t.versions, [-1, -1, 0, 1, -1, -1, 2])
    assert (t.head_version, t.finish_reason, t.metadata["num_turns"]) == (0, "length", 3)
    with pytest.raises(ValueError, match="do not equal the tokens so far"):
        Trajectory.from_turns([1, 2], [s1, s1], reward=0.0)


def test_rlvr_one_request_per_group_rewards_off_thread():
    gen = FakeGenerator(version=3)
    threads = []

    def reward(prompt, completion, answer, **meta):
        threads.append(threading.current_thread().name)
        return float(completion.split()[0] == answer) + (0.5 if meta.get("extra") else 0)

    wf = RLVRWorkflow(reward, tokenizer=Tok())
    ctx = make_ctx(gen, group_id=4)
    item = Item("a", [1, 2, 3], metadata={"extra": True, "answer": "ignored"})
    out = GroupSampler(wf, 3).run(item, ctx)
    assert len(gen.requests) == 1 and gen.requests[0][1].n == 3  # one n-sample request
    seed = ctx.sampling.seed
    firsts = [seed % 50 + 10 + i for i in range(3)]
    exp = [float(str(f) == "12") + 0.5 for f in firsts]
    np.testing.assert_allclose(out.rewards, exp)
    assert out.head_version == 3 and out.group_id == 4
    assert all(n.startswith("reward") for n in threads) and len(threads) == 3
    assert out.trajectories[1].metadata["completion_text"] == str(firsts[1])


class EchoWorkflow(RolloutWorkflow):
    """Custom workflow: one request per episode, reward = first token id."""

    def __init__(self):
        self.threads = set()

    def run_episode(self, item, ctx):
        self.threads.add(threading.current_thread().name)
        s = ctx.generate(item.prompt_ids)[0]
        return Trajectory.from_completion(s.prompt_ids, s.completion_ids, s.logprobs, s.versions,
                                          ctx.reward(lambda x: float(x), s.completion_ids[0]), s.finish_reason)


def test_custom_workflow_n_episodes_with_own_seeds():
    gen = FakeGenerator()
    wf = EchoWorkflow()
    ctx = make_ctx(gen)
    group = GroupSampler(wf, 4).run(Item("b", [1]), ctx)
    seeds = [req[1].seed for req in gen.requests]
    assert sorted(seeds) == sorted(derive_seed(7, i) for i in range(4)) and len(set(seeds)) == 4
    assert all(req[1].n == 1 for req in gen.requests)
    assert sorted(group.rewards.tolist()) == sorted(float(s % 50 + 10) for s in seeds)
    assert all(n.startswith("episode") for n in wf.threads)


class Flaky(RolloutWorkflow):
    def __init__(self, mode):
        self.mode = mode

    def run_episode(self, item, ctx):
        if self.mode == "raise":
            raise ValueError("boom")
        if self.mode == "none" and ctx.sample_index == 1:
            return None
        if self.mode == "bad":
            return {"not": "a trajectory"}
        if self.mode == "slow":
            ctx.generate(item.prompt_ids)
        return Trajectory.from_completion([1], [2], [-1.0], [0], float(ctx.sample_index), "stop")


@pytest.mark.parametrize("mode, kw, reason", [
    ("raise", {}, "error:ValueError"),
    ("none", {}, "episode_none"),
    ("bad", {}, "invalid_trajectory"),
    ("ok", dict(should_accept=lambda g: g.rewards.std() == 0), "filtered"),
])
def test_group_rejections(mode, kw, reason):
    with pytest.raises(GroupRejected) as e:
        GroupSampler(Flaky(mode), 3, **kw).run(Item("c", [1]), make_ctx(FakeGenerator()))
    assert e.value.reason == reason


def test_partial_group_and_timeout_abort():
    g = GroupSampler(Flaky("none"), 3, allow_partial=True).run(Item("c", [1]), make_ctx(FakeGenerator()))
    assert g.rewards.tolist() == [0.0, 2.0] and g.metadata["dropped_episodes"] == 1
    gen = FakeGenerator(never=True)
    with pytest.raises(GroupRejected) as e:
        GroupSampler(Flaky("slow"), 2).run(Item("d", [1]), make_ctx(gen, timeout_s=0.01))
    assert e.value.reason == "timeout" and all(h.aborted for h in gen.handles)


class ByItem(RolloutWorkflow):
    """Fails deterministically by item: raises for i % 5 == 0, returns None for i % 7 == 0."""

    def run_episode(self, item, ctx):
        i = item["i"]
        if i % 5 == 0:
            raise RuntimeError(f"item {i}")
        if i % 7 == 0:
            return None
        time.sleep(0.001 * (i % 3))
        s = ctx.generate(item["prompt_ids"])[0]
        return Trajectory.from_completion(s.prompt_ids, s.completion_ids, s.logprobs, s.versions, i, "stop")


def test_dispatcher_accounting_and_failures_never_kill_the_loop():
    gen = FakeGenerator()
    m = StalenessManager(1, batch_size=2, max_concurrent=4)
    data = iter([{"i": i, "prompt_ids": [1, i]} for i in range(1, 1000)])
    d = RolloutDispatcher(ByItem(), gen, m, data, n_samples=2, sampling=SamplingParams(max_new_tokens=4)).start()
    consumed = []
    try:
        for k in range(6):
            batch = m.get_batch(k, timeout=10)
            consumed += [g.item.item["i"] for g in batch]
            assert all(isinstance(g.item, TrajectoryGroup) and len(g.item.trajectories) == 2 for g in batch)
            gen.version = k + 1
            m.set_version(k + 1)
        assert d.fatal_error is None
    finally:
        d.stop(timeout=5)
    c = m.counts()
    assert c.balanced() and c.running == 0 and c.consumed == 12
    assert all(i % 5 and i % 7 for i in consumed) and len(set(consumed)) == 12
    fails = d.failure_counts()
    assert set(fails) <= {"error:RuntimeError", "episode_none"} and fails["error:RuntimeError"] >= 2
    assert c.rejected_by_reason.get("error:RuntimeError") == fails["error:RuntimeError"]
    assert "item 5" in " ".join(d.recent_errors) or "item 10" in " ".join(d.recent_errors)


def test_dispatcher_fatal_after_consecutive_failures_and_data_exhaustion():
    m = StalenessManager(0, batch_size=2)
    d = RolloutDispatcher(Flaky("raise"), FakeGenerator(), m, iter([Item(str(i), [1]) for i in range(50)]),
                          n_samples=1, max_consecutive_failures=5).start()
    deadline = time.time() + 5
    while d.fatal_error is None and time.time() < deadline:
        time.sleep(0.01)
    d.stop(timeout=5)
    assert "5 consecutive failed groups" in str(d.fatal_error)
    assert m.counts().balanced() and m.counts().running == 0

    m2 = StalenessManager(4, batch_size=1)
    d2 = RolloutDispatcher(Flaky("ok"), FakeGenerator(), m2, iter([Item("x", [1])]), n_samples=1).start()
    assert m2.get_batch(0, timeout=5)[0].item.item.id == "x"
    deadline = time.time() + 5
    while not d2.data_exhausted and time.time() < deadline:
        time.sleep(0.01)
    d2.stop(timeout=5)
    c = m2.counts()
    assert d2.data_exhausted and c.rejected_by_reason == {"data_exhausted": 1} and c.balanced()
