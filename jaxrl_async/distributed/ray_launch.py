"""Start the roles of a multi-process run on an existing Ray cluster and supervise them.

``python -m jaxrl_async.launch.ray --config FILE [key=value ...] [--address auto|HOST:PORT] [--generators N]
[--trainer-processes K] [--trainer-gpus G] [--generator-gpus G] [--trainer-resources KEY=N] ...``, or sized as
AReaL's Ray launcher is: ``cluster.n_nodes=4 cluster.n_gpus_per_node=8 [cluster.trainer_nodes=2]`` (the trainer
on the first T nodes, one process per node; one generator replica per other node).

The same roles and command lines as ``distributed.launch`` (the local launcher), placed by Ray: one placement
group for the trainer (one bundle per trainer process, ``--trainer-placement`` PACK by default: as few nodes as
possible, the bundles of one node together) and one per generator replica (one bundle each), GPUs by
``num_gpus`` (Ray sets each role's ``CUDA_VISIBLE_DEVICES``), a TPU trainer slice reserved whole with Ray's TPU
helpers (``--tpu-topology 4x4 --tpu-version v5p``: one bundle and one trainer process per TPU VM of the slice).
On each bundle a small actor (``distributed.role_host.RoleHost``) starts the role as an ordinary process (the
controller and trainer processes ``distributed.controller``, each replica ``distributed.generator_role``) and
hands it the run secret (``$JAXRL_RPC_AUTHKEY``, generated unless set), the controller's address and, for K > 1
trainer processes, the ``jax.distributed`` coordinator address: both on the node of the first trainer bundle,
on ports the actor there reserves. The roles then talk over the project's own RPC (mutual TLS) and pull weights
device-to-device; nothing of the run's traffic goes through Ray.

Output: every role's lines, prefixed with its name (``[controller]``, ``[trainer-1]``, ``[generator-0]``), and the
launcher's own (``[launch] generator-0: pid N on HOST (IP, node ID)``). The working directory and the run
directory must be on a filesystem every node sees (a marker file the launcher writes must be read back by every
node's actor; else one line, exit 2). Supervision as the local launcher: a replica process that exits non-zero
while the controller runs (or whose actor died) is restarted on its bundle after ``--restart-backoff`` seconds
(doubling, at most 30 s; at most ``--max-restarts`` per replica) and rejoins with the current weights; the
launcher exits with the controller's status. Ctrl-C (SIGINT) or SIGTERM to the launcher: the controller gets
SIGTERM (it finishes its step, saves a checkpoint and stops the others), whatever runs ``--grace`` seconds
later is killed; a second Ctrl-C kills at once. Then the actors are killed and the placement groups removed;
a role process also dies with its actor (``PR_SET_PDEATHSIG``), so a launcher killed with SIGKILL leaves
nothing either (Ray removes a dead driver's actors).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import threading
import time

from jaxrl_async.cli.common import UserError, cli_main
from jaxrl_async.distributed.launch import build_parser as local_parser
from jaxrl_async.distributed.launch import check_args, check_run_args, role_commands
from jaxrl_async.distributed.role_host import RoleHost

RAY_MISSING = "the Ray launcher needs Ray: pip install 'jaxrl_async[ray]' (or: pip install 'ray==2.60.*')"
# the launcher's environment variables the roles get (besides --trainer-env / --generator-env): the run's and
# JAX's settings; never the device variables (Ray sets CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS per bundle)
FORWARD_PREFIXES = ("JAX_", "XLA_", "JAXRL_", "HF_", "NCCL_", "TF_CPP_")
FORWARD_KEYS = ("PYTHONPATH", "PYTHONFAULTHANDLER", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_OFFLINE")
POLL_S = 0.3
CALL_TIMEOUT_S = 60.0


class Interrupted(Exception):
    """Ctrl-C / SIGTERM to the launcher before the roles started."""


def _wait_all(ray, refs: list, timeout: float, stops: list[int]) -> bool:
    """Wait for every ref within ``timeout`` (False: some did not finish), in slices of 1 s so that a Ctrl-C
    during the placement or the actors' start stops the launcher at once (``Interrupted``)."""
    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        if stops[0]:
            raise Interrupted
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, left))
    return True


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError(RAY_MISSING) from None
    return ray


