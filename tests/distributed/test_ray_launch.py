"""The Ray launcher (``python -m jaxrl_async.launch.ray``; issue 26 item 1) on a Ray cluster of two node processes
on this machine (``ray_cluster.RayCluster``: a head with 2 CPUs and the custom resource ``jx_head``, a second node
with 2 CPUs and ``jx_gen``), started once per module and stopped in its finalizer (only its own processes).

* ``test_without_ray_the_launcher_says_how_to_get_it``: Ray not importable -> one line, exit 2.
* ``test_areal_style_cluster_settings_size_the_run``: ``cluster.n_nodes=4 cluster.n_gpus_per_node=8`` -> flags.
* ``test_no_cluster_at_the_address_is_one_line``: nothing listening at ``--address`` -> one line, exit 2.
* ``test_a_run_the_cluster_cannot_place_is_one_line``: resources no node has -> one line, exit 2.
* ``test_tiny_run_under_ray_places_roles_and_leaves_nothing`` (default, ~1 min with the cluster): the tiny run,
  one trainer process and 2 generator replicas, to completion: the trainer's bundle on the head, the replicas'
  on the other node (by their custom resources, checked by the node ids the launcher prints), the roles import
  this checkout, every role's lines prefixed, and afterwards no role process nor actor left (by pid).
* ``test_ctrl_c_tears_down_and_the_same_command_resumes`` (slow): a 2-process trainer and 2 replicas; SIGINT to
  the launcher after the first step: exit 130, every role process and actor gone; the same command again
  resumes from the checkpoint the interrupted run saved and trains to the end.
* ``test_killed_replica_is_restarted_under_ray`` (slow): ``test_replicas_launch``'s audit under Ray: generator-1's
  process SIGKILLed after the first step is restarted on its bundle, rejoins, serves again; then generator-0's
  ACTOR (its Ray worker) is SIGKILLed: its process dies with it, a new actor on the same bundle restarts it, it
  rejoins; every prompt trained exactly once, lag <= eta.
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

from jaxrl_async.data.ledger import read_data_ledger
from jaxrl_async.testing import subprocess_xla_flags
from ray_cluster import IP  # tests/distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TINY = os.path.join(os.path.dirname(HERE), "loop", "tiny_config.py")
ETA = 2


def test_without_ray_the_launcher_says_how_to_get_it(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from jaxrl_async.distributed.ray_launch import main; "
            f"sys.exit(main(['--config', {TINY!r}, 'run_dir={tmp_path / 'run'}']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'jaxrl_async[ray]'" in lines[0], out.stderr
    assert not (tmp_path / "run").exists()


def test_areal_style_cluster_settings_size_the_run():
    from jaxrl_async.cli.common import UserError
    from jaxrl_async.distributed.ray_launch import apply_cluster_settings, build_parser

    ap = build_parser()
    args, rest = ap.parse_known_args(["--config", "c.py", "cluster.n_nodes=4", "cluster.n_gpus_per_node=8", "x.y=1"])
    assert apply_cluster_settings(args, rest) == ["--config", "c.py", "x.y=1"]
    assert (args.trainer_processes, args.generators, args.trainer_gpus, args.generator_gpus, args.generator_devices) \
        == (2, 2, 8.0, 8.0, 8)
    args, rest = ap.parse_known_args(["cluster.n_nodes=3", "cluster.n_gpus_per_node=8"])
    apply_cluster_settings(args, rest)
    assert (args.trainer_processes, args.generators) == (1, 2)  # docs/launch.md's SLURM layout
    args, rest = ap.parse_known_args(["cluster.n_nodes=4", "cluster.trainer_nodes=3"])
    apply_cluster_settings(args, rest)
    assert (args.trainer_processes, args.generators, args.trainer_gpus) == (3, 1, 0.0)
    for bad, msg in [("cluster.n_nodes=1", "at least 2 nodes"), ("cluster.n_gpus=8", "unknown cluster setting"),
                     ("cluster.n_nodes=two", "expected an integer")]:
        args, rest = ap.parse_known_args([bad])
        with pytest.raises(UserError, match=msg):
            apply_cluster_settings(args, rest)
    args, rest = ap.parse_known_args(["cluster.n_nodes=2", "cluster.trainer_nodes=2"])
    with pytest.raises(UserError, match=r"must be in \[1, cluster.n_nodes=2\)"):
        apply_cluster_settings(args, rest)


def test_no_cluster_at_the_address_is_one_line(tmp_path):
    pytest.importorskip("ray")
    from ray_cluster import free_port  # tests/distributed

    out = subprocess.run([sys.executable, "-m", "jaxrl_async.launch.ray", "--address", f"{IP}:{free_port()}",
                          "--config", TINY, f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"launch.ray: error: no Ray cluster at --address {IP}:"), out.stderr


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    from ray_cluster import RayCluster  # tests/distributed: imports no Ray

    c = RayCluster([(2, {"jx_head": 2}), (2, {"jx_gen": 2})])
    try:
        yield c
    finally:
        c.stop()
        assert not c.pids(), "Ray processes left"


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["XLA_FLAGS"] = subprocess_xla_flags()
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env.pop("JAXRL_RPC_AUTHKEY", None)  # the launcher makes the run's secret
    return env


def _cmd(cluster, trainer_processes: int, generators: int, *run: str) -> list[str]:
    return [sys.executable, "-m", "jaxrl_async.launch.ray", "--address", cluster.address,
            "--generators", str(generators), "--trainer-processes", str(trainer_processes),
            "--trainer-cpu-devices", str(3 - trainer_processes), "--generator-cpu-devices", "1",
            "--trainer-resources", "jx_head=1", "--generator-resources", "jx_gen=1", "--grace", "30",
            "--placement-timeout", "120", "--config", TINY, *run]


def _placed(log: str) -> dict[str, dict]:
    """role -> {pid, node, actor} from the launcher's lines (the last start of each role)."""
    out = {}
    for m in re.finditer(r"^\[launch\] ([\w-]+): pid (\d+) on \S+ \(([\d.]+), node (\w+)\), actor pid (\d+)", log, re.M):
        out[m.group(1)] = {"pid": int(m.group(2)), "ip": m.group(3), "node": m.group(4), "actor": int(m.group(5))}
    return out


