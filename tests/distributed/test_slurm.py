"""docs/launch.md's SLURM job on a real one-node SLURM (issue 26 item 4; slow).

``test_documented_one_node_sbatch_script_runs_the_tiny_run``: starts ``munged`` (its own key and socket),
``slurmctld`` and ``slurmd`` (Debian's ``slurm-wlm`` + ``munge`` packages) as this test's processes, on a
``slurm.conf`` written into a temporary directory (this host as the one node, 2 CPUs, ports chosen free,
state/spool/logs/pids under the temporary directory), waits for the node to be idle (``sinfo``), submits
the block of docs/launch.md marked ``slurm-one-node`` VERBATIM with ``sbatch`` (from the repository's root,
``PORT``/``RUN_DIR`` in the environment, the venv's ``python`` first on ``PATH``), waits for the job, and
checks the job's state and exit code, the run's ``summary.json`` (completed, every step) and its data
ledger (every step consumed, no prompt trained twice). A job step first checks that the jobs import this
checkout's ``jaxrl_async``. Teardown (always): ``scancel``, then every process whose environment names this
test's ``slurm.conf`` (the job's, slurmstepd) and the daemons, by pid.

Skipped with one line when ``slurmctld``/``slurmd``/``munged`` are not installed (CI does not install them:
``apt-get install -y slurm-wlm munge``). Needs root (``SlurmUser=root``, munge as root).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxrl_async.data.ledger import read_data_ledger
from role_procs import role_env  # tests/distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DOC = os.path.join(ROOT, "docs", "launch.md")
MARKER = "<!-- slurm-one-node:"
STEPS = 3  # trainer.total_steps in the documented block

_MISSING = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "sinfo") if shutil.which(b) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=f"SLURM not installed ({', '.join(_MISSING)} missing; "
                                              "apt-get install -y slurm-wlm munge)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the test's SLURM runs as root (SlurmUser=root)"),
]


def documented_script() -> str:
    """The ```bash block right after the ``slurm-one-node`` marker in docs/launch.md."""
    text = open(DOC).read()
    at = text.index(MARKER)
    m = re.compile(r"```bash\n(.*?)```", re.S).search(text, at)
    assert m and text[at:m.start()].count("\n") == 1, "the marker must be the line right above the ```bash block"
    return m.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout: float, what: str, log=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s\n{log()}")
        time.sleep(0.5)


def _pids_naming(needle: str, spare: set[int] = frozenset()) -> list[int]:
    """Live (not zombie) processes whose environment contains ``needle`` (this test's SLURM_CONF), except
    this process, the pids in ``spare`` and their children (slurmctld's slurmscriptd)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid() or int(d) in spare:
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[1]) in spare:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle.encode() in f.read():
                    out.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return out


class OneNodeSlurm:
    """munged + slurmctld + slurmd for this host, everything under ``base``."""

    def __init__(self, base):
        self.base = str(base)
        self.node = socket.gethostname().split(".")[0]
        self.conf = os.path.join(self.base, "slurm.conf")
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.up_s = None  # seconds from the first daemon to the node idle

    def path(self, *p) -> str:
        return os.path.join(self.base, *p)

    def logs(self) -> str:
        out = []
        for name in ("munged.out", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            p = self.path("log", name)
            if os.path.exists(p):
                out.append(f"--- {name}\n" + open(p, errors="replace").read()[-3000:])
        return "\n".join(out)

    def _spawn(self, cmd: list[str], out: str) -> subprocess.Popen:
        p = subprocess.Popen(cmd, env=self.env, stdout=open(self.path("log", out), "wb"), stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def start(self) -> None:
        t0 = time.monotonic()
        for d in ("munge", "state", "spool", "log"):
            os.makedirs(self.path(d), mode=0o700)
        key = self.path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = self.path("munge", "munge.sock")
        self._spawn(["munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
                     f"--pid-file={self.path('munge', 'munged.pid')}", f"--seed-file={self.path('munge', 'seed')}",
                     f"--log-file={self.path('log', 'munged.log')}"], "munged.out")
        _wait(lambda: os.path.exists(sock), 30, "munged's socket", self.logs)
        ctld_port, d_port = _free_port(), _free_port()
        conf = f"""\
