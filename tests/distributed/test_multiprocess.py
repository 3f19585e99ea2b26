"""Multi-process run on localhost: controller+trainer process and a generator process, each with its
own simulated CPU devices (tests/loop/tiny_config.py's tiny run).

Two scenarios:
* the generator process is killed with SIGKILL mid-run: the controller stops with an error naming
  it (name and pid), within a bounded time, instead of hanging;
* (slow; tests/distributed/test_trainer_group.py runs the same path with a 2-process trainer in CI)
  a short async run completes; every weight push crossed processes through jax.experimental.transfer
  with matching per-leaf checksums on both sides, except version 2 whose pull is corrupted on purpose
  (fault injection) and goes through the disk fallback; lag <= eta for every trained group.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxrl_async.distributed.launch import reserve_port
from jaxrl_async.data.ledger import read_data_ledger
from role_procs import kill_all, role_env, wait_or_kill  # tests/distributed

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(os.path.dirname(HERE), "loop", "tiny_config.py")
ETA = 2


def _start(run_dir, log_dir, steps, extra_gen=(), extra_cfg=()):
    port, env = reserve_port(), role_env(log_dir.parent / "jax_cache")
    addr = f"127.0.0.1:{port}"
    ctrl_log, gen_log = open(log_dir / "controller.log", "wb"), open(log_dir / "generator.log", "wb")
    ctrl = subprocess.Popen([sys.executable, "-m", "jaxrl_async.distributed.controller", "--listen", addr,
                             "--listen-reuse-port", "--generator-devices", "1", "--cpu-devices", "2", "--accept-timeout", "120",
                             "--heartbeat-timeout", "30", "--replica-timeout", "5", "--config", TINY, f"run_dir={run_dir}",
                             f"trainer.total_steps={steps}", f"rollout.max_head_offpolicyness={ETA}",
                             "checkpoint.every_steps=null", *extra_cfg],
                            env=env, stdout=ctrl_log, stderr=subprocess.STDOUT)
    gen = subprocess.Popen([sys.executable, "-m", "jaxrl_async.distributed.generator_role", "--controller", addr,
                            "--name", "generator-0", "--cpu-devices", "1", *extra_gen],
                           env=env, stdout=gen_log, stderr=subprocess.STDOUT)
    return ctrl, gen


def test_killed_generator_process_stops_the_controller_with_its_name(tmp_path):
    run_b = tmp_path / "run"
    ctrl_b, gen_b = _start(run_b, tmp_path, steps=50)
    try:
        # kill -9 the generator once the trainer has finished a step
        deadline = time.monotonic() + 240
        metrics = run_b / "metrics.jsonl"
        while not (metrics.exists() and "train/loss" in metrics.read_text()):
            assert time.monotonic() < deadline, "the run made no training step"
            assert ctrl_b.poll() is None, (tmp_path / "controller.log").read_text()
            time.sleep(0.5)
        os.kill(gen_b.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        rc_b = wait_or_kill(ctrl_b, 120)
        stop_s = time.monotonic() - t_kill
    finally:
        kill_all([ctrl_b, gen_b])
    log_b = (tmp_path / "controller.log").read_text()
    # clear error naming it, no hang
    assert rc_b == 1, log_b[-3000:]
    assert re.search(rf"run failed: .*generator-0 \(pid {gen_b.pid} on [^)]*\) closed the connection", log_b), \
        log_b[-3000:]
    assert stop_s < 90, stop_s


@pytest.mark.slow  # the same path with a 2-process trainer is in CI: test_trainer_group.py
def test_controller_trainer_and_generator_processes_complete_run(tmp_path):
    run_a = tmp_path / "run"
    ctrl_a, gen_a = _start(run_a, tmp_path, steps=3, extra_gen=("--inject-corrupt-pull", "2"))
    try:
        rc_a = wait_or_kill(ctrl_a, 240)
        wait_or_kill(gen_a, 60)
    finally:
        kill_all([ctrl_a, gen_a])
    log_a = (tmp_path / "controller.log").read_text()

    # --- A: completed, pushes crossed processes via the transfer API, checksums agree -------------
    assert rc_a == 0, log_a[-3000:]
    summary = json.loads((run_a / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["stopped_by"] == "completed"
    assert summary["counts"]["balanced"], summary["counts"]
    pushes = [json.loads(line) for line in (run_a / "weight_push.jsonl").read_text().splitlines()]
    by_version = {p["version"]: p for p in pushes}
    assert 0 in by_version and max(by_version) == 3, sorted(by_version)
    for v, p in by_version.items():
        g = p["generators"][0]
        assert g["checksums_match"], p  # the generator's checksum of what it uses == the trainer's
        assert len(p["checksums"]) == g["shards"] or g["transport"] == "disk"
        if v == 2:  # corrupted after the pull on purpose: caught by the checksum, recovered from disk
            assert p["transport"] == "disk" and g["transport"] == "disk", p
            assert "ChecksumMismatch" in p["fallback_reason"] and "generator-0 (pid" in p["fallback_reason"]
        else:
            assert p["transport"] == "transfer" and g["transport"] == "jax.experimental.transfer", p
            assert g["pull_s"] is not None and g["shards"] >= len(p["checksums"])
    assert 2 in by_version, "the fault-injected version was skipped (newest wins); the fallback was not exercised"
    assert not any(n.startswith("v") for n in os.listdir(run_a / "weight_push")), "fallback files left behind"
    # staleness bound per trained group
    consumes = read_data_ledger(str(run_a)).events("consume")
    lags = [lag for e in consumes for lag in e["lags"]]
    assert len(lags) == 3 * 4 and max(lags) <= ETA, lags
