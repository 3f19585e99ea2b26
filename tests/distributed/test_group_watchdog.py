"""The trainer-group leader's watchdog: a lost follower ends process 0 with status 1 and one line naming it
within seconds, even while its main thread is blocked (in CI, an in-flight Orbax commit waiting at a barrier
for the killed process let the JAX coordination service abort the leader instead: SIGABRT, no line); a group
that is finishing normally is left alone."""

import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from jaxrl_async.distributed.trainer_group import GroupLeader

    class Peer:  # what GroupLeader reads of an rpc.Peer
        name, error = "trainer-1 (pid 4242 on hostA)", None
        def close(self):
            pass

    peer = Peer()
    group = GroupLeader([peer])
    group.start_watchdog(grace_s=0.5, poll_s=0.05)
    if sys.argv[1] == "finishing":
        group._finishing.set()  # what finish() does first
    threading.Timer(0.2, lambda: setattr(peer, "error", ConnectionResetError("peer closed"))).start()
    time.sleep(3)  # the main thread blocked where only the dead peer could release it (the watchdog fires at ~0.7 s)
    print("main thread woke up")
""")


def _run(mode: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - t0


def test_lost_follower_ends_a_blocked_leader_with_status_1_and_a_named_line():
    proc, took = _run("running")
    assert proc.returncode == 1, proc
    assert "run failed: trainer process trainer-1 (pid 4242 on hostA) lost: peer closed" in proc.stderr, proc.stderr
    assert "main thread woke up" not in proc.stdout and took < 3, took


def test_a_finishing_group_is_left_alone():
    proc, took = _run("finishing")
    assert proc.returncode == 0 and "main thread woke up" in proc.stdout and "run failed" not in proc.stderr, proc