ClusterName=jaxrltest
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('slurmd.pid')}
SlurmctldLogFile={self.path('log', 'slurmctld.log')}
SlurmdLogFile={self.path('log', 'slurmd.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=5
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=30 State=UP
"""
        with open(self.conf, "w") as f:
            f.write(conf)
        self._spawn(["slurmctld", "-D", "-i", "-f", self.conf], "slurmctld.out")
        self._spawn(["slurmd", "-D", "-f", self.conf, "-N", self.node], "slurmd.out")

        def idle() -> bool:
            for p in self.procs:
                assert p.poll() is None, f"{p.args[0]} exited with status {p.returncode}\n{self.logs()}"
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True,
                               timeout=30)
            return r.returncode == 0 and r.stdout.split() == [self.node, "idle"]

        _wait(idle, 90, "the node idle in sinfo", self.logs)
        self.up_s = time.monotonic() - t0

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60, **kw)

    def job_state(self, job: str) -> dict:
        r = self.run(["scontrol", "-o", "show", "job", job])
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv) if r.returncode == 0 else {}

    def stop(self) -> None:
        """scancel every job, then every process naming this test's slurm.conf in its environment
        (jobs, slurmstepd), then the daemons; all by pid, bounded."""
        try:
            subprocess.run(["scancel", "--full", "--quiet", "--user=root"], env=self.env, timeout=30,
                           capture_output=True)
        except Exception:
            pass
        t0 = time.monotonic()
        deadline = t0 + 15
        own = {p.pid for p in self.procs}
        while time.monotonic() < deadline:
            left = _pids_naming(f"SLURM_CONF={self.conf}", own)
            if not left:
                break
            if time.monotonic() > deadline - 10:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.5)
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        left = _pids_naming(f"SLURM_CONF={self.conf}")
        print(f"SLURM down in {time.monotonic() - t0:.1f} s")
        assert not left, f"processes of the test's SLURM left: {left}"


@pytest.fixture
def slurm(tmp_path):
    cluster = OneNodeSlurm(tmp_path / "slurm")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_documented_one_node_sbatch_script_runs_the_tiny_run(slurm, tmp_path):
    t0 = time.monotonic()
    run = tmp_path / "run"
    env = role_env(tmp_path / "jax_cache")
    env.pop("JAXRL_RPC_AUTHKEY")  # the script makes its own
    env.update(SLURM_CONF=slurm.conf, PORT=str(_free_port()), RUN_DIR=str(run),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))

    # the jobs' python imports this checkout (PYTHONPATH / the editable install travel with the environment)
    r = slurm.run(["srun", "-N1", "-n1", "--time=2", "python", "-c", "import jaxrl_async; print(jaxrl_async.__file__)"],
                  env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr + slurm.logs()
    assert r.stdout.strip() == os.path.join(ROOT, "jaxrl_async", "__init__.py"), r.stdout

    script = tmp_path / "one_node.sbatch"
    script.write_text(documented_script())
    out = tmp_path / "job.out"
    r = slurm.run(["sbatch", "--parsable", f"--output={out}", str(script)], env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr + slurm.logs()
    job = r.stdout.strip().split(";")[0]
    t_submit = time.monotonic()

    def log() -> str:
        return (out.read_text(errors="replace")[-5000:] if out.exists() else "(no job output)") + "\n" + slurm.logs()

    _wait(lambda: slurm.job_state(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                          "NODE_FAIL", "OUT_OF_MEMORY"), 400, f"job {job}", log)
    state = slurm.job_state(job)
    job_s = time.monotonic() - t_submit
    text = out.read_text(errors="replace")
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, log())
    print(f"SLURM up in {slurm.up_s:.1f} s, the import check {t_submit - t0:.1f} s, job {job}: "
          f"{state['JobState']} {state['ExitCode']} in {job_s:.0f} s")

    assert f"[jaxrl_async] done: {STEPS} steps" in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "completed" and summary["steps"] == STEPS, summary
    consumes = read_data_ledger(str(run)).events("consume")
    assert [e["step"] for e in consumes] == list(range(1, STEPS + 1)), consumes
    trained = [d for e in consumes for d in e["draws"]]
    assert len(trained) == len(set(trained)) == 4 * STEPS, trained
