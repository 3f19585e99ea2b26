"""Sandbox attack suite (issue 17): each attack is untrusted code run through the public API
(``Sandbox.run`` / ``CodeReward``) and asserts containment; each has a control where practical that
shows the same attack *working* with that one protection left out (``Sandbox._disabled``, tests only)
or with the old design, so that the test can fail.  Kernel features that a control needs and this
machine lacks are skipped with the reason."""
import errno
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from jaxrl_async.rewards import _seccomp
from jaxrl_async.rewards import _isolation as isolation
from jaxrl_async.rewards import sandbox as sandbox_mod
from jaxrl_async.rewards.code_reward import CodeReward, CodeRewardConfig
from jaxrl_async.rewards.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError, probe_isolation

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = probe_isolation()
ARCH = _seccomp.host_arch()
NR = _seccomp.syscall_numbers(ARCH) if ARCH else {}
FULL = bool(PROBE["namespaces"] and PROBE["net"] and PROBE["root"])
needs_full = pytest.mark.skipif(not FULL, reason=f"needs root + namespaces for the full sandbox: {PROBE}")

# untrusted-side helper: raw syscalls by name (numbers of this architecture), -errno on failure
SYSCALL_PRELUDE = """
import ctypes, json, os, sys
_libc = ctypes.CDLL(None, use_errno=True)
NR = %r
def sc(name, *args):
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    r = _libc.syscall(ctypes.c_long(NR[name]), *args)
    return r if r >= 0 else -ctypes.get_errno()
"""


def prelude() -> str:
    return SYSCALL_PRELUDE % ({k: NR[k] for k in (
        "keyctl", "add_key", "unshare", "clone", "clone3", "io_uring_setup", "memfd_create", "shmget",
        "ptrace", "bpf", "perf_event_open", "mount", "userfaultfd", "setns")},)


def hardened(**kw) -> Sandbox:
    """A Sandbox that must have every protection (skips with the reason where the machine cannot)."""
    if not FULL:
        pytest.skip(f"needs root + namespaces: {PROBE}")
    try:
        return Sandbox(SandboxConfig(hardening="required", **kw))
    except SandboxUnavailableError as exc:
        pytest.skip(f"hardening unavailable on this machine: {exc}")


def without(sb_kwargs: dict, *protections: str) -> Sandbox:
    sb = hardened(**sb_kwargs)
    sb._disabled = frozenset(protections)
    return sb


def out_json(res):
    assert res.returncode == 0, (res.killed_reason, res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------- seccomp policy
def run_bpf(prog: bytes, nr: int, arch: int, args=(0,) * 6) -> int:
    """A classic-BPF interpreter for the instructions the compiler emits."""
    ins = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * 6)[:6])
    pc, acc = 0, 0
    for _ in range(len(ins) + 1):
        code, jt, jf, k = ins[pc]
        if code == 0x20:
            acc, pc = struct.unpack_from("=I", data, k)[0], pc + 1
        elif code == 0x06:
            return k
        elif code == 0x05:
            pc += 1 + k
        elif code == 0x54:  # ALU AND K
            acc, pc = acc & k, pc + 1
        elif code in (0x15, 0x35, 0x45):
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += 1 + (jt if hit else jf)
        else:
            raise AssertionError(f"unknown opcode {code:#x}")
    raise AssertionError("program did not return")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_policy_compiles_to_the_intended_decisions(arch):
    prog, table, audit = _seccomp.build_filter(arch), _seccomp.syscall_numbers(arch), _seccomp.AUDIT_ARCH[arch]
    allow, eperm, enosys = 0x7FFF0000, 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS
    for name, nr in table.items():
        if name in _seccomp.ALLOWED:
            assert run_bpf(prog, nr, audit) == allow, name
        elif name in _seccomp.DENIED:
            assert run_bpf(prog, nr, audit) == eperm, name
    for name in ("keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter", "shmget", "memfd_create",
                 "unshare", "setns", "ptrace", "mount", "bpf", "perf_event_open", "userfaultfd"):
        assert run_bpf(prog, table[name], audit) == eperm, name
    for name in ("read", "write", "openat", "mmap", "futex", "execve", "wait4", "rt_sigreturn", "exit_group"):
        assert run_bpf(prog, table[name], audit) == allow, name
    clone = table["clone"]
    assert run_bpf(prog, clone, audit, (0x01200011,)) == allow  # fork()'s flags
    assert run_bpf(prog, clone, audit, (0x003D0F00,)) == allow  # pthread_create's flags
    for flag in (0x10000000, 0x40000000, 0x20000000, 0x00020000, 0x08000000, 0x04000000, 0x02000000):
        assert run_bpf(prog, clone, audit, (flag | 17,)) == eperm, hex(flag)
    assert run_bpf(prog, table["clone3"], audit) == enosys  # glibc falls back to clone
    eafno = 0x50000 | errno.EAFNOSUPPORT
    for family, want in ((1, eafno), (2, allow), (10, allow), (16, eafno), (40, eafno), (38, eafno), (17, eafno)):
        assert run_bpf(prog, table["socket"], audit, (family, 1)) == want, family
    assert run_bpf(prog, table["socketpair"], audit, (1, 1)) == eafno
    unix = _seccomp.build_filter(arch, unix_sockets=True)  # SandboxConfig.allow_unix_sockets
    for args, want in (((1, 1), allow), ((1, 1 | 0x80800), allow), ((1, 2), eafno), ((1, 5), eafno), ((16, 3), eafno),
                       ((2, 2), allow)):
        assert run_bpf(unix, table["socket"], audit, args) == want, args
        if args[0] != 2:
            assert run_bpf(unix, table["socketpair"], audit, args) == want, args
    for p in (prog, unix):  # buffer sizes cannot be raised; other options can be set
        for opt in (7, 8, 32, 33):
            assert run_bpf(p, table["setsockopt"], audit, (3, 1, opt)) == eperm, opt
        assert run_bpf(p, table["setsockopt"], audit, (3, 1, 2)) == allow  # SO_REUSEADDR
        assert run_bpf(p, table["setsockopt"], audit, (3, 6, 7)) == allow  # IPPROTO_TCP option 7
    assert run_bpf(prog, table["personality"], audit, (0xFFFFFFFF,)) == allow
    assert run_bpf(prog, table["personality"], audit, (0x0040000,)) == eperm  # ADDR_NO_RANDOMIZE
    assert run_bpf(prog, 999, audit) == enosys and run_bpf(prog, 0x40000000 + 250, audit) == enosys  # x32 keyctl
    other = _seccomp.AUDIT_ARCH["aarch64" if arch == "x86_64" else "x86_64"]
    assert run_bpf(prog, 0, other) == 0x80000000 and run_bpf(prog, 0, 0x40000003) == 0x80000000  # KILL_PROCESS


