"""The localhost launcher (``python -m jaxrl_async.distributed.launch``) as a user runs it, and how role
processes end (issue 31 item 7):

* ``test_launcher_clean_finish_is_quiet_with_one_progress_line_per_step``: the tiny run through the
  launcher with one generator process and a trainer of one process (~30 s) or (slow, a variant) of 2
  processes (every kind of role): exit 0, every role exits 0, one ``[controller] train: k/N`` progress
  line per step in order (reward, staleness, time per step), and nothing alarming in the combined output:
  no traceback, no error or warning, no lost connection (the second trainer process used to report its
  controller's orderly close as ``closed the connection (EOFError)``; the next test checks that in the
  default suite).
* ``test_role_processes_tell_an_orderly_end_from_a_lost_controller``: a generator process and a
  trainer-group follower, each against a stand-in controller (this process) that ends them in order
  (``stop`` / ``finish``, then closes: exit 0, quiet) or just closes (a controller that died: the
  process names the lost controller and exits 3).
* ``test_console_line``: the launcher's handling of a role line holding a progress bar's redraws.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest

from jaxrl_async.distributed import rpc
from jaxrl_async.distributed.launch import console_line
from role_procs import kill_all, role_env, wait_or_kill  # tests/distributed

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(os.path.dirname(HERE), "loop", "tiny_config.py")
STEPS = 3
# what a clean finish must not print (case-sensitive words; the Gloo lines "Rank 0 is connected" are fine)
ALARMING = re.compile(r"Traceback|Error|WARNING|Warning|warning|EXCEPTION|Exception|closed the connection|lost|"
                      r"stopping|failed|rejected|exited with status [1-9]")


@pytest.mark.parametrize("trainer_processes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_launcher_clean_finish_is_quiet_with_one_progress_line_per_step(tmp_path, trainer_processes):
    env = role_env(tmp_path / "jax_cache")
    del env["PYTHONUNBUFFERED"]  # the launcher sets it for its roles
    cmd = [sys.executable, "-m", "jaxrl_async.distributed.launch", "--trainer-processes", str(trainer_processes),
           "--trainer-cpu-devices", str(3 - trainer_processes), "--generator-cpu-devices", "1", "--grace", "30",
           "--config", TINY, f"run_dir={tmp_path / 'run'}", f"trainer.total_steps={STEPS}", "logging.progress=true",
           "checkpoint.every_steps=null"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    bad = [line for line in log.splitlines() if ALARMING.search(line)]
    assert not bad, "\n".join(bad) + "\n---\n" + log[-4000:]
    assert "\r" not in log
    others = [0] * (trainer_processes - 1)
    assert f"[launch] controller exited with status 0; other trainer processes: {others}; generators: [0]" in log, \
        log[-2000:]
    progress = re.findall(r"^\[controller\] train: (\d+)/(\d+) \[\S+, (\S+)s/step\] (.*)$", log, re.M)
    assert [(int(k), int(n)) for k, n, _, _ in progress] == [(k, STEPS) for k in range(1, STEPS + 1)], log[-4000:]
    for _, _, rate, fields in progress:
        assert float(rate) > 0 and "reward_mean=" in fields and "lag_max=" in fields and "loss=" in fields, fields
    # every role's lines keep their prefix, and whole lines
    followers = [f"[trainer-{i}]" for i in range(1, trainer_processes)]
    for prefix in [f"[controller] [jaxrl_async] done: {STEPS} steps", "[generator-0] [generator-0 pid"] + \
            [f"{f} [trainer {f[9:-1]} pid" for f in followers]:
        assert prefix in log, (prefix, log[-4000:])
    roles = {line.split("]", 1)[0] + "]" for line in log.splitlines()}
    assert roles == {"[controller]", "[generator-0]", "[launch]", *followers}, roles


def _role_cmd(kind: str, addr: str, name: str) -> list[str]:
    if kind == "generator":
        return [sys.executable, "-m", "jaxrl_async.distributed.generator_role", "--controller", addr, "--name", name,
                "--connect-timeout", "60"]
    follower = ("import sys; from jaxrl_async.distributed.trainer_group import run_follower; "
                f"sys.exit(run_follower(None, {addr!r}, connect_timeout_s=60.0, heartbeat_timeout_s=60.0))")
    return [sys.executable, "-c", follower]


def test_role_processes_tell_an_orderly_end_from_a_lost_controller(tmp_path):
    env = role_env()
    listener = rpc.listen("127.0.0.1:0", bytes.fromhex(env["JAXRL_RPC_AUTHKEY"]))
    addr = f"127.0.0.1:{listener.address[1]}"
    cases = [("generator", "orderly"), ("generator", "lost"), ("trainer", "orderly"), ("trainer", "lost")]
    procs, logs = {}, {}
    try:
        for i, (kind, end) in enumerate(cases):  # one at a time: a follower registers as trainer-0 (no pid to tell)
            logs[i] = tmp_path / f"{kind}-{end}.log"
            procs[i] = subprocess.Popen(_role_cmd(kind, addr, f"generator-{i}"), env=env, stdout=open(logs[i], "wb"),
                                        stderr=subprocess.STDOUT)
            conn = rpc.accept(listener, 120, f"{kind} process")
            registered = threading.Event()

            def handler(method, args, reply, registered=registered):
                assert method == "register"
                registered.set()
                reply(True, None)

            peer = rpc.Peer(conn, f"{kind} process", handler=handler)
            assert registered.wait(60), logs[i].read_text()
            peer.call("__ping__", timeout=60.0)  # answered after the reply to register was read: registered there
            if end == "orderly":
                peer.call("stop" if kind == "generator" else "finish", timeout=60.0)
            peer.close()  # orderly: after stop / finish, as the controller does; lost: a controller gone
            rc = wait_or_kill(procs[i], 60)
            text = logs[i].read_text()
            if end == "orderly":
                assert rc == 0 and not ALARMING.search(text), (kind, rc, text)
            else:
                assert rc == 3, (kind, rc, text)
                assert re.search(rf"controller at {re.escape(addr)} closed the connection \(\w+\).*; stopping", text), text
                assert "Traceback" not in text, text
    finally:
        kill_all(procs.values())
        listener.close()


def test_console_line():
    assert console_line(b"[jaxrl_async] done\n") == "[jaxrl_async] done"
    assert console_line(b"\rtrain:   0%|  | 0/4\rtrain:  25%|# | 1/4 [00:07]\r   \r\n") == "train:  25%|# | 1/4 [00:07]"
    assert console_line(b"\r   \r\n") is None
    assert console_line(b"\xff bytes\r\n") == "\ufffd bytes"