def _all_pids(log: str) -> list[int]:
    """Every role process and actor the launcher started (restarts included)."""
    return [int(p) for m in re.finditer(r"^\[launch\] [\w-]+: pid (\d+) .*actor pid (\d+)", log, re.M)
            for p in m.groups()]


def _gone(pids: list[int], timeout: float) -> list[int]:
    from ray_cluster import alive  # tests/distributed

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def _rows(run) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _check_placement(log: str, trainer_processes: int, generators: int) -> None:
    placed = _placed(log)
    trainers = ["controller"] + [f"trainer-{i}" for i in range(1, trainer_processes)]
    gens = [f"generator-{k}" for k in range(generators)]
    assert set(placed) == set(trainers + gens), placed
    t_nodes = {placed[r]["node"] for r in trainers}
    g_nodes = {placed[r]["node"] for r in gens}
    assert len(t_nodes) == 1 and len(g_nodes) == 1 and t_nodes != g_nodes, placed  # jx_head vs jx_gen
    assert {p["ip"] for p in placed.values()} == {IP}, placed  # the nodes' registered address
    m = re.search(rf"^\[launch\] controller at {re.escape(IP)}:\d+.*; jaxrl_async from (\S+)$", log, re.M)
    assert m and os.path.samefile(m.group(1), os.path.join(ROOT, "jaxrl_async")), log[:3000]  # this checkout


def test_a_run_the_cluster_cannot_place_is_one_line(tmp_path, cluster):
    cmd = _cmd(cluster, 1, 1, "--generator-resources", "jx_nowhere=1", "--placement-timeout", "3",
               f"run_dir={tmp_path / 'run'}")
    out = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("launch.ray: error: the Ray cluster could not place the run "
                                                     "within --placement-timeout 3 s"), out.stderr[-3000:]
    assert "jx_nowhere" in errors[0] and "[launch] controller" not in out.stderr


def test_tiny_run_under_ray_places_roles_and_leaves_nothing(tmp_path, cluster):
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = subprocess.run(_cmd(cluster, 1, 2, f"run_dir={run}", "trainer.total_steps=2", "checkpoint.every_steps=null"),
                         env=_env(tmp_path), capture_output=True, text=True, timeout=400)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    print(f"run {time.monotonic() - t0:.0f} s")
    _check_placement(log, 1, 2)
    assert "[launch] controller exited with status 0; other trainer processes: []; generators: [0, 0]" in log, log[-3000:]
    for prefix in ("[controller] [jaxrl_async] done: 2 steps", "[generator-0] [generator-0 pid",
                   "[generator-1] [generator-1 pid"):
        assert prefix in log, (prefix, log[-3000:])
    assert {line.split("]", 1)[0] + "]" for line in log.splitlines() if line.startswith("[")} == {
        "[launch]", "[controller]", "[generator-0]", "[generator-1]"}
    assert json.loads((run / "summary.json").read_text())["stopped_by"] == "completed"
    left = _gone(_all_pids(log), 30)
    assert not left, f"processes left: {left}"


