"""What runs a role process on a node for a cluster launcher (``distributed.ray_launch``), standard library only.

``RoleHost`` is the body of the Ray actor that the Ray launcher places on a placement-group bundle: it runs ONE
role's ordinary command line (the one ``distributed.launch`` runs locally) as a child process, keeps its output
lines for the launcher to collect (``poll``), signals, stops and restarts it, and reserves ports on its node (the
controller's and the ``jax.distributed`` coordinator's, held bound until the actor ends). The module imports no
JAX and nothing heavy of the package (the actor's worker imports it), and nothing of Ray: the launcher wraps the
class with ``ray.remote``.

A role process dies with its host: it is started with ``PR_SET_PDEATHSIG`` = SIGKILL (Linux) from the thread that
stays alive as long as the process runs (its output pump), so a Ray worker that is killed (node lost, the launcher
gone and its actors fate-shared, ``ray.kill``) leaves no role process behind.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def console_line(raw: bytes) -> str | None:
    """One line of a role's output as the launcher shows it (without the prefix and the newline), or None
    for nothing to show. A line holding carriage returns is a progress bar's redraws (a role that still
    draws one, e.g. started with a terminal's settings): its last non-empty state stands for them."""
    text = raw.decode(errors="replace").rstrip("\r\n")
    if "\r" in text:
        text = next((seg for seg in reversed(text.split("\r")) if seg.strip()), "")
        if not text:
            return None
    return text


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the launcher's teardown still stops it
        pass


class RoleHost:
    """One role process on this node (see the module docstring). Every method returns within its timeout."""

    def __init__(self, name: str):
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=20000)
        self._lock = threading.Lock()
        self._reserved: list[socket.socket] = []
        self._pump: threading.Thread | None = None

    def info(self) -> dict:
        """Where this actor runs: node address, host name, Ray node id, its pid, its Python, device variables."""
        import ray  # present: this runs inside a Ray worker

        node_id = ray.get_runtime_context().get_node_id()
        # the address the node registered with (``ray start --node-ip-address``), which may differ from the
        # address of the default route that ray.util.get_node_ip_address() gives
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n.get("NodeID") == node_id), None)
        return {"ip": ip or ray.util.get_node_ip_address(), "host": socket.gethostname(), "node_id": node_id,
                "pid": os.getpid(), "python": sys.executable,
                "env": {k: v for k, v in os.environ.items()
                        if k in ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_NAME", "TPU_WORKER_ID")}}

    def read_marker(self, path: str) -> str | None:
        """The content of ``path`` as this node sees it (None: absent or unreadable): the shared-filesystem check."""
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError:
            return None

    def path_exists(self, path: str) -> bool:
        return os.path.isdir(path)

    def probe(self, env: dict[str, str], cwd: str | None, timeout: float = 60.0) -> str:
        """Where a role process started here with ``env`` in ``cwd`` imports jaxrl_async from (a process like
        the roles: this node's Python, the worker's environment updated by ``env``), or ``error: ...``."""
        full = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        full.update(env)
        code = "import os, jaxrl_async; print(os.path.dirname(os.path.abspath(jaxrl_async.__file__)))"
        try:
            out = subprocess.run([sys.executable, "-c", code], env=full, cwd=cwd, capture_output=True, text=True,
                                 timeout=timeout, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"error: {e}"
        if out.returncode != 0:
            return "error: " + (out.stderr.strip().splitlines() or ["exit status %d" % out.returncode])[-1]
        return out.stdout.strip()

    def reserve_port(self, host: str) -> int:
        """A free port on ``host`` that this actor keeps bound (``SO_REUSEPORT``, not listening) while it lives,
        as ``distributed.launch.reserve_port`` does for the local launcher."""
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, 0))
        self._reserved.append(s)
        return s.getsockname()[1]

    def start(self, cmd: list[str], env: dict[str, str], cwd: str | None, timeout: float = 60.0) -> int:
        """Start ``cmd`` (the previous process of this host must have exited); returns its pid."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name}: a process is still running (pid {self.proc.pid})")
        if self._pump is not None:
            self._pump.join(timeout)
        full = dict(os.environ)  # the worker's: Ray's device assignment (CUDA_VISIBLE_DEVICES, TPU_VISIBLE_CHIPS)
        for k in [k for k in full if k.startswith("RAY_")]:
            del full[k]
        full.update(env)
        box: dict = {}
        started = threading.Event()

        def pump() -> None:  # starts the process and lives as long as its output: PDEATHSIG follows this thread
            try:
                p = subprocess.Popen(cmd, env=full, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            except OSError as e:
                box["error"] = e
                started.set()
                return
            box["proc"] = p
            started.set()
            for raw in iter(p.stdout.readline, b""):
                line = console_line(raw)
                if line is not None:
                    with self._lock:
                        self.lines.append(line)
            p.wait()

        self._pump = threading.Thread(target=pump, name=f"role-{self.name}", daemon=True)
        self._pump.start()
        if not started.wait(timeout):
            raise RuntimeError(f"{self.name}: the process did not start within {timeout} s")
        if "error" in box:
            raise RuntimeError(f"{self.name}: cannot start {cmd[0]}: {box['error']}")
        self.proc = box["proc"]
        return self.proc.pid

    def poll(self) -> tuple[list[str], int | None, int | None]:
        """(output lines since the last call, the process's exit status or None while it runs, its pid). The
        status is given only once every line it wrote was collected."""
        p = self.proc
        rc = None if p is None else p.poll()
        if rc is not None and self._pump is not None:
            self._pump.join(5.0)
        with self._lock:
            out = list(self.lines)
            self.lines.clear()
        return out, rc, None if p is None else p.pid

    def send_signal(self, sig: int) -> bool:
        p = self.proc
        if p is None or p.poll() is not None:
            return False
        p.send_signal(sig)
        return True

    def stop(self, grace: float) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; the exit status (None: nothing was started)."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30.0)
        return p.returncode

    def wait(self, timeout: float) -> int | None:
        """The exit status within ``timeout`` seconds, else None (still running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return None if self.proc is None else self.proc.returncode
            time.sleep(0.05)
        return None