# -------------------------------------------------------------------------------------- keyrings
KEYRING_HELPER = """
import ctypes, json, sys
sys.path.insert(0, {project!r})
from jaxrl_async.rewards.sandbox import Sandbox, SandboxConfig
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL = {keyctl}
def kc(*a):
    a = [ctypes.c_long(x) if isinstance(x, int) else x for x in a]
    return libc.syscall(ctypes.c_long(KEYCTL), *a)
assert kc(1, None) > 0  # KEYCTL_JOIN_SESSION_KEYRING: a session keyring of our own (nothing shared is touched)
assert libc.syscall(ctypes.c_long({add_key}), b"user", {desc!r}.encode(), {secret!r}.encode(),
                    ctypes.c_long(len({secret!r})), ctypes.c_long(-3)) > 0
sb = Sandbox(SandboxConfig(hardening="required"))
sb._disabled = frozenset({disabled!r})
res = sb.run({code!r})
planted = kc(10, -3, b"user", {plant!r}.encode(), 0)  # KEYCTL_SEARCH in our session keyring
print(json.dumps({{"stdout": res.stdout, "stderr": res.stderr[-1000:], "planted_seen": planted > 0}}))
"""

KEYRING_ATTACK = """
out = {}
kid = sc("keyctl", 10, -3, b"user", DESC.encode(), 0)  # search the session keyring for the parent's key
out["search"] = kid
if kid > 0:
    buf = ctypes.create_string_buffer(256)
    n = sc("keyctl", 11, kid, buf, 256)
    out["secret"] = buf.raw[:max(n, 0)].decode(errors="replace")
out["plant"] = sc("add_key", b"user", PLANT.encode(), b"planted", 7, -3)
print(json.dumps(out))
"""


