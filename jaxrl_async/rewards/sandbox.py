"""Code-execution sandbox for untrusted Python (code rewards, agent tools).

Each :meth:`Sandbox.run` starts a fresh process tree through ``_sandbox_launcher.py`` (read its
docstring for the process tree) and never raises for anything the untrusted program does: every
outcome is a :class:`SandboxResult`.  Safe to call from many threads at once (no ``preexec_fn``; each
call owns its pipes; one sandbox uid per concurrent run).

What contains what (``namespaces`` mode, i.e. running as root on Linux, as on the dev machines and
the usual TPU/GPU VMs; checked by ``tests/rewards/test_sandbox.py``):

===================  =======================================================================
attack               containment
===================  =======================================================================
infinite loop        ``RLIMIT_CPU`` (SIGXCPU at the soft limit, SIGKILL one second later) and
                     the wall deadline (PID 1 ``kill(-1, SIGKILL)``; the parent kills the whole
                     launcher process group ``wall_timeout_s + 2`` s later as a last resort).
fork bomb            ``RLIMIT_NPROC`` applies because the program runs as a *non-root* sandbox uid
                     (root ignores it) that is unique per concurrent run, so the count is per
                     sandbox; plus the PID namespace: when the program's main process exits or
                     is killed, PID 1 exits and the kernel SIGKILLs everything left in the
                     namespace (no escaped daemons, ``setsid`` does not help).
memory hog           ``RLIMIT_AS`` (→ ``MemoryError``); tmpfs capped at ``tmpfs_bytes``.
huge output          the parent keeps at most ``max_output_bytes`` per stream and (by default)
                     kills the run on overflow; nothing unbounded is ever buffered.
writes outside cwd   the whole mount tree is recursively read-only + nosuid inside the private
                     mount namespace; the only writable place is a private, size-capped tmpfs
                     on ``/tmp`` (work dir ``/tmp/work``) that exists only in that namespace and
                     vanishes with it.  Guarantee: nothing the program writes is visible outside
                     the sandbox or survives the run.  In addition the program is not root
                     (sandbox uid, no groups, ``no_new_privs`` so setuid binaries cannot regain
                     root) and ``RLIMIT_FSIZE`` caps each file.
parent's secrets     ``execve`` with a minimal explicit environment (``PATH``, ``HOME``, ``LANG``,
                     ``TMPDIR`` plus ``SandboxConfig.env``); Python runs with ``-I``.  ``/proc`` is
                     a fresh mount of the new PID namespace, so host processes (and their
                     ``/proc/<pid>/environ``) are not even visible.
network              new network namespace: only a down loopback device, so every connect
                     (including to 127.0.0.1 of the host) fails with ``ENETUNREACH``; abstract
                     unix sockets are per-namespace too.
===================  =======================================================================

Fallback (``plain`` mode: no namespaces, e.g. an unprivileged container): rlimits, uid switch
when root, own process group killed at the end, parent-made work dir deleted afterwards; no
network or filesystem isolation, so it is refused unless ``network_isolation="best_effort"``
or ``"disabled"`` is configured explicitly.  Known gaps in every mode: no seccomp filter (the
kernel attack surface is the full syscall set of an unprivileged process), world-readable host
files remain readable, and ``RLIMIT_AS`` does not bound page cache / kernel memory.
"""
from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Literal, Mapping, Sequence

__all__ = [
    "SandboxConfig",
    "SandboxResult",
    "Sandbox",
    "SandboxUnavailableError",
    "probe_isolation",
]

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_launcher.py")
_MAIN = "main.py"


