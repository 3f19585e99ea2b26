"""The controller + trainer role: the run (``loop.RLRun``) with its generators in other processes.

``python -m jaxrl_async.distributed.controller --listen HOST:PORT [--generators N]
[--generator-devices G] [--cpu-devices T] [--transfer-host HOST] [--coordinator ADDR --num-processes P
--process-id I | --jax-distributed] [--coordinator-bind HOST[:PORT]] [--config FILE] [key=value ...]``
(``$JAXRL_RPC_AUTHKEY``: the run's secret, hex, >= 16 random bytes; network security: docs/launch.md
section 5)

The controller (data ledger, staleness manager, rollout dispatcher, workflows and rewards,
checkpoints, metrics) lives in the trainer process, as AReaL's controller lives on the trainer's
rank 0: a checkpoint must hold the trainer state and the data/rollout state of the same moment,
and the trainer is the consumer every batch goes to. The loop is the single-process one
(``loop.RLRun``), given another set of role services (``DistributedServices``; the contracts are
``jaxrl_async.api``):

* ``remote_generator.RemoteGenerators.start`` (the generator role; the ``N`` generator processes
  (``generator_role``) were accepted by ``DistributedServices.place``): send them the engine spec, plan the
  cross-process push against their parameter layouts, push the initial weights and
  start them; returns a ``RemoteGenerator`` (the ``Generator`` interface over RPC: ``submit`` ->
  handle with ``result(timeout)``, ``abort``, ``stats``, ``error``), so workflows, the dispatcher
  and eval run unchanged;
* ``RemoteGenerators.pusher``: a ``TransferPusher`` (the ``WeightPusher`` interface): weights travel
  device-to-device through ``jax.experimental.transfer`` (``distributed.transfer``), checksummed,
  with a disk fallback; the version is advertised to the staleness manager only after EVERY
  generator applied it (the invariant the staleness bound rests on).

The trainer itself may be an SPMD group of several processes (``jax.distributed``; ``--coordinator``
or auto-detection): every trainer process runs this module; process 0 is the controller and the
others follow it (``distributed.trainer_group``), each serving its own weight shards to the
generators from its own transfer server.

Console: ``[jaxrl_async] ...`` lines and the steps' progress (``logging.progress``): a tqdm bar when stderr is a
terminal, else one line per step (``console.ProgressLines``: the launcher's pipe, a cluster job's log file).

A generator process that dies or hangs is named in the error (``PeerLostError`` via the dispatcher's
fatal-error check and the pusher), the run stops with an emergency checkpoint instead of hanging, and
running the same command again resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
from typing import Any, Callable, Sequence

from jaxrl_async.distributed import rpc
from jaxrl_async.distributed.remote_generator import RemoteGenerator, RemoteGenerators
from jaxrl_async.loop.services import LocalTrainer
from jaxrl_async.loop.setup import Placement
from jaxrl_async.loop.warm_start import WarmStart


# =============================================================================================
# The services
# =============================================================================================
def role_config(cfg: Any, generator_devices: int, trainer_devices: int) -> Any:
    """``cfg`` for the multi-process roles: each role's mesh spans its own process's devices
    (``mesh.generator`` per generator process, ``mesh.trainer`` on the trainer's), so explicit
    device indices and the simulated device count of the single-process layout do not apply."""
    from jaxrl_async.config import validate

    m = cfg.mesh
    G, T = int(generator_devices), int(trainer_devices)
    mesh = dataclasses.replace(m, generator=dataclasses.replace(m.generator, devices=tuple(range(G))),
                               trainer=dataclasses.replace(m.trainer, devices=tuple(range(G, G + T))),
                               num_generator_devices=None, colocate=False, cpu_devices=None, layout=None)
    return validate(dataclasses.replace(cfg, mesh=mesh), num_devices=G + T)


class GroupTrainer:
    """``api.trainer.TrainerService`` over a trainer group: every operation is first sent to the followers
    (``GroupLeader.send``), which run it on their own ``loop.services.LocalTrainer``, then run on the
    leader's (``local``). The same ordered operations on every process: the collectives match."""

    def __init__(self, local: LocalTrainer, group: Any):
        self.local, self.group = local, group

    @property
    def checkpointer(self) -> Any:
        return self.local.checkpointer

    @property
    def params(self) -> Any:
        return self.local.params

    def latest_checkpoint(self) -> int | None:  # a directory listing, no collective
        return self.local.latest_checkpoint()

    def state_consumed(self) -> bool:
        return self.local.state_consumed()

    def build(self) -> None:
        self.group.send("build")
        self.local.build()

    def restore(self) -> Any:
        futs = self.group.send("restore")
        r = self.local.restore()
        steps = self.group.results(futs, "restore")
        if any(s != r.step for s in steps):
            raise RuntimeError(f"trainer group restored different checkpoints: step {r.step} here, {steps} on the "
                               "other processes (is the run directory on a filesystem every host sees?)")
        return r

    def initial_state(self, sft_examples: Sequence[Any] | None) -> None:
        self.group.send("initial_state", None if sft_examples is None else list(sft_examples))
        self.local.initial_state(sft_examples)

    def train(self, trajectories: Sequence[Any], policy_version: int) -> list:
        self.group.send("train", list(trajectories), int(policy_version))  # the batch travels leader -> followers
        return self.local.train(trajectories, policy_version)

    def save(self, meta: Any, buffered: Sequence[Any]) -> Any:
        self.group.send("save", meta, list(buffered))
        return self.local.save(meta, buffered)

    def wait_checkpoint(self) -> None:
        self.group.send("wait_checkpoint")
        self.local.wait_checkpoint()

    def close_checkpoint(self) -> None:
        if self.group.error is not None:
            return  # Orbax's close synchronises with processes that are gone: leave it to the exit
        self.group.send("close_checkpoint")
        self.local.close_checkpoint()

    def export(self, step: int) -> Any:
        self.group.send("export", int(step))
        return self.local.export(step)


class DistributedServices:
    """The roles of a multi-process run (module docstring): ``place`` accepts the other trainer processes
    and the generator processes; the trainer is a ``GroupTrainer`` when the trainer spans several
    processes (else a ``LocalTrainer``); the generator role is ``RemoteGenerators``."""

    def __init__(self, *, listener: Any, num_generators: int = 1, accept_timeout_s: float = 300.0,
                 call_timeout_s: float = 600.0, heartbeat_s: float = 5.0, heartbeat_timeout_s: float = 60.0,
                 transfer_host: str = "127.0.0.1", replica_timeout_s: float = 300.0):
        self.listener, self.num_generators = listener, int(num_generators)
        self.replica_timeout_s = float(replica_timeout_s)
        self._rejoin_stop = threading.Event()
        self.accept_timeout_s, self.call_timeout_s = accept_timeout_s, call_timeout_s
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.transfer_host = transfer_host
        self.peers: list[rpc.Peer] = []  # the generator processes
        self.group = None  # trainer_group.GroupLeader when the trainer spans several processes
        self.remote: RemoteGenerator | None = None
        self.run_dir: str | None = None

    def place(self, cfg: Any, control: Any) -> Placement:
        import jax

        from jaxrl_async.distributed.trainer_group import GroupLeader, trainer_mesh

        devs = jax.devices()
        mesh = trainer_mesh(cfg)
        P = jax.process_count()
        control.say(f"trainer devices: {len(devs)} x {devs[0].platform} in {P} process(es), mesh {dict(mesh.shape)}; "
                    f"generators: {self.num_generators} process(es), listening on {self.listener.address}")
        followers = self._accept_peers(P - 1, control.say)
        if followers:
            self.group = GroupLeader(followers, call_timeout_s=self.call_timeout_s)
            self.group.start_watchdog()
        return Placement(trainer_mesh=mesh, trainer_ids=tuple(range(len(devs))))

    def _accept_peers(self, n_followers: int, say: Callable[[str], None]) -> list[rpc.Peer]:
        """Accept the other trainer processes and the generator processes (any order); returns the
        followers in process order and keeps the generators (``peers``)."""
        followers: dict[int, rpc.Peer] = {}
        total = n_followers + self.num_generators
        for k in range(total):
            peer, hello = self._accept_one(k, total, n_followers)
            if hello.get("role") == "trainer":
                i = int(hello["process_index"])
                if not 0 < i <= n_followers or i in followers:
                    raise RuntimeError(f"{peer.name}: trainer process index {i} is not one of 1..{n_followers} "
                                       "or registered twice (same --num-processes on every trainer process?)")
                followers[i] = peer
                say(f"trainer process connected: {peer.name}")
            else:
                if len(self.peers) >= self.num_generators:
                    raise RuntimeError(f"{peer.name}: more generator processes than --generators {self.num_generators}")
                self.peers.append(peer)
                say(f"generator connected: {peer.name}")
        self.peers.sort(key=lambda p: p.name)  # a stable order (logs, push records), whatever connected first
        return [followers[i] for i in sorted(followers)]

    def _accept_one(self, k: int, total: int, n_followers: int) -> tuple[rpc.Peer, dict[str, Any]]:
        conn = rpc.accept(self.listener, self.accept_timeout_s,
                          f"role process ({k + 1} of {total}: {n_followers} other trainer process(es), "
                          f"{self.num_generators} generator(s))")
        return self._register(conn, k)

    def _register(self, conn: Any, k: int) -> tuple[rpc.Peer, dict[str, Any]]:
        """The role process on ``conn`` registers (name, pid, host; within 60 s)."""
        hello: dict[str, Any] = {}
        got = threading.Event()

        def handler(method: str, args: tuple, reply: Callable) -> None:
            if method != "register":
                raise ValueError(f"controller: unexpected call {method!r} from a role process")
            hello.update(args[0])
            got.set()
            reply(True, None)

        peer = rpc.Peer(conn, f"role process #{k}", handler=handler, heartbeat_s=self.heartbeat_s,
                        heartbeat_timeout_s=self.heartbeat_timeout_s)
        if not got.wait(60.0):
            raise TimeoutError(f"role connection #{k} did not register within 60 s")
        peer.name = f"{hello['name']} (pid {hello['pid']} on {hello['host']})"
        return peer, hello

    def after_setup(self, setup: Any, control: Any) -> None:
        self.run_dir = setup.run_dir
        if self.group is not None:
            spec = {"model_cfg": setup.model_cfg, "run_dir": setup.run_dir, "tokenizer_dir": setup.tokenizer_dir}
            infos = self.group.results(self.group.send("setup", spec), "setup")
            control.say(f"trainer group: {self.group.size} processes (" + ", ".join(
                f"#{i['process_index']} pid {i['pid']} on {i['host']}" for i in infos) + " follow this one)")

    def trainer(self, setup: Any, control: Any) -> Any:
        local = LocalTrainer.of_setup(setup, WarmStart(setup.cfg, setup.trainer_mesh, control,
                                                       interruptible=self.group is None))
        return local if self.group is None else GroupTrainer(local, self.group)

    def generators(self, setup: Any, control: Any) -> RemoteGenerators:
        return RemoteGenerators(self, setup, control.say)

    def start_rejoins(self, role: RemoteGenerators, say: Callable[[str], None]) -> None:
        """After the generators started (``RemoteGenerators.start``): from now on, a generator process that
        connects (a replica restarted by its launcher) registers and rejoins (``RemoteGenerators.join``) on a
        thread of its own."""
        def admit(conn: Any, k: int) -> None:
            try:
                peer, hello = self._register(conn, k)
            except Exception as e:  # noqa: BLE001 - one line; the run goes on
                say(f"a role process connected but did not register: {type(e).__name__}: {e}")
                conn.close()
                return
            if hello.get("role") == "trainer":
                say(f"{peer.name}: a trainer process cannot join a running group; closing it")
                peer.close()
                return
            say(f"generator connected: {peer.name} (rejoining)")
            role.join(peer, str(hello["name"]))

        def loop() -> None:
            k = self.num_generators + 1000
            while not self._rejoin_stop.is_set():
                try:
                    conn = self.listener.accept(1.0, "restarted generator")
                except TimeoutError:
                    continue
                except Exception:  # noqa: BLE001 - the listener is closed: the run is ending
                    return
                k += 1
                threading.Thread(target=admit, args=(conn, k), name=f"rejoin-{k}", daemon=True).start()

        threading.Thread(target=loop, name="rejoin-acceptor", daemon=True).start()

    def close(self) -> None:
        """The end of the run: requests per generator, and the trainer group let go (its operation logs
        compared: every follower must have run the leader's operations, in the leader's order)."""
        self._rejoin_stop.set()
        if self.remote is not None:
            r = self.remote
            print("[jaxrl_async] requests per generator: " + ", ".join(
                f"{x.name} {x.requests}" + (f" ({x.failures} lost, {x.rejoins} rejoined)" if x.failures else "")
                for x in r.replicas), file=sys.stderr, flush=True)
        if self.group is not None:
            self.group.finish(log_dir=self.run_dir)


# =============================================================================================
# CLI
# =============================================================================================
def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_async.distributed.controller", add_help=False)
    ap.add_argument("--listen", required=True, help="HOST:PORT the generator processes connect to (mutual TLS keyed "
                    "by $JAXRL_RPC_AUTHKEY)")
    ap.add_argument("--listen-reuse-port", action="store_true", help="bind --listen with SO_REUSEPORT: the port was "
                    "reserved by the launching process holding it bound (distributed.launch.reserve_port)")
    ap.add_argument("--generators", type=int, default=1)
    ap.add_argument("--generator-devices", type=int, required=True, help="devices of each generator process")
    ap.add_argument("--cpu-devices", type=int, default=None, help="simulated CPU devices of this process")
    ap.add_argument("--accept-timeout", type=float, default=300.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=60.0)
    ap.add_argument("--replica-timeout", type=float, default=300.0, help="seconds the run waits with no generator "
                    "replica in service (all lost, none restarted yet) before it fails with an emergency checkpoint")
    ap.add_argument("--transfer-host", default=None, help="interface address the transfer server listens on and "
                    "generators pull from (default: the --listen host on process 0; on the other trainer processes "
                    "the address they reach process 0 from). Never 0.0.0.0: the transfer server has no "
                    "authentication of its own (docs/launch.md)")
    g = ap.add_argument_group("trainer group (one SPMD program over several processes: jax.distributed)")
    g.add_argument("--jax-distributed", action="store_true", help="jax.distributed.initialize() with auto-detection "
                   "(SLURM, TPU pod, JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of the jax.distributed coordinator (process 0)")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument("--coordinator-bind", default=None, help="HOST[:PORT] the coordinator (process 0) listens on "
                   "(default: $JAX_COORDINATOR_BIND_ADDRESS, else the coordinator address itself; never every "
                   "interface: the coordination service has no authentication)")
    g.add_argument("--jax-heartbeat-timeout", type=int, default=60, help="seconds after which the JAX coordination "
                   "service gives up on a silent trainer process (and aborts the others)")
    return ap.parse_known_args(argv)


def init_distributed(a: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` for a trainer group (explicit or auto-detected); no-op otherwise.
    On CPU the cross-process collectives use gloo. The coordinator (on process 0) listens on
    ``coordinator_bind_address`` (below), not on every interface as jax's default ``[::]:PORT``."""
    import jax

    explicit = [a.coordinator, a.num_processes, a.process_id]
    if any(x is not None for x in explicit) and not all(x is not None for x in explicit):
        raise ValueError("--coordinator, --num-processes and --process-id go together")
    if not (a.jax_distributed or a.coordinator):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw = dict(heartbeat_timeout_seconds=int(a.jax_heartbeat_timeout))
    if a.coordinator:
        coordinator, n, pid = a.coordinator, int(a.num_processes), int(a.process_id)
    else:
        from jax._src import clusters  # jax is pinned; the auto-detection jax.distributed.initialize runs itself

        coordinator, n, pid, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, None, 300)
        if local is not None:
            kw["local_device_ids"] = local
    kw["coordinator_bind_address"] = coordinator_bind_address(coordinator, getattr(a, "coordinator_bind", None))
    jax.distributed.initialize(coordinator, n, pid, **kw)


def coordinator_bind_address(coordinator: str, explicit: str | None = None) -> str:
    """Where process 0's coordination service listens: ``explicit`` (``HOST[:PORT]``; the port
    defaults to the coordinator's), else ``$JAX_COORDINATOR_BIND_ADDRESS``, else the coordinator
    address itself (the address the other processes reach it by is an address of this host). Every
    interface is refused."""
    from jaxrl_async.distributed.transfer import check_bind_host

    bind = explicit or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or coordinator
    try:
        host, port = rpc.parse_address(bind)
    except ValueError:  # HOST alone (IPv6 in brackets): the coordinator's port
        host, port = bind.strip("[]"), rpc.parse_address(coordinator)[1]
    check_bind_host(host, "jax.distributed coordinator (--coordinator-bind)")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _isatty(f: Any) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):  # replaced or closed
        return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    a, rest = split_argv(argv)
    import jax

    from jaxrl_async.config import ConfigError

    if a.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", int(a.cpu_devices))
    try:
        if a.transfer_host is not None:
            from jaxrl_async.distributed.transfer import check_bind_host

            check_bind_host(a.transfer_host, "--transfer-host")
        init_distributed(a)
    except ValueError as e:
        print(f"[jaxrl_async] {e}", file=sys.stderr)
        return 2
    try:
        from jaxrl_async.config import peek_config

        cfg = role_config(peek_config(rest), a.generator_devices, jax.device_count())
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    if jax.process_index() > 0:  # a follower of the trainer group
        from jaxrl_async.distributed.trainer_group import run_follower

        return run_follower(cfg, a.listen, connect_timeout_s=a.accept_timeout, heartbeat_timeout_s=a.heartbeat_timeout,
                            transfer_host=a.transfer_host)
    from jaxrl_async.distributed.transfer import check_bind_host
    from jaxrl_async.loop import FatalRunError, RLRun

    try:
        authkey = rpc.authkey_from_env()
        host = check_bind_host(a.transfer_host or rpc.parse_address(a.listen)[0],
                               "transfer server (the --listen host; give --transfer-host)")
    except (RuntimeError, ValueError) as e:
        print(f"[jaxrl_async] {e}", file=sys.stderr)
        return 2
    listener = rpc.listen(a.listen, authkey, reuse_port=a.listen_reuse_port)
    services = DistributedServices(listener=listener, num_generators=a.generators, accept_timeout_s=a.accept_timeout,
                                   heartbeat_timeout_s=a.heartbeat_timeout, transfer_host=host,
                                   replica_timeout_s=a.replica_timeout)
    try:
        # the steps' progress: a bar on a terminal; one line per step into a pipe or a file (the launcher
        # streams this process's output line by line: a bar's carriage-return redraws would show at its end only)
        result = RLRun(cfg, services, progress_style="bar" if _isatty(sys.stderr) else "lines").run()
    except BaseException as e:
        group_err = services.group.error if services.group is not None else None
        if group_err is not None:  # a trainer process is gone: jax's exit barrier would wait for it
            print(f"[jaxrl_async] run failed: {group_err} (then: {type(e).__name__}: {e})", file=sys.stderr, flush=True)
            os._exit(1)
        if isinstance(e, FatalRunError):
            print(f"[jaxrl_async] run failed: {e}", file=sys.stderr, flush=True)
            return 1
        from jaxrl_async.cli.common import error_line, is_user_error

        if is_user_error(e):  # e.g. model.lora: a generator's base differs from the trainer's
            print(error_line("controller", e), file=sys.stderr, flush=True)
            return 2
        if isinstance(e, (TimeoutError, ConnectionError, rpc.RemoteError)):
            print(f"[jaxrl_async] run failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return 1
        raise
    finally:
        listener.close()
    print(f"[jaxrl_async] done: {result.steps} steps, version {result.version} ({result.stopped_by})", file=sys.stderr)
    return 0


def exit_after_orderly_end(rc: int = 0) -> None:
    """The controller's exit once ``main`` returned (a completed run, or a failure already reported in one line
    with its emergency checkpoint committed and closed): jax.distributed's shutdown (the trainer followers' exit
    barrier), logging and stdio flushed, then ``os._exit(rc)``. Interpreter finalization would stop the daemon
    threads (RPC, transfer server, monitors) wherever they are, and one stopped inside C++ code aborted the
    controller ("FATAL: exception not rethrown", status -6): after `done` in 2 of ~30 runs under Ray on a loaded
    machine, and after a lost generator's "run failed" line once in a clean-clone CI run."""
    import logging

    import jax

    jax.distributed.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    exit_after_orderly_end(main())