def build_parser() -> argparse.ArgumentParser:
    ap = local_parser()
    ap.prog = "python -m jaxrl_async.launch.ray"
    ap.description = __doc__.split("\n\n", 1)[1].strip()
    for a in ap._actions:  # the local launcher's words that mean something else here
        if a.dest == "port":
            a.help = "controller port on the node of the first trainer bundle (default: a free one there)"
        elif a.dest == "trainer_processes":
            a.help = "trainer processes (one SPMD group through jax.distributed), one placement-group bundle each"
    g = ap.add_argument_group("Ray")
    g.add_argument("--address", default="auto", help="the Ray cluster: auto ($RAY_ADDRESS, else the cluster started "
                   "on this machine) or HOST:PORT of its head (GCS)")
    g.add_argument("--trainer-cpus", type=float, default=1.0, help="CPUs of each trainer bundle")
    g.add_argument("--generator-cpus", type=float, default=1.0, help="CPUs of each generator bundle")
    g.add_argument("--trainer-gpus", type=float, default=0.0, help="GPUs of each trainer bundle (one trainer process)")
    g.add_argument("--generator-gpus", type=float, default=0.0, help="GPUs of each generator replica's bundle")
    g.add_argument("--trainer-resources", action="append", default=[], metavar="KEY=N",
                   help="custom Ray resource of each trainer bundle (repeatable), e.g. a node label resource")
    g.add_argument("--generator-resources", action="append", default=[], metavar="KEY=N",
                   help="custom Ray resource of each generator bundle (repeatable)")
    g.add_argument("--trainer-placement", default="PACK", choices=["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"],
                   help="placement-group strategy of the trainer bundles (PACK: fewest nodes; STRICT_PACK: one node)")
    g.add_argument("--tpu-topology", default=None, help="reserve the trainer's TPU slice whole (ray.util.tpu, e.g. "
                   "4x4): one bundle and one trainer process per TPU VM; needs --tpu-version")
    g.add_argument("--tpu-version", default=None, help="TPU generation of --tpu-topology (v4, v5p, v6e, ...)")
    g.add_argument("--generator-tpus", type=float, default=0.0, help="TPU chips of each generator replica's bundle")
    g.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to connect to the Ray cluster")
    g.add_argument("--placement-timeout", type=float, default=300.0,
                   help="seconds to wait for the placement groups (the cluster's free resources) before giving up")
    return ap


CLUSTER_KEYS = ("cluster.n_nodes", "cluster.n_gpus_per_node", "cluster.trainer_nodes")