class SandboxUnavailableError(RuntimeError):
    """The requested isolation cannot be provided on this machine."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run.  Sizes in bytes, times in seconds.

    Attributes:
      wall_timeout_s: wall-clock limit of the program (from fork to exit).
      cpu_time_s: ``RLIMIT_CPU`` soft limit (hard = soft + 1 s), summed over the program's threads.
      memory_bytes: ``RLIMIT_AS`` (virtual address space) of each process.
      file_size_bytes: ``RLIMIT_FSIZE``: largest file the program may write.
      max_processes: ``RLIMIT_NPROC`` for the sandbox uid (processes + threads).
      max_open_files: ``RLIMIT_NOFILE``.
      tmpfs_bytes: size cap of the private tmpfs holding ``/tmp`` and the work dir.
      max_output_bytes: bytes kept per stream (stdout, stderr); the rest is dropped.
      kill_on_output_overflow: kill the program as soon as a stream exceeds ``max_output_bytes``.
      network_isolation: ``"required"`` refuses to run without a private network namespace;
        ``"best_effort"`` uses one if possible; ``"disabled"`` shares the host network (explicit opt-in).
      python: interpreter for the program; ``None`` picks ``sys.executable`` if the sandbox uid can
        execute it (every path component world-searchable), else ``/usr/bin/python3``.
      env: extra environment variables for the program (nothing else is inherited).
      uid_base, uid_count: sandbox uids are drawn from ``[uid_base, uid_base + uid_count)``, one per
        concurrent run (unused uids without a passwd entry; only when the parent is root).
    """

    wall_timeout_s: float = 10.0
    cpu_time_s: float = 5.0
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_processes: int = 64
    max_open_files: int = 64
    tmpfs_bytes: int = 64 << 20
    max_output_bytes: int = 1 << 20
    kill_on_output_overflow: bool = True
    network_isolation: Literal["required", "best_effort", "disabled"] = "required"
    python: str | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    uid_base: int = 200_000
    uid_count: int = 100_000

    def __post_init__(self):
        for name in ("wall_timeout_s", "cpu_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("memory_bytes", "file_size_bytes", "max_processes", "max_open_files", "tmpfs_bytes",
                     "max_output_bytes", "uid_count"):
            if not int(getattr(self, name)) > 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.network_isolation not in ("required", "best_effort", "disabled"):
            raise ValueError(f"SandboxConfig.network_isolation must be 'required', 'best_effort' or "
                             f"'disabled', got {self.network_isolation!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run.

    ``returncode``: exit code, ``-signal`` if killed by a signal, ``None`` if the program never ran
    (``killed_reason == "setup_error"``).  ``killed_reason``: ``None`` or one of ``"wall_timeout"``,
    ``"cpu_limit"``, ``"output_limit"``, ``"signal"``, ``"setup_error"``.
    """

    returncode: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    killed_reason: str | None
    wall_time_s: float
    cpu_time_s: float | None
    isolation: str
    setup_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


# ----------------------------------------------------------------------------------- isolation probe
_probe_lock = threading.Lock()
_probe_cache: dict | None = None


def probe_isolation() -> dict:
    """What this machine allows (cached per process): ``{"root", "namespaces", "net", "error"}``."""
    global _probe_cache
    with _probe_lock:
        if _probe_cache is None:
            if not sys.platform.startswith("linux"):
                _probe_cache = {"root": False, "namespaces": False, "net": False, "error": sys.platform}
            else:
                proc = subprocess.run([sys.executable, "-I", "-S", _LAUNCHER, "--probe"], capture_output=True,
                                      timeout=30, env={})
                try:
                    _probe_cache = json.loads(proc.stdout.decode().strip().splitlines()[-1])
                except (IndexError, ValueError):
                    _probe_cache = {"root": os.geteuid() == 0, "namespaces": False, "net": False,
                                    "error": proc.stderr.decode(errors="replace")[-500:]}
        return dict(_probe_cache)


def _world_executable(path: str) -> bool:
    """True if a uid with no relation to the file owner can execute ``path`` (realpath, every dir o+x)."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        d = os.path.dirname(real)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            if d == "/":
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


def _default_python(as_other_uid: bool) -> str:
    if not as_other_uid or _world_executable(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_executable(candidate):
            return candidate
    raise SandboxUnavailableError(f"no Python interpreter executable by the sandbox uid: {sys.executable} "
                                  "is not world-executable and /usr/bin/python3 is missing; set SandboxConfig.python")


class _UidPool:
    """One sandbox uid per concurrent run; the start offset depends on the pid so that two processes
    on one host rarely share uids (sharing would only make them share the RLIMIT_NPROC budget)."""

    def __init__(self, base: int, count: int):
        self._base, self._count = base, count
        self._next = itertools.count((os.getpid() * 1009) % count)
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            while True:
                uid = self._base + next(self._next) % self._count
                if uid not in self._used:
                    self._used.add(uid)
                    return uid

    def release(self, uid: int) -> None:
        with self._lock:
            self._used.discard(uid)


class _BoundedBuffer:
    def __init__(self, limit: int):
        self.limit, self.chunks, self.size, self.truncated = limit, [], 0, False

    def feed(self, data: bytes) -> bool:
        """Append; returns True if the limit was exceeded (the excess is dropped)."""
        room = self.limit - self.size
        if len(data) > room:
            self.truncated = True
            data = data[:max(room, 0)]
        if data:
            self.chunks.append(data)
            self.size += len(data)
        return self.truncated

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


class Sandbox:
    """Runs untrusted Python programs; see the module docstring for the guarantees."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        probe = probe_isolation()
        self._root = bool(probe["root"]) and os.geteuid() == 0
        want_net = self.config.network_isolation != "disabled"
        self._mode = "namespaces" if probe["namespaces"] else "plain"
        self._unshare_net = want_net and bool(probe["net"])
        if self.config.network_isolation == "required" and not (self._mode == "namespaces" and self._unshare_net):
            raise SandboxUnavailableError(
                "SandboxConfig.network_isolation='required' but this machine cannot create network/mount/PID "
                f"namespaces (probe: {probe}); run as root with CAP_SYS_ADMIN, or set "
                "network_isolation='best_effort' to accept the unisolated fallback")
        self._python = self.config.python or _default_python(self._root)
        self._uids = _UidPool(self.config.uid_base, self.config.uid_count)

    @property
    def isolation(self) -> str:
        """e.g. ``"namespaces+net+uid"`` or ``"plain"``."""
        parts = [self._mode] + (["net"] if self._mode == "namespaces" and self._unshare_net else [])
        return "+".join(parts + (["uid"] if self._root else []))

    def run(self, code: str, *, stdin: str | bytes = b"", args: Sequence[str] = (),
            files: Mapping[str, str | bytes] | None = None, wall_timeout_s: float | None = None) -> SandboxResult:
        """Run ``code`` as ``python -I main.py *args`` in a fresh sandbox with ``stdin`` as its input.

        ``files`` (relative path → content) are written next to ``main.py`` in the work dir.
        """
        cfg = self.config
        wall = float(wall_timeout_s if wall_timeout_s is not None else cfg.wall_timeout_s)
        all_files = {_MAIN: code}
        for rel, content in (files or {}).items():
            norm = os.path.normpath(rel)
            if os.path.isabs(norm) or norm.startswith("..") or norm == _MAIN:
                raise ValueError(f"sandbox file name {rel!r} must be relative, inside the work dir and not {_MAIN!r}")
            all_files[norm] = content
        encoded = {k: base64.b64encode(v.encode() if isinstance(v, str) else bytes(v)).decode()
                   for k, v in all_files.items()}
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else bytes(stdin)

        uid = self._uids.acquire() if self._root else None
        staging = tempfile.mkdtemp(prefix="jaxrl-sandbox-")
        status_r, status_w = os.pipe()
        # fds still owned by this call; _spawn_and_collect closes the write end right after the spawn and
        # removes it here, so the finally below never closes a number another thread may have reused.
        open_fds = [status_r, status_w]
        try:
            if self._mode == "namespaces":
                workdir = "/tmp/work"
            else:
                workdir = os.path.join(staging, "work")
                os.mkdir(workdir, 0o700)
                os.chmod(staging, 0o711)
                if uid is not None:
                    os.chown(workdir, uid, uid)
            cpu = max(1, int(-(-cfg.cpu_time_s // 1)))
            launcher_cfg = {
                "mode": self._mode,
                "unshare_net": self._unshare_net,
                "argv": [self._python, "-I", _MAIN, *map(str, args)],
                "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": "/tmp",
                        "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", **dict(cfg.env)},
                "files": encoded,
                "workdir": workdir,
                "uid": uid,
                "gid": uid,
                "rlimits": {
                    "RLIMIT_CPU": [cpu, cpu + 1],
                    "RLIMIT_AS": [cfg.memory_bytes, cfg.memory_bytes],
                    "RLIMIT_FSIZE": [cfg.file_size_bytes, cfg.file_size_bytes],
                    "RLIMIT_NPROC": [cfg.max_processes, cfg.max_processes],
                    "RLIMIT_NOFILE": [cfg.max_open_files, cfg.max_open_files],
                    "RLIMIT_CORE": [0, 0],
                },
                "tmpfs_bytes": cfg.tmpfs_bytes,
                "wall_timeout_s": wall,
                "status_fd": status_w,
            }
            cfg_path = os.path.join(staging, "launcher.json")
            fd = os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(launcher_cfg, f)
            return self._spawn_and_collect(cfg_path, status_r, status_w, stdin_bytes, wall, open_fds)
        finally:
            for fd in open_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(staging, ignore_errors=True)
            if uid is not None:
                self._uids.release(uid)

    # ------------------------------------------------------------------------------------ internals
    def _spawn_and_collect(self, cfg_path: str, status_r: int, status_w: int, stdin_bytes: bytes,
                           wall: float, open_fds: list[int]) -> SandboxResult:
        cfg = self.config
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-S", _LAUNCHER, cfg_path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, close_fds=True,
                                pass_fds=(status_w,), start_new_session=True, cwd="/")
        open_fds.remove(status_w)
        os.close(status_w)
        out, err = _BoundedBuffer(cfg.max_output_bytes), _BoundedBuffer(cfg.max_output_bytes)
        status_chunks: list[bytes] = []
        killed_reason = None
        parent_deadline = t0 + wall + 2.0
        sel = selectors.DefaultSelector()
        try:
            for f in (proc.stdout, proc.stderr):
                os.set_blocking(f.fileno(), False)
                sel.register(f.fileno(), selectors.EVENT_READ, f)
            os.set_blocking(status_r, False)
            sel.register(status_r, selectors.EVENT_READ, None)
            pending_in = memoryview(stdin_bytes)
            if pending_in:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, proc.stdin)
            else:
                proc.stdin.close()
            while sel.get_map():
                remaining = parent_deadline - time.monotonic()
                if remaining <= 0:
                    killed_reason = "wall_timeout"
                    break
                for key, events in sel.select(timeout=min(remaining, 1.0)):
                    if events & selectors.EVENT_WRITE:
                        try:
                            n = os.write(key.fd, pending_in[:65536])
                            pending_in = pending_in[n:]
                        except (BrokenPipeError, OSError):
                            pending_in = pending_in[:0]
                        if not pending_in:
                            sel.unregister(key.fd)
                            proc.stdin.close()
                        continue
                    try:
                        data = os.read(key.fd, 65536)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    if key.fd == status_r:
                        status_chunks.append(data[:65536])
                        continue
                    buf = out if key.data is proc.stdout else err
                    if buf.feed(data) and cfg.kill_on_output_overflow and killed_reason is None:
                        killed_reason = "output_limit"
                if killed_reason == "output_limit":
                    break
        finally:
            sel.close()
            if killed_reason is not None or proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # outer + inner launcher; PID 1's death kills the namespace
                except ProcessLookupError:
                    pass
            for f in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    f.close()
                except OSError:
                    pass
            proc.wait()
        wall_time = time.monotonic() - t0
        if True:  # drain whatever status the launcher managed to write
            try:
                while chunk := os.read(status_r, 65536):
                    status_chunks.append(chunk)
            except (BlockingIOError, OSError):
                pass
        return self._result(b"".join(status_chunks), out, err, killed_reason, wall_time)

    def _result(self, status_raw: bytes, out: _BoundedBuffer, err: _BoundedBuffer, killed_reason: str | None,
                wall_time: float) -> SandboxResult:
        statuses = []
        for line in status_raw.decode(errors="replace").splitlines():
            try:
                statuses.append(json.loads(line))
            except ValueError:
                continue
        setup = next((s for s in statuses if s.get("kind") == "setup_error"), None)
        final = next((s for s in statuses if s.get("kind") in ("exited", "signaled")), None)
        returncode, cpu_time, timed_out = None, None, killed_reason == "wall_timeout"
        if final is not None:
            returncode = final["code"] if final["kind"] == "exited" else -final["signal"]
            cpu_time = final.get("cpu_time_s")
            if final.get("timed_out"):
                timed_out, killed_reason = True, killed_reason or "wall_timeout"
            elif final["kind"] == "signaled" and killed_reason is None:
                sig = final["signal"]
                cpu_hit = sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_time is not None
                                                    and cpu_time >= self.config.cpu_time_s - 0.05)
                killed_reason = "cpu_limit" if cpu_hit else "signal"
        if setup is not None and killed_reason is None:
            killed_reason = "setup_error"
        elif final is None and killed_reason is None:
            killed_reason, setup = "setup_error", {"error": "launcher ended without a status"}
        return SandboxResult(returncode=returncode, stdout=out.text(), stderr=err.text(),
                             stdout_truncated=out.truncated, stderr_truncated=err.truncated, timed_out=timed_out,
                             killed_reason=killed_reason, wall_time_s=wall_time, cpu_time_s=cpu_time,
                             isolation=self.isolation, setup_error=None if setup is None else setup.get("error"))
