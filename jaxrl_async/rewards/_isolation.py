"""Host-side isolation resources of the sandbox (``rewards/sandbox.py``): the process's one pool of
sandbox uids (never two live runs on one uid, locked host-wide) and the per-run memory cgroups (v2
``memory.max``, or the v1 memory controller), with their fork hygiene. Split out of ``sandbox.py``;
``Sandbox`` is their only user.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import logging
import os
import re
import signal
import stat
import sys
import threading
import time

logger = logging.getLogger("jaxrl_async.rewards.sandbox")

_UID_LOCK_DIR = "/run/jaxrl-sandbox"
_CGROUP_DIR_NAME = "jaxrl-sandbox"


# ----------------------------------------------------------------------------------------- uid pool
class _UidPool:
    """The process's one allocator of sandbox uids: a uid is never held by two live runs, whichever
    Sandbox (code reward, Python tool, ...) asks.  Across processes of the host a run also holds a
    byte-range lock on ``/run/jaxrl-sandbox/uids.lock`` at offset ``uid`` (released by the kernel when the
    process dies); where that file cannot be used, uniqueness is per process only (logged).  Uids rotate
    from a pid-dependent start so that consecutive runs rarely reuse one."""

    def __init__(self):
        self._cond = threading.Condition()
        self._used: set[int] = set()
        self._cursor = (os.getpid() * 1009) % 100_003
        self._lock_fd: int | None = None
        self._lock_tried = False

    def _host_lock(self, uid: int) -> bool:
        if not self._lock_tried:
            self._lock_tried = True
            try:
                os.makedirs(_UID_LOCK_DIR, mode=0o700, exist_ok=True)
                st = os.lstat(_UID_LOCK_DIR)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
                    raise OSError(f"{_UID_LOCK_DIR} is not a root-owned directory writable only by root")
                self._lock_fd = os.open(os.path.join(_UID_LOCK_DIR, "uids.lock"),
                                        os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                logger.warning("sandbox uid lock file unusable (%s): sandbox uids are unique per process only", exc)
        if self._lock_fd is None:
            return True
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, uid, os.SEEK_SET)
            return True
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False  # another process of this host runs a sandbox on this uid
            raise

    def acquire(self, base: int, count: int) -> int:
        """A uid of ``[base, base + count)`` held by no live run; waits while all are held."""
        with self._cond:
            while True:
                for i in range(count):
                    uid = base + (self._cursor + i) % count
                    if uid in self._used or not self._host_lock(uid):
                        continue
                    self._used.add(uid)
                    self._cursor += i + 1
                    return uid
                self._cond.wait(0.05)  # a release here notifies; one in another process is polled

    def release(self, uid: int) -> None:
        with self._cond:
            if self._lock_fd is not None:
                try:
                    fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, uid, os.SEEK_SET)
                except OSError:
                    pass
            self._used.discard(uid)
            self._cond.notify_all()


UIDS = _UidPool()


# ------------------------------------------------------------------------------------ memory cgroups
class CgroupUnavailable(Exception):
    pass


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def write_control(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class RunCgroup:
    """One run's use of a cgroup slot: the OOM-kill count before the run and the peak-reset handle."""

    def __init__(self, path: str, oom_before: int, peak_fd: int | None):
        self.path, self.oom_before, self.peak_fd = path, oom_before, peak_fd


