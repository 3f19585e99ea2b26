"""The generator role over generator processes (``RemoteGenerators``: ``api.generator.GeneratorRole``):
``RemoteGenerator`` is ``rollout.orchestrator.Generator``'s service (``api.generator.GeneratorService``)
over RPC, ``TransferPusher`` the weight push across processes (``api.generator.WeightPushService``;
``distributed.transfer`` moves the shards). Used by ``controller.DistributedServices``."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import json
import os
import shutil
import threading
import time
from typing import Any, Callable, Sequence

from jaxrl_async.generator.factory import generator_model_config
from jaxrl_async.distributed import rpc
from jaxrl_async.distributed.replicas import RemoteGenerator, RemoteHandle
from jaxrl_async.generator.weight_sync import NewestWinsPusher

__all__ = ["PUSH_LOG", "CrossPushStats", "RemoteGenerator", "RemoteGenerators", "RemoteHandle", "TransferPusher",
           "adapters_of"]

PUSH_LOG = "weight_push.jsonl"


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
        self.last: tuple[list, list[int], int] | None = None  # the newest delivered (wire, checksums, version)
        self._start()

    def _prepare(self, params: Any) -> tuple[list, Any]:
        from jaxrl_async.distributed.transfer import prepare_wire
        from jaxrl_async.generator.weight_sync import transfer_guard

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
        from jaxrl_async.distributed.transfer import host_checksums

        wire, sums_dev = payload
        v = stats.version
        sums = host_checksums(sums_dev)
        peers = self.remote.push_targets()  # the live replicas; a joining one catches up on this thread
        replies = self._send_weights(peers, v, wire, sums, stats)
        self.last = (wire, sums, v)  # what a (re)joining replica is given before it serves
        got = [r for r in replies if r is not None]
        t2 = time.perf_counter()
        # the generators reply after applying: apply_s is theirs (slowest), transfer_s the rest
        stats.apply_s = max((float(r.get("apply_s") or 0.0) for r in got), default=0.0)
        stats.total_s = t2 - t0
        stats.transfer_s = stats.total_s - stats.apply_s
        stats.transport = "disk" if stats.fallback_reason else "transfer"
        x = 0
        for s in sums:
            x ^= s
        stats.checksum = x
        if self.log_path is not None:
            addresses = self.addresses or [self.server.address()]
            rec = {**dataclasses.asdict(stats), "checksums": sums, "routes": dict(self.routes),
                   "trainer_processes": len(addresses),
                   "generators": [{"name": p.name, "lost": r is None,
                                   **{k: (r or {}).get(k) for k in ("transport", "pull_s", "verify_s", "apply_s",
                                                                    "load_s", "shards", "bytes", "sources")},
                                   "checksums_match": r is not None and r.get("checksums") == sums}
                                  for p, r in zip(peers, replies)]}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def _send_weights(self, peers: Sequence[rpc.Peer], v: int, wire: list, sums: list[int],
                      stats: CrossPushStats | None = None) -> list[dict | None]:
        """Version ``v`` to ``peers`` (pull from the transfer servers, the disk fallback for a failed
        pull); their replies, None for a replica lost (or dropped for not answering) meanwhile."""
        from jaxrl_async.distributed.transfer import commit_fallback, new_pull_id, start_fallback, write_shards

        if not peers:
            return []
        shards = self.sender.shards(wire)
        addresses = self.addresses or [self.server.address()]
        uuids = [new_pull_id() for _ in peers]  # 64 random bits each, sent over the encrypted RPC
        if self.group is not None:  # the other trainer processes register their shards
            self.group.call("register", v, uuids, self.timeout_s, timeout=self.timeout_s + 30.0)
        futs = []
        for p, uuid in zip(peers, uuids):
            self.server.await_pull(uuid, shards)
            futs.append(p.call_async("pull_weights", v, uuid, addresses, sums, self.timeout_s))
        replies = [self._reply(f, p, "pull_weights", v) for f, p in zip(futs, peers)]
        failed = [i for i, r in enumerate(replies) if r is not None and not r["ok"]]
        if failed:
            reason = "; ".join(f"{peers[i].name}: {replies[i]['reason']}" for i in failed)
            if stats is not None:
                stats.fallback_reason = reason
            tmp = start_fallback(self.fallback_dir, v)
            entries = write_shards(tmp, wire, key=self.fallback_key)
            if self.group is not None:
                for got in self.group.call("write_fallback", v, tmp, timeout=self.timeout_s + 30.0):
                    entries.extend(got)
            path = commit_fallback(tmp, v, self.keys, wire, sums, entries, key=self.fallback_key)
            for i in failed:
                p = peers[i]
                replies[i] = self._reply(p.call_async("load_weights", v, path, sums, self.timeout_s), p, "load_weights", v)
            shutil.rmtree(path, ignore_errors=True)
        return replies

    def _reply(self, fut: cf.Future, peer: rpc.Peer, method: str, version: int) -> dict | None:
        """A replica's reply; None when it was lost, or did not answer in time (then it is dropped: its
        process sees the connection close and exits, its launcher restarts it)."""
        try:
            r = fut.result(self.timeout_s + 30.0)
        except cf.TimeoutError:
            self.remote.mark_lost(peer, rpc.PeerTimeoutError(
                f"{peer.name}: {method} of version {version} not answered within {self.timeout_s + 30:.0f} s"))
            return None
        except rpc.PeerLostError:
            return None  # the router saw it (or will, from its monitor)
        if r.get("ok") and r.get("checksums") is not None and len(r["checksums"]) != len(self.keys):
            raise RuntimeError(f"{peer.name}: {method} of version {version} verified {len(r['checksums'])} leaves, "
                               f"{len(self.keys)} were sent")
        return r

    def catch_up(self, peer: rpc.Peer, have: int | None = None, then: Callable[[], Any] | None = None) -> cf.Future:
        """On the push thread (between two pushes): give ``peer`` the newest pushed version unless it
        already has it (``have``), then run ``then`` (the router's ``activate``). The future's value: the
        version it holds."""
        def task() -> int:
            if self.last is None:
                raise RuntimeError("no weights were pushed yet")
            wire, sums, v = self.last
            if have is None or have < v:
                r = self._send_weights([peer], v, wire, sums)[0]
                if r is None:
                    raise rpc.PeerLostError(f"{peer.name}: lost while receiving version {v}")
                if not r.get("ok"):
                    raise RuntimeError(f"{peer.name}: version {v} not applied: {r.get('reason')}")
            if then is not None:
                then()
            return v

        return self.run_on_push_thread(task)


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



class RemoteGenerators:
    """``api.generator.GeneratorRole`` over generator processes: ``start`` sends them the engine spec, plans
    the cross-process push against their parameter layouts, pushes the initial weights and starts them
    (a ``RemoteGenerator``); ``pusher`` is a ``TransferPusher``."""

    def __init__(self, services: Any, setup: Any, say: Callable[[str], None]):
        self.services, self.setup, self.say = services, setup, say
        self.group, self.peers = services.group, services.peers
        self.call_timeout_s = services.call_timeout_s
        self.select = None  # LoRA: params -> the adapters (what a push carries)
        self.remote: RemoteGenerator | None = None
        self._pusher: TransferPusher | None = None  # the run's (``pusher``): rejoining replicas catch up on its thread
        self._initial_last: Any = None  # the initial push's (wire, checksums, version)
        self._pusher_ready = threading.Event()
        self.join_spec: dict[str, Any] | None = None

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
        self.join_spec = self._spec(first, lora_src)
        futs = [p.call_async("init", self.join_spec) for p in peers]  # engines built in parallel
        infos = [_result(f, p, "init", self.call_timeout_s) for f, p in zip(futs, peers)]
        if lora_src is not None:
            if self.group is not None and lora_src["source"] != "push":
                self.group.send("base_fingerprint", dtype)  # a collective over the trainer group
            self.say(lora_remote.check_bases(peers, infos, params, dtype, lora_src))
        self.server = start_server(self.services.transfer_host)
        self.addresses = [self.server.address()]
        self._configure_push(first, [i["layouts"] for i in infos], dtype)
        self.remote = self.services.remote = RemoteGenerator(
            peers, call_timeout_s=min(self.call_timeout_s, 120.0), say=self.say,
            replica_timeout_s=getattr(self.services, "replica_timeout_s", 300.0))
        initial = self._make_pusher(None, self.call_timeout_s, None)
        st = initial.push_now(params, version)
        self._initial_last = initial.last
        initial.close()
        self.say(f"initial weights (version {version}, {st.bytes / 2**20:.1f} MiB) pushed to {len(peers)} generator(s) "
                 f"via {st.transport} in {st.total_s:.2f} s (routes {dict(initial.routes)})")
        if lora_src is not None and self.select is None:  # the base went once; from now on the adapters only
            self.select = adapters_of
            self._configure_push(adapters_of(params), [i["lora_adapter_layouts"] for i in infos], dtype,
                                 stage="adapters")
        self.remote.start_info = [p.call("start", timeout=self.call_timeout_s) for p in peers]
        self.remote.set_version(version)
        if hasattr(self.services, "start_rejoins"):  # restarted replicas may connect from now on
            self.services.start_rejoins(self, self.say)
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
        self.push_config = (src_layouts, dst_layouts[0], dtype, keys, stage)  # a rejoining replica's
        self.src_shardings = [x.sharding for x in leaves]
        if self.group is not None:  # one transfer server per trainer process, each serving its own shards
            self.addresses[1:] = self.group.results(self.group.send("configure_push", self.plans, dtype,
                                                                     self.select is not None), "configure_push")
        owners = WireSender(self.plans, self.src_shardings).owners
        self.owners = owners
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

        p = self._make_pusher(applied, timeout_s, initial_version)
        p.last = self._initial_last
        self._pusher = p
        self._pusher_ready.set()
        return p

    # -- a restarted replica rejoins ----------------------------------------------------------------
    def join(self, peer: rpc.Peer, name: str) -> bool:
        """A restarted generator process registered as ``name``: build its engine, configure the push,
        give it the newest pushed weights, start it, and (on the push thread, so it misses no push) put
        it back in the routing set. One line and the process stopped / closed when it cannot rejoin."""
        remote = self.remote
        rep = remote.begin_join(name, peer) if remote is not None else None
        if rep is None:
            self.say(f"{peer.name}: not admitted (no lost replica named {name!r}, or the run is ending); stopping it")
            try:
                peer.call("stop", timeout=30.0)
            except (rpc.PeerLostError, rpc.PeerTimeoutError, rpc.RemoteError):
                pass
            peer.close()
            return False
        t0 = time.monotonic()
        try:
            if self.setup.model_cfg.lora is not None:
                raise RuntimeError("a LoRA run does not re-admit a restarted replica (issue 26: not built)")
            src_layouts, dst_layouts, dtype, keys, stage = self.push_config
            info = _result(peer.call_async("init", self.join_spec), peer, "init", self.call_timeout_s)
            if info["layouts"] != dst_layouts:
                raise RuntimeError("its parameter layouts differ from the other replicas' (another mesh or devices?)")
            got = peer.call("configure_push", src_layouts, dtype, self.owners, stage, timeout=self.call_timeout_s)
            if got.get("keys", keys) != keys:
                raise RuntimeError("its engine has different parameters than the trainer")
            if not self._pusher_ready.wait(self.call_timeout_s):
                raise TimeoutError(f"the run's weight pusher did not start within {self.call_timeout_s:.0f} s")
            pusher = self._pusher
            v = pusher.catch_up(peer).result(pusher.timeout_s + 60.0)
            peer.call("start", timeout=self.call_timeout_s)
            v = pusher.catch_up(peer, have=v, then=lambda: remote.activate(rep, peer)).result(pusher.timeout_s + 60.0)
        except Exception as e:  # noqa: BLE001 - one line; the process exits and may be restarted again
            remote.abandon_join(rep, peer, RuntimeError(f"{peer.name}: rejoin failed: {type(e).__name__}: {e}"))
            return False
        self.say(f"{peer.name} rejoined at version {v} ({time.monotonic() - t0:.1f} s: engine, weights, compile)")
        return True

    def close(self) -> None:
        pass  # the generator processes are stopped by ``RemoteGenerator.stop``
