"""A Ray cluster of several node processes on this machine for the Ray launcher's tests, and its scoped stop.

``RayCluster(nodes)``: a head (``ray start --head``) and one more ``ray start --address=HEAD`` per extra entry of
``nodes`` ((CPUs, custom resources) each), every node on 127.0.0.2 (a loopback address: Ray replaces 127.0.0.1
by the machine's outward address, and the tests talk to loopback addresses only) with every port chosen free (no
fixed port that another user's Ray on the machine could hold: client server, dashboard, agents, metrics...), a tiny
object store, no dashboard UI, and its own temporary directory. ``stop()`` ends only this cluster's processes: those whose
command line names the cluster's temporary directory (GCS, raylets, monitors) and their descendants (agents,
workers, actors), SIGTERM then SIGKILL; never ``ray stop``, which ends every Ray on the machine.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command of this interpreter
IP = "127.0.0.2"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((IP, 0))
        return s.getsockname()[1]


def _ports(head: bool) -> list[str]:
    names = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port"]
    if head:
        names += ["--ray-client-server-port", "--dashboard-port"]
    return [f"{n}={free_port()}" for n in names]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it is only waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class RayCluster:
    def __init__(self, nodes: list[tuple[int, dict[str, float]]], env: dict | None = None):
        self.tmp = tempfile.mkdtemp(prefix="jxray-")  # short: Ray's socket paths live under it
        self.env = dict(env or os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [self.env.get("PYTHONPATH")] if p])
        self.env["RAY_USAGE_STATS_ENABLED"] = "0"
        self.port = free_port()
        self.address = f"{IP}:{self.port}"
        common = [f"--node-ip-address={IP}", "--object-store-memory=100000000", "--disable-usage-stats"]
        try:
            for i, (cpus, res) in enumerate(nodes):
                where = ["--head", f"--port={self.port}", f"--temp-dir={self.tmp}", "--include-dashboard=false"] \
                    if i == 0 else [f"--address={self.address}"]
                cmd = RAY + ["start"] + where + common + _ports(i == 0) + [f"--num-cpus={cpus}",
                                                                           f"--resources={json.dumps(res)}"]
                out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
                assert out.returncode == 0, (cmd, out.stdout[-3000:], out.stderr[-3000:])
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        """This cluster's processes: those naming its temporary directory, and their descendants."""
        kids = _children()
        roots = [int(d) for d in os.listdir("/proc") if d.isdigit() and self.tmp in _cmdline(int(d))]
        out, stack = [], list(roots)
        while stack:
            p = stack.pop()
            if p != os.getpid() and p not in out:
                out.append(p)
                stack += kids.get(p, [])
        return out

    def stop(self, timeout: float = 5.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout
            while any(alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.tmp, ignore_errors=True)
