"""The generator role: one process (one host's devices) serving rollouts to the controller.

``python -m jaxrl_async.distributed.generator_role --controller HOST:PORT [--name generator-0]
[--cpu-devices N]`` (``$JAXRL_RPC_AUTHKEY`` set to the controller's secret).

It connects to the controller (retrying while the controller starts), registers, and serves:

* ``init(spec)``: build the ``PagedEngine`` on a mesh of ALL this process's devices
  (``spec["mesh_shape"]`` / ``mesh_axes`` from the run's ``mesh.generator``), reply with the
  parameter keys and their target layouts (what the trainer plans the push against);
* ``configure_push(src layouts, dtype, owners)``: the per-leaf transfer plan
  (``transfer.plan_transfer``), computed here from the same inputs as on the trainer, and which
  trainer process serves each shard (``owners``; a trainer group runs one transfer server per process);
  starts this process's transfer server (it only pulls) on ``--transfer-host``, by default the
  local address of its connection to the controller;
* LoRA (``spec["lora"]``, ``distributed.lora_remote``): ``init`` also builds the frozen base once (from
  ``model.path`` or the init seed) and replies with its fingerprint, which the controller checks
  against its own (or, for a base that exists only in the trainer, receives it with the first push and
  is then switched to adapter pushes by ``configure_push(..., stage="adapters")``); pushes carry the
  adapters only and ``_apply`` joins them with the base (or merges them into a fresh copy,
  ``model.lora.decode="merged"``);
* ``pull_weights(version, uuid, addresses, checksums)``: pull the shards from the trainer processes'
  transfer servers onto this process's devices, verify the checksums, hand the weights to the ``Generator``
  (applied between two decode steps); ``load_weights(version, path, checksums)`` is the disk
  fallback (its files verified with the run key's HMAC, ``transfer.read_weights``); both on one
  worker thread, so pushes apply in order;
* ``start()``: compile (warmup) with the first weights and start the ``Generator``;
* ``submit`` / ``abort`` / ``stats`` / ``stop``: the ``Generator`` API. A submit's reply is sent
  when the request finishes (one watcher thread polls the handles), so any number of requests can
  be in flight on one connection.

When the controller's connection breaks (controller exited or died) the process stops its
generator and exits with status 3: a generator never outlives its run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import socket
import sys
import threading
import time
from typing import Any, Callable

EXIT_CONTROLLER_LOST = 3


class GeneratorServer:
    """The handlers (``rpc.Peer`` calls them on its reader thread; slow work goes to threads)."""

    def __init__(self, name: str, *, corrupt_versions: frozenset[int] = frozenset(), log: Callable[[str], None],
                 transfer_host: str = "127.0.0.1", fallback_key: bytes | None = None):
        self.name = name
        self.transfer_host = transfer_host
        self.fallback_key = fallback_key
        self.corrupt_versions = corrupt_versions
        self.log = log
        self.stopped = threading.Event()
        self.engine = self.generator = self.tokenizer = None
        self.lora = None  # lora_remote.GeneratorLora of a LoRA run
        self.push_shardings = None  # what a push lands in: the engine's parameters, or the adapters (LoRA)
        self.spec: dict[str, Any] = {}
        self.keys: list[str] = []
        self.receiver = None
        self.owners: list[int] | None = None
        self._initial: tuple[list, int] | None = None
        self._transfer_server = None
        self._conns: dict[str, Any] = {}
        self._slow = cf.ThreadPoolExecutor(1, thread_name_prefix="generator-role-work")  # init/start/weights, in order
        self._watch_lock = threading.Lock()
        self._watched: dict[str, tuple[Any, Callable]] = {}
        self._watcher = threading.Thread(target=self._watch_loop, name="generator-role-watch", daemon=True)
        self._watcher.start()

    # -- dispatch -----------------------------------------------------------------------------
    def handle(self, method: str, args: tuple, reply: Callable[[bool, Any], None]) -> None:
        fast = {"submit": self._submit, "abort": self._abort, "stats": self._stats}
        if method in fast:
            fast[method](*args, reply=reply)
            return
        slow = {"init": self._init, "configure_push": self._configure_push, "pull_weights": self._pull_weights,
                "load_weights": self._load_weights, "start": self._start, "stop": self._stop,
                "param_checksums": self._param_checksums}
        if method not in slow:
            raise ValueError(f"{self.name}: unknown method {method!r}")
        from jaxrl_async.distributed.rpc import answer

        self._slow.submit(answer, slow[method], args, reply)

    # -- setup ----------------------------------------------------------------------------------
    def _init(self, spec: dict[str, Any]) -> dict[str, Any]:
        import jax
        from transformers import AutoTokenizer

        from jaxrl_async.generator.factory import build_engine
        from jaxrl_async.config import resolve_shape
        from jaxrl_async.distributed.transfer import layout_of, tree_keys
        from jaxrl_async.sharding.mesh import make_mesh

        self.spec = spec
        devs = jax.local_devices()
        shape = resolve_shape(tuple(spec["mesh_shape"]), len(devs), "mesh.generator.shape")
        mesh = make_mesh(shape, tuple(spec["mesh_axes"]), devices=devs)
        self.engine = build_engine(spec["engine"], spec["model_config"], mesh, reserve_weight_push=True,
                                   record_routing=bool(spec.get("record_routing", False)))
        if spec.get("tokenizer_dir"):
            self.tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
        shardings = self.push_shardings = self.engine.param_shardings
        extra: dict[str, Any] = {}
        if spec.get("lora") is not None:  # the base built here once; pushes carry the adapters only
            from jaxrl_async.distributed.lora_remote import GeneratorLora

            self.lora = lo = GeneratorLora(spec["lora"], mesh, self.engine.param_shardings)
            shardings = self.push_shardings = lo.first_push_shardings  # the adapters, or base + adapters once
            extra["lora_base"] = fp = lo.fingerprint()
            extra["lora_adapter_layouts"] = [layout_of(s, len(shp)) for s, shp in
                                             zip(jax.tree.leaves(lo.adapter_shardings), lo.adapter_shapes)]
            self.log(f"LoRA base from {fp['source']} in {fp['load_s']:.1f} s ({spec['lora']['decode']} decode)")
        self.keys = tree_keys(shardings)
        leaves = jax.tree.leaves(shardings)
        shapes = spec["param_shapes"]
        self.log(f"engine on {len(devs)} x {devs[0].platform} (mesh {dict(mesh.shape)})")
        return {"keys": self.keys, "layouts": [layout_of(s, len(shp)) for s, shp in zip(leaves, shapes)],
                "devices": [str(d) for d in devs], "mesh": dict(mesh.shape), "host": socket.gethostname(),
                "pid": os.getpid(), **extra}

    def _configure_push(self, src_layouts: list, dtype: str, owners: list[int] | None = None,
                        stage: str | None = None) -> dict[str, Any]:
        """``stage="adapters"`` (LoRA whose base came with the first push): from now on pushes carry the adapters."""
        import jax

        from jaxrl_async.distributed.transfer import WireReceiver, layout_of, plan_transfer, start_server, tree_keys

        shapes = self.spec["param_shapes"]
        if stage == "adapters":
            if self.lora is None:
                raise RuntimeError(f"{self.name}: configure_push(stage='adapters') without LoRA")
            self.push_shardings = self.lora.adapter_shardings
            self.keys = tree_keys(self.push_shardings)
            shapes = self.lora.adapter_shapes
        elif stage is not None:
            raise ValueError(f"{self.name}: unknown push stage {stage!r}")
        dst = jax.tree.leaves(self.push_shardings)
        plans = plan_transfer(self.keys, shapes, dtype, src_layouts, [layout_of(s, len(shp)) for s, shp in zip(dst, shapes)])
        self.receiver = WireReceiver(plans, dst)
        self.owners = list(owners) if owners is not None else None
        if self._transfer_server is None:
            self._transfer_server = start_server(self.transfer_host)
        return {"routes": sorted({p.route for p in plans}), "keys": self.keys}

    def _conn(self, address: str) -> Any:
        if address not in self._conns:
            self._conns[address] = self._transfer_server.connect(address)
        return self._conns[address]

    # -- weights -------------------------------------------------------------------------------
    def _pull_weights(self, version: int, uuid: int, addresses: list[str], checksums: list[int],
                      timeout_s: float) -> dict:
        """Pull + verify + apply; a failure is a reply ``ok=False`` (the trainer falls back to disk)."""
        import jax
        import jax.numpy as jnp

        from jaxrl_async.distributed.transfer import verify

        t0 = time.perf_counter()
        try:
            leaves = self.receiver.pull([self._conn(a) for a in addresses], uuid, timeout_s, self.owners)
            if version in self.corrupt_versions:  # fault injection (tests): one flipped element
                leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].add(jnp.asarray(1, leaves[0].dtype))
            t1 = time.perf_counter()
            got = verify(leaves, checksums, self.keys, version)
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which falls back to disk
            self.log(f"pull of version {version} failed: {type(e).__name__}: {e}")
            return {"ok": False, "reason": f"{type(e).__name__}: {e}", "pull_s": time.perf_counter() - t0}
        t2 = time.perf_counter()
        self._apply(jax.tree.unflatten(jax.tree.structure(self.push_shardings), leaves), version, timeout_s)
        return {"ok": True, "transport": "jax.experimental.transfer", "checksums": got, "pull_s": t1 - t0,
                "verify_s": t2 - t1, "apply_s": time.perf_counter() - t2, "shards": len(self.receiver.specs),
                "bytes": self.receiver.nbytes, "sources": len(addresses)}

    def _load_weights(self, version: int, path: str, checksums: list[int], timeout_s: float) -> dict:
        import jax

        from jaxrl_async.distributed.transfer import read_weights, verify

        if self.fallback_key is None:
            raise RuntimeError(f"{self.name}: no key for the disk fallback")
        t0 = time.perf_counter()
        leaves, manifest = read_weights(path, self.keys, jax.tree.leaves(self.push_shardings),
                                        key=self.fallback_key, version=version)
        got = verify(leaves, checksums, self.keys, version)
        if got != manifest:
            raise RuntimeError(f"weight push fallback {path}: manifest checksums differ from the trainer's")
        t1 = time.perf_counter()
        self._apply(jax.tree.unflatten(jax.tree.structure(self.push_shardings), leaves), version, timeout_s)
        return {"ok": True, "transport": "disk", "checksums": got, "load_s": t1 - t0,
                "apply_s": time.perf_counter() - t1, "bytes": sum(int(x.nbytes) for x in leaves)}

    def _apply(self, params: Any, version: int, timeout_s: float) -> None:
        if self.lora is not None:  # pushed adapters -> base + adapters, or the merged copy
            params = self.lora.params(params)
        if self.generator is None:
            self._initial = (params, int(version))
        else:
            self.generator.update_params(params, int(version), wait=True, timeout=timeout_s)

    def _param_checksums(self) -> list[int]:
        import jax

        from jaxrl_async.distributed.transfer import checksum_fn

        return checksum_fn(jax.tree.leaves(self.generator._params))

    def _start(self) -> dict[str, Any]:
        from jaxrl_async.generator.orchestrator import Generator

        if self._initial is None:
            raise RuntimeError(f"{self.name}: start() before the first weights arrived")
        params, version = self._initial
        t0 = time.perf_counter()
        self.engine.warmup(params, max_samples=self.spec["n_samples"], truncation=self.spec.get("truncation", True))
        compile_s = time.perf_counter() - t0
        self.generator = Generator(self.engine, params, version=version, tokenizer=self.tokenizer,
                                   kv_update_policy=self.spec["kv_update_policy"],
                                   max_prefills_per_step=self.spec["max_prefills_per_step"])
        self.generator.start()
        self._initial = None
        e = self.engine
        self.log(f"generator started at version {version}: {e.max_concurrent_decodes} slots, {e.num_pages} KV pages "
                 f"of {e.page_size}; compiled in {compile_s:.1f} s")
        return {"compile_s": compile_s, "slots": e.max_concurrent_decodes, "num_pages": e.num_pages,
                "page_size": e.page_size}

    def _stop(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self.generator is not None:
            try:
                self.generator.stop()
            except RuntimeError as e:
                self.log(str(e))
        self.stopped.set()

    # -- requests --------------------------------------------------------------------------------
    def _submit(self, request_id: str, prompt_ids: list[int], sampling: Any, metadata: Any, images: Any = None, *,
                reply) -> None:
        if self.generator is None:
            raise RuntimeError(f"{self.name}: submit before start()")
        handle = self.generator.submit(prompt_ids, sampling, request_id=request_id, metadata=metadata,
                                       **({} if images is None else {"images": images}))
        with self._watch_lock:
            self._watched[request_id] = (handle, reply)

    def _abort(self, request_id: str, *, reply) -> None:
        if self.generator is not None:
            self.generator.abort(request_id)
        reply(True, None)

    def _stats(self, *, reply) -> None:
        if self.generator is None:
            raise RuntimeError(f"{self.name}: stats before start()")
        err = self.generator.error
        reply(True, (self.generator.stats(), None if err is None else f"{type(err).__name__}: {err}"))

    def _watch_loop(self) -> None:
        """Send each request's reply when its handle is done (RequestOutput, or the error)."""
        while not self.stopped.is_set():
            with self._watch_lock:
                done = [(rid, h, r) for rid, (h, r) in self._watched.items() if h.done()]
                for rid, _, _ in done:
                    del self._watched[rid]
            for _rid, h, reply in done:
                try:
                    reply(True, h.result(0))
                except BaseException as e:  # noqa: BLE001
                    cause = e.__cause__ or e
                    reply(False, (type(e).__name__, f"{e} (cause: {type(cause).__name__}: {cause})", ""))
            if not done:
                time.sleep(0.003)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_async.distributed.generator_role", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--controller", required=True, help="HOST:PORT of the controller (trainer role)")
    ap.add_argument("--name", default="generator-0")
    ap.add_argument("--cpu-devices", type=int, default=None, help="simulated CPU devices (CPU-only machines)")
    ap.add_argument("--connect-timeout", type=float, default=300.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=120.0)
    ap.add_argument("--transfer-host", default=None, help="interface address of this process's transfer server "
                    "(default: the local address of its connection to the controller; never 0.0.0.0)")
    ap.add_argument("--inject-corrupt-pull", default="", help="testing only: comma-separated versions whose pulled "
                    "weights are corrupted after the pull (exercises the checksum and the disk fallback)")
    a = ap.parse_args(argv)
    if a.cpu_devices is not None:
        import jax

        jax.config.update("jax_num_cpu_devices", int(a.cpu_devices))
    from jaxrl_async.distributed import rpc

    def say(msg: str) -> None:
        print(f"[{a.name} pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)

    from jaxrl_async.distributed.transfer import check_bind_host, fallback_key

    corrupt = frozenset(int(v) for v in a.inject_corrupt_pull.split(",") if v.strip())
    try:
        if a.transfer_host is not None:
            check_bind_host(a.transfer_host, "--transfer-host")
        key = rpc.authkey_from_env()
        conn = rpc.connect(a.controller, key, a.connect_timeout, "the controller")
    except (TimeoutError, RuntimeError, ValueError, ConnectionError) as e:
        say(str(e))
        return 2
    server = GeneratorServer(a.name, corrupt_versions=corrupt, log=say,
                             transfer_host=a.transfer_host or conn.local_host, fallback_key=fallback_key(key))
    lost = threading.Event()

    def on_lost(err: BaseException) -> None:
        if server.stopped.is_set():  # stop() was served: the controller closing afterwards is the normal end
            return
        say(f"{err}; stopping")
        lost.set()
        server.shutdown()

    peer = rpc.Peer(conn, f"controller at {a.controller}", handler=server.handle, on_lost=on_lost,
                    heartbeat_s=10.0, heartbeat_timeout_s=a.heartbeat_timeout)
    try:
        peer.call("register", {"name": a.name, "pid": os.getpid(), "host": socket.gethostname()}, timeout=60.0)
    except Exception as e:  # noqa: BLE001
        say(f"registration with the controller failed: {type(e).__name__}: {e}")
        return 2
    say(f"registered with the controller at {a.controller}")
    while not server.stopped.wait(0.5):
        pass
    time.sleep(0.2)  # let the reply to stop() go out
    peer.close()
    return EXIT_CONTROLLER_LOST if lost.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
