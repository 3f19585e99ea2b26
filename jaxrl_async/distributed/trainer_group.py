"""A trainer that spans several processes: one SPMD program (``jax.distributed``) driven by process 0.

Every process of the trainer group runs ``python -m jaxrl_async.distributed.controller`` with the
same arguments and the multi-controller runtime (``jax.distributed.initialize``: explicit
``--coordinator/--num-processes/--process-id``, or auto-detected from SLURM / a TPU pod / the
``JAX_*`` variables). The trainer mesh spans the devices of all of them (``trainer_mesh``).

* **Process 0, the leader**, is the controller: data, staleness, rollouts, rewards, metrics,
  checkpoints' metadata, the weight push (``controller.DistributedServices``). It holds a
  ``GroupLeader``: an RPC connection to every other trainer process.
* **Processes 1..P-1, the followers** (``TrainerFollower``), hold their shards of the same training
  state and execute, **in the leader's order**, every operation that runs a program over the
  trainer mesh or synchronises Orbax: SPMD requires that all processes issue the same collectives
  in the same order, and Orbax barriers on construction, save, restore and close (measured). The
  leader sends each such operation (``GroupLeader.send``) just before running it itself; the
  follower's main thread runs them one by one from a queue:

  ``setup`` (model config, run dir; builds this process's ``loop.services.LocalTrainer`` and the
  initial parameters exactly as the leader does), then the trainer service's operations
  (``api.trainer.TrainerService``, sent by ``controller.GroupTrainer``): ``build`` (trainer and
  checkpointer), ``initial_state`` (the SFT examples: the warm start runs whole here) or ``restore``
  (replies with the step restored; the leader checks it equals its own), ``train`` (the batch's
  trajectories and policy version: the batch travels leader -> followers over the RPC), ``save``,
  ``wait_checkpoint``, ``export``, ``close_checkpoint``; and the push's: ``configure_push`` (the transfer plan;
  starts this process's transfer server and
  replies with its address), ``push`` (cast + reshard + checksums of version v, kept until the
  generators have pulled it), ``base_fingerprint`` (LoRA), ``finish`` (replies with the operations
  this process ran; the leader checks they are the ones it sent, in order: ``RUN/trainer_group_ops.json``).

  Two calls are served on the RPC thread instead, because they are per-process work the leader's
  push thread asks for while the main threads train on: ``register(version, uuids)`` (this
  process's shards of version v onto its transfer server, one registration per generator) and
  ``write_fallback(version, dir)`` (its shards of version v to the disk fallback directory).

Stops: SIGTERM / SIGINT reach every process of a SLURM step or a terminal's process group at once.
A follower does not stop on them: process 0 finishes the step, saves a checkpoint (which needs every
process) and then ends the group with ``finish``; a follower whose leader is gone exits by itself.

Failure: an operation that fails on a follower is answered with the error and the follower exits
at once (status 1), so the leader's pending collective fails (gloo: connection reset) instead of
waiting; the leader names the follower (``GroupLeader.error``) and stops the run with exit 1. A
follower whose leader disappears exits with status 3. Beyond that the JAX coordination service
aborts any process whose peer stopped heartbeating (``--heartbeat-timeout``): no hang.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from jaxrl_async.distributed import rpc

EXIT_LEADER_LOST = 3
OPS_LOG = "trainer_group_ops.json"  # the leader's and every follower's ordered operations (``GroupLeader.finish``)
EXIT_FAILED = 1
ROLE = "trainer"


def trainer_mesh(cfg: Any) -> Any:
    """The trainer mesh over every device of the group (``mesh.trainer`` shape and axes)."""
    import jax

    from jaxrl_async.config import resolve_shape
    from jaxrl_async.sharding.mesh import make_mesh

    devs = jax.devices()
    shape = resolve_shape(cfg.mesh.trainer.shape, len(devs), "mesh.trainer.shape")
    return make_mesh(shape, cfg.mesh.trainer.axis_names, devices=devs)


def local_address(conn: Any) -> str:
    """The IP of this end of ``conn``: the address the other end reaches this host by (the default
    transfer-server address of a follower)."""
    return conn.local_host


# =============================================================================================
# Leader side
# =============================================================================================
class TrainerGroupError(RuntimeError):
    """A follower of the trainer group failed or disappeared (the message names it)."""


class GroupLeader:
    """Process 0's handle on the followers (``peers``: one ``rpc.Peer`` each, in process order)."""

    def __init__(self, peers: Sequence[rpc.Peer], *, call_timeout_s: float = 600.0):
        self.peers = list(peers)
        self.call_timeout_s = call_timeout_s
        self._pending: list[tuple[rpc.Peer, str, cf.Future]] = []
        self.sent: list[str] = []  # every ordered operation, in order (the followers must run exactly these)
        self._lock = threading.Lock()
        self._finishing = threading.Event()

    def start_watchdog(self, grace_s: float = 5.0, poll_s: float = 0.5) -> threading.Thread:
        """End this process (status 1, one line naming the follower) ``grace_s`` after a follower is lost,
        unless the group is finishing normally. The main thread normally reports the loss itself (the next
        collective fails fast), but it can be blocked where only the dead peer could release it: an Orbax
        checkpoint barrier, or a save waiting for an in-flight async commit. The JAX coordination service
        would then abort the process (SIGABRT) after its heartbeat timeout, and nothing more can be saved
        without every process anyway."""
        def watch() -> None:
            while not self._finishing.is_set():
                err = self.error
                if err is not None:
                    if self._finishing.wait(grace_s):
                        return
                    print(f"[jaxrl_async] run failed: {err}", file=sys.stderr, flush=True)
                    os._exit(EXIT_FAILED)
                time.sleep(poll_s)

        t = threading.Thread(target=watch, name="trainer-group-watchdog", daemon=True)
        t.start()
        return t

    @property
    def size(self) -> int:
        return len(self.peers) + 1

    @property
    def error(self) -> BaseException | None:
        """The first follower failure: a lost connection or a failed ordered operation."""
        for p in self.peers:
            if p.error is not None:
                return TrainerGroupError(f"trainer process {p.name} lost: {p.error}")
        with self._lock:
            pending = list(self._pending)
        for p, method, f in pending:
            if f.done() and f.exception() is not None:
                return TrainerGroupError(f"trainer process {p.name} failed in {method!r}: {f.exception()}")
        return None

    def raise_if_failed(self) -> None:
        err = self.error
        if err is not None:
            raise err

    def send(self, method: str, *args: Any) -> list[cf.Future]:
        """Queue the ordered operation ``method`` on every follower (do not wait); the caller then
        runs the same operation itself. Raises if a follower has already failed."""
        self.raise_if_failed()
        futs = [p.call_async(method, *args) for p in self.peers]
        with self._lock:
            self.sent.append(method)
            self._pending = [x for x in self._pending if not x[2].done() or x[2].exception() is not None]
            self._pending.extend((p, method, f) for p, f in zip(self.peers, futs))
        return futs

    def results(self, futs: Sequence[cf.Future], method: str, timeout: float | None = None) -> list[Any]:
        """The followers' replies to ``send``'s futures (timeout names the follower)."""
        out = []
        for p, f in zip(self.peers, futs):
            try:
                out.append(f.result(self.call_timeout_s if timeout is None else timeout))
            except cf.TimeoutError:
                raise rpc.PeerTimeoutError(f"trainer process {p.name}: no reply to {method!r} within "
                                           f"{self.call_timeout_s if timeout is None else timeout:.0f} s") from None
            except (rpc.RemoteError, rpc.PeerLostError) as e:
                raise TrainerGroupError(f"trainer process {p.name} failed in {method!r}: {e}") from e
        return out

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """An unordered call on every follower (served on its RPC thread); waits for the replies."""
        return self.results([p.call_async(method, *args) for p in self.peers], method, timeout)

    def finish(self, timeout: float = 120.0, log_dir: str | None = None) -> None:
        """Let the followers exit (after everything queued ran); close the connections. Each follower
        replies with the operations it ran: they must be the leader's (``sent``), in the same order;
        written to ``log_dir/trainer_group_ops.json`` (one line here when they differ)."""
        self._finishing.set()
        if self.error is None:
            try:
                ops = self.results(self.send("finish"), "finish", timeout)
                self._check_ops(ops, log_dir)
            except (TrainerGroupError, rpc.PeerTimeoutError, rpc.PeerLostError) as e:
                print(f"[jaxrl_async] trainer group: {e}", file=sys.stderr, flush=True)
        for p in self.peers:
            p.close()

    def _check_ops(self, followers: Sequence[list[str]], log_dir: str | None) -> None:
        leader = [m for m in self.sent if m != "finish"]
        if log_dir is not None:
            with open(os.path.join(log_dir, OPS_LOG), "w") as f:
                json.dump({"leader": leader, "followers": [list(o) for o in followers]}, f)
        for p, ops in zip(self.peers, followers):
            if list(ops) != leader:
                print(f"[jaxrl_async] trainer group: {p.name} ran {len(ops)} operations, the leader sent "
                      f"{len(leader)} (first difference at #{_first_difference(ops, leader)})", file=sys.stderr, flush=True)


