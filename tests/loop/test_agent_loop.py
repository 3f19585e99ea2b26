"""``rollout.workflow=openai_agent`` in the real RL loop (tiny model, real engine, trainer, checkpoints): an agent
written with the ``openai`` SDK (``loop_targets.two_turn_agent``, two calls per episode through the run's agent
endpoint) trains end to end with per-turn samples; and a run killed with SIGKILL resumes without losing or
duplicating an episode (the data ledger's audit of ``test_fault_tolerance``)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_fault_tolerance import START_TIMEOUT_S, Attempt, _audit, _committed
from test_rl_loop import _check_accounting, _rows, tiny_run_config

from jaxrl_async.loop import RLRun

AGENT = {"rollout.workflow": "openai_agent", "rollout.agent": "loop_targets:two_turn_agent",
         "rollout.engine.max_sequence_length": 96, "rollout.engine.max_prefill_length": 80,
         "trainer.packing.row_len_buckets": "(128,)", "model.max_position_embeddings": 128}


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def test_openai_agent_workflow_trains_in_the_async_loop(tmp_path):
    cfg = tiny_run_config(tmp_path / "run", eta=1, steps=2, **AGENT)
    res = RLRun(cfg).run()
    assert res.stopped_by == "completed" and res.steps == 2
    _check_accounting(res, B=4)
    rows = [r for r in _rows(res.run_dir) if "train/loss" in r]
    assert len(rows) == 2 and all(np.isfinite(r["train/grad_norm"]) for r in rows)
    for r in rows:  # 4 groups x 4 episodes x 2 calls: two per-turn samples per episode
        assert r["agent/episodes"] == 16 and r["agent/turns_mean"] == 2 and r["agent/samples_per_episode"] == 2, r
        assert r["agent/stitch_fallbacks"] == 0 and r["agent/stitched_episodes"] == 0


def test_openai_agent_run_resumes_after_sigkill_without_losing_or_repeating_an_episode(tmp_path, jax_cache):
    run = str(tmp_path / "run")
    T = 5
    args = [f"trainer.total_steps={T}", "checkpoint.every_steps=1", *(f"{k}={v}" for k, v in AGENT.items())]
    a = Attempt(run, args, jax_cache, "a1_kill")
    a.wait_for(lambda: len(a.trained_steps()) >= 2 and len(_committed(run)) >= 1, "2 trained steps", START_TIMEOUT_S,
               poll_s=0.02)
    a.kill9()
    resume_from = _committed(run)[-1]
    b = Attempt(run, args, jax_cache, "a2_resume")
    if b.wait(START_TIMEOUT_S + 120) != 0:
        b.fail(f"exit code {b.proc.returncode}")
    _audit(run, T, [2, 2], [resume_from])
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl")) if x.strip()]
    assert all(r["agent/turns_mean"] == 2 for r in rows if "train/loss" in r)
