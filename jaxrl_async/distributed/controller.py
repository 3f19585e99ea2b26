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

* ``RemoteGenerators.start`` (the generator role): accept ``N`` generator processes (``generator_role``), send them the engine
  spec, plan the cross-process push against their parameter layouts, push the initial weights and
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

A generator process that dies or hangs is named in the error (``PeerLostError`` via the dispatcher's
fatal-error check and the pusher), the run stops with an emergency checkpoint instead of hanging, and
running the same command again resumes.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import dataclasses
import itertools
import json
import os
import shutil
import sys
import threading
import time
from typing import Any, Callable, Sequence

from jaxrl_async.components import generator_model_config
from jaxrl_async.distributed import rpc
from jaxrl_async.loop.services import LocalTrainer
from jaxrl_async.loop.setup import Placement
from jaxrl_async.loop.warm_start import WarmStart
from jaxrl_async.weight_sync import NewestWinsPusher

PUSH_LOG = "weight_push.jsonl"


# =============================================================================================
# Remote generator (Generator interface over RPC)
# =============================================================================================
class RemoteHandle:
    def __init__(self, request_id: str, future: cf.Future, gen: "RemoteGenerator", peer_index: int):
        self.request_id, self._future, self._gen, self._peer = request_id, future, gen, peer_index

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        from jaxrl_async.rollout.orchestrator import GeneratorError

        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"request {self.request_id!r} not finished after {timeout} s "
                               f"(on {self._gen.peers[self._peer].name})") from None
        except (rpc.PeerLostError, rpc.RemoteError) as e:
            raise GeneratorError(f"request {self.request_id!r} failed: {e}") from e

    def abort(self) -> None:
        self._gen.abort(self.request_id)


class RemoteGenerator:
    """``rollout.orchestrator.Generator``'s caller API over generator processes.

    Requests go to the generator with the fewest in flight. ``error`` is the first lost peer
    (``PeerLostError`` naming it): the dispatcher checks it and stops the run.
    """

    def __init__(self, peers: Sequence[rpc.Peer], *, call_timeout_s: float = 120.0):
        self.peers = list(peers)
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._inflight = [0] * len(self.peers)
        self.submitted = [0] * len(self.peers)  # requests routed to each generator (load balance)
        self._where: dict[str, int] = {}
        self._ids = itertools.count()
        self._version = 0
        self._last_stats = None
        self.start_info: list[dict] = []

    @property
    def error(self) -> BaseException | None:
        return next((p.error for p in self.peers if p.error is not None), None)

    @property
    def version(self) -> int:
        return self._version

    def start(self) -> "RemoteGenerator":
        return self  # started in RemoteGenerators.start (after the first weights)

    def set_version(self, version: int) -> None:
        """The version every generator now decodes with (the pusher's ``on_applied``)."""
        self._version = int(version)

    def submit(self, prompt_ids: Sequence[int], sampling: Any = None, request_id: str | None = None,
               metadata: Any = None, *, stream: bool = False) -> RemoteHandle:
        from jaxrl_async.rollout.orchestrator import GeneratorError

        if stream:
            raise NotImplementedError("streaming requests are not served across processes")
        err = self.error
        if err is not None:
            raise GeneratorError(f"generator lost: {err}") from err
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        with self._lock:
            i = min(range(len(self.peers)), key=lambda k: self._inflight[k])
            self._inflight[i] += 1
            self.submitted[i] += 1
            self._where[rid] = i
        fut = self.peers[i].call_async("submit", rid, [int(t) for t in prompt_ids], sampling, metadata)

        def done(_f: cf.Future, i: int = i, rid: str = rid) -> None:
            with self._lock:
                self._inflight[i] -= 1
                self._where.pop(rid, None)

        fut.add_done_callback(done)
        return RemoteHandle(rid, fut, self, i)

    def abort(self, request_id: str) -> None:
        with self._lock:
            i = self._where.get(str(request_id))
        if i is not None and self.peers[i].error is None:
            self.peers[i].call_async("abort", str(request_id))

    def stats(self) -> Any:
        """The generators' ``GeneratorStats`` summed (version: the minimum). A failed call keeps the
        last value (the peer loss itself is reported through ``error``)."""
        from jaxrl_async.rollout.orchestrator import GeneratorStats

        try:
            got = [p.call("stats", timeout=self.call_timeout_s)[0] for p in self.peers]
        except (rpc.PeerLostError, rpc.PeerTimeoutError, rpc.RemoteError):
            if self._last_stats is None:
                raise
            return self._last_stats
        if len(got) == 1:
            s = got[0]
        else:
            f = {k.name: None for k in dataclasses.fields(GeneratorStats)}
            summed = {k: sum(getattr(g, k) for g in got) for k in f if k not in ("version",)}
            summed["slot_utilisation"] = sum(g.slot_utilisation for g in got) / len(got)
            s = GeneratorStats(version=min(g.version for g in got), **summed)
        self._last_stats = s
        return s

    def stop(self) -> None:
        for p in self.peers:
            if p.error is None:
                try:
                    p.call("stop", timeout=60.0)
                except (rpc.PeerLostError, rpc.PeerTimeoutError, rpc.RemoteError):
                    pass
            p.close()