def _first_difference(a: Sequence[str], b: Sequence[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# =============================================================================================
# Follower side
# =============================================================================================
class TrainerFollower:
    """One non-leader process of the trainer group (module docstring): runs the leader's ordered
    operations on its main thread (``serve``); ``register`` / ``write_fallback`` on the RPC thread."""

    UNORDERED = ("register", "write_fallback")

    def __init__(self, cfg: Any, *, transfer_host: str = "127.0.0.1", log: Callable[[str], None] | None = None):
        import jax

        self.cfg = cfg
        self.transfer_host = transfer_host
        self.log = log or (lambda s: print(f"[trainer {jax.process_index()}] {s}", file=sys.stderr, flush=True))
        self._ops: queue.Queue = queue.Queue()
        self._side = cf.ThreadPoolExecutor(2, thread_name_prefix="trainer-follower-push")
        self._cv = threading.Condition()
        self._wires: dict[int, list] = {}
        self.done = threading.Event()
        self.lost = threading.Event()
        self.run_dir = None
        self.trainer = None  # loop.services.LocalTrainer (``setup``)
        self.sender = self.server = self.dtype = None
        self.executed: list[str] = []  # the ordered operations run, in order (returned by ``finish``)
        self.adapters_only = False  # LoRA: pushes carry the adapters (configure_push)

    # -- dispatch -----------------------------------------------------------------------------
    def handle(self, method: str, args: tuple, reply: Callable[[bool, Any], None]) -> None:
        if method in self.UNORDERED:
            self._side.submit(rpc.answer, getattr(self, "_" + method), args, reply)
        elif method == "ping":
            reply(True, os.getpid())
        elif hasattr(self, "_op_" + method):
            self._ops.put((method, args, reply))
        else:
            raise ValueError(f"trainer follower: unknown operation {method!r}")

    def serve(self) -> int:
        """Run ordered operations until ``finish`` (0), a failure (1) or the leader's loss (3)."""
        while not self.done.is_set():
            if self.lost.is_set():
                return EXIT_LEADER_LOST
            try:
                method, args, reply = self._ops.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                value = getattr(self, "_op_" + method)(*args)
            except BaseException as e:  # noqa: BLE001
                self.log(f"{method} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                reply(False, (type(e).__name__, str(e), traceback.format_exc()))
                return EXIT_FAILED
            self.executed.append(method)
            reply(True, value)
        return 0

    # -- ordered operations (the leader runs the same, in the same order) ---------------------
    def _op_setup(self, spec: dict[str, Any]) -> dict[str, Any]:
        """This process's ``LocalTrainer``: the initial parameters built exactly as the leader builds them."""
        import jax

        from jaxrl_async.loop.services import LocalTrainer
        from jaxrl_async.loop.warm_start import WarmStart
        from jaxrl_async.checkpoint.lora_base import base_reference
        from jaxrl_async.loop.state import initial_params

        model_cfg, self.run_dir = spec["model_cfg"], spec["run_dir"]
        mesh = trainer_mesh(self.cfg)
        _, params = initial_params(self.cfg, model_cfg, mesh=mesh)
        self.trainer = LocalTrainer(self.cfg, self.run_dir, model_cfg, mesh, params,
                                    base_ref=base_reference(self.cfg, model_cfg), tokenizer_dir=spec["tokenizer_dir"],
                                    warm_start=WarmStart(self.cfg, mesh, None, interruptible=False), writes_files=False)
        self.log(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} of "
                 f"{jax.device_count()} trainer devices (mesh {dict(mesh.shape)})")
        return {"pid": os.getpid(), "host": socket.gethostname(), "process_index": jax.process_index()}

    # the trainer service's operations (``api.trainer.TrainerService``), run on this process's LocalTrainer
    def _op_build(self) -> None:
        self.trainer.build()

    def _op_restore(self) -> int:
        return int(self.trainer.restore().step)

    def _op_initial_state(self, sft_examples: Sequence[Any] | None) -> None:
        self.trainer.initial_state(sft_examples)

    def _op_train(self, trajs: Sequence[Any], version: int) -> None:
        self.trainer.train(trajs, version)

    def _op_save(self, meta: Any, buffered: list) -> None:
        self.trainer.save(meta, buffered)

    def _op_wait_checkpoint(self) -> None:
        self.trainer.wait_checkpoint()

    def _op_export(self, step: int) -> None:
        self.trainer.export(step)

    def _op_close_checkpoint(self) -> None:
        self.trainer.close_checkpoint()

    def _pushed(self) -> Any:
        from jaxrl_async.models import lora

        return lora.split(self.trainer.params)[0] if self.adapters_only else self.trainer.params

    def _op_configure_push(self, plans: Sequence[Any], dtype: str, adapters_only: bool = False) -> str:
        import jax

        from jaxrl_async.distributed.transfer import WireSender, start_server

        self.adapters_only = bool(adapters_only)
        self.sender = WireSender(plans, [x.sharding for x in jax.tree.leaves(self._pushed())])
        self.dtype = jax.numpy.dtype(dtype)
        if self.server is None:
            self.server = start_server(self.transfer_host)
        return self.server.address()

    def _op_push(self, version: int) -> None:
        from jaxrl_async.distributed.transfer import prepare_wire

        wire, _ = prepare_wire(self.sender, self._pushed(), self.dtype)
        with self._cv:
            self._wires[int(version)] = wire
            self._cv.notify_all()

    def _op_base_fingerprint(self, dtype: str) -> None:
        import jax

        from jaxrl_async.distributed.lora_remote import trainer_base_fingerprint

        trainer_base_fingerprint(self.trainer.params, jax.numpy.dtype(dtype))  # a collective: the leader runs it too

    def _op_finish(self) -> list[str]:
        """The group ends; the reply is this process's operation log (the leader compares it with its own)."""
        self.done.set()
        return list(self.executed)

    # -- unordered (RPC thread pool) ------------------------------------------------------------
    def _wire(self, version: int, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while int(version) not in self._wires:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"weights of version {version} not prepared on this process after "
                                       f"{timeout_s:.0f} s")
                self._cv.wait(min(left, 1.0))
            return self._wires[int(version)]

    def _register(self, version: int, uuids: Sequence[int], timeout_s: float) -> int:
        wire = self._wire(version, timeout_s)
        with self._cv:  # pushes are delivered in increasing versions: older ones are never asked for
            for v in [v for v in self._wires if v < int(version)]:
                del self._wires[v]
        shards = self.sender.shards(wire)
        for u in uuids:
            self.server.await_pull(int(u), shards)
        return len(shards)

    def _write_fallback(self, version: int, tmp: str) -> list[dict]:
        from jaxrl_async.distributed.transfer import fallback_key, write_shards

        home = os.path.realpath(os.path.join(self.run_dir, "weight_push"))
        if os.path.dirname(os.path.realpath(tmp)) != home:
            raise ValueError(f"write_fallback: {tmp!r} is not a directory of {home}")
        return write_shards(tmp, self._wire(version, 60.0), key=fallback_key(rpc.authkey_from_env()))


def run_follower(cfg: Any, controller: str, *, connect_timeout_s: float, heartbeat_timeout_s: float,
                 transfer_host: str | None = None) -> int:
    """Connect to the leader at ``controller``, register, and serve (``TrainerFollower.serve``)."""
    import jax

    me = jax.process_index()

    def say(msg: str) -> None:
        print(f"[trainer {me} pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)

    try:
        conn = rpc.connect(controller, rpc.authkey_from_env(), connect_timeout_s, "the controller (trainer process 0)")
    except (TimeoutError, RuntimeError, ConnectionError) as e:
        say(str(e))
        return 2
    follower = TrainerFollower(cfg, transfer_host=transfer_host or local_address(conn), log=say)

    def on_signal(signum: int, _frame: Any) -> None:
        say(f"{signal.Signals(signum).name}: process 0 stops the group (checkpoint first); waiting for it")

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    def on_lost(err: BaseException) -> None:
        if follower.done.is_set():  # ``finish`` was served: the leader closing afterwards is the normal end
            return
        say(f"{err}; stopping")
        follower.lost.set()

    peer = rpc.Peer(conn, f"controller at {controller}", handler=follower.handle, on_lost=on_lost,
                    heartbeat_s=5.0, heartbeat_timeout_s=heartbeat_timeout_s)
    try:
        peer.call("register", {"role": ROLE, "name": f"trainer-{me}", "process_index": me, "pid": os.getpid(),
                               "host": socket.gethostname()}, timeout=60.0)
    except Exception as e:  # noqa: BLE001
        say(f"registration with the controller failed: {type(e).__name__}: {e}")
        return 2
    say(f"registered with the controller at {controller}")
    status = follower.serve()
    if status != 0:
        # leave now: the leader's collectives fail fast, and jax's shutdown barrier would wait for it
        say("exiting (status %d)" % status)
        sys.stderr.flush()
        time.sleep(0.5)  # let the error reply go out
        os._exit(status)
    time.sleep(0.2)  # let the reply to finish() go out
    peer.close()
    return 0
