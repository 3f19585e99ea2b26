"""Sandbox containment on this machine.  Every attack also has a control showing the same code
*does* succeed without the sandbox (or with the protection switched off), so each test can fail."""
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from jaxrl_async.rewards.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError, probe_isolation

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = probe_isolation()
pytestmark = pytest.mark.skipif(not (PROBE["namespaces"] and PROBE["net"] and PROBE["root"]),
                                reason=f"needs root + namespaces for the full sandbox: {PROBE}")
UID_BASE, UID_COUNT = 200_000, 100_000


@pytest.fixture(scope="module")
def sb():
    return Sandbox(SandboxConfig(wall_timeout_s=5, cpu_time_s=3, memory_bytes=256 << 20, max_processes=16,
                                 max_output_bytes=64 << 10))


def _unsandboxed(code, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)


def _sandbox_uid_pids():
    """Host pids owned by any sandbox uid."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/status") as f:
                    uid = next(int(ln.split()[1]) for ln in f if ln.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if UID_BASE <= uid < UID_BASE + UID_COUNT:
                pids.append(int(d))
    return pids


def test_basic_run_clean_identity(sb):
    res = sb.run("import os, sys\nprint(sys.stdin.read()[::-1], os.getuid(), os.getcwd(), sys.flags.isolated)",
                 stdin="abc", args=("x",))
    assert res.ok and res.killed_reason is None and not res.timed_out
    rev, uid, cwd, isolated = res.stdout.split()
    assert rev == "cba" and cwd == "/tmp/work" and isolated == "1"
    assert UID_BASE <= int(uid) < UID_BASE + UID_COUNT  # not root
    assert sb.isolation == "namespaces+net+uid+memcg+seccomp"
    fail = sb.run("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    assert (fail.returncode, fail.stdout, fail.stderr, fail.ok) == (3, "out\n", "err\n", False)


def test_infinite_loop_cpu_limit_and_wall_timeout():
    cpu = Sandbox(SandboxConfig(cpu_time_s=1, wall_timeout_s=10)).run("while True: pass")
    assert cpu.killed_reason == "cpu_limit" and cpu.returncode < 0 and cpu.wall_time_s < 4
    wall = Sandbox(SandboxConfig(cpu_time_s=10, wall_timeout_s=1)).run("import time\nwhile True: time.sleep(0.01)")
    assert wall.timed_out and wall.killed_reason == "wall_timeout" and 0.9 < wall.wall_time_s < 3


def test_fork_bomb_contained_and_no_survivors(sb):
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(500):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        os.setsid(); time.sleep(120); os._exit(0)\n"  # detached daemons trying to outlive the run
        "    n += 1\n"
        "print(n, flush=True)\n"
    )
    res = sb.run(code)
    assert res.ok, res.stderr
    assert 0 < int(res.stdout) < 16  # RLIMIT_NPROC=16 stops the forks (the root parent would not be limited)
    assert _sandbox_uid_pids() == []  # PID-namespace teardown killed every detached child
    bomb = sb.run("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", wall_timeout_s=1.5)
    assert bomb.timed_out and bomb.wall_time_s < 5
    time.sleep(0.2)
    assert _sandbox_uid_pids() == []


def test_memory_hog(sb):
    res = sb.run("x = bytearray(512 << 20)")
    assert res.returncode == 1 and "MemoryError" in res.stderr
    assert sb.run("x = bytearray(64 << 20)").ok  # control: below the 256 MiB RLIMIT_AS


def test_huge_output_bounded(sb):
    res = sb.run("import sys\nwhile True: sys.stdout.write('x' * 65536)")
    assert res.killed_reason == "output_limit" and res.stdout_truncated
    assert len(res.stdout) == 64 << 10 and res.wall_time_s < 4
    keep = Sandbox(SandboxConfig(max_output_bytes=1000, kill_on_output_overflow=False))
    res = keep.run("import sys\nfor _ in range(200): sys.stdout.write('y' * 65536)\nprint('done', file=sys.stderr)")
    assert res.ok and res.stdout_truncated and res.stdout == "y" * 1000 and res.stderr == "done\n"


def test_writes_outside_workdir_fail_or_stay_invisible(sb):
    tag = uuid.uuid4().hex
    in_project = os.path.join(PROJECT_DIR, f"PWNED-{tag}")  # the checkout, wherever it lives
    in_host = f"/usr/PWNED-{tag}"  # a host directory that is never under a sandbox-private tmpfs
    targets = [in_project, in_host, f"/var/tmp/pwned-{tag}", f"/tmp/pwned-{tag}", f"/dev/shm/pwned-{tag}"]
    code = (
        "import sys\n"
        f"for p in {targets!r}:\n"
        "    try:\n"
        "        open(p, 'w').write('x'); print(p, 'WROTE')\n"
        "    except OSError as e:\n"
        "        print(p, e.errno)\n"
        "open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())\n"
    )
    res = sb.run(code)
    assert res.ok, res.stderr
    lines = dict(ln.rsplit(" ", 1) for ln in res.stdout.splitlines()[:-1])
    assert lines[in_host] == "30"  # EROFS: the whole host tree is mounted read-only
    # the checkout too; a checkout under /tmp, /var/tmp, /dev/shm or /run is hidden by the sandbox's own empty
    # tmpfs there, so the path does not even exist inside (ENOENT)
    private = any(PROJECT_DIR.startswith(d) for d in ("/tmp/", "/var/tmp/", "/dev/shm/", "/run/"))
    assert lines[in_project] == ("2" if private else "30"), (PROJECT_DIR, lines[in_project])
    for shared in (f"/tmp/pwned-{tag}", f"/var/tmp/pwned-{tag}", f"/dev/shm/pwned-{tag}"):
        assert lines[shared] == "WROTE"  # the private tmpfs: allowed inside...
    assert res.stdout.splitlines()[-1] == "ok"  # work dir writable
    for p in targets:
        assert not os.path.exists(p), p  # ...but nothing is visible outside
    # control: the same write succeeds without the sandbox
    ctrl = _unsandboxed(f"open('/var/tmp/pwned-{tag}', 'w').write('x')")
    assert ctrl.returncode == 0 and os.path.exists(f"/var/tmp/pwned-{tag}")
    os.unlink(f"/var/tmp/pwned-{tag}")


def test_parent_secrets_invisible(sb, monkeypatch):
    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv("JAXRL_TEST_SECRET", secret)
    code = (
        "import os, glob\n"
        "found = [k for k, v in os.environ.items() if 'JAXRL_TEST_SECRET' in k or v.startswith('s3cr3t-')]\n"
        "for p in glob.glob('/proc/[0-9]*/environ'):\n"
        "    try:\n"
        "        if b's3cr3t-' in open(p, 'rb').read(): found.append(p)\n"
        "    except OSError: pass\n"
        "print(found, len(glob.glob('/proc/[0-9]*')))\n"
    )
    res = sb.run(code)
    assert res.ok, res.stderr
    assert res.stdout.startswith("[] ")
    assert int(res.stdout.split()[-1]) <= 3  # only PID 1 + the program: host processes invisible
    ctrl = _unsandboxed("import os; print(os.environ.get('JAXRL_TEST_SECRET'))")
    assert ctrl.stdout.strip() == secret  # control: an ordinary child does inherit it


def test_network_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')\n"
        "except OSError as e:\n"
        "    print('errno', e.errno)\n"
    )
    try:
        res = Sandbox(SandboxConfig(network_isolation="required")).run(code)
        assert res.ok and res.stdout.strip() == "errno 101", res.stdout  # ENETUNREACH
        # controls: host network when isolation is explicitly disabled, and an ordinary subprocess
        assert Sandbox(SandboxConfig(network_isolation="disabled")).run(code).stdout.strip() == "CONNECTED"
        assert _unsandboxed(code).stdout.strip() == "CONNECTED"
    finally:
        server.close()


def test_concurrent_runs_get_distinct_uids(sb):
    out = [None] * 4

    def work(i):
        out[i] = sb.run(f"import os, time; time.sleep(0.3); print(os.getuid(), {i})")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok for r in out)
    uids = [int(r.stdout.split()[0]) for r in out]
    assert [int(r.stdout.split()[1]) for r in out] == [0, 1, 2, 3] and len(set(uids)) == 4


def test_files_and_bad_names(sb):
    res = sb.run("print(open('data/in.txt').read())", files={"data/in.txt": "hello"})
    assert res.stdout == "hello\n"
    with pytest.raises(ValueError, match="relative"):
        sb.run("pass", files={"../escape": "x"})


def test_required_isolation_refused_when_unavailable(monkeypatch):
    import jaxrl_async.rewards.sandbox as sandbox_mod
    monkeypatch.setattr(sandbox_mod, "_probe_cache", {**PROBE, "namespaces": False, "net": False, "error": "x"})
    with pytest.raises(SandboxUnavailableError, match="network_isolation"):
        Sandbox(SandboxConfig(network_isolation="required"))
    plain = Sandbox(SandboxConfig(network_isolation="best_effort", wall_timeout_s=5))
    assert plain.isolation == "plain+uid+memcg+seccomp"
    res = plain.run("import os; print(os.getuid() != 0, os.getcwd().endswith('/work'))")
    assert res.ok and res.stdout.split() == ["True", "True"]


def test_hardening_required_refuses_and_best_effort_logs(monkeypatch, caplog):
    import jaxrl_async.rewards._isolation as isolation
    import jaxrl_async.rewards.sandbox as sandbox_mod
    monkeypatch.setattr(isolation, "_cgroups", {None: "no memory controller mounted (test)"})
    monkeypatch.setattr(sandbox_mod, "_probe_cache", {**PROBE, "seccomp": False, "seccomp_error": "EINVAL (test)"})
    monkeypatch.setattr(sandbox_mod, "_warned", set())
    with pytest.raises(SandboxUnavailableError, match="memcg: no memory controller.*seccomp: cannot install"):
        Sandbox(SandboxConfig())  # hardening follows network_isolation="required"
    with pytest.raises(SandboxUnavailableError, match="hardening='best_effort'"):
        Sandbox(SandboxConfig(network_isolation="best_effort", hardening="required"))
    with caplog.at_level("WARNING", logger="jaxrl_async.rewards.sandbox"):
        degraded = Sandbox(SandboxConfig(hardening="best_effort", memory_bytes=128 << 20))
    assert degraded.isolation == "namespaces+net+uid"
    assert any("runs without memcg, seccomp" in r.getMessage() for r in caplog.records), caplog.text
    res = degraded.run("import os; print('ok')")
    assert res.ok and res.memory_peak_bytes is None and res.isolation == "namespaces+net+uid"


class _FakeCgroupV2Os:
    """``os`` for the sandbox module in which ``mkdir`` makes a directory that looks like a cgroup v2 one."""

    FILES = {"memory.max": "max\n", "memory.swap.max": "max\n", "memory.oom.group": "0\n", "memory.peak": "0\n",
             "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n", "cgroup.procs": "", "cgroup.kill": ""}

    def __getattr__(self, name):
        return getattr(os, name)

    def mkdir(self, path, mode=0o777):
        os.mkdir(path, mode)
        for name, content in self.FILES.items():
            with open(os.path.join(path, name), "w") as f:
                f.write(content)


def test_cgroup_v2_slot_protocol_on_a_fake_hierarchy(tmp_path, monkeypatch):
    """This machine mounts the v1 memory controller; the v2 file protocol is checked on a fake tree."""
    import jaxrl_async.rewards._isolation as isolation
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    monkeypatch.setattr(isolation, "os", _FakeCgroupV2Os())
    cgroups = isolation._setup_memory_cgroups(str(tmp_path))
    assert cgroups.version == 2 and (tmp_path / "cgroup.subtree_control").read_text() == "+memory"
    run = cgroups.acquire(123 << 20)
    slot = run.path
    assert open(os.path.join(slot, "memory.max")).read() == str(123 << 20)
    assert open(os.path.join(slot, "memory.swap.max")).read() == "0"
    assert open(os.path.join(slot, "memory.oom.group")).read() == "1"
    assert run.peak_fd is not None and run.oom_before == 0
    with open(os.path.join(slot, "memory.events"), "w") as f:
        f.write("oom 1\noom_kill 1\n")
    with open(os.path.join(slot, "memory.peak"), "w") as f:
        f.write("4567\n")
    assert cgroups.finish(run) == (True, 4567)
    again = cgroups.acquire(1 << 30)  # the empty slot is reused with the new limit
    assert again.path == slot and open(os.path.join(slot, "memory.max")).read() == str(1 << 30)
    with open(os.path.join(slot, "memory.peak"), "w") as f:
        f.write("89\n")
    assert cgroups.finish(again) == (False, 89)  # OOM kills counted from the run's start