# =============================================================================================
# Weight pusher across processes
# =============================================================================================
@dataclasses.dataclass
class CrossPushStats:
    version: int
    bytes: int
    dispatch_s: float  # trainer-thread time in push()
    transfer_s: float = 0.0  # total_s - apply_s: dispatch, checksums, pulls (or disk fallback), verification
    apply_s: float = 0.0  # the slowest generator's hand-over to its decode thread
    total_s: float = 0.0
    transport: str = ""  # "transfer" or "disk" (any generator needed the fallback)
    checksum: int = 0  # xor of the per-leaf checksums (the full list is in weight_push.jsonl)
    fallback_reason: str | None = None


class TransferPusher(NewestWinsPusher):
    """``weight_sync.WeightPusher``'s interface across processes (see ``distributed.transfer``).

    ``push`` (trainer thread): cast to the generator dtype (fresh buffers: the next step may donate
    the trainer's), for ``via_trainer`` leaves reshard on the trainer devices, and the checksums on
    device; dispatch only (on a trainer group every process runs the same, told by ``group.send``).
    The push thread then registers the shards with the transfer server(s) once per generator (fresh
    uuid; each trainer process its own shards), asks each generator to pull from ``addresses`` (one
    per trainer process), and waits for the replies (timeout); a generator whose pull failed or
    whose checksum differed gets the disk fallback (every trainer process writes its shards).
    ``on_applied(version)`` runs once every generator uses the version. Newest wins: a push that
    arrives while one is in flight replaces a waiting one.
    """

    _applier = "the generators"

    def __init__(self, remote: RemoteGenerator, plans: Sequence[Any], src_shardings: Sequence[Any], *, dtype: Any,
                 server: Any, on_applied: Callable[[int], None] | None, timeout_s: float, initial_version: int | None,
                 fallback_dir: str, log_path: str | None = None, guard: bool = True, group: Any = None,
                 addresses: Sequence[str] | None = None, fallback_key: bytes | None = None,
                 select: Callable[[Any], Any] | None = None):
        import jax.numpy as jnp

        from jaxrl_async.distributed.transfer import WireSender

        super().__init__(on_applied=on_applied, timeout_s=timeout_s, guard=guard, initial_version=initial_version,
                         thread_name="weight-push-remote")
        self.remote, self.plans = remote, list(plans)
        self.keys = [p.key for p in self.plans]
        self.sender = WireSender(self.plans, src_shardings)
        self.dtype = jnp.dtype(dtype)
        self.server = server
        self.group = group  # trainer_group.GroupLeader of a multi-process trainer, else None
        self.addresses = list(addresses) if addresses is not None else None
        self.fallback_dir = fallback_dir
        self.log_path = log_path
        self.routes = collections.Counter(p.route for p in self.plans)
        self.fallback_key = fallback_key if fallback_key is not None else _fallback_key()
        self.select = select  # params -> the pushed tree (LoRA: the adapters); None: all of them
        self._start()

    def _prepare(self, params: Any) -> tuple[list, Any]:
        from jaxrl_async.distributed.transfer import prepare_wire
        from jaxrl_async.weight_sync import transfer_guard

        with transfer_guard(self.guard):
            return prepare_wire(self.sender, params, self.dtype)

    def _dispatch(self, params: Any, version: int) -> tuple[tuple[list, Any], CrossPushStats, float]:
        t0 = time.perf_counter()
        if self.group is not None:
            self.group.send("push", int(version))
        wire, sums = self._prepare(params if self.select is None else self.select(params))
        stats = CrossPushStats(version=int(version), bytes=int(sum(x.size * x.dtype.itemsize for x in wire)),
                               dispatch_s=time.perf_counter() - t0)
        return (wire, sums), stats, t0

    def push(self, params: Any, version: int) -> CrossPushStats:
        self._raise_if_failed()
        wire, stats, t0 = self._dispatch(params, version)
        self._post(wire, stats, t0)
        return stats

    def push_now(self, params: Any, version: int) -> CrossPushStats:
        """Push synchronously (the initial weights, before the push thread's consumer exists)."""
        wire, stats, t0 = self._dispatch(params, version)
        self._deliver(wire, stats, t0)
        self.history.append(stats)
        return stats

    def _deliver(self, payload: tuple[list, Any], stats: CrossPushStats, t0: float) -> None:
        from jaxrl_async.distributed.transfer import (commit_fallback, host_checksums, new_pull_id, start_fallback,
                                                      write_shards)

        wire, sums_dev = payload
        v = stats.version
        sums = host_checksums(sums_dev)
        shards = self.sender.shards(wire)
        addresses = self.addresses or [self.server.address()]
        uuids = [new_pull_id() for _ in self.remote.peers]  # 64 random bits each, sent over the encrypted RPC
        if self.group is not None:  # the other trainer processes register their shards
            self.group.call("register", v, uuids, self.timeout_s, timeout=self.timeout_s + 30.0)
        futs = []
        for p, uuid in zip(self.remote.peers, uuids):
            self.server.await_pull(uuid, shards)
            futs.append(p.call_async("pull_weights", v, uuid, addresses, sums, self.timeout_s))
        replies = [self._reply(f, p, "pull_weights", v) for f, p in zip(futs, self.remote.peers)]
        failed = [i for i, r in enumerate(replies) if not r["ok"]]
        path = None
        if failed:
            stats.fallback_reason = "; ".join(f"{self.remote.peers[i].name}: {replies[i]['reason']}" for i in failed)
            tmp = start_fallback(self.fallback_dir, v)
            entries = write_shards(tmp, wire, key=self.fallback_key)
            if self.group is not None:
                for got in self.group.call("write_fallback", v, tmp, timeout=self.timeout_s + 30.0):
                    entries.extend(got)
            path = commit_fallback(tmp, v, self.keys, wire, sums, entries, key=self.fallback_key)
            for i in failed:
                p = self.remote.peers[i]
                replies[i] = self._reply(p.call_async("load_weights", v, path, sums, self.timeout_s), p, "load_weights", v)
            shutil.rmtree(path, ignore_errors=True)
        t2 = time.perf_counter()
        # the generators reply after applying: apply_s is theirs (slowest), transfer_s the rest
        stats.apply_s = max(float(r.get("apply_s") or 0.0) for r in replies)
        stats.total_s = t2 - t0
        stats.transfer_s = stats.total_s - stats.apply_s
        stats.transport = "disk" if failed else "transfer"
        x = 0
        for s in sums:
            x ^= s
        stats.checksum = x
        if self.log_path is not None:
            rec = {**dataclasses.asdict(stats), "checksums": sums, "routes": dict(self.routes),
                   "trainer_processes": len(addresses),
                   "generators": [{"name": p.name, **{k: r.get(k) for k in ("transport", "pull_s", "verify_s",
                                                                         "apply_s", "load_s", "shards", "bytes",
                                                                         "sources")},
                                   "checksums_match": r.get("checksums") == sums}
                                  for p, r in zip(self.remote.peers, replies)]}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def _reply(self, fut: cf.Future, peer: rpc.Peer, method: str, version: int) -> dict:
        try:
            r = fut.result(self.timeout_s + 30.0)
        except cf.TimeoutError:
            raise rpc.PeerTimeoutError(f"{peer.name}: {method} of version {version} not answered within "
                                       f"{self.timeout_s + 30:.0f} s") from None
        if r.get("ok") and r.get("checksums") is not None and len(r["checksums"]) != len(self.keys):
            raise RuntimeError(f"{peer.name}: {method} of version {version} verified {len(r['checksums'])} leaves, "
                               f"{len(self.keys)} were sent")
        return r


