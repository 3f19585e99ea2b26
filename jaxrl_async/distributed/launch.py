"""Start the roles of a multi-process run on this host and supervise them.

``python -m jaxrl_async.distributed.launch [--generators N] [--trainer-processes K]
[--trainer-cpu-devices T] [--generator-cpu-devices G] [--port P] [--config FILE] [key=value ...]``

Spawns the controller (``distributed.controller``: controller + trainer; with ``--trainer-processes
K`` > 1, K trainer processes forming one SPMD program through ``jax.distributed`` on a local
coordinator, process 0 being the controller) and ``N`` generator processes
(``distributed.generator_role``) with a fresh ``$JAXRL_RPC_AUTHKEY``, streams their output with a role
prefix (the controller's steps as one progress line each: ``[controller] train: 3/150 [00:09<04:50,
2.01s/step] reward_mean=..., eval_acc=..., lag_max=...``), and exits with the controller's status. On a
GPU node, give each role its devices with ``--trainer-env CUDA_VISIBLE_DEVICES=4,5,6,7
--generator-env CUDA_VISIBLE_DEVICES=0,1,2,3`` (TPU: ``TPU_VISIBLE_CHIPS``); on several nodes start
the role modules directly from the cluster's launcher (``docs/launch.md``).

Supervision: a generator replica that exits with a non-zero status while the controller runs (killed,
crashed, or dropped by the controller for not answering) is restarted after a backoff (``--restart-backoff``
seconds, doubling, at most 30 s; at most ``--max-restarts`` times per replica); meanwhile the controller
re-queues its requests to the other replicas, and the restarted process rejoins under the same name (it is
given the newest weights before it serves; ``distributed/replicas.py``). With no replica in service for
``--replica-timeout`` seconds (a controller option) the controller fails with an error naming the last
lost one (and an emergency checkpoint). A trainer process that dies ends the run (no restart). The
controller exiting stops the generators (they exit when its connection
closes; killed after ``--grace`` seconds otherwise). A clean finish is quiet: the controller stops each
generator (``stop``) and ends the trainer group (``finish``) before it closes their connections, so they
exit 0 without reporting a lost controller; a generator or trainer process that loses its controller
otherwise says so and exits 3.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

from jaxrl_async.cli.common import UserError, cli_main, make_parser
from jaxrl_async.distributed.role_host import console_line


def free_port() -> int:
    """A port that was free a moment ago (racy: anything may bind it before the caller does); the
    launcher and the tests use ``reserve_port``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESERVED: list[socket.socket] = []


