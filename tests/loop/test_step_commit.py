"""The step as a unit (``loop.step.StepRunner``): state, policy version, ledger and step advance together,
so a failure after the update (a failed push) can never save one without the other (issue 24, Found 1).

* ``test_push_failure_after_the_update_trains_every_prompt_once``: a real eta = 0 run whose weight push of
  version 3 fails (the generator role's pusher raises ``WeightPushError``, as when a generator timed out
  or died) stops with an emergency checkpoint of step 3 holding step 3's data as consumed; the rerun
  resumes there and trains to 4. Every prompt is trained exactly once (ledger), in the same batches as an
  uninterrupted run, and the final weights and optimizer state equal the uninterrupted run's bit for bit.
* ``test_a_failed_update_consumes_nothing``: a train call that raises leaves step, version and ledger as
  they were (its batch stays outstanding and is replayed after a resume).
"""
import os
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_rl_loop import tiny_run_config  # noqa: E402

from jaxrl_async.checkpoint import HOST, Checkpointer, NonFiniteTracker  # noqa: E402
from jaxrl_async.data.ledger import read_data_ledger  # noqa: E402
from jaxrl_async.loop import RLRun  # noqa: E402
from jaxrl_async.loop.services import LocalGenerators, LocalServices  # noqa: E402
from jaxrl_async.loop.step import FatalRunError, StepRunner  # noqa: E402
from jaxrl_async.generator.weight_sync import WeightPushError  # noqa: E402


class _FailingPusher:
    """The real pusher, except that the push of ``fail_version`` raises (after nothing was sent)."""

    def __init__(self, inner, fail_version):
        self.inner, self.fail_version = inner, fail_version

    def push(self, params, version):
        if version == self.fail_version:
            raise WeightPushError(f"injected: generator did not apply version {version}")
        return self.inner.push(params, version)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _FailingPushServices(LocalServices):
    def __init__(self, fail_version):
        self.fail_version = fail_version

    def generators(self, setup, control):
        role = LocalGenerators(setup, control.say)
        make = role.pusher
        role.pusher = lambda *a, **k: _FailingPusher(make(*a, **k), self.fail_version)
        return role


def _state(run_dir, step):
    import jax

    r = Checkpointer(run_dir, read_only=True).restore(step, targets={"params": HOST, "opt_state": HOST})
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree_util.tree_flatten_with_path(r.arrays)[0]]


def test_push_failure_after_the_update_trains_every_prompt_once(tmp_path):
    common = {"checkpoint.every_steps": "None"}
    whole = RLRun(tiny_run_config(tmp_path / "whole", eta=0, steps=4, **common)).run()
    assert whole.stopped_by == "completed" and whole.steps == 4
    run = tmp_path / "failed"
    with pytest.raises(FatalRunError, match="injected") as info:  # one line for the user: "run failed: ..."
        RLRun(tiny_run_config(run, eta=0, steps=4, **common), _FailingPushServices(fail_version=3)).run()
    assert isinstance(info.value.__cause__, WeightPushError)
    ck = Checkpointer(str(run), read_only=True)
    assert ck.all_steps() == [3]
    meta = ck.read_meta(3)
    assert meta["extra"]["why"] == "emergency" and meta["step"] == meta["policy_version"] == 3
    led = read_data_ledger(str(run))
    assert [e["step"] for e in led.events("consume")] == [1, 2, 3]  # step 3's batch: trained AND consumed
    resumed = RLRun(tiny_run_config(run, eta=0, steps=4, **common)).run()
    assert resumed.stopped_by == "completed" and resumed.steps == 4
    # every prompt trained exactly once, in the uninterrupted run's batches, all on-policy
    events = [[(e["step"], e["draws"], e["lags"]) for e in read_data_ledger(d).events("consume")]
              for d in (str(tmp_path / "whole"), str(run))]
    assert events[0] == events[1] and [s for s, _, _ in events[1]] == [1, 2, 3, 4]
    draws = [d for _, ds, _ in events[1] for d in ds]
    assert len(draws) == len(set(draws)) == 4 * 4
    assert all(lag == 0 for _, _, lags in events[1] for lag in lags)
    a, b = _state(str(tmp_path / "whole"), 4), _state(str(run), 4)
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k
    mid = dict(_state(str(run), 3))  # not vacuous: step 4 moved the parameters
    assert any(not np.array_equal(mid[k], x) for k, x in a if k.startswith("['params']"))


def test_a_failed_update_consumes_nothing():
    class Trainer:
        def train(self, trajectories, policy_version):
            raise RuntimeError("device lost")

    class Ledger:
        consumed_calls = []

        def draw_index(self, ticket):
            return ticket.id

        def consumed(self, *a, **k):
            self.consumed_calls.append((a, k))

    from jaxrl_async.rl.advantages import AdvantageConfig
    from jaxrl_async.rollout.workflow import Trajectory, TrajectoryGroup

    t = Trajectory(tokens=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0], reward=1.0,
                   prompt_len=1)
    group = types.SimpleNamespace(ticket=types.SimpleNamespace(id=0), lag=0,
                                  item=TrajectoryGroup(None, [t, t], 0, {}), head_version=0)
    ledger = Ledger()
    runner = StepRunner(Trainer(), ledger, NonFiniteTracker(), advantage=AdvantageConfig(preset="grpo"), n_samples=2,
                        step=5, version=5)
    with pytest.raises(RuntimeError, match="device lost"):
        runner.run([group])
    assert (runner.step, runner.version, ledger.consumed_calls) == (5, 5, [])