@pytest.mark.slow
def test_ctrl_c_tears_down_and_the_same_command_resumes(tmp_path, cluster):
    run, log_path = tmp_path / "run", tmp_path / "launch.log"
    steps = 30
    cmd = _cmd(cluster, 2, 2, f"run_dir={run}", f"trainer.total_steps={steps}", "checkpoint.every_steps=null",
               "rollout.reward=loop_targets:has_digit_slow")  # ~0.4 s per step: the run is interrupted mid-way
    env = _env(tmp_path)
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not any("train/loss" in r for r in _rows(run)):
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "no training step"
            time.sleep(0.3)
        t_int = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    print(f"SIGINT to exit: {time.monotonic() - t_int:.1f} s")
    assert rc == 130, log[-5000:]
    assert "[launch] interrupted: the controller stops the run" in log, log[-3000:]
    _check_placement(log, 2, 2)
    pids = _all_pids(log)
    assert len(pids) == 8, pids  # 4 role processes, 4 actors
    left = _gone(pids, 30)
    assert not left, f"processes left after Ctrl-C: {left}\n{log[-3000:]}"
    summary = json.loads((run / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert 0 < stopped_at < steps and (run / "checkpoints" / str(stopped_at)).is_dir(), summary

    # the same command again: resumes from that checkpoint, trains to the end
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    log2 = out.stdout + out.stderr
    assert out.returncode == 0, log2[-5000:]
    assert f"resumed from {run / 'checkpoints' / str(stopped_at)}" in log2, log2[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "completed" and summary["steps"] == steps, summary
    assert "[launch] controller exited with status 0; other trainer processes: [0]; generators: [0, 0]" in log2
    assert not _gone(_all_pids(log2), 30)


@pytest.mark.slow
def test_killed_replica_is_restarted_under_ray(tmp_path, cluster):
    run, log_path = tmp_path / "run", tmp_path / "launch.log"
    steps = 100
    cmd = _cmd(cluster, 1, 2, "--restart-backoff", "0.5", "--heartbeat-timeout", "30", "--replica-timeout", "120",
               f"run_dir={run}", f"trainer.total_steps={steps}", f"rollout.max_head_offpolicyness={ETA}",
               "checkpoint.every_steps=null", "rollout.reward=loop_targets:has_digit_slow")
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(cmd, env=_env(tmp_path), stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        pid = None
        while pid is None or not any("train/loss" in r for r in _rows(run)):
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "no training step / generator-1 never registered"
            m = re.search(r"\[generator-1\] \[generator-1 pid (\d+)\] registered", log_path.read_text())
            pid = int(m.group(1)) if m else None
            time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        # then generator-0's actor (its Ray worker): its role process dies with it, the launcher places a new actor
        # on the same bundle and restarts the process there
        while not re.search(r"generator-1 \(pid \d+ on [^)]*\) back in service", log_path.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline + 120, log_path.read_text()[-4000:]
            time.sleep(0.3)
        first0 = _placed(log_path.read_text())["generator-0"]
        os.kill(first0["actor"], signal.SIGKILL)
        rc = proc.wait(400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert rc == 0, log[-5000:]
    print(f"{time.monotonic() - t_kill:.0f} s from the kill to the end")
    assert _placed(log)["generator-1"]["pid"] != pid  # the last start of generator-1 is the restart
    assert re.search(rf"\[launch\] generator-1 \(pid {pid}\) exited with status -9; restarting it", log), log[-4000:]
    assert "[launch] generator-1 restarted (pid" in log, log[-4000:]
    assert re.search(r"generator replica .*generator-1 \(pid \d+ on [^)]*\) back in service", log), log[-4000:]
    # the actor kill: the role process went with it (PDEATHSIG), a new actor and process, back in service
    assert re.search(r"\[launch\] generator-0: its actor on .* is lost", log), log[-4000:]
    assert "[launch] generator-0 restarted (pid" in log, log[-4000:]
    assert _placed(log)["generator-0"]["actor"] != first0["actor"] and not _gone([first0["pid"]], 10)
    assert re.search(r"generator replica .*generator-0 \(pid \d+ on [^)]*\) back in service", log), log[-4000:]

    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "completed" and summary["steps"] == steps, summary
    h = read_data_ledger(str(run))
    consumes = h.events("consume")
    trained = [d for e in consumes for d in e["draws"]]
    assert len(trained) == len(set(trained)) == 4 * steps, "a prompt was trained twice"
    rejected = [e["draw"] for e in h.events("reject")]
    assert sorted(trained + rejected + summary["data"]["outstanding_draws"]) == list(range(summary["data"]["next_draw"]))
    assert max(lag for e in consumes for lag in e["lags"]) <= ETA
    rows = [r for r in _rows(run) if "train/loss" in r]
    assert max(r["staleness/max"] for r in rows) <= ETA
    last = rows[-1]
    assert last["generator/1/rejoins"] >= 1 and last["generator/1/requests_since_join"] > 0, last
    assert last["generator/0/rejoins"] >= 1 and last["generator/0/requests_since_join"] > 0, last
    assert last["generator/replica_failures"] == 2, last
    assert last["generator/replicas_live"] == 2 and 0 < last["generator/recovery_s"] < 120, last
    print({k: v for k, v in last.items() if k.startswith("generator/") and not k[10].isdigit()})
    assert not _gone(_all_pids(log), 30)
