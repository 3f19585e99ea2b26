"""Code-execution sandbox for untrusted Python (code rewards, agent tools).

Each :meth:`Sandbox.run` starts a fresh process tree through ``_sandbox_launcher.py`` (read its
docstring for the process tree) and never raises for anything the untrusted program does: every
outcome is a :class:`SandboxResult`.  Safe to call from many threads at once (no ``preexec_fn``; each
call owns its pipes; one sandbox uid per concurrent run, host-wide).

What contains what (``namespaces`` mode, i.e. running as root on Linux, as on the dev machines and
the usual TPU/GPU VMs; every row is an attack in ``tests/rewards/test_sandbox.py`` or
``tests/rewards/test_sandbox_attacks.py``):

===================  =======================================================================
attack               containment
===================  =======================================================================
infinite loop        ``RLIMIT_CPU`` (SIGXCPU at the soft limit, SIGKILL one second later) and
                     the wall deadline (PID 1 ``kill(-1, SIGKILL)``; the parent kills the whole
                     launcher process group ``wall_timeout_s + 2`` s later as a last resort).
fork bomb            ``RLIMIT_NPROC`` applies because the program runs as a *non-root* sandbox uid
                     (root ignores it) that no other live run holds (one uid pool per process, and
                     a byte-range lock per uid on ``/run/jaxrl-sandbox/uids.lock`` across
                     processes), so the count is per run; plus the PID namespace: when the
                     program's main process exits or is killed, PID 1 exits and the kernel
                     SIGKILLs everything left in the namespace (``setsid`` does not help).
memory hog           a memory cgroup per run (v2 ``memory.max``, or the v1 memory controller
                     where that is the one mounted) caps everything the run's processes use
                     together: anonymous memory of every process, tmpfs and shared-memory pages,
                     kernel memory; the OOM killer ends the run (``killed_reason="memory_limit"``).
                     ``RLIMIT_AS`` per process on top (→ ``MemoryError`` for a single big
                     allocation); the tmpfs is capped at ``tmpfs_bytes``.
SysV shm, memfd      denied by seccomp (``EPERM``), and charged to the cgroup anyway.
uncharged kernel     socket buffers are not (fully) charged to the memory cgroup: no netlink
memory               sockets, no unix sockets unless ``allow_unix_sockets`` (then stream only),
                     buffer sizes cannot be raised; inet sockets hold nothing in the private
                     network namespace.  Pipes, epoll, inotify, timers are charged; per-uid
                     limits (``RLIMIT_SIGPENDING``, ``RLIMIT_MSGQUEUE`` 0, pipe/inotify user
                     limits) bound the rest.  Every rlimit is reset (``_rlimits``): no real-time
                     priority, no nice boost.
huge output          the parent keeps at most ``max_output_bytes`` per stream and (by default)
                     kills the run on overflow; nothing unbounded is ever buffered.
writes outside cwd   the whole mount tree is recursively read-only + nosuid + nodev inside the
                     private mount namespace; the only writable place is one private, size-capped
                     tmpfs on ``/tmp`` (work dir ``/tmp/work``; the same tmpfs is ``/var/tmp`` and
                     ``/dev/shm``) that exists only in that namespace and vanishes with it.  It is
                     ``noexec`` unless ``allow_exec=True``: dropped binaries and shared objects cannot
                     be executed or mapped executable.  The program is not root (sandbox uid, no
                     groups, ``no_new_privs``) and ``RLIMIT_FSIZE`` caps each file.
host unix sockets    filesystem sockets are not network-namespaced and a read-only mount does not
                     stop ``connect``: ``/tmp``, ``/var/tmp``, ``/dev/shm`` are the private tmpfs,
                     ``/run`` (and ``/var/run``) an empty read-only tmpfs, ``/dev`` a minimal
                     read-only tmpfs (null, zero, full, random, urandom): no host socket, FIFO or
                     device node there is reachable.  Abstract sockets are per network namespace.
kernel keyrings      a new anonymous session keyring per run (the parent's session keyring, whose
                     keys every descendant *possesses*, is gone), the uid's user keyrings emptied,
                     and ``keyctl`` / ``add_key`` / ``request_key`` denied by seccomp.
kernel surface       a seccomp allow-list (``_seccomp.py``): no new namespaces (user namespaces
                     included), ``io_uring``, ``ptrace``, ``bpf``, ``perf_event_open``, mounts,
                     ``userfaultfd``, SysV IPC, ``memfd_create``, keyrings, ``AF_NETLINK``,
                     ``AF_VSOCK``/``AF_ALG`` sockets, ...; unknown syscalls get ``ENOSYS``.
parent's secrets     ``execve`` with a minimal explicit environment (``PATH``, ``HOME``, ``LANG``,
                     ``TMPDIR`` plus ``SandboxConfig.env``); Python runs with ``-I``.  ``/proc`` is
                     a fresh mount of the new PID namespace, so host processes (and their
                     ``/proc/<pid>/environ``) are not even visible.
network              new network namespace: only a down loopback device, so every connect
                     (including to 127.0.0.1 of the host) fails with ``ENETUNREACH``.
===================  =======================================================================

Hardening (``SandboxConfig.hardening``): the seccomp filter needs x86_64 or aarch64; the memory cgroup
needs root and a memory controller (cgroup v2 with ``memory`` available at the root of the hierarchy or
in ``cgroup_parent``; else the v1 memory hierarchy).  ``"required"`` (the default whenever
``network_isolation="required"``) refuses to construct a Sandbox without them
(:class:`SandboxUnavailableError` naming what is missing); ``"best_effort"`` runs without the missing
parts, logs one warning per process naming them and leaves them out of :attr:`Sandbox.isolation`
(e.g. ``"namespaces+net+uid+seccomp"`` instead of ``"namespaces+net+uid+memcg+seccomp"``).  The run
cgroups live in ``<this process's memory cgroup>/jaxrl-sandbox/<pid>-<n>`` (one per concurrent run,
reused, removed at exit; leftovers of dead processes are removed by the next Sandbox), so an outer limit
on the job covers them, or under ``cgroup_parent`` (e.g. a systemd ``Delegate=yes`` unit).  Where the
own cgroup cannot hold them (v2: processes in it and no delegation; v1: not writable) they go to the
hierarchy's root, logged once.

Fallback (``plain`` mode: no namespaces, e.g. an unprivileged container): rlimits, uid switch
when root, the memory cgroup and seccomp filter when available, own process group killed at the end
and (as root) every process of the run's uid, parent-made work dir deleted afterwards; no network or
filesystem isolation, so it is refused unless ``network_isolation="best_effort"`` or ``"disabled"`` is
configured explicitly.  Known gaps in every mode: world-readable host files remain readable, and so does
a world-writable unix socket *outside* the directories above; without root (plain mode) there is no uid
switch, no cgroup, and a ``setsid`` daemon can outlive the run (the parent stops reading its output
0.5 s after the program ended).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import logging
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

from jaxrl_async.rewards import _isolation, _seccomp
from jaxrl_async.rewards._isolation import CgroupUnavailable, RunCgroup, write_control

__all__ = [
    "SandboxConfig",
    "SandboxResult",
    "Sandbox",
    "SandboxUnavailableError",
    "probe_isolation",
]

logger = logging.getLogger(__name__)

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_launcher.py")
_MAIN = "main.py"
_STATUS_GRACE_S = 0.5  # output still read after the program's end (a daemon may hold the pipes)


class SandboxUnavailableError(RuntimeError):
    """The requested isolation cannot be provided on this machine."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run.  Sizes in bytes, times in seconds.

    Attributes:
      wall_timeout_s: wall-clock limit of the program (from fork to exit).
      cpu_time_s: ``RLIMIT_CPU`` soft limit (hard = soft + 1 s), summed over the program's threads.
      memory_bytes: memory of the whole run (every process, tmpfs and shared memory) through the run's
        memory cgroup, and ``RLIMIT_AS`` (virtual address space) of each process.
      file_size_bytes: ``RLIMIT_FSIZE``: largest file the program may write.
      max_processes: ``RLIMIT_NPROC`` for the sandbox uid (processes + threads).
      max_open_files: ``RLIMIT_NOFILE``.
      tmpfs_bytes: size cap of the private tmpfs holding ``/tmp`` (the work dir), ``/var/tmp``, ``/dev/shm``.
      max_output_bytes: bytes kept per stream (stdout, stderr); the rest is dropped.
      kill_on_output_overflow: kill the program as soon as a stream exceeds ``max_output_bytes``.
      network_isolation: ``"required"`` refuses to run without a private network namespace;
        ``"best_effort"`` uses one if possible; ``"disabled"`` shares the host network (explicit opt-in).
      hardening: the seccomp filter and the memory cgroup (module docstring): ``"required"`` refuses to
        construct without them, ``"best_effort"`` logs what is missing and runs; ``None`` (default):
        ``"required"`` if ``network_isolation == "required"``, else ``"best_effort"``.
      allow_unix_sockets: let the program create ``AF_UNIX`` *stream* sockets and socket pairs (``asyncio``'s
        event loop and ``multiprocessing.Pipe()`` need one; ``os.pipe``, ``subprocess``,
        ``multiprocessing.Pool`` / ``Queue`` and ``concurrent.futures`` do not).  Off by default: the kernel
        does not charge the sk_buff heads of queued unix data to the memory cgroup (~1 MiB per filled pair,
        measured), so with it on, host memory outside ``memory_bytes`` is bounded only by
        ``max_processes * max_open_files`` filled sockets (buffer sizes cannot be raised: the filter denies
        ``SO_SNDBUF`` / ``SO_RCVBUF``); keep both limits small in configs that turn it on.
      allow_exec: let the program execute (or map executable) files it writes to the tmpfs; off by
        default (``noexec``), turn on only for configs that compile and run binaries.
      cgroup_parent: directory of a delegated cgroup to create the run cgroups in (v2: ``memory`` in its
        ``cgroup.controllers``; v1: a directory of the memory hierarchy); ``None``: a ``jaxrl-sandbox``
        cgroup under this process's own memory cgroup, so that a limit on the job covers the runs too
        (v2 without delegation there, or an unwritable v1 directory: the hierarchy's root, logged).
      python: interpreter for the program; ``None`` picks ``sys.executable`` if the sandbox uid can
        execute it (every path component world-searchable), else ``/usr/bin/python3``.
      env: extra environment variables for the program (nothing else is inherited).
      uid_base, uid_count: sandbox uids are drawn from ``[uid_base, uid_base + uid_count)``, one per
        concurrent run across every Sandbox of the process and (through a lock file) of the host
        (unused uids without a passwd entry; only when the parent is root).
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
    hardening: Literal["required", "best_effort"] | None = None
    allow_unix_sockets: bool = False
    allow_exec: bool = False
    cgroup_parent: str | None = None
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
        if self.hardening not in (None, "required", "best_effort"):
            raise ValueError(f"SandboxConfig.hardening must be 'required', 'best_effort' or None, "
                             f"got {self.hardening!r}")

    @property
    def effective_hardening(self) -> str:
        if self.hardening is not None:
            return self.hardening
        return "required" if self.network_isolation == "required" else "best_effort"


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run.

    ``returncode``: exit code, ``-signal`` if killed by a signal, ``None`` if the program never ran
    (``killed_reason == "setup_error"``).  ``killed_reason``: ``None`` or one of ``"wall_timeout"``,
    ``"cpu_limit"``, ``"memory_limit"`` (the run's memory cgroup OOM-killed the program),
    ``"output_limit"``, ``"signal"``, ``"setup_error"``.  ``memory_peak_bytes``: the run cgroup's peak
    usage (``None`` without a cgroup or where the kernel cannot reset it between runs).
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
    memory_peak_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


# ----------------------------------------------------------------------------------- isolation probe
_probe_lock = threading.Lock()
_probe_cache: dict | None = None


def probe_isolation() -> dict:
    """What this machine allows (cached per process):
    ``{"root", "namespaces", "net", "seccomp", "error", "seccomp_error"}``."""
    global _probe_cache
    with _probe_lock:
        if _probe_cache is None:
            if not sys.platform.startswith("linux"):
                _probe_cache = {"root": False, "namespaces": False, "net": False, "seccomp": False,
                                "error": sys.platform}
            else:
                proc = subprocess.run([sys.executable, "-I", "-S", _LAUNCHER, "--probe"], capture_output=True,
                                      timeout=30, env={})
                try:
                    _probe_cache = json.loads(proc.stdout.decode().strip().splitlines()[-1])
                except (IndexError, ValueError):
                    _probe_cache = {"root": os.geteuid() == 0, "namespaces": False, "net": False, "seccomp": False,
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


# uid pool and memory cgroups: rewards/_isolation.py




_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning("%s", message)


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


_seccomp_cache: dict[str, str] = {}


def _seccomp_program(arch: str, unix_sockets: bool) -> str:
    """The compiled filter for ``arch``, base64 (built once per process and variant)."""
    key = f"{arch}:{int(unix_sockets)}"
    with _warned_lock:
        if key not in _seccomp_cache:
            _seccomp_cache[key] = base64.b64encode(_seccomp.build_filter(arch, unix_sockets)).decode()
        return _seccomp_cache[key]


def _seccomp_first_pass() -> str:
    """Tests only (controls): the first pass's socket rules (netlink and unix sockets of any type allowed,
    buffer sizes settable), everything else as now."""
    arch = _seccomp.host_arch()
    saved = (_seccomp.SOCKET_FAMILIES, _seccomp.BUFFER_OPTIONS)
    try:
        _seccomp.SOCKET_FAMILIES, _seccomp.BUFFER_OPTIONS = (1, 2, 10, 16), ()
        return base64.b64encode(_seccomp.build_filter(arch, unix_sockets=True)).decode()
    finally:
        _seccomp.SOCKET_FAMILIES, _seccomp.BUFFER_OPTIONS = saved


_SIGPENDING = 1024  # queued signals and POSIX timers (each timer holds one) of the run's uid
_MEMLOCK = 64 << 10  # the kernel's historical default; locked pages are charged to the cgroup anyway


def _rlimits(cfg: SandboxConfig, cpu: int, full: bool) -> dict[str, list[int]]:
    """Every resource limit of the program: the configured ones, and every other limit reset to a value
    that needs no trust in the parent's: no real-time priority or time (``RLIMIT_RTPRIO`` / ``RLIMIT_RTTIME``),
    no nice boost (``RLIMIT_NICE`` 0: the nice value can only grow), no POSIX message queue bytes, few
    queued signals / POSIX timers, the historical ``RLIMIT_MEMLOCK``; ``RLIMIT_DATA`` / ``RLIMIT_RSS`` =
    ``memory_bytes``.  ``RLIMIT_STACK`` keeps the parent's value (stack pages count in the memory cgroup and
    ``RLIMIT_AS``; solutions raise it for deep recursion).  ``full=False``: the first pass's six (controls)."""
    out = {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [cfg.memory_bytes, cfg.memory_bytes],
        "RLIMIT_FSIZE": [cfg.file_size_bytes, cfg.file_size_bytes],
        "RLIMIT_NPROC": [cfg.max_processes, cfg.max_processes],
        "RLIMIT_NOFILE": [cfg.max_open_files, cfg.max_open_files],
        "RLIMIT_CORE": [0, 0],
    }
    if full:
        out.update({
            "RLIMIT_RTPRIO": [0, 0],
            "RLIMIT_RTTIME": [cpu * 1_000_000, cpu * 1_000_000],
            "RLIMIT_NICE": [0, 0],
            "RLIMIT_MSGQUEUE": [0, 0],
            "RLIMIT_SIGPENDING": [_SIGPENDING, _SIGPENDING],
            "RLIMIT_MEMLOCK": [_MEMLOCK, _MEMLOCK],
            "RLIMIT_DATA": [cfg.memory_bytes, cfg.memory_bytes],
            "RLIMIT_RSS": [cfg.memory_bytes, cfg.memory_bytes],
        })
    return out


class Sandbox:
    """Runs untrusted Python programs; see the module docstring for the guarantees."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = cfg = config or SandboxConfig()
        probe = probe_isolation()
        self._root = bool(probe["root"]) and os.geteuid() == 0
        want_net = cfg.network_isolation != "disabled"
        self._mode = "namespaces" if probe["namespaces"] else "plain"
        self._unshare_net = want_net and bool(probe["net"])
        if cfg.network_isolation == "required" and not (self._mode == "namespaces" and self._unshare_net):
            raise SandboxUnavailableError(
                "SandboxConfig.network_isolation='required' but this machine cannot create network/mount/PID "
                f"namespaces (probe: {probe}); run as root with CAP_SYS_ADMIN, or set "
                "network_isolation='best_effort' to accept the unisolated fallback")
        self._python = cfg.python or _default_python(self._root)
        # hardening: seccomp filter + memory cgroup (+ the keyring reset, which needs the keyctl number)
        missing: dict[str, str] = {}
        arch = _seccomp.host_arch()
        self._seccomp_b64: str | None = None
        self._keyctl_nr: int | None = None
        if arch is None:
            missing["seccomp"] = "no seccomp policy for this architecture (x86_64 and aarch64 only)"
        else:
            self._keyctl_nr = _seccomp.syscall_numbers(arch)["keyctl"]
            if probe.get("seccomp"):
                self._seccomp_b64 = _seccomp_program(arch, cfg.allow_unix_sockets)
            else:
                missing["seccomp"] = f"cannot install a seccomp filter here: {probe.get('seccomp_error', '?')}"
        self._cgroups: _isolation.MemoryCgroups | None = None
        try:
            self._cgroups = _isolation.memory_cgroups(cfg.cgroup_parent)
        except CgroupUnavailable as exc:
            missing["memcg"] = str(exc)
        if missing:
            detail = "; ".join(f"{k}: {v}" for k, v in sorted(missing.items()))
            if cfg.effective_hardening == "required":
                raise SandboxUnavailableError(
                    f"SandboxConfig.hardening='required' (the default with network_isolation='required') but "
                    f"{detail}; set hardening='best_effort' to run without (logged)")
            _warn_once(f"sandbox runs without {', '.join(sorted(missing))} (hardening='best_effort'): {detail}")
        self._missing = missing
        # Tests only: protections to leave out, to show that an attack works without them (controls).
        # Members: "seccomp", "memcg", "keyring", "shared_dirs", "kill_uid", "rlimits" (only the first
        # pass's CPU/AS/FSIZE/NPROC/NOFILE/CORE: the others stay as inherited), "socket_rules" (the filter
        # of the first pass: netlink and unix sockets of any type, buffer sizes settable).
        self._disabled: frozenset[str] = frozenset()

    @property
    def isolation(self) -> str:
        """e.g. ``"namespaces+net+uid+memcg+seccomp"`` or ``"plain"``."""
        parts = [self._mode] + (["net"] if self._mode == "namespaces" and self._unshare_net else [])
        parts += ["uid"] if self._root else []
        parts += ["memcg"] if self._cgroups is not None and "memcg" not in self._disabled else []
        parts += ["seccomp"] if self._seccomp_b64 is not None and "seccomp" not in self._disabled else []
        return "+".join(parts)

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
        off = self._disabled

        uid = _isolation.UIDS.acquire(cfg.uid_base, cfg.uid_count) if self._root else None
        staging = None
        cgroup: RunCgroup | None = None
        status_r, status_w = os.pipe()
        # fds still owned by this call; _spawn_and_collect closes the write end right after the spawn and
        # removes it here, so the finally below never closes a number another thread may have reused.
        open_fds = [status_r, status_w]
        try:
            staging = tempfile.mkdtemp(prefix="jaxrl-sandbox-")
            if self._cgroups is not None and "memcg" not in off:
                try:
                    cgroup = self._cgroups.acquire(cfg.memory_bytes)
                except OSError as exc:
                    if cfg.effective_hardening == "required":
                        return self._setup_failure(f"memory cgroup: {exc}")
                    _warn_once(f"sandbox run without its memory cgroup (hardening='best_effort'): {exc}")
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
                "rlimits": _rlimits(cfg, cpu, "rlimits" not in off),
                "tmpfs_bytes": cfg.tmpfs_bytes,
                "wall_timeout_s": wall,
                "status_fd": status_w,
                "seccomp": (None if "seccomp" in off or self._seccomp_b64 is None else
                            _seccomp_first_pass() if "socket_rules" in off else self._seccomp_b64),
                "keyctl_nr": None if "keyring" in off else self._keyctl_nr,
                "allow_exec": bool(cfg.allow_exec),
                "private_shared_dirs": "shared_dirs" not in off,
                "kill_uid": "kill_uid" not in off,
            }
            go = None
            if cgroup is not None:
                go = os.pipe()
                open_fds += list(go)
                launcher_cfg["cgroup_go_fd"] = go[0]
            cfg_path = os.path.join(staging, "launcher.json")
            fd = os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(launcher_cfg, f)
            res = self._spawn_and_collect(cfg_path, status_r, status_w, stdin_bytes, wall, open_fds, cgroup, go)
            if cgroup is not None:
                oom, peak = self._cgroups.finish(cgroup)
                cgroup = None
                res = self._with_memory(res, oom, peak)
            return res
        finally:
            if cgroup is not None:  # not reached finish(): an exception above
                self._cgroups.finish(cgroup)
            for fd in open_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            if uid is not None:
                _isolation.UIDS.release(uid)

    def _setup_failure(self, error: str) -> SandboxResult:
        return SandboxResult(returncode=None, stdout="", stderr="", stdout_truncated=False, stderr_truncated=False,
                             timed_out=False, killed_reason="setup_error", wall_time_s=0.0, cpu_time_s=None,
                             isolation=self.isolation, setup_error=error)

    @staticmethod
    def _with_memory(res: SandboxResult, oom: bool, peak: int | None) -> SandboxResult:
        reason = res.killed_reason
        killed = reason in (None, "signal", "cpu_limit") and res.returncode == -signal.SIGKILL
        if oom and (killed or reason == "setup_error"):  # (the OOM killer may pick a launcher process too)
            reason = "memory_limit"
        return dataclasses.replace(res, killed_reason=reason, memory_peak_bytes=peak)

    # ------------------------------------------------------------------------------------ internals
    def _spawn_and_collect(self, cfg_path: str, status_r: int, status_w: int, stdin_bytes: bytes,
                           wall: float, open_fds: list[int], cgroup: RunCgroup | None,
                           go: tuple[int, int] | None) -> SandboxResult:
        cfg = self.config
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-S", _LAUNCHER, cfg_path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, close_fds=True,
                                pass_fds=(status_w,) + ((go[0],) if go else ()), start_new_session=True, cwd="/")
        for fd in [status_w] + ([go[0]] if go else []):
            open_fds.remove(fd)
            os.close(fd)
        if go is not None:  # the launcher waits for this before it forks anything (see _sandbox_launcher.main)
            try:
                write_control(os.path.join(cgroup.path, "cgroup.procs"), str(proc.pid))
                ok = b"1"
            except OSError as exc:
                logger.warning("sandbox: cannot move the launcher into %s: %s", cgroup.path, exc)
                ok = b"0"
            try:
                os.write(go[1], ok)
            except OSError:
                pass
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
            status_open = True
            while sel.get_map():
                now = time.monotonic()
                remaining = parent_deadline - now
                if remaining <= 0:
                    if status_open:
                        killed_reason = "wall_timeout"
                    break  # else: the program ended long ago; something it left holds the pipes
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
                        if key.fd == status_r:  # the launcher has exited: the program's end is known
                            status_open = False
                            parent_deadline = min(parent_deadline, time.monotonic() + _STATUS_GRACE_S)
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