def apply_cluster_settings(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """AReaL's way of sizing a Ray run, ``cluster.n_nodes=N cluster.n_gpus_per_node=G [cluster.trainer_nodes=T]``
    (T default: N // 2, at least 1): the trainer on T nodes (one trainer process per node with its G GPUs, one
    SPMD group), one generator replica on each of the other N - T nodes (its G GPUs). Sets the launcher's flags
    accordingly and returns ``rest`` without the ``cluster.*`` settings (they are not run settings)."""
    kept, got = [], {}
    for a in rest:
        if not a.startswith("cluster."):
            kept.append(a)
            continue
        k, sep, v = a.partition("=")
        if k not in CLUSTER_KEYS or not sep:
            raise UserError(f"{a}: unknown cluster setting (known: {', '.join(k + '=...' for k in CLUSTER_KEYS)})")
        try:
            got[k] = int(v)
        except ValueError:
            raise UserError(f"{k}: expected an integer, got {v!r}") from None
    if not got:
        return kept
    n = got.get("cluster.n_nodes")
    if n is None or n < 2:
        raise UserError("cluster.n_nodes: at least 2 nodes (the trainer and the generators on nodes of their own); "
                        "on one node give --trainer-gpus / --generator-gpus / --generators instead")
    t = got.get("cluster.trainer_nodes", max(1, n // 2))
    g = got.get("cluster.n_gpus_per_node", 0)
    if not 1 <= t < n:
        raise UserError(f"cluster.trainer_nodes: must be in [1, cluster.n_nodes={n}), got {t}")
    if g < 0:
        raise UserError(f"cluster.n_gpus_per_node: must be >= 0, got {g}")
    args.trainer_processes, args.generators = t, n - t
    if g:
        args.trainer_gpus = args.generator_gpus = float(g)
        args.generator_devices = g
    say(f"cluster.n_nodes={n}: the trainer on {t} node(s) ({t} process(es)" + (f" x {g} GPUs" if g else "")
        + f"), {n - t} generator replica(s)" + (f" x {g} GPUs" if g else ""))
    return kept


def _resources(flag: str, kvs: list[str]) -> dict[str, float]:
    out = {}
    for kv in kvs:
        k, sep, v = kv.partition("=")
        try:
            out[k] = float(v)
        except ValueError:
            raise UserError(f"{flag} {kv!r}: expected KEY=NUMBER") from None
        if not sep or not k or out[k] <= 0:
            raise UserError(f"{flag} {kv!r}: expected KEY=NUMBER (> 0)")
    return out


def bundle(cpus: float, gpus: float, tpus: float, custom: dict[str, float]) -> dict[str, float]:
    b = {"CPU": cpus, **custom}
    if gpus:
        b["GPU"] = gpus
    if tpus:
        b["TPU"] = tpus
    return b


def actor_options(ray, pg, index: int, spec: dict[str, float]) -> dict:
    """The role host actor takes its whole bundle, so that Ray assigns it the bundle's devices (its
    CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS, which the role process inherits)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    custom = {k: v for k, v in spec.items() if k not in ("CPU", "GPU", "memory")}
    return dict(num_cpus=spec.get("CPU", 0), num_gpus=spec.get("GPU", 0), resources=custom or None, max_restarts=0,
                max_concurrency=4, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False))


def forwarded_env(extra: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES) or k in FORWARD_KEYS}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a role that dies of a signal (abort, segfault) shows its threads' stacks
    for kv in extra:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def say(msg: str) -> None:
    print(f"[launch] {msg}", file=sys.stderr, flush=True)


class Role:
    """A role of the run on its bundle: name, command line, host actor (recreated if it dies)."""

    def __init__(self, name: str, pg, index: int, spec: dict[str, float], kind: str):
        self.name, self.pg, self.index, self.spec, self.kind = name, pg, index, spec, kind
        self.host = None
        self.info: dict = {}
        self.cmd: list[str] = []
        self.env: dict[str, str] = {}
        self.rc: int | None = None
        self.pid: int | None = None
        self.started = False

    def create_host(self, ray) -> None:
        self.host = ray.remote(RoleHost).options(name=None, **actor_options(ray, self.pg, self.index, self.spec)) \
            .remote(self.name)


@cli_main("launch.ray")
def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    check_args(ap, args)
    rest = apply_cluster_settings(args, rest)
    trainer_custom = _resources("--trainer-resources", args.trainer_resources)
    generator_custom = _resources("--generator-resources", args.generator_resources)
    if bool(args.tpu_topology) != bool(args.tpu_version):
        raise UserError("--tpu-topology and --tpu-version go together")
    cfg = check_run_args(rest)
    ray = import_ray()
    if args.generator_devices is None:  # a replica's devices: its bundle's GPUs / TPU chips, else simulated CPUs
        args.generator_devices = int(args.generator_gpus) or int(args.generator_tpus) or args.generator_cpu_devices or 1
    cwd = os.getcwd()
    run_dir = os.path.abspath(cfg.resolved_run_dir)
    os.environ.setdefault("JAXRL_RPC_AUTHKEY", secrets.token_hex(32))
    secret = os.environ["JAXRL_RPC_AUTHKEY"]

    _connect(ray, args.address, args.connect_timeout)
    stops = [0]

    def on_signal(signum, frame):
        stops[0] += 1

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    pgs, roles = [], []
    try:
        return _run(ray, args, rest, cfg, cwd, run_dir, secret, trainer_custom, generator_custom, pgs, roles, stops)
    except Interrupted:
        say("interrupted before the roles started")
        return 130
    finally:
        _teardown(ray, pgs, roles)
        for s, h in old.items():
            signal.signal(s, h)


def _connect(ray, address: str, timeout: float) -> None:
    """``ray.init`` on the cluster at ``address``, within ``timeout`` seconds (Ray itself retries a silent GCS
    forever): an explicit HOST:PORT is probed first (a refused port is one line at once); a connection that does
    not complete in time ends the launcher with one line, exit 2 (nothing was started yet)."""
    no_cluster = f"no Ray cluster at --address {address}"
    hint = "(start one with `ray start --head`, or give its HOST:PORT)"
    if "://" not in address and address != "auto":
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout, 10.0)).close()
        except (OSError, ValueError) as e:
            raise UserError(f"{no_cluster}: {e} {hint}") from None
    connected = threading.Event()

    def watchdog() -> None:
        if not connected.wait(timeout):
            print(f"launch.ray: error: {no_cluster}: not connected within --connect-timeout {timeout:g} s {hint}",
                  file=sys.stderr, flush=True)
            os._exit(2)

    threading.Thread(target=watchdog, name="ray-connect-watchdog", daemon=True).start()
    runtime_env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}} if os.environ.get("PYTHONPATH") else None
    try:
        ray.init(address=address, log_to_driver=False, runtime_env=runtime_env, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UserError(f"{no_cluster}: {' '.join(str(e).split())[:300]} {hint}") from None
    finally:
        connected.set()


def _place(ray, args, trainer_custom, generator_custom, pgs, stops) -> tuple[list, list]:
    """Reserve the placement groups; returns (trainer roles, generator roles), their hosts not yet created."""
    from ray.util.placement_group import placement_group

    tag = secrets.token_hex(3)
    if args.tpu_topology:  # a TPU slice whole: one bundle per TPU VM, its chips (ray.util.tpu)
        from ray.util.tpu import slice_placement_group

        sp = slice_placement_group(args.tpu_topology, args.tpu_version, strategy="SPREAD",
                                   name=f"jaxrl-{tag}-trainer-slice")
        pgs.append(sp)  # removed with its head reservations (SlicePlacementGroup.shutdown)
        t_pg = sp.placement_group
        if t_pg is None:
            raise UserError(f"no TPU slice {args.tpu_version} {args.tpu_topology} could be reserved on this cluster")
        specs = [dict(b) for b in t_pg.bundle_specs]
        if len(specs) != args.trainer_processes:
            say(f"TPU slice {args.tpu_version}-{args.tpu_topology}: {len(specs)} TPU VMs, one trainer process each")
            args.trainer_processes = len(specs)
    else:
        spec = bundle(args.trainer_cpus, args.trainer_gpus, 0, trainer_custom)
        specs = [spec] * args.trainer_processes
        t_pg = placement_group(specs, strategy=args.trainer_placement, name=f"jaxrl-{tag}-trainer")
        pgs.append(t_pg)
    trainers = [Role("controller" if i == 0 else f"trainer-{i}", t_pg, i, specs[i], "trainer")
                for i in range(len(specs))]
    g_spec = bundle(args.generator_cpus, args.generator_gpus, args.generator_tpus, generator_custom)
    gens = []
    for k in range(args.generators):
        pg = placement_group([g_spec], strategy="PACK", name=f"jaxrl-{tag}-generator-{k}")
        pgs.append(pg)
        gens.append(Role(f"generator-{k}", pg, 0, g_spec, "generator"))
    if not _wait_all(ray, [pg.ready() for pg in [t_pg] + [r.pg for r in gens]], args.placement_timeout, stops):
        want = [specs[0]] * len(specs) + [g_spec] * args.generators
        raise UserError(f"the Ray cluster could not place the run within --placement-timeout {args.placement_timeout:g} "
                        f"s: bundles {want} (trainer placement {args.trainer_placement}); the cluster has "
                        f"{ray.cluster_resources()}, free {ray.available_resources()}")
    return trainers, gens


def _run(ray, args, rest, cfg, cwd, run_dir, secret, trainer_custom, generator_custom, pgs, roles, stops) -> int:
    trainers, gens = _place(ray, args, trainer_custom, generator_custom, pgs, stops)
    roles += trainers + gens
    for r in roles:
        r.create_host(ray)
    refs = [r.host.info.remote() for r in roles]
    if not _wait_all(ray, refs, args.placement_timeout, stops):
        raise UserError(f"the role actors did not start within --placement-timeout {args.placement_timeout:g} s")
    try:
        infos = ray.get(refs, timeout=CALL_TIMEOUT_S)
    except ray.exceptions.RayActorError as e:
        raise UserError("a role actor could not start (is jaxrl_async installed, or on PYTHONPATH, on every "
                        f"node?): {' '.join(str(e).split())[:300]}") from None
    for r, info in zip(roles, infos):
        r.info = info

    # the run directory and the working directory must be what every node sees
    os.makedirs(run_dir, exist_ok=True)
    token = secrets.token_hex(16)
    marker = os.path.join(run_dir, f".launch-ray-{token[:12]}")
    with open(marker, "w", encoding="utf-8") as f:
        f.write(token)
    try:
        by_node = {r.info["node_id"]: r for r in roles}
        seen = ray.get([r.host.read_marker.remote(marker) for r in by_node.values()], timeout=CALL_TIMEOUT_S)
        cwd_ok = ray.get([r.host.path_exists.remote(cwd) for r in by_node.values()], timeout=CALL_TIMEOUT_S)
    finally:
        os.unlink(marker)
    for r, got, ok in zip(by_node.values(), seen, cwd_ok):
        where = f"node {r.info['ip']} ({r.info['host']}, {r.info['node_id'][:8]})"
        if got != token:
            raise UserError(f"run_dir {run_dir} is not on a filesystem {where} sees (it must be shared by every node: "
                            "checkpoints, metrics, the weight-push fallback)")
        if not ok:
            raise UserError(f"the working directory {cwd} does not exist on {where}: start the launcher from a "
                            "directory every node sees (the config file and relative paths are read there)")

    # what the role processes import, by node (a process started as they are: this node's Python, env, cwd)
    probe_env = forwarded_env([])
    found = ray.get([r.host.probe.remote(probe_env, cwd) for r in by_node.values()], timeout=2 * CALL_TIMEOUT_S)
    for r, where in zip(by_node.values(), found):
        if where.startswith("error:"):
            raise UserError(f"jaxrl_async does not import on node {r.info['ip']} ({r.info['host']}): {where[7:]} "
                            "(install it on every node, or put it on a shared filesystem and PYTHONPATH)")
    if len(set(found)) > 1:
        say("warning: the nodes import jaxrl_async from different places: " + ", ".join(
            f"{r.info['ip']} ({r.info['node_id'][:8]}): {w}" for r, w in zip(by_node.values(), found)))

    # the controller and the jax.distributed coordinator on the node of the first trainer bundle
    head = trainers[0]
    host_ip = head.info["ip"]
    port = args.port or ray.get(head.host.reserve_port.remote(host_ip), timeout=CALL_TIMEOUT_S)
    coord = ray.get(head.host.reserve_port.remote(host_ip), timeout=CALL_TIMEOUT_S) if len(trainers) > 1 else None
    t_cmds, g_cmds = role_commands(args, rest, port, coordinator_port=coord, host=host_ip)
    base = forwarded_env([])
    base["JAXRL_RPC_AUTHKEY"] = secret
    for r, cmd in zip(trainers, t_cmds):
        r.cmd, r.env = [r.info["python"]] + cmd[1:], {**base, **forwarded_env(args.trainer_env)}
    for r, cmd in zip(gens, g_cmds):
        r.cmd, r.env = [r.info["python"]] + cmd[1:], {**base, **forwarded_env(args.generator_env)}
    say(f"controller at {host_ip}:{port}" + (f", jax.distributed coordinator at {host_ip}:{coord}" if coord else "")
        + f"; run_dir {run_dir}; jaxrl_async from {found[list(by_node).index(head.info['node_id'])]}")

    def start(r: Role) -> None:
        r.pid = ray.get(r.host.start.remote(r.cmd, r.env, cwd), timeout=CALL_TIMEOUT_S)
        r.rc, r.started = None, True
        devs = {k: v for k, v in r.info["env"].items() if v}
        say(f"{r.name}: pid {r.pid} on {r.info['host']} ({r.info['ip']}, node {r.info['node_id'][:12]}), actor pid "
            f"{r.info['pid']}, bundle {r.spec}" + (f", {devs}" if devs else ""))

    for r in trainers + gens:
        start(r)
    return _supervise(ray, args, trainers, gens, start, stops)


def _poll(ray, roles: list[Role], final: bool = False) -> list[Role]:
    """Print the roles' new lines and update their status; returns the roles whose actor died. ``final``: also
    the roles already seen to exit (their last lines, after ``_stop``)."""
    live = [r for r in roles if r.started and (r.rc is None or (final and not r.info.get("lost")))]
    refs = [r.host.poll.remote() for r in live]
    dead = []
    for r, ref in zip(live, refs):
        try:
            lines, rc, _ = ray.get(ref, timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            say(f"{r.name}: its actor on {r.info.get('host')} is lost ({type(e).__name__}); its process dies with it")
            r.rc = -9 if r.rc is None else r.rc
            r.info["lost"] = True
            dead.append(r)
            continue
        for line in lines:
            sys.stderr.write(f"[{r.name}] {line}\n")
        sys.stderr.flush()
        r.rc = rc if rc is not None else r.rc
    return dead


def _supervise(ray, args, trainers: list[Role], gens: list[Role], start, stops) -> int:
    ctrl = trainers[0]
    roles = trainers + gens
    restarts = {r.name: 0 for r in gens}
    due: dict[str, float] = {}
    finished: set[str] = set()
    interrupted_at = None
    while ctrl.rc is None:
        lost_hosts = _poll(ray, roles)
        if stops[0] and interrupted_at is None:
            interrupted_at = time.monotonic()
            say("interrupted: the controller stops the run (it saves a checkpoint); Ctrl-C again kills every role")
            try:
                ray.get(ctrl.host.send_signal.remote(int(signal.SIGTERM)), timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        if interrupted_at is not None and (stops[0] > 1 or time.monotonic() > interrupted_at + args.grace):
            say("killing every role" + ("" if stops[0] > 1 else f" (--grace {args.grace:g} s passed)"))
            break
        if ctrl.rc is not None:
            break
        now = time.monotonic()
        for r in gens:
            if r.name in due:
                if now >= due[r.name] and interrupted_at is None:
                    del due[r.name]
                    try:
                        if r.info.get("lost"):  # a new actor on the same bundle (the old one's is released)
                            try:
                                ray.kill(r.host)
                            except Exception:  # already gone
                                pass
                            r.create_host(ray)
                            r.info = ray.get(r.host.info.remote(), timeout=CALL_TIMEOUT_S)
                        start(r)
                        say(f"{r.name} restarted (pid {r.pid}; restart {restarts[r.name]} of {args.max_restarts})")
                    except Exception as e:  # the node is gone and its bundle not placed again yet: try later
                        say(f"{r.name}: restart failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                            "trying again")
                        r.info["lost"] = True
                        due[r.name] = now + min(args.restart_backoff * 2 ** restarts[r.name], 30.0)
                continue
            if r.name in finished or r.rc is None:
                continue
            if r in lost_hosts:
                r.info["lost"] = True
            if r.rc == 0:
                finished.add(r.name)
            elif interrupted_at is None and restarts[r.name] < args.max_restarts:
                delay = min(args.restart_backoff * 2 ** restarts[r.name], 30.0)
                restarts[r.name] += 1
                due[r.name] = now + delay
                say(f"{r.name} (pid {r.pid}) exited with status {r.rc}; restarting it in {delay:.1f} s")
            else:
                finished.add(r.name)
                if interrupted_at is None:
                    say(f"{r.name} (pid {r.pid}) exited with status {r.rc}; not restarted (--max-restarts "
                        f"{args.max_restarts} reached)")
        time.sleep(POLL_S)
    rc = ctrl.rc
    others = [r for r in roles if r is not ctrl]
    if rc is not None and stops[0] < 2:  # the others end when the controller closes their connections
        if rc == 2:  # a configuration error: nothing ran, the others would only wait for a connection
            _stop(ray, [r for r in others if r.started and r.rc is None], 5.0)
        deadline = time.monotonic() + args.grace
        while any(r.started and r.rc is None for r in others) and time.monotonic() < deadline and stops[0] < 2:
            _poll(ray, others)
            time.sleep(POLL_S)
    _stop(ray, [r for r in roles if r.started and r.rc is None], 5.0)
    _poll(ray, roles, final=True)  # the last lines
    if rc is None:
        rc = ctrl.rc if ctrl.rc is not None else 1
    say(f"controller exited with status {ctrl.rc}; other trainer processes: {[r.rc for r in trainers[1:]]}; "
        f"generators: {[r.rc for r in gens]}")
    if interrupted_at is not None:
        return rc if rc not in (0, None) else 130
    return rc


def _stop(ray, roles: list[Role], grace: float) -> None:
    """SIGTERM to each process, SIGKILL after ``grace``; their exit statuses recorded."""
    refs = [(r, r.host.stop.remote(grace)) for r in roles]
    for r, ref in refs:
        try:
            rc = ray.get(ref, timeout=grace + CALL_TIMEOUT_S)
            r.rc = rc if rc is not None else r.rc
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            r.rc = -9 if r.rc is None else r.rc
            r.info["lost"] = True


def _teardown(ray, pgs: list, roles: list[Role]) -> None:
    """Kill the role hosts (their processes die with them) and remove the placement groups; then disconnect."""
    from ray.util.placement_group import remove_placement_group

    live = [r for r in roles if r.host is not None and r.started and r.rc is None]
    if live:
        _stop(ray, live, 5.0)
    for r in roles:
        if r.host is not None:
            try:
                ray.kill(r.host)
            except Exception:  # already dead
                pass
    for pg in pgs:
        try:
            if hasattr(pg, "shutdown"):  # a TPU SlicePlacementGroup
                pg.shutdown()
            else:
                remove_placement_group(pg)
        except Exception:  # already removed (the cluster went away)
            pass
    ray.shutdown()
