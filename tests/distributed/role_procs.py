"""Helpers of the multi-process tests: the environment of a role process and bounded waits."""
from __future__ import annotations

import os
import secrets
import subprocess

from jaxrl_async.testing import subprocess_xla_flags


def role_env(cache_dir=None) -> dict:
    """The environment for role processes: a fresh RPC secret, unbuffered output, each process's own
    simulated device count, and (``cache_dir``) a shared persistent compilation cache."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["XLA_FLAGS"] = subprocess_xla_flags()  # each role sets its own simulated device count
    env["JAXRL_RPC_AUTHKEY"] = secrets.token_hex(16)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> int:
    """``proc``'s exit status; a process still running after ``timeout`` is killed and reported as a hang."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"pid {proc.pid} still running after {timeout} s (a hang)") from None


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
