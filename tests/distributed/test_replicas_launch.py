"""Two generator replicas through the localhost launcher, one killed mid-run (issue 26 items 2-3).

``test_killed_replica_is_restarted_and_rejoins_and_every_prompt_is_trained_once``: the tiny run with
``--generators 2``; after the first training step the test SIGKILLs generator-1's process (by pid). The
controller re-queues its in-flight requests to generator-0, the launcher restarts the process, it rejoins
(newest weights before it serves) and serves again. Checked from the run's own records: exit 0, every
step trained, no prompt trained twice and none lost (ledger: trained + rejected + outstanding = every
draw), lag <= eta for every trained group (ledger and ``staleness/max`` in the metrics), the failure
counted (``generator/replica_failures``, ``generator/recovery_s``), generator-1 back in service with
requests after its restart, and both replicas got requests before the kill (routing by load).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from jaxrl_async.data.ledger import read_data_ledger
from role_procs import role_env  # tests/distributed

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(os.path.dirname(HERE), "loop", "tiny_config.py")
ETA = 2
STEPS = 60


def _rows(run) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def test_killed_replica_is_restarted_and_rejoins_and_every_prompt_is_trained_once(tmp_path):
    run, log_path = tmp_path / "run", tmp_path / "launch.log"
    env = role_env(tmp_path / "jax_cache")
    cmd = [sys.executable, "-m", "jaxrl_async.distributed.launch", "--generators", "2", "--trainer-cpu-devices", "2",
           "--generator-cpu-devices", "1", "--grace", "30", "--restart-backoff", "0.5", "--heartbeat-timeout", "30",
           "--replica-timeout", "120", "--config", TINY, f"run_dir={run}", f"trainer.total_steps={STEPS}",
           f"rollout.max_head_offpolicyness={ETA}", "checkpoint.every_steps=null",
           "rollout.reward=loop_targets:has_digit_slow"]  # ~0.4 s per step: the run outlasts the restart
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        pid = None
        while pid is None or not any("train/loss" in r for r in _rows(run)):
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "no training step / generator-1 never registered"
            m = re.search(r"\[generator-1\] \[generator-1 pid (\d+)\] registered", log_path.read_text())
            pid = int(m.group(1)) if m else None
            time.sleep(0.3)
        step_at_kill = max(r["step"] for r in _rows(run) if "train/loss" in r)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        rc = proc.wait(400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert rc == 0, log[-5000:]
    print(f"run {time.monotonic() - t0:.0f} s, killed generator-1 after step {step_at_kill}, "
          f"{time.monotonic() - t_kill:.0f} s from the kill to the end")

    # the launcher restarted it, the controller re-admitted it
    assert re.search(rf"\[launch\] generator-1 \(pid {pid}\) exited with status -9; restarting it", log), log[-4000:]
    assert "[launch] generator-1 restarted (pid" in log, log[-4000:]
    assert re.search(r"generator replica .*generator-1 \(pid \d+ on [^)]*\) back in service", log), log[-4000:]

    # every prompt trained exactly once, none lost
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "completed" and summary["steps"] == STEPS, summary
    h = read_data_ledger(str(run))
    consumes = h.events("consume")
    assert [e["step"] for e in consumes] == list(range(1, STEPS + 1))
    trained = [d for e in consumes for d in e["draws"]]
    assert len(trained) == len(set(trained)) == 4 * STEPS, "a prompt was trained twice"
    rejected = [e["draw"] for e in h.events("reject")]
    outstanding = summary["data"]["outstanding_draws"]
    assert sorted(trained + rejected + outstanding) == list(range(summary["data"]["next_draw"])), \
        "a prompt was skipped or duplicated"
    lags = [lag for e in consumes for lag in e["lags"]]
    assert max(lags) <= ETA, lags

    # metrics: staleness, the failure, the recovery, generator-1 serving again
    rows = [r for r in _rows(run) if "train/loss" in r]
    assert len(rows) == STEPS and max(r["staleness/max"] for r in rows) <= ETA
    last = rows[-1]
    assert last["generator/replica_failures"] >= 1 and last["generator/1/failures"] >= 1, last
    assert last["generator/1/rejoins"] >= 1 and last["generator/1/requests_since_join"] > 0, last
    assert last["generator/1/live"] == 1 and last["generator/replicas_live"] == 2, last
    assert 0 < last["generator/recovery_s"] < 120, last
    first = rows[0]
    assert first["generator/0/requests"] > 0 and first["generator/1/requests"] > 0, first  # both routed to
    print({k: v for k, v in last.items() if k.startswith("generator/")})