class MemoryCgroups:
    """Memory cgroups of the runs under one base directory: one slot per concurrent run, reused from run
    to run (creating and removing a memcg per run would leave dying memcgs behind and costs more), each
    verified empty before reuse, all removed at exit."""

    def __init__(self, base: str, version: int, remove_base: bool = False):
        self.base, self.version = base, version
        self._remove_base = remove_base  # a base made under our own cgroup: removed at exit if empty
        self._free: list[str] = []
        self._all: set[str] = set()
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._pid = os.getpid()
        self._memsw = False
        self._remove_stale()

    def _remove_stale(self) -> None:
        try:
            names = os.listdir(self.base)
        except OSError:
            return
        for name in names:
            m = re.fullmatch(r"(\d+)-\d+", name)
            # a dead process's slots, or a recycled pid's (this process has created none yet)
            if m and (int(m.group(1)) == self._pid or not _pid_alive(int(m.group(1)))):
                path = os.path.join(self.base, name)
                self._empty(path)
                try:
                    os.rmdir(path)
                except OSError:
                    pass

    def _new_slot(self) -> str:
        for _ in range(100):
            path = os.path.join(self.base, f"{self._pid}-{next(self._seq)}")
            try:
                os.mkdir(path, 0o755)
                break
            except FileExistsError:  # left by an earlier process with this pid and still busy
                continue
            except FileNotFoundError:  # another process of our cgroup removed the shared base at its exit
                _make_base(self.base, self.version)
        else:
            raise OSError(errno.EEXIST, f"no free cgroup name under {self.base}")
        if self.version == 2:
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if os.path.exists(os.path.join(path, name)):
                    write_control(os.path.join(path, name), value)
        else:
            self._memsw = os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes"))
        with self._lock:
            self._all.add(path)
        return path

    def _set_limit(self, path: str, limit: int) -> None:
        if self.version == 2:
            write_control(os.path.join(path, "memory.max"), str(limit))
            return
        mem, memsw = os.path.join(path, "memory.limit_in_bytes"), os.path.join(path, "memory.memsw.limit_in_bytes")
        try:
            write_control(mem, str(limit))
        except OSError:
            if not self._memsw:
                raise
            write_control(memsw, str(limit))  # raising the limit: memory+swap must grow first
            write_control(mem, str(limit))
        if self._memsw:
            write_control(memsw, str(limit))

    def _oom_kills(self, path: str) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in _read(os.path.join(path, name)).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def acquire(self, limit: int) -> RunCgroup:
        with self._lock:
            path = self._free.pop() if self._free else None
        try:
            if path is None:
                path = self._new_slot()
            self._set_limit(path, limit)
            peak_fd = None
            if self.version == 1:
                write_control(os.path.join(path, "memory.max_usage_in_bytes"), "0")
                peak_fd = -1
            elif os.path.exists(os.path.join(path, "memory.peak")):
                fd = os.open(os.path.join(path, "memory.peak"), os.O_RDWR | os.O_CLOEXEC)
                try:
                    os.write(fd, b"reset\n")  # per open file (Linux >= 6.12); older kernels refuse the write
                    peak_fd = fd
                except OSError:
                    os.close(fd)
            return RunCgroup(path, self._oom_kills(path), peak_fd)
        except BaseException:
            if path is not None:
                self._discard(path)
            raise

    def finish(self, run: RunCgroup) -> tuple[bool, int | None]:
        """(OOM kill during the run?, peak bytes); the slot goes back to the pool if it is empty."""
        oom = peak = None
        try:
            oom = self._oom_kills(run.path) > run.oom_before
            if run.peak_fd == -1:
                peak = int(_read(os.path.join(run.path, "memory.max_usage_in_bytes")))
            elif run.peak_fd is not None:
                peak = int(os.pread(run.peak_fd, 64, 0).split()[0])
        except (OSError, ValueError, IndexError):
            pass
        finally:
            if run.peak_fd not in (None, -1):
                os.close(run.peak_fd)
        if self._empty(run.path):
            with self._lock:
                self._free.append(run.path)
        else:
            logger.warning("sandbox cgroup %s still has processes after the run; not reused", run.path)
            self._discard(run.path)
        return bool(oom), peak

    def _empty(self, path: str) -> bool:
        """Kill whatever is left in the cgroup (plain mode stragglers); True once it is empty."""
        procs = os.path.join(path, "cgroup.procs")
        deadline = time.monotonic() + 1.0
        while True:
            try:
                pids = [int(p) for p in _read(procs).split()]
            except (OSError, ValueError):
                return False
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            if os.path.exists(os.path.join(path, "cgroup.kill")):
                try:
                    write_control(os.path.join(path, "cgroup.kill"), "1")
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)

    def _discard(self, path: str) -> None:
        with self._lock:
            self._all.discard(path)
        try:
            os.rmdir(path)
        except OSError:
            pass

    def close(self) -> None:
        if os.getpid() != self._pid:
            return
        with self._lock:
            paths, self._free, self._all = list(self._all), [], set()
        for path in paths:
            self._empty(path)
            try:
                os.rmdir(path)
            except OSError:
                pass
        if self._remove_base:  # (other processes' slots left: EBUSY, they remove it)
            try:
                os.rmdir(self.base)
            except OSError:
                pass


_cgroup_lock = threading.Lock()
_cgroups: dict[str | None, MemoryCgroups | str] = {}


def _mount_points() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of the cgroup file systems."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                point = fields[4].replace("\\040", " ")
                out.append((point, rfields[0], set(rfields[2].split(","))))
    return out


def _v2_enable_memory(path: str) -> None:
    if "memory" not in _read(os.path.join(path, "cgroup.subtree_control")).split():
        write_control(os.path.join(path, "cgroup.subtree_control"), "+memory")


def _make_base(base: str, version: int) -> None:
    os.makedirs(base, mode=0o755, exist_ok=True)
    if version == 2:
        _v2_enable_memory(base)


