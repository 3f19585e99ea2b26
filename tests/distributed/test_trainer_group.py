"""A trainer that spans several processes (jax.distributed SPMD group; distributed/trainer_group.py).

* ``test_group_updates_equal_single_process``: 3 RL batches (2 minibatches each, the batch rows
  sharded over the processes) on a trainer mesh fsdp=2 made of 2 processes x 1 CPU device give
  bit-identical losses and parameters to the same mesh in one process with 2 devices.
* ``test_two_trainer_processes_kill_and_resume``: the tiny async run with the controller, a second
  trainer process and generator processes (started as a user would, each its own simulated CPU
  device). Run 1: once a periodic checkpoint is committed, the second trainer process is killed
  with SIGKILL: the controller stops within a bounded time with an error naming it. Run 2 (the same
  command; the group formed by jax.distributed's SLURM auto-detection, ``--jax-distributed`` with the
  variables srun sets, on localhost; two generator replicas): every process restores the same step,
  trains to the end, saves and exports. Every weight push of run 2 was pulled by both generators
  from the transfer servers of BOTH trainer processes (each serving the shards it owns) with
  matching checksums, except generator-0's first pull after the initial one, corrupted after the
  pull on purpose and recovered from the disk fallback that both trainer processes wrote their
  shards to; both generators served rollouts; lag <= eta for every group.
* ``test_sigterm_to_every_trainer_process_checkpoints_and_resumes`` (slow): SIGTERM to both trainer
  processes at once (a SLURM preemption): the follower waits for process 0, which finishes the step,
  saves on both processes and ends the group: every process exits 0; the same command resumes.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl_async.distributed.launch import reserve_port
from jaxrl_async.data.ledger import read_data_ledger
from role_procs import kill_all, role_env, wait_or_kill  # tests/distributed

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(os.path.dirname(HERE), "loop", "tiny_config.py")
WORKER = os.path.join(HERE, "group_step_worker.py")
ETA = 2


def test_group_updates_equal_single_process(tmp_path):
    env = role_env()
    single, group = tmp_path / "single.npz", tmp_path / "group.npz"
    coord = f"127.0.0.1:{reserve_port()}"
    procs = [subprocess.Popen([sys.executable, WORKER, str(group), "--coordinator", coord, "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    try:
        out = subprocess.run([sys.executable, WORKER, str(single), "--single"], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        for p in procs:
            assert wait_or_kill(p, 300) == 0, p.stdout.read().decode(errors="replace")[-3000:]
    finally:
        kill_all(procs)
    s, g = np.load(single), np.load(group)
    assert len(s["losses"]) == 6 and np.isfinite(s["losses"]).all()
    np.testing.assert_array_equal(g["losses"], s["losses"])
    keys = [k for k in s.files if k.startswith("p")]
    assert keys and sorted(keys) == sorted(k for k in g.files if k.startswith("p"))
    for k in keys:
        np.testing.assert_array_equal(g[k], s[k], err_msg=k)  # bit for bit


def _slurm_job_id() -> int:
    """A job id whose jax.distributed SLURM coordinator port (61440 + id % 4096) is free here."""
    for job in range(int(secrets.randbelow(4096)), 8192):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job % 4096))
                return job
            except OSError:
                continue
    raise RuntimeError("no free port in 61440-65535")


def _start_roles(run_dir, log_dir, tag, steps, extra_gen=(), slurm=False, generators=1):
    """The controller (trainer process 0), trainer process 1 and the generators, as separate processes
    (``extra_gen`` goes to generator-0 only).
    The trainer group forms with an explicit coordinator, or (``slurm``) by jax.distributed's
    auto-detection from the variables srun sets (``--jax-distributed``)."""
    env = role_env(log_dir / "jax_cache")
    addr = f"127.0.0.1:{reserve_port()}"
    common = ["--listen", addr, "--listen-reuse-port", "--generators", str(generators), "--generator-devices", "1",
              "--cpu-devices", "1",
              "--accept-timeout", "120",
              "--heartbeat-timeout", "30", "--jax-heartbeat-timeout", "20"]
    job, coord = _slurm_job_id(), f"127.0.0.1:{reserve_port()}"
    cfg = ["--config", TINY, f"run_dir={run_dir}", f"trainer.total_steps={steps}",
           f"rollout.max_head_offpolicyness={ETA}", "checkpoint.every_steps=2", "checkpoint.export_hf=true"]
    procs = {}
    for i in range(2):
        group = (["--jax-distributed"] if slurm else
                 ["--coordinator", coord, "--num-processes", "2", "--process-id", str(i)])
        e = dict(env, SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                 SLURM_PROCID=str(i), SLURM_LOCALID=str(i)) if slurm else env
        log = open(log_dir / f"{tag}-trainer{i}.log", "wb")
        procs[f"trainer{i}"] = subprocess.Popen([sys.executable, "-m", "jaxrl_async.distributed.controller", *common,
                                                 *group, *cfg], env=e, stdout=log, stderr=subprocess.STDOUT)
    for k in range(generators):
        name = "generator" if k == 0 else f"generator{k}"
        log = open(log_dir / f"{tag}-{name}.log", "wb")
        procs[name] = subprocess.Popen([sys.executable, "-m", "jaxrl_async.distributed.generator_role",
                                        "--controller", addr, "--name", f"generator-{k}", "--cpu-devices", "1",
                                        *(extra_gen if k == 0 else ())], env=env, stdout=log, stderr=subprocess.STDOUT)
    return procs


def _committed(run) -> list[int]:
    d = run / "checkpoints"
    return sorted(int(n) for n in os.listdir(d) if n.isdigit() and (d / n / "commit_success.txt").exists()) \
        if d.is_dir() else []


def _wait_for_checkpoint(run, after, procs, read_log):
    deadline = time.monotonic() + 300
    while not any(s > after for s in _committed(run)):
        assert time.monotonic() < deadline, "no new checkpoint\n" + read_log()[-3000:]
        assert procs["trainer0"].poll() is None, read_log()[-3000:]
        time.sleep(0.3)


def _log_reader(logs):
    return lambda tag, name: (logs / f"{tag}-{name}.log").read_text(errors="replace")


def _start_until_checkpoint(run, logs, read):
    """Run 1 of a long run (30 steps): its role processes once a checkpoint after step 1 is committed."""
    procs = _start_roles(run, logs, "run1", steps=30)
    try:
        _wait_for_checkpoint(run, 1, procs, lambda: read("run1", "trainer0"))
    except BaseException:
        kill_all(procs.values())
        raise
    return procs


def test_two_trainer_processes_kill_and_resume(tmp_path):
    run, logs, read = tmp_path / "run", tmp_path, _log_reader(tmp_path)
    # --- run 1: SIGKILL trainer process 1 once a checkpoint is committed ---------------------------
    p1 = _start_until_checkpoint(run, logs, read)
    try:
        victim = p1["trainer1"].pid
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        rc1 = wait_or_kill(p1["trainer0"], 150)
        stop_s = time.monotonic() - t_kill
        wait_or_kill(p1["generator"], 60)
    finally:
        kill_all(p1.values())
    log1 = read("run1", "trainer0")
    assert rc1 == 1, log1[-3000:]
    assert re.search(rf"run failed: trainer process trainer-1 \(pid {victim} on [^)]*\) lost", log1), log1[-3000:]
    assert stop_s < 90, stop_s

    # --- run 2: the same command (group by SLURM auto-detection) resumes and completes ------------
    start = _committed(run)[-1]
    assert start >= 2
    end = start + 3
    p2 = _start_roles(run, logs, "run2", steps=end, extra_gen=("--inject-corrupt-pull", str(start + 1)), slurm=True,
                      generators=2)
    try:
        rc2 = wait_or_kill(p2["trainer0"], 300)
        rc2b = wait_or_kill(p2["trainer1"], 60)
        rc2g = [wait_or_kill(p2[g], 60) for g in ("generator", "generator1")]
    finally:
        kill_all(p2.values())
    log2 = read("run2", "trainer0")
    assert rc2 == 0 and rc2b == 0 and rc2g == [0, 0], log2[-3000:] + read("run2", "trainer1")[-2000:]
    assert f"resumed from {run}/checkpoints/{start}: step {start}" in log2, log2[-3000:]
    assert "trainer group: 2 processes" in log2 and "in 2 process(es)" in log2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == end and summary["stopped_by"] == "completed", summary
    assert summary["counts"]["balanced"], summary["counts"]
    assert (run / "hf" / "model.safetensors").is_file() and end in _committed(run)
    pushes = [json.loads(line) for line in (run / "weight_push.jsonl").read_text().splitlines()]
    by_version = {p["version"]: p for p in pushes[-(end - start + 1):]}  # run 2's pushes
    assert sorted(by_version) == list(range(start, end + 1)), sorted(by_version)
    for v, p in by_version.items():
        gens = {g["name"].split(" ")[0]: g for g in p["generators"]}
        assert sorted(gens) == ["generator-0", "generator-1"], p
        assert all(g["checksums_match"] for g in p["generators"]), p
        assert p["trainer_processes"] == 2, p
        g0, g1 = gens["generator-0"], gens["generator-1"]
        assert g1["transport"] == "jax.experimental.transfer" and g1["sources"] == 2, p  # from both trainers
        if v == start + 1:  # generator-0's pull corrupted on purpose: recovered from both processes' disk shards
            assert p["transport"] == "disk" and g0["transport"] == "disk", p
            assert "ChecksumMismatch" in p["fallback_reason"] and "generator-0" in p["fallback_reason"], p
        else:
            assert p["transport"] == "transfer" and g0["transport"] == "jax.experimental.transfer", p
            assert g0["sources"] == 2, p
    assert not any(n.startswith("v") for n in os.listdir(run / "weight_push")), "fallback files left behind"
    m = re.search(r"requests per generator: (.*)", log2)
    served = dict(re.findall(r"(generator-\d) (\d+)", m.group(1))) if m else {}
    assert sorted(served) == ["generator-0", "generator-1"] and all(int(n) > 0 for n in served.values()), \
        log2[-3000:]  # both replicas served rollouts
    consumes = [e for e in read_data_ledger(str(run)).events("consume") if e["step"] > start]
    lags = [lag for e in consumes for lag in e["lags"]]
    assert len(consumes) == end - start and lags and max(lags) <= ETA, (consumes, lags)
    # the follower ran exactly the leader's ordered operations, in its order (controller.GroupTrainer sends
    # each trainer-service operation, the pusher its pushes): the run's protocol between trainer processes
    ops = json.loads((run / "trainer_group_ops.json").read_text())
    assert ops["followers"] == [ops["leader"]], ops
    leader = ops["leader"]
    assert leader[:3] == ["setup", "build", "restore"], leader
    assert leader.count("train") == end - start and leader.count("push") >= end - start, leader
    assert leader[-4:] == ["save", "wait_checkpoint", "export", "close_checkpoint"], leader


@pytest.mark.slow
def test_sigterm_to_every_trainer_process_checkpoints_and_resumes(tmp_path):
    run, logs, read = tmp_path / "run", tmp_path, _log_reader(tmp_path)
    p1 = _start_until_checkpoint(run, logs, read)
    try:
        for name in ("trainer0", "trainer1"):  # a SLURM preemption signals every task at once
            p1[name].send_signal(signal.SIGTERM)
        rc1 = [wait_or_kill(p1[name], 150) for name in ("trainer0", "trainer1", "generator")]
    finally:
        kill_all(p1.values())
    log1 = read("run1", "trainer0")
    assert rc1 == [0, 0, 0], log1[-3000:] + read("run1", "trainer1")[-2000:]
    m = re.search(r"stopped by SIGTERM after step (\d+): checkpoint \S+ is committed", log1)
    assert m and int(m.group(1)) >= 2 and int(m.group(1)) in _committed(run), log1[-3000:]
    assert "process 0 stops the group" in read("run1", "trainer1")
    preempted = int(m.group(1))
    p2 = _start_roles(run, logs, "run2", steps=preempted + 1)
    try:
        rc2 = [wait_or_kill(p2[name], 300) for name in ("trainer0", "trainer1", "generator")]
    finally:
        kill_all(p2.values())
    log2 = read("run2", "trainer0")
    assert rc2 == [0, 0, 0], log2[-3000:]
    assert f"resumed from {run}/checkpoints/{preempted}: step {preempted}" in log2, log2[-3000:]