def reserve_port(host: str = "127.0.0.1") -> int:
    """A free port that this process keeps bound (``SO_REUSEPORT``, not listening) until it exits, so
    that nothing else takes it before the role process binds it: the controller's RPC listener
    (``--listen-reuse-port``) and jax's coordinator (gRPC binds with ``SO_REUSEPORT``) share it; a
    plain bind by anything else fails."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, 0))
    _RESERVED.append(s)
    return s.getsockname()[1]


def _pump(proc: subprocess.Popen, prefix: str) -> threading.Thread:
    """Copy ``proc``'s output to this process's stderr line by line, each line behind ``prefix`` (whole
    lines: the roles' lines do not interleave mid-line)."""
    def run() -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = console_line(raw)
            if line is not None:
                sys.stderr.write(f"{prefix} {line}\n")
                sys.stderr.flush()

    t = threading.Thread(target=run, name=f"launch-pump{prefix}", daemon=True)
    t.start()
    return t


def role_commands(args: argparse.Namespace, rest: list[str], port: int, coordinator_port: int | None = None,
                  host: str = "127.0.0.1") -> tuple[list[list[str]], list[list[str]]]:
    """(trainer process commands, generator commands); the first trainer command is the controller, listening on
    ``host:port`` (the jax.distributed coordinator of K > 1 trainer processes on ``host:coordinator_port``)."""
    py = sys.executable
    addr = f"{host}:{port}"
    ctrl = [py, "-m", "jaxrl_async.distributed.controller", "--listen", addr, "--generators", str(args.generators),
            "--generator-devices", str(args.generator_devices)]
    if getattr(args, "port", None) is None:  # reserve_port holds it
        ctrl += ["--listen-reuse-port"]
    if args.trainer_cpu_devices:
        ctrl += ["--cpu-devices", str(args.trainer_cpu_devices)]
    K = int(getattr(args, "trainer_processes", 1) or 1)
    if K > 1:
        coord = f"{host}:{coordinator_port or reserve_port()}"
        trainers = [ctrl + ["--coordinator", coord, "--num-processes", str(K), "--process-id", str(i)] + rest
                    for i in range(K)]
    else:
        trainers = [ctrl + rest]
    gens = []
    for k in range(args.generators):
        g = [py, "-m", "jaxrl_async.distributed.generator_role", "--controller", addr, "--name", f"generator-{k}"]
        if args.generator_cpu_devices:
            g += ["--cpu-devices", str(args.generator_cpu_devices)]
        gens.append(g)
    return trainers, gens


def _env(extra: list[str]) -> dict[str, str]:
    """A role's environment: this one, unbuffered output (its lines reach the console as they are
    written, not when a pipe buffer fills), then ``extra`` (``KEY=VALUE``)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    for kv in extra:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def build_parser():
    ap = make_parser("python -m jaxrl_async.distributed.launch", __doc__.split("\n\n", 1)[1].strip())
    ap.add_argument("--generators", type=int, default=1, help="generator processes")
    ap.add_argument("--trainer-processes", type=int, default=1, help="trainer processes (one SPMD group) on this "
                    "host, for trying a multi-host trainer locally (simulated CPU devices); they share --trainer-env, "
                    "so on a GPU node use one trainer process that sees all the trainer's GPUs")
    ap.add_argument("--trainer-cpu-devices", type=int, default=None, help="simulated CPU devices of each trainer process")
    ap.add_argument("--generator-cpu-devices", type=int, default=None,
                    help="simulated CPU devices of each generator process")
    ap.add_argument("--generator-devices", type=int, default=None,
                    help="devices per generator process (default: --generator-cpu-devices, else 1)")
    ap.add_argument("--trainer-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment variable of the trainer processes (repeatable)")
    ap.add_argument("--generator-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment variable of the generator processes (repeatable)")
    ap.add_argument("--port", type=int, default=None, help="controller port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--grace", type=float, default=60.0,
                    help="seconds the other processes get to exit after the controller, then they are killed")
    ap.add_argument("--max-restarts", type=int, default=3, help="restarts of each generator replica (0: none)")
    ap.add_argument("--restart-backoff", type=float, default=1.0,
                    help="seconds before a replica's first restart (doubling per restart of it, at most 30)")
    return ap


# options of the run itself (main.py) that the controller passes on; the controller's own options
# (--accept-timeout, ...) are checked by its parser
_RUN_OPTIONS = ("--config", "--print-config", "--dry-run")


def check_run_args(rest: list[str]):
    """The arguments passed on to the controller: its own options, ``--config FILE`` and ``key=value``
    overrides. Loads the config and applies the overrides (no validation: that needs the role's devices)
    so that a missing config file or a wrong key stops here with one line, before any process starts. Returns
    the (unvalidated) config."""
    from jaxrl_async.distributed.controller import split_argv
    from jaxrl_async.config import peek_config

    _, leftover = split_argv(["--listen", "127.0.0.1:0", "--generator-devices", "1"] + rest)
    for a in leftover:
        if a.startswith("-") and a.split("=", 1)[0] not in _RUN_OPTIONS:
            raise UserError(f"unknown option {a!r} (see --help; the run's options: {', '.join(_RUN_OPTIONS)})")
    return peek_config(leftover)


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The launcher's own flags (``ap.error``: usage and one line, exit 2); shared with the Ray launcher."""
    for name in ("generators", "trainer_processes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("trainer_cpu_devices", "generator_cpu_devices", "generator_devices"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.port is not None and not 0 < args.port < 65536:
        ap.error("--port must be in [1, 65535]")
    if args.grace < 0:
        ap.error("--grace must be >= 0")
    if args.max_restarts < 0 or args.restart_backoff < 0:
        ap.error("--max-restarts and --restart-backoff must be >= 0")
    for flag, kvs in (("--trainer-env", args.trainer_env), ("--generator-env", args.generator_env)):
        for kv in kvs:
            if "=" not in kv or not kv.split("=", 1)[0]:
                ap.error(f"{flag} {kv!r}: expected KEY=VALUE")


@cli_main("launch")
def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    check_args(ap, args)
    check_run_args(rest)
    if args.generator_devices is None:
        args.generator_devices = args.generator_cpu_devices or 1
    port = args.port or reserve_port()
    os.environ.setdefault("JAXRL_RPC_AUTHKEY", secrets.token_hex(32))
    trainer_cmds, gen_cmds = role_commands(args, rest, port)
    trainers = [subprocess.Popen(cmd, env=_env(args.trainer_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                for cmd in trainer_cmds]
    ctrl = trainers[0]
    pumps = [_pump(ctrl, "[controller]")] + [_pump(p, f"[trainer-{i}]") for i, p in enumerate(trainers[1:], 1)]
    gen_env = _env(args.generator_env)

    def start_generator(k: int) -> subprocess.Popen:
        p = subprocess.Popen(gen_cmds[k], env=gen_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        pumps.append(_pump(p, f"[generator-{k}]"))
        return p

    gens = [start_generator(k) for k in range(len(gen_cmds))]
    restarts = [0] * len(gens)
    due: dict[int, float] = {}  # replica -> when its restart is due
    finished: set[int] = set()  # stopped by the controller (status 0), or out of restarts
    try:
        while ctrl.poll() is None:
            now = time.monotonic()
            for k, p in enumerate(gens):
                if k in due:
                    if now >= due[k]:
                        del due[k]
                        gens[k] = start_generator(k)
                        print(f"[launch] generator-{k} restarted (pid {gens[k].pid}; restart {restarts[k]} of "
                              f"{args.max_restarts})", file=sys.stderr, flush=True)
                    continue
                if k in finished or p.poll() is None:
                    continue
                # status 0: the controller stopped it (the run's orderly end); anything else is a lost replica
                if p.returncode == 0:
                    finished.add(k)
                elif restarts[k] < args.max_restarts:
                    delay = min(args.restart_backoff * 2 ** restarts[k], 30.0)
                    restarts[k] += 1
                    due[k] = now + delay
                    print(f"[launch] generator-{k} (pid {p.pid}) exited with status {p.returncode}; restarting it in "
                          f"{delay:.1f} s", file=sys.stderr, flush=True)
                else:
                    finished.add(k)
                    print(f"[launch] generator-{k} (pid {p.pid}) exited with status {p.returncode}; not restarted "
                          f"(--max-restarts {args.max_restarts} reached)", file=sys.stderr, flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        ctrl.terminate()
    rc = ctrl.wait()
    if rc == 2:  # a configuration error: nothing ran, the others would only wait for a connection
        for p in trainers[1:] + gens:
            if p.poll() is None:
                p.terminate()
    deadline = time.monotonic() + args.grace
    for p in trainers[1:] + gens:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for t in pumps:
        t.join(5.0)
    print(f"[launch] controller exited with status {rc}; other trainer processes: "
          f"{[p.returncode for p in trainers[1:]]}; generators: {[p.returncode for p in gens]}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