def adapters_of(params: Any) -> Any:
    """LoRA: what a push carries (the generators hold the base)."""
    from jaxrl_async.models import lora

    return lora.split(params)[0]


def _fallback_key() -> bytes:
    from jaxrl_async.distributed.transfer import fallback_key

    return fallback_key(rpc.authkey_from_env())


def _result(fut: cf.Future, peer: rpc.Peer, method: str, timeout: float) -> Any:
    try:
        return fut.result(timeout)
    except cf.TimeoutError:
        raise rpc.PeerTimeoutError(f"{peer.name}: no reply to {method!r} within {timeout:.0f} s") from None


# =============================================================================================
# The loop
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
                 transfer_host: str = "127.0.0.1"):
        self.listener, self.num_generators = listener, int(num_generators)
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
        local = LocalTrainer(setup.cfg, setup.run_dir, setup.model_cfg, setup.trainer_mesh, setup.init_params,
                             base_ref=setup.base_ref, tokenizer_dir=setup.tokenizer_dir,
                             warm_start=WarmStart(setup.cfg, setup.trainer_mesh, control,
                                                  interruptible=self.group is None))
        return local if self.group is None else GroupTrainer(local, self.group)

    def generators(self, setup: Any, control: Any) -> "RemoteGenerators":
        return RemoteGenerators(self, setup, control.say)

    def close(self) -> None:
        """The end of the run: requests per generator, and the trainer group let go (its operation logs
        compared: every follower must have run the leader's operations, in the leader's order)."""
        if self.remote is not None:
            print("[jaxrl_async] requests per generator: " + ", ".join(
                f"{p.name.split(' ')[0]} {n}" for p, n in zip(self.remote.peers, self.remote.submitted)),
                file=sys.stderr, flush=True)
        if self.group is not None:
            self.group.finish(log_dir=self.run_dir)