def _keyring_run(disabled):
    tag = uuid.uuid4().hex[:12]
    desc, plant, secret = f"jaxrl-test-secret-{tag}", f"jaxrl-test-plant-{tag}", f"s3cr3t-{tag}"
    code = prelude() + f"DESC, PLANT = {desc!r}, {plant!r}\n" + KEYRING_ATTACK
    helper = KEYRING_HELPER.format(project=PROJECT_DIR, keyctl=NR["keyctl"], add_key=NR["add_key"], desc=desc,
                                   secret=secret, plant=plant, disabled=sorted(disabled), code=code)
    proc = subprocess.run([sys.executable, "-c", helper], capture_output=True, text=True, timeout=60, cwd=PROJECT_DIR)
    if proc.returncode != 0 and "AssertionError" in proc.stderr and "kc(1, None)" in proc.stderr:
        pytest.skip(f"kernel keyrings unavailable: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report, json.loads(report["stdout"].strip().splitlines()[-1]), secret


@needs_full
def test_keyring_parent_session_secret_unreadable_and_planted_key_invisible():
    hardened()
    report, attack, secret = _keyring_run(disabled=())
    assert attack["search"] == -errno.EPERM and "secret" not in attack  # keyctl denied by seccomp
    assert attack["plant"] == -errno.EPERM and not report["planted_seen"]
    # with seccomp alone (no keyring reset) the parent's session keyring is still not the program's
    report, attack, _ = _keyring_run(disabled=("keyring",))
    assert attack["search"] == -errno.EPERM and not report["planted_seen"]
    report, attack, _ = _keyring_run(disabled=("seccomp",))  # the fresh session keyring alone
    assert attack["search"] < 0 and "secret" not in attack and not report["planted_seen"]
    # control: both off -> the program reads the parent's secret and plants a key the parent then sees
    report, attack, secret = _keyring_run(disabled=("seccomp", "keyring"))
    assert attack.get("secret") == secret and attack["plant"] > 0 and report["planted_seen"]


@needs_full
def test_keyring_nothing_left_between_runs_on_one_uid():
    tag = uuid.uuid4().hex[:12]
    store = prelude() + f"print(json.dumps({{'add': sc('add_key', b'user', b'left-{tag}', b'data', 4, -4)}}))"
    fetch = prelude() + f"print(json.dumps({{'found': sc('keyctl', 10, -4, b'user', b'left-{tag}', 0)}}))"
    kw = dict(uid_base=299_990, uid_count=1)  # one uid: the second run gets the first run's uid
    sb = hardened(**kw)
    assert out_json(sb.run(store))["add"] == -errno.EPERM
    assert out_json(sb.run(fetch))["found"] < 0
    seccomp_only_off = without(kw, "seccomp")  # user keyrings are emptied at each start
    assert out_json(seccomp_only_off.run(store))["add"] > 0
    assert out_json(seccomp_only_off.run(fetch))["found"] < 0
    control = without(kw, "seccomp", "keyring")
    assert out_json(control.run(store))["add"] > 0
    assert out_json(control.run(fetch))["found"] > 0  # control: the next run on this uid reads it
    seccomp_only_off.run("pass")  # leave the uid's keyring empty


# --------------------------------------------------------------------------- unix sockets of the host
@needs_full
def test_host_unix_sockets_in_shared_dirs_unreachable():
    tag = uuid.uuid4().hex[:12]
    paths = [f"/dev/shm/jaxrl-test-{tag}.sock", f"/var/tmp/jaxrl-test-{tag}.sock", f"/tmp/jaxrl-test-{tag}.sock",
             f"/run/jaxrl-test-{tag}.sock"]
    servers = []
    try:
        for p in paths:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(p)
            os.chmod(p, 0o777)  # any uid may connect: only the mount layout stands in the way
            s.listen(4)
            s.settimeout(0.05)
            servers.append(s)
        code = textwrap.dedent(f"""
            import json, socket
            out = {{}}
            for p in {paths!r}:
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    c.connect(p); c.sendall(b"hello"); out[p] = "CONNECTED"
                except OSError as e:
                    out[p] = e.errno
            print(json.dumps(out))
        """)
        default = hardened().run(code)  # no unix sockets at all by default
        assert default.returncode == 1 and f"[Errno {errno.EAFNOSUPPORT}]" in default.stderr, default.stderr[-500:]
        res = out_json(hardened(allow_unix_sockets=True).run(code))
        assert res == {p: errno.ENOENT for p in paths}, res
        # control: without the private directories the read-only mount does not stop connect()
        ctrl = out_json(without({"allow_unix_sockets": True}, "shared_dirs").run(code))
        tmp = f"/tmp/jaxrl-test-{tag}.sock"
        assert ctrl.pop(tmp) == errno.ENOENT  # /tmp was a private tmpfs before already
        assert all(v == "CONNECTED" for v in ctrl.values()), ctrl
    finally:
        for s in servers:
            s.close()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


# ----------------------------------------------------------------------------------------- memory
MEM = 192 << 20
SPREAD = textwrap.dedent("""
    import os, time, json
    r, w = os.pipe()
    kids = []
    for i in range(4):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            x = b"\\x01" * (64 << 20)  # 64 MiB touched, < RLIMIT_AS of each process
            os.write(w, b"1"); os.close(w)
            time.sleep(20)
            os._exit(0)
        kids.append(pid)
    os.close(w)
    got = 0
    while True:
        d = os.read(r, 16)
        if not d:
            break
        got += len(d)
    time.sleep(0.1)
    alive = sum(1 for p in kids if os.waitpid(p, os.WNOHANG) == (0, 0))
    print(json.dumps({"reported": got, "alive": alive}))
""")


@needs_full
def test_memory_limit_covers_all_processes_together():
    sb = hardened(memory_bytes=MEM, max_processes=16)
    res = sb.run(SPREAD)
    assert res.ok, (res.killed_reason, res.stderr[-500:])
    assert out_json(res)["alive"] <= 2  # 4 x 64 MiB never coexist under 192 MiB: the OOM killer stepped in
    assert res.memory_peak_bytes is not None and res.memory_peak_bytes <= MEM
    # control: RLIMIT_AS alone is per process, so all four hold their 64 MiB at once
    ctrl = without(dict(memory_bytes=MEM, max_processes=16), "memcg").run(SPREAD)
    assert out_json(ctrl) == {"reported": 4, "alive": 4}


SHM = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
total = 0
for i in range(4):
    sid = libc.shmget(0, 64 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if sid < 0:
        print(json.dumps({"errno": ctypes.get_errno(), "total": total})); raise SystemExit
    addr = libc.shmat(sid, None, 0)
    ctypes.memset(addr, 1, 64 << 20)  # resident, and it stays after the detach
    libc.shmdt(ctypes.c_void_p(addr))
    total += 64 << 20
print(json.dumps({"errno": 0, "total": total}))
"""

MEMFD = """
import json, os
try:
    fd = os.memfd_create("x")
except OSError as e:
    print(json.dumps({"errno": e.errno, "total": 0})); raise SystemExit
chunk, total, fds = b"\\x01" * (1 << 20), 0, [fd]
for i in range(256):
    if i % 8 == 0 and i:
        fds.append(os.memfd_create("x"))  # 8 MiB per file: below RLIMIT_FSIZE
    total += os.write(fds[-1], chunk)  # pages of unnamed files: not address space, no tmpfs cap
print(json.dumps({"errno": 0, "total": total}))
"""


@needs_full
@pytest.mark.parametrize("name,code", [("sysv_shm", SHM), ("memfd", MEMFD)])
def test_shared_memory_beyond_memory_bytes(name, code):
    kw = dict(memory_bytes=160 << 20)
    assert out_json(hardened(**kw).run(code)) == {"errno": errno.EPERM, "total": 0}  # seccomp
    no_seccomp = without(kw, "seccomp").run(code)  # the memory cgroup alone: charged, the run is killed
    assert no_seccomp.killed_reason == "memory_limit", (no_seccomp.killed_reason, no_seccomp.stdout)
    assert no_seccomp.memory_peak_bytes <= 160 << 20
    ctrl = without(kw, "seccomp", "memcg").run(code)  # control: 256 MiB resident under a 160 MiB limit
    assert out_json(ctrl) == {"errno": 0, "total": 256 << 20}


# -------------------------------------------------------------------------------------------- uids
@needs_full
def test_uid_never_shared_between_two_sandbox_instances():
    kw = dict(uid_base=299_980, uid_count=2, wall_timeout_s=10)
    a, b = hardened(**kw), hardened(**kw)  # e.g. the code reward and the Python tool
    code = "import os, time, json\nt0 = time.monotonic(); time.sleep(0.4)\nprint(json.dumps([os.getuid(), t0, time.monotonic()]))"
    results = []

    def work(sb):
        results.append(out_json(sb.run(code)))

    threads = [threading.Thread(target=work, args=(sb,)) for sb in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and {r[0] for r in results} <= {299_980, 299_981}
    for i, (u1, s1, e1) in enumerate(results):
        for u2, s2, e2 in results[i + 1:]:
            if s1 < e2 and s2 < e1:
                assert u1 != u2, results  # two live runs never share a uid (the others waited)


HOG = ("import os, time\nfor _ in range(64):\n    try:\n        if os.fork() == 0: time.sleep(2); os._exit(0)\n"
       "    except OSError: break\ntime.sleep(1.5)")
VICTIM = ("import os, time\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n        time.sleep(0.2)\n"
          "        os._exit(0)\n    pids.append(pid)\nprint('forked', len(pids))")


@needs_full
def test_uid_collision_denial_of_service(monkeypatch):
    kw = dict(max_processes=8, wall_timeout_s=6)
    a, b = hardened(**kw), hardened(**kw)

    def race():
        hog = threading.Thread(target=a.run, args=(HOG,))
        hog.start()
        time.sleep(0.7)  # the hog holds its whole RLIMIT_NPROC budget
        res = b.run(VICTIM)
        hog.join()
        return res

    assert race().stdout.strip() == "forked 4"  # distinct uids: the other run is not affected
    # control: force both instances onto one uid (the old per-instance pools did so) -> the victim cannot fork
    monkeypatch.setattr(isolation.UIDS, "acquire", lambda base, count: 299_970)
    monkeypatch.setattr(isolation.UIDS, "release", lambda uid: None)
    res = race()
    assert res.returncode != 0 and "BlockingIOError" in res.stderr, res


@needs_full
def test_uid_held_by_another_process_is_skipped():
    uid = 299_960
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({os.path.join(isolation._UID_LOCK_DIR, 'uids.lock')!r}, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, {uid}, os.SEEK_SET)
        print('locked', flush=True); time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        sb = hardened(uid_base=uid, uid_count=2)
        uids = {int(sb.run("import os; print(os.getuid())").stdout) for _ in range(3)}
        assert uids == {uid + 1}
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------- namespaces, io_uring, ...
KERNEL_SURFACE = """
import socket
out = {"clone_newuser": sc("clone", 0x10000000 | 17, 0, 0, 0, 0)}  # first: no user namespace entered yet
if out["clone_newuser"] == 0:
    os._exit(0)  # the child of a successful clone
out.update({
    "userns_unshare": sc("unshare", 0x10000000),
    "netns_unshare": sc("unshare", 0x40000000),
    "clone3": sc("clone3", 0, 0),
    "io_uring": sc("io_uring_setup", 8, ctypes.create_string_buffer(120)),
    "keyctl": sc("keyctl", 0, -3, 0),
    "memfd": sc("memfd_create", b"x", 0),
    "shmget": sc("shmget", 0, 4096, 0o1600),
    "userfaultfd": sc("userfaultfd", 0),
    "ptrace": sc("ptrace", 16, 1, 0, 0),
    "bpf": sc("bpf", 0, 0, 0),
    "perf": sc("perf_event_open", ctypes.create_string_buffer(128), 0, -1, -1, 0),
    "mount": sc("mount", b"none", b"/tmp", b"tmpfs", 0, 0),
})
for name, fam in (("vsock", 40), ("alg", 38), ("packet", 17)):
    try:
        socket.socket(fam, socket.SOCK_DGRAM if fam != 38 else socket.SOCK_SEQPACKET).close(); out[name] = 0
    except OSError as e:
        out[name] = -e.errno
print(json.dumps(out))
"""


@needs_full
def test_kernel_surface_user_namespaces_io_uring_and_more_denied():
    res = out_json(hardened().run(prelude() + KERNEL_SURFACE))
    for name in ("userns_unshare", "netns_unshare", "clone_newuser", "io_uring", "keyctl", "memfd", "shmget",
                 "userfaultfd", "ptrace", "bpf", "perf", "mount"):
        assert res[name] == -errno.EPERM, (name, res)
    assert res["clone3"] == -errno.ENOSYS
    for name in ("vsock", "alg", "packet"):
        assert res[name] == -errno.EAFNOSUPPORT, (name, res)
    # control: the same program without the filter (the sandbox uid is unprivileged; what such a uid may do
    # depends on the kernel's settings, so each item is checked where this kernel allows it)
    ctrl = out_json(without({}, "seccomp").run(prelude() + KERNEL_SURFACE))
    assert ctrl["keyctl"] >= 0 and ctrl["memfd"] >= 0 and ctrl["shmget"] >= 0, ctrl
    assert ctrl["alg"] in (0, -errno.EAFNOSUPPORT)  # (-EAFNOSUPPORT: a kernel without AF_ALG)
    # the controls that depend on the kernel's settings have their own tests below (skipped where impossible)


def _one_call_control(expr: str):
    code = prelude() + "import socket\n" + f"print(json.dumps({expr}))"
    return out_json(hardened().run(code)), out_json(without({}, "seccomp").run(code))


@needs_full
def test_io_uring_denied():
    got, ctrl = _one_call_control('sc("io_uring_setup", 8, ctypes.create_string_buffer(120))')
    assert got == -errno.EPERM
    if ctrl < 0:
        pytest.skip(f"io_uring disabled or absent in this kernel (control errno {-ctrl})")
    assert ctrl >= 0  # control: an io_uring instance


@needs_full
def test_vsock_to_the_hypervisor_denied():
    code = ("import socket, json\ntry:\n    socket.socket(40, socket.SOCK_STREAM).close(); r = 0\n"
            "except OSError as e:\n    r = -e.errno\nprint(json.dumps(r))")
    got = out_json(hardened().run(code))
    ctrl = out_json(without({}, "seccomp").run(code))
    assert got == -errno.EAFNOSUPPORT
    if ctrl != 0:
        pytest.skip(f"no vsock transport in this kernel/VM (control errno {-ctrl})")


@needs_full
def test_user_namespace_gives_no_capabilities_inside():
    """The finding: a new user namespace made CAP_NET_ADMIN available in a fresh network namespace."""
    code = prelude() + "print(json.dumps([sc('unshare', 0x10000000), sc('unshare', 0x40000000)]))"
    assert out_json(hardened().run(code)) == [-errno.EPERM, -errno.EPERM]
    ctrl = out_json(without({}, "seccomp").run(code))
    if ctrl[0] != 0:
        pytest.skip(f"unprivileged user namespaces unavailable here (control errno {-ctrl[0]})")
    assert ctrl == [0, 0]  # control: user namespace, then a network namespace we administer


# ----------------------------------------------------------------------------- dropped executables
DROPPED = textwrap.dedent("""
    import ctypes, glob, json, os, shutil, subprocess
    out = {}
    for d in ("/tmp/work", "/tmp", "/dev/shm", "/var/tmp"):
        p = os.path.join(d, "dropped")
        shutil.copy("/bin/true", p); os.chmod(p, 0o755)
        try:
            out[d] = subprocess.run([p]).returncode
        except OSError as e:
            out[d] = -e.errno
    ld = sorted(glob.glob("/lib64/ld-linux*.so*") + glob.glob("/lib/ld-linux*.so*"))[0]
    out["via_ld_so"] = subprocess.run([ld, "/tmp/work/dropped"], capture_output=True).returncode
    lib = next(ln.split()[-1] for ln in open("/proc/self/maps")
               if ln.split()[-1].startswith("/") and ".so" in ln and "libc.so" not in ln and "ld-linux" not in ln)
    shutil.copy(lib, "/tmp/work/dropped.so")
    try:
        ctypes.CDLL("/tmp/work/dropped.so"); out["so"] = 0
    except OSError as e:
        out["so"] = str(e)
    print(json.dumps(out))
""")


@needs_full
def test_dropped_binary_and_shared_object_cannot_execute():
    res = out_json(hardened().run(DROPPED))
    for d in ("/tmp/work", "/tmp", "/dev/shm", "/var/tmp"):
        assert res[d] == -errno.EACCES, res  # noexec tmpfs
    assert res["via_ld_so"] != 0  # the loader cannot map it executable either
    assert "failed to map segment" in res["so"] or "Operation not permitted" in res["so"], res
    ctrl = out_json(hardened(allow_exec=True).run(DROPPED))  # control: a config that needs exec
    assert ctrl == {"/tmp/work": 0, "/tmp": 0, "/dev/shm": 0, "/var/tmp": 0, "via_ld_so": 0, "so": 0}, ctrl


# ------------------------------------------------------------------------------- plain (best_effort)
PLAIN_UIDS = (299_900, 50)
# The parent waits for the middle child, so the setsid'd grandchild exists (in its own session) before the
# parent prints and exits: without the wait, a loaded machine could tear the process group down before the
# middle child had forked, and the control below would find no daemon to leave behind.
DAEMON = ("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
          "        time.sleep(60)\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('parent done')")


def _uid_pids():
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/status") as f:
                    st = f.read()
            except OSError:
                continue
            uid = int(next(ln for ln in st.splitlines() if ln.startswith("Uid:")).split()[1])
            state = next(ln for ln in st.splitlines() if ln.startswith("State:")).split()[1]
            if PLAIN_UIDS[0] <= uid < sum(PLAIN_UIDS) and state != "Z":
                pids.append(int(d))
    return pids


@needs_full
def test_plain_mode_setsid_daemon_killed_and_zero_second_program(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "_probe_cache", {**PROBE, "namespaces": False, "net": False})
    kw = dict(network_isolation="best_effort", hardening="required", wall_timeout_s=5, uid_base=PLAIN_UIDS[0],
              uid_count=PLAIN_UIDS[1])
    plain = Sandbox(SandboxConfig(**kw))
    assert plain.isolation.startswith("plain+uid")
    quick = plain.run("pass")
    assert quick.ok and not quick.timed_out and quick.wall_time_s < 2, quick
    res = plain.run(DAEMON)
    assert res.ok and not res.timed_out and res.stdout == "parent done\n" and res.wall_time_s < 2, res
    time.sleep(0.1)
    assert _uid_pids() == []
    memcg_only = Sandbox(SandboxConfig(**kw))
    memcg_only._disabled = frozenset({"kill_uid"})  # the cgroup still empties itself after the run
    res = memcg_only.run(DAEMON)
    assert res.ok and not res.timed_out and res.wall_time_s < 3, res
    time.sleep(0.1)
    assert _uid_pids() == []
    control = Sandbox(SandboxConfig(**kw))
    control._disabled = frozenset({"kill_uid", "memcg"})
    try:
        # control: the old teardown (process group only) leaves the daemon. Up to 3 runs, each polled for 2 s: a CI run
        # once saw no daemon 0.1 s after the run (its fork raced the previous runs' teardown), which voids the
        # control without saying anything about the two teardowns above
        for _ in range(3):
            res = control.run(DAEMON)
            assert res.ok and not res.timed_out and res.wall_time_s < 3, res  # reported right even so
            deadline = time.monotonic() + 2.0
            while not _uid_pids() and time.monotonic() < deadline:
                time.sleep(0.05)
            if _uid_pids():
                break
        assert len(_uid_pids()) == 1
    finally:
        for pid in _uid_pids():
            os.kill(pid, 9)


# ------------------------------------------------------------------------------- code reward hacks
FRAME_HACK = textwrap.dedent("""
    import os, sys
    found = None
    f = sys._getframe()
    while f is not None:
        for scope in (f.f_locals, f.f_globals):
            for v in list(scope.values()):
                if isinstance(v, str) and v.startswith("@@jaxrl-result-"):
                    found = v
        f = f.f_back
    leaks = []
    for what in ("mem", "environ", "maps", "fd/1"):
        try:
            with open("/proc/%d/%s" % (os.getppid(), what), "rb") as fh:
                fh.read(1)
            leaks.append(what)
        except OSError:
            pass
    print("LEAKS", leaks, file=sys.stderr)
    if found:
        sys.__stdout__.write("\\n" + found + "true\\n"); sys.__stdout__.flush()
        os._exit(0)
    def f(x):
        return -1
""")

OLD_ASSERT_HARNESS = r'''
import json, sys
def _harness():
    marker = sys.stdin.readline().strip()
    case = json.loads(sys.stdin.readline())
    import importlib.util
    spec = importlib.util.spec_from_file_location("solution", "solution.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = mod
    spec.loader.exec_module(mod)
    exec(compile(case["assert_src"], "<test>", "exec"), mod.__dict__)
    sys.__stdout__.write("\n" + marker + "true\n")
_harness()
'''


@needs_full
def test_code_reward_stack_frame_hack():
    sb = hardened(wall_timeout_s=6, cpu_time_s=4)
    tests = [{"assert": "assert f(2) == 4"}]
    with CodeReward(CodeRewardConfig(max_concurrency=1), sandbox=sb) as cr:
        score = cr.score("```python\n" + FRAME_HACK + "```", tests)
        assert score.reward == 0.0, score
        outcome = score.outcomes[0]
        assert "LEAKS []" in outcome.result.stderr  # the harness is not readable through /proc either
        honest = cr.score("```python\ndef f(x):\n    return x * x\n```", tests)
        assert honest.reward == 1.0, honest.outcomes[0].result.stderr
    # control: the previous design (test run inside the program's interpreter) is beaten by the same code
    marker = "@@jaxrl-result-" + uuid.uuid4().hex + "@@"
    res = sb.run(OLD_ASSERT_HARNESS, stdin=marker + "\n" + json.dumps({"assert_src": tests[0]["assert"]}) + "\n",
                 files={"solution.py": FRAME_HACK})
    assert res.ok and (marker + "true") in res.stdout.splitlines()


@needs_full
def test_code_reward_always_equal_object_and_patching():
    sb = hardened(wall_timeout_s=6, cpu_time_s=4)
    hack = ("```python\nimport builtins\nclass E:\n    def __eq__(self, o): return True\n    __hash__ = None\n"
            "def f(x): return E()\nbuiltins.AssertionError = type('Never', (Exception,), {})\n```")
    with CodeReward(CodeRewardConfig(max_concurrency=1), sandbox=sb) as cr:
        assert cr.score(hack, [{"assert": "assert f(2) == 4"}]).reward == 0.0


# ------------------------------------------------- issue 27: kernel memory outside the memory cgroup
def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


def _host_memory_taken(sb: Sandbox, code: str):
    """(largest drop of the host's MemAvailable during the run, result): sampled every 20 ms."""
    base = low = _mem_available()
    stop = threading.Event()

    def sample():
        nonlocal low
        while not stop.is_set():
            low = min(low, _mem_available())
            time.sleep(0.02)

    t = threading.Thread(target=sample)
    t.start()
    try:
        res = sb.run(code)
    finally:
        stop.set()
        t.join()
    return base - low, res


# Four processes, each: netlink datagrams to itself with the largest SO_RCVBUF (the finding), unix
# datagrams / stream writes from closed senders, pipes raised to 1 MiB, POSIX timers; each part is capped
# (80 MiB of netlink payload per process: ~650 MiB of host memory with the skb overhead when nothing stops
# it) and failures are reported, not raised.  The parent reports what each family gave, then everything holds for 1 s.
KMEM = """
import ctypes, fcntl, json, os, socket, time
PROCS, NETLINK_CAP = 4, 80 << 20
def part(name, fn, out):
    try:
        out[name] = fn()
    except OSError as e:
        out[name] = -e.errno
keep = []
def netlink():
    sent = 0
    while sent < NETLINK_CAP:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2)  # NETLINK_USERSOCK: users may send
        keep.append(s)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
        s.bind((0, 0)); s.setblocking(False)
        try:
            while sent < NETLINK_CAP:
                s.sendto(b"x" * 32768, s.getsockname()); sent += 32768
        except BlockingIOError:
            pass
    return sent
def unix_dgram():
    r = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); keep.append(r); r.bind("")
    for _ in range(11):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.setblocking(False)
        try:
            s.sendto(b"x" * 200000, r.getsockname())
        except BlockingIOError:
            pass
        s.close()
    return 1
def unix_stream():
    n = 0
    for _ in range(8):
        a, b = socket.socketpair(); a.setblocking(False); keep.append(b)
        try:
            while True:
                a.send(b"x"); n += 1
        except BlockingIOError:
            a.close()
    return n
def pipes():
    n = 0
    for _ in range(8):
        r, w = os.pipe(); keep.append(r)
        fcntl.fcntl(w, 1031, 1 << 20)
        os.set_blocking(w, False)
        try:
            while True:
                n += os.write(w, b"x" * 65536)
        except BlockingIOError:
            os.close(w)
    return n
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); keep.append(s); s.bind(("127.0.0.1", 0))
    s.sendto(b"x", s.getsockname())
    return 1
def timers():
    rt, tid, n = ctypes.CDLL("librt.so.1", use_errno=True), ctypes.c_void_p(), 0
    while n < 100000 and rt.timer_create(1, None, ctypes.byref(tid)) == 0:
        n += 1
    return n
pids = []
for p in range(PROCS):
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = {}
        for name, fn in (("netlink", netlink), ("unix_dgram", unix_dgram), ("unix_stream", unix_stream),
                         ("pipes", pipes), ("udp", udp), ("timers", timers)):
            part(name, fn, out)
        os.write(wr, json.dumps(out).encode()); os.close(wr)
        time.sleep(1.0)
        os._exit(0)
    os.close(wr); pids.append((pid, rd))
outs = [json.loads(os.read(rd, 65536) or b"{}") for _, rd in pids]
print(json.dumps(outs), flush=True)
for pid, _ in pids:
    os.waitpid(pid, 0)
"""
HOST_MEMORY_BOUND = 256 << 20


@needs_full
def test_kernel_memory_outside_the_cgroup_is_bounded():
    """Finding 1 of issue 27: no mix of processes, sockets, pipes and timers in a 128 MiB run takes more than
    256 MiB of host memory (MemAvailable of the host, not the cgroup's own count)."""
    kw = dict(memory_bytes=128 << 20, wall_timeout_s=20, cpu_time_s=10)
    for _ in range(3):  # the host is shared (CI runs another test file beside this one): a drop caused by others
        taken, res = _host_memory_taken(hardened(**kw), KMEM)  # is transient, the attack's would repeat
        if taken < HOST_MEMORY_BOUND:
            break
    assert taken < HOST_MEMORY_BOUND, (taken >> 20, res.killed_reason, res.stderr[-500:])
    if res.returncode == 0:  # (the cgroup may OOM-kill the pipes' part first: charged, as it should be)
        for out in json.loads(res.stdout.strip().splitlines()[-1]):
            assert out["netlink"] == out["unix_dgram"] == out["unix_stream"] == -errno.EAFNOSUPPORT, out
            assert out["udp"] == -errno.ENETUNREACH and out["timers"] <= sandbox_mod._SIGPENDING, out
    else:
        assert res.killed_reason == "memory_limit", (res.killed_reason, res.stderr[-500:])
    # control: the first pass's socket rules (netlink, unix sockets of any type, buffer sizes settable)
    taken_ctrl, ctrl = _host_memory_taken(without(kw, "socket_rules"), KMEM)
    assert taken_ctrl > HOST_MEMORY_BOUND, (taken_ctrl >> 20, ctrl.killed_reason, ctrl.stdout[-800:])
    assert ctrl.memory_peak_bytes is None or ctrl.memory_peak_bytes < taken_ctrl / 2  # outside the cgroup


@needs_full
def test_unix_sockets_opt_in_stream_only_and_buffers_fixed():
    code = textwrap.dedent("""
        import asyncio, json, socket
        out = {}
        for name, fn in (("pair", lambda: socket.socketpair()[0]),
                         ("dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)),
                         ("seqpacket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)),
                         ("rcvbuf", lambda: socket.socket().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)),
                         ("asyncio", lambda: asyncio.run(asyncio.sleep(0)))):
            try:
                fn(); out[name] = 0
            except OSError as e:
                out[name] = e.errno
        print(json.dumps(out))
    """)
    assert out_json(hardened().run(code)) == {"pair": errno.EAFNOSUPPORT, "dgram": errno.EAFNOSUPPORT,
                                              "seqpacket": errno.EAFNOSUPPORT, "rcvbuf": errno.EPERM,
                                              "asyncio": errno.EAFNOSUPPORT}
    assert out_json(hardened(allow_unix_sockets=True).run(code)) == {
        "pair": 0, "dgram": errno.EAFNOSUPPORT, "seqpacket": errno.EAFNOSUPPORT, "rcvbuf": errno.EPERM, "asyncio": 0}


# ------------------------------------------------------------------- issue 27: rlimits, cgroup placement
RT_NICE = """
import json, os
out = {}
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1)); out["fifo"] = 0
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # back at once (never spin as FIFO)
except OSError as e:
    out["fifo"] = e.errno
try:
    os.setpriority(os.PRIO_PROCESS, 0, -5); out["nice"] = 0
except OSError as e:
    out["nice"] = e.errno
print(json.dumps(out))
"""


@needs_full
def test_real_time_priority_and_nice_boost_denied_under_a_permissive_parent():
    import resource
    sb, ctrl_sb = hardened(), without({}, "rlimits")
    saved = {r: resource.getrlimit(r) for r in (resource.RLIMIT_RTPRIO, resource.RLIMIT_NICE)}
    try:  # a parent allowed real-time priority and a nice boost (the launcher inherits both)
        resource.setrlimit(resource.RLIMIT_RTPRIO, (1, 1))
        resource.setrlimit(resource.RLIMIT_NICE, (30, 30))
    except (ValueError, OSError) as exc:  # (raising a hard limit needs CAP_SYS_RESOURCE)
        for r, v in saved.items():
            resource.setrlimit(r, v)
        got = out_json(sb.run(RT_NICE))
        assert got == {"fifo": errno.EPERM, "nice": errno.EACCES}, got
        pytest.skip(f"cannot give this process RLIMIT_RTPRIO / RLIMIT_NICE for the control: {exc}")
    try:
        got = out_json(sb.run(RT_NICE))
        ctrl = out_json(ctrl_sb.run(RT_NICE))
    finally:
        for r, v in saved.items():
            resource.setrlimit(r, v)
    assert got == {"fifo": errno.EPERM, "nice": errno.EACCES}, got
    if ctrl["fifo"] != 0:
        pytest.skip(f"SCHED_FIFO unavailable to this cgroup even with RLIMIT_RTPRIO (control: {ctrl})")
    assert ctrl == {"fifo": 0, "nice": 0}, ctrl


def _memory_cgroup_of(text: str) -> str:
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or (controllers == "" and not any(
                "memory" in ln.split(":")[1] for ln in text.splitlines())):
            return path
    raise AssertionError(text)


@needs_full
def test_run_cgroups_sit_under_this_process_cgroup():
    """An outer limit on the job (its cgroup) covers the runs: they are created below our own cgroup."""
    with open("/proc/self/cgroup") as f:
        own = _memory_cgroup_of(f.read())
    code = "print(open('/proc/self/cgroup').read())"
    got = _memory_cgroup_of(hardened().run(code).stdout)
    assert got.startswith(own.rstrip("/") + "/jaxrl-sandbox/"), (own, got)
    if own.strip("/") == "":
        pytest.skip("this process sits at the hierarchy's root: nothing to tell apart")
    # control: the first pass's place, the hierarchy's root (the job's limit does not cover it)
    mounts = [m for m in isolation._mount_points() if "memory" in m[2] or m[1] == "cgroup2"]
    root_dir = os.path.join(mounts[0][0], f"jaxrl-sandbox-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(root_dir)
    try:
        ctrl = Sandbox(SandboxConfig(hardening="required", cgroup_parent=root_dir)).run(code)
        got_ctrl = _memory_cgroup_of(ctrl.stdout)
        assert not got_ctrl.startswith(own.rstrip("/") + "/"), got_ctrl
    finally:
        isolation.memory_cgroups(root_dir).close()
        os.rmdir(root_dir)


# ------------------------------------------------------- issue 27: reward hacking by shadowing names
SHADOW_CASES = [
    ("abs", "def f(x):\n    return 7\ndef abs(x):\n    return 0\n", "assert abs(f(3.5) - 0.5) < 1e-6"),
    ("all", "def f(x):\n    return [0]\ndef all(x):\n    return True\n", "assert all(f(3))"),
    ("len", "def f(x):\n    return []\ndef len(x):\n    return 3\n", "assert len(f(3)) == 3"),
    ("fake_math", "class math:\n    isclose = staticmethod(lambda *a, **k: True)\ndef f(x):\n    return 0\n",
     "assert math.isclose(f(5), 2.5)"),
    ("fake_math_module", "import types\nmath = types.ModuleType('math')\nmath.isclose = lambda *a, **k: True\n"
                         "def f(x):\n    return 0\n", "assert math.isclose(f(5), 2.5)"),
    ("patched_math", "import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n    return 0\n",
     "assert math.isclose(f(5), 2.5)"),
    ("patched_builtins", "import builtins\nbuiltins.abs = lambda x: 0\ndef f(x):\n    return 7\n",
     "assert abs(f(3.5) - 0.5) < 1e-6"),
    ("always_equal", "class A:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
                     "def f(x):\n    return A()\n", "assert f(3) == 9"),
    ("int_subclass", "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
                     "def f(x):\n    return I(0)\n", "assert f(3) == 9"),
    ("shadowed_check", "def check(c):\n    pass\ndef f(x):\n    return 0\n",
     "def check(candidate):\n    assert candidate(3) == 9\ncheck(f)"),
]


@needs_full
def test_code_reward_shadowing_names_the_tests_use():
    """Finding 2 of issue 27: a wrong program that also defines a name the test uses (or patches a module
    or builtins in its own process, or returns an always-equal object) scores 0.  Right programs still pass,
    and an explicit entry point may shadow a builtin."""
    cr = CodeReward(CodeRewardConfig(sandbox=SandboxConfig(hardening="required"), max_concurrency=2))
    hack = {name: cr.score(f"```python\n{code}```", [{"assert": test}]) for name, code, test in SHADOW_CASES}
    assert {k: v.reward for k, v in hack.items()} == {name: 0.0 for name, _, _ in SHADOW_CASES}, {
        k: [o.result.stderr[-300:] for o in v.outcomes if o.result] for k, v in hack.items() if v.reward}
    right = [("def f(x):\n    return x - 3\n", "assert abs(f(3.5) - 0.5) < 1e-6"),
             ("import math\ndef f(x):\n    return x / 2\n", "assert math.isclose(f(5), 2.5)"),
             ("import statistics as st\ndef f(x):\n    return list(range(x))\n", "assert st.mean(f(3)) == 1"),
             ("def f(x):\n    return x * x\n", "def check(candidate):\n    assert candidate(3) == 9\ncheck(f)")]
    assert [cr.score(f"```python\n{c}```", [{"assert": t}]).reward for c, t in right] == [1.0] * len(right)
    entry = cr.score("```python\ndef sum(xs):\n    return 42\n```", [{"assert": "assert sum([1]) == 42",
                                                                     "entry_point": "sum"}])
    assert entry.reward == 1.0  # the author named it: the program's own `sum` is the function under test
    # control: resolving every name the test uses from the program (the first pass) lets the shadows pass
    cr._legacy_test_names = True
    ctrl = {name: cr.score(f"```python\n{code}```", [{"assert": test}]).reward
            for name, code, test in SHADOW_CASES if name in ("abs", "all", "len", "fake_math", "shadowed_check")}
    cr.close()
    assert ctrl == {"abs": 1.0, "all": 1.0, "len": 1.0, "fake_math": 1.0, "shadowed_check": 0.0}, ctrl