def _own_cgroup(version: int) -> str | None:
    """This process's cgroup path (``/proc/self/cgroup``) in the v2 hierarchy or the v1 memory hierarchy."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if (version == 2 and controllers == "") or (version == 1 and "memory" in controllers.split(",")):
                    return path
    except (OSError, ValueError):
        pass
    return None


def _under_own_cgroup(point: str, version: int) -> MemoryCgroups | None:
    """Run cgroups under this process's own cgroup (so an outer limit covers them), or None (logged) where
    that cannot work: v2 needs ``memory`` delegated to it and no process in it to enable the controller for
    its children (the no-internal-process rule); v1 needs it to be writable."""
    rel = _own_cgroup(version)
    if rel is None or rel.strip("/") == "":
        return None  # we are at the hierarchy's root
    own = os.path.join(point, rel.lstrip("/"))
    base = os.path.join(own, _CGROUP_DIR_NAME)
    try:
        if not os.path.isdir(own):
            raise OSError(errno.ENOENT, f"{own} not visible in this mount namespace")
        if version == 2:
            if "memory" not in _read(os.path.join(own, "cgroup.controllers")).split():
                raise OSError(errno.EACCES, "the memory controller is not delegated to it")
            _v2_enable_memory(own)  # EBUSY where our cgroup holds processes (only the root may)
        elif _read(os.path.join(own, "memory.use_hierarchy")).strip() == "0":
            logger.warning("sandbox: %s has memory.use_hierarchy=0: its limit does not cover the run cgroups", own)
        _make_base(base, version)
    except OSError as exc:
        logger.warning("sandbox: cannot create the run cgroups under this process's cgroup %s (%s): using the "
                       "hierarchy's root %s instead, where a limit on this job does not cover them; set "
                       "SandboxConfig.cgroup_parent to a delegated cgroup to change that", own, exc, point)
        return None
    return MemoryCgroups(base, version, remove_base=True)  # rmdir at exit fails while others use it


def _setup_memory_cgroups(parent: str | None) -> MemoryCgroups:
    if not sys.platform.startswith("linux"):
        raise CgroupUnavailable(f"no cgroups on {sys.platform}")
    if os.geteuid() != 0:
        raise CgroupUnavailable("not root: cannot create memory cgroups")
    try:
        if parent is not None:
            if os.path.exists(os.path.join(parent, "cgroup.controllers")):
                if "memory" not in _read(os.path.join(parent, "cgroup.controllers")).split():
                    raise CgroupUnavailable(f"cgroup_parent {parent}: no memory controller in cgroup.controllers")
                _v2_enable_memory(parent)
                return MemoryCgroups(parent, 2)
            if os.path.exists(os.path.join(parent, "memory.limit_in_bytes")):
                return MemoryCgroups(parent, 1)
            raise CgroupUnavailable(f"cgroup_parent {parent} is not a cgroup v2 directory nor a v1 memory cgroup")
        mounts = _mount_points()
        for point, fstype, _ in mounts:
            if fstype == "cgroup2" and "memory" in _read(os.path.join(point, "cgroup.controllers")).split():
                own = _under_own_cgroup(point, 2)
                if own is not None:
                    return own
                _v2_enable_memory(point)  # allowed at the root of the hierarchy (it may hold processes)
                base = os.path.join(point, _CGROUP_DIR_NAME)
                os.makedirs(base, mode=0o755, exist_ok=True)
                _v2_enable_memory(base)
                return MemoryCgroups(base, 2)
        for point, fstype, opts in mounts:
            if fstype == "cgroup" and "memory" in opts:
                own = _under_own_cgroup(point, 1)
                if own is not None:
                    return own
                base = os.path.join(point, _CGROUP_DIR_NAME)
                os.makedirs(base, mode=0o755, exist_ok=True)
                return MemoryCgroups(base, 1)
    except OSError as exc:
        raise CgroupUnavailable(f"cannot set up a memory cgroup: {exc}") from exc
    raise CgroupUnavailable("no memory controller mounted (neither cgroup v2 nor the v1 memory hierarchy)")


def memory_cgroups(parent: str | None) -> MemoryCgroups:
    """The process's run cgroups under ``parent`` (cached; raises CgroupUnavailable with the reason)."""
    with _cgroup_lock:
        got = _cgroups.get(parent)
        if got is None:
            try:
                got = _setup_memory_cgroups(parent)
            except CgroupUnavailable as exc:
                got = str(exc)
            _cgroups[parent] = got
    if isinstance(got, str):
        raise CgroupUnavailable(got)
    return got


@atexit.register
def _close_cgroups() -> None:
    for got in list(_cgroups.values()):
        if isinstance(got, MemoryCgroups):
            got.close()


def _after_fork_in_child() -> None:
    global UIDS, _cgroups, _cgroup_lock
    UIDS = _UidPool()  # the parent's runs and locks are not this process's
    _cgroup_lock = threading.Lock()
    _cgroups = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