class RemoteGenerators:
    """``api.generator.GeneratorRole`` over generator processes: ``start`` sends them the engine spec, plans
    the cross-process push against their parameter layouts, pushes the initial weights and starts them
    (a ``RemoteGenerator``); ``pusher`` is a ``TransferPusher``."""

    def __init__(self, services: DistributedServices, setup: Any, say: Callable[[str], None]):
        self.services, self.setup, self.say = services, setup, say
        self.group, self.peers = services.group, services.peers
        self.call_timeout_s = services.call_timeout_s
        self.select = None  # LoRA: params -> the adapters (what a push carries)
        self.remote: RemoteGenerator | None = None

    def _spec(self, first: Any, lora_src: Any) -> dict[str, Any]:
        import jax

        c, ro = self.setup.cfg, self.setup.cfg.rollout
        return {"model_config": generator_model_config(self.setup.model_cfg), "engine": ro.engine,
                "mesh_shape": tuple(c.mesh.generator.shape), "mesh_axes": tuple(c.mesh.generator.axis_names),
                "tokenizer_dir": self.setup.tokenizer_dir,
                "param_shapes": [tuple(x.shape) for x in jax.tree.leaves(first)], "n_samples": ro.n_samples,
                "kv_update_policy": ro.kv_update_policy, "max_prefills_per_step": ro.engine.max_prefills_per_step,
                "lora": lora_src, "truncation": ro.sampling.top_k > 0 or ro.sampling.top_p < 1.0,
                "record_routing": ro.record_routing}

    def start(self, params: Any, version: int) -> RemoteGenerator:
        import jax

        from jaxrl_async.distributed.transfer import start_server

        model_cfg, peers = self.setup.model_cfg, self.peers
        dtype = str(jax.numpy.dtype(model_cfg.dtype))
        lora_src = None
        if model_cfg.lora is not None:  # the generators hold the base; pushes carry the adapters only
            from jaxrl_async.distributed import lora_remote

            lora_src = lora_remote.base_source(self.setup.cfg, model_cfg)
        # the first push: the adapters (the generators build the base), or base + adapters once (source "push")
        self.select = adapters_of if lora_src is not None and lora_src["source"] != "push" else None
        first = params if self.select is None else self.select(params)
        futs = [p.call_async("init", self._spec(first, lora_src)) for p in peers]  # engines built in parallel
        infos = [_result(f, p, "init", self.call_timeout_s) for f, p in zip(futs, peers)]
        if lora_src is not None:
            if self.group is not None and lora_src["source"] != "push":
                self.group.send("base_fingerprint", dtype)  # a collective over the trainer group
            self.say(lora_remote.check_bases(peers, infos, params, dtype, lora_src))
        self.server = start_server(self.services.transfer_host)
        self.addresses = [self.server.address()]
        self._configure_push(first, [i["layouts"] for i in infos], dtype)
        self.remote = self.services.remote = RemoteGenerator(peers, call_timeout_s=min(self.call_timeout_s, 120.0))
        initial = self._make_pusher(None, self.call_timeout_s, None)
        st = initial.push_now(params, version)
        initial.close()
        self.say(f"initial weights (version {version}, {st.bytes / 2**20:.1f} MiB) pushed to {len(peers)} generator(s) "
                 f"via {st.transport} in {st.total_s:.2f} s (routes {dict(initial.routes)})")
        if lora_src is not None and self.select is None:  # the base went once; from now on the adapters only
            self.select = adapters_of
            self._configure_push(adapters_of(params), [i["lora_adapter_layouts"] for i in infos], dtype,
                                 stage="adapters")
        self.remote.start_info = [p.call("start", timeout=self.call_timeout_s) for p in peers]
        self.remote.set_version(version)
        return self.remote

    def _configure_push(self, tree: Any, dst_layouts: list, dtype: str, stage: str | None = None) -> None:
        """Plan the pushes of ``tree`` (its leaves on the trainer) against the generators' layouts and
        configure both sides (the generators, and the other processes of a trainer group)."""
        import jax

        from jaxrl_async.distributed.transfer import WireSender, layout_of, plan_transfer, tree_keys

        peers = self.peers
        leaves = jax.tree.leaves(tree)
        keys = tree_keys(tree)
        for p, info in zip(peers, dst_layouts):
            if len(info) != len(keys):
                raise RuntimeError(f"{p.name}: its engine has different parameters than the trainer "
                                   f"({len(info)} vs {len(keys)} leaves)")
            if info != dst_layouts[0]:
                raise RuntimeError(f"{p.name}: generator layouts differ between generator processes")
        src_layouts = [layout_of(x.sharding, x.ndim) for x in leaves]
        self.plans = plan_transfer(keys, [x.shape for x in leaves], dtype, src_layouts, dst_layouts[0])
        self.src_shardings = [x.sharding for x in leaves]
        if self.group is not None:  # one transfer server per trainer process, each serving its own shards
            self.addresses[1:] = self.group.results(self.group.send("configure_push", self.plans, dtype,
                                                                     self.select is not None), "configure_push")
        owners = WireSender(self.plans, self.src_shardings).owners
        for p in peers:
            got = p.call("configure_push", src_layouts, dtype, owners, stage, timeout=self.call_timeout_s)
            if got.get("keys", keys) != keys:
                raise RuntimeError(f"{p.name}: its engine has different parameters than the trainer")

    def _make_pusher(self, on_applied: Any, timeout_s: float, initial_version: int | None) -> TransferPusher:
        import jax

        return TransferPusher(self.remote, self.plans, self.src_shardings,
                              dtype=jax.numpy.dtype(self.setup.model_cfg.dtype), server=self.server,
                              on_applied=on_applied, timeout_s=timeout_s, initial_version=initial_version,
                              fallback_dir=os.path.join(self.setup.run_dir, "weight_push"),
                              log_path=os.path.join(self.setup.run_dir, PUSH_LOG), group=self.group,
                              addresses=self.addresses, select=self.select)

    def pusher(self, generator: Any, *, on_applied: Callable[[int], None], timeout_s: float,
               initial_version: int) -> TransferPusher:
        def applied(v: int) -> None:
            generator.set_version(v)
            on_applied(v)

        return self._make_pusher(applied, timeout_s, initial_version)

    def close(self) -> None:
        pass  # the generator processes are stopped by ``RemoteGenerator.stop``


# =============================================================================================
# CLI
# =============================================================================================
def _split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    a, rest = _split_argv(argv)
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
        from jaxrl_async.main import _peek_config

        cfg = role_config(_peek_config(rest), a.generator_devices, jax.device_count())
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
                                   heartbeat_timeout_s=a.heartbeat_timeout, transfer_host=host)
    try:
        result = RLRun(cfg, services).run()
    except BaseException as e:
        group_err = services.group.error if services.group is not None else None
        if group_err is not None:  # a trainer process is gone: jax's exit barrier would wait for it
            print(f"[jaxrl_async] run failed: {group_err} (then: {type(e).__name__}: {e})", file=sys.stderr, flush=True)
            os._exit(1)
        if isinstance(e, FatalRunError):
            print(f"[jaxrl_async] run failed: {e}", file=sys.stderr, flush=True)
            return 1
        from jaxrl_async.cli import error_line, is_user_error

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


if __name__ == "__main__":
    sys.exit(main())
