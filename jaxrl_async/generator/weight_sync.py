"""Trainer → generator weight push: device-to-device, resharded, off the decode path.

After each update the trainer calls :meth:`WeightPusher.push` with its (fp32, trainer-sharded)
parameters and the new policy version. The push has two halves:

1. **Dispatch, on the trainer thread** (milliseconds of host time, asynchronous on the device):
   cast to the generator's parameter dtype on the trainer mesh (a jitted ``astype``; skipped when
   the dtypes agree), then move and reshard (fsdp×tensor → data×tensor) without leaving the
   devices. ``jax.device_put`` between two device sets copies device-to-device only when every
   destination shard is, index for index, a shard of the source; otherwise it silently gathers the
   array on the host. :func:`plan_push` therefore picks, per leaf, one of three routes:

   * ``direct``: the destination's shard indices are all source shard indices: one
     ``device_put`` (shard-wise device-to-device copies);
   * ``via_generator``: copy the shards as they are to a mesh of generator devices shaped like the
     trainer mesh (plus a replica axis; needs n_trainer | n_generator), then reshard with a jitted
     identity among the generator devices (XLA collectives);
   * ``via_trainer``: reshard first on the trainer devices onto a mesh shaped like the generator
     mesh (plus a replica axis; needs n_generator | n_trainer), then copy shard-wise.

   It must be *dispatched* before the trainer's next step, because that step donates (frees) the
   trainer's parameter buffers; JAX orders the copy's reads before the donation. ``may_alias=False``
   guarantees fresh buffers even when the two meshes share devices (colocated mode).
2. **Completion, on the transfer thread**: wait until the copy is on the generator devices, then
   ``Generator.update_params(params, version, wait=True)`` (on this thread, the engine derives what its
   decode programs need from the new weights, ``Engine.prepare_params``: on CPU the packed copy of the
   layer matrices; then the decode thread swaps them in between two decode steps), then
   ``on_applied(version)`` — the loop advertises the version to the staleness manager only now, which
   is what makes "head version ≥ admission version" hold. ``PushStats.apply_s`` includes that
   preparation.

Double buffering: at most one copy is being completed and one waits in a one-slot mailbox; a
newer push replaces a waiting one (its version is skipped: the generator jumps to the newer
weights). Decoding never waits for a transfer: the generator keeps decoding with the old weights
until the new ones are complete on its devices.

No host round trip: both halves run under ``jax.transfer_guard_device_to_host("disallow_explicit")`` and
``jax.transfer_guard_host_to_device("disallow_explicit")`` (``guard=True``, the default), so a change that
would route weights through host memory fails loudly instead of silently costing seconds.

Errors in the transfer thread are kept in ``error`` and re-raised by the next ``push``/``wait``;
every wait has a timeout.

LoRA (``lora=LoraPush(...)``, ``models/lora.py``): the generator's copy of the frozen base is placed once
(``LoraPush.base``, on the generator devices); ``push`` moves only the adapter leaves (the same routes,
guards and mailbox; ``PushStats.bytes`` counts only them) and the push thread then hands the generator
either ``join(adapters, base)`` (``decode="unmerged"``: the layer code applies the low-rank update) or a
freshly merged copy ``W + (alpha/r) A B`` computed on the generator devices (``decode="merged"``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["NewestWinsPusher", "WeightPusher", "PushStats", "WeightPushError", "plan_push", "PushPlan", "LoraPush"]


class WeightPushError(RuntimeError):
    """The transfer thread failed (the original exception is chained)."""


@dataclasses.dataclass
class PushStats:
    version: int
    bytes: int
    dispatch_s: float  # host time the trainer thread spent in push()
    transfer_s: float = 0.0  # dispatch -> copy complete on the generator devices
    apply_s: float = 0.0  # copy complete -> generator uses the weights
    total_s: float = 0.0  # dispatch -> applied


@dataclasses.dataclass
class LoraPush:
    """Adapter-only pushes (see the module docstring). ``spec``: the ``LoraSpec``; ``base``: the frozen base
    weights already on the generator devices (generator dtype and shardings); ``decode``: "unmerged" or
    "merged". The pusher's ``target_shardings`` are then those of the full tree, base + adapters (the
    generator rules of the LoRA model config)."""

    spec: Any
    base: Any
    decode: str = "unmerged"

    def __post_init__(self):
        if self.decode not in ("unmerged", "merged"):
            raise ValueError(f"LoraPush.decode: must be 'unmerged' or 'merged', got {self.decode!r}")


def transfer_guard(enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    stack.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    return stack


def _index_set(sharding: Any, shape: tuple[int, ...]) -> set:
    return {tuple((sl.start, sl.stop, sl.step) for sl in idx) for idx in sharding.devices_indices_map(shape).values()}


def _device_array(sharding: Any) -> np.ndarray:
    return np.asarray(sharding.mesh.devices)


@dataclasses.dataclass(frozen=True)
class PushPlan:
    """How each leaf travels: ``routes`` (per leaf, ``direct``/``via_generator``/``via_trainer``) and the
    intermediate shardings of the two-hop routes (None for ``direct``)."""

    routes: Any
    intermediate: Any


def plan_push(src_shardings: Any, dst_shardings: Any, shapes: Any) -> PushPlan:
    """Per leaf: a device-to-device route from ``src`` (trainer) to ``dst`` (generator) sharding.

    Raises ValueError when no route exists (neither device count divides the other and the shard
    indices do not match), naming the leaf.
    """
    from jax.sharding import Mesh, NamedSharding

    def one(path, src, dst, shape):
        shape = tuple(shape)
        if _index_set(dst, shape) <= _index_set(src, shape):
            return "direct", None
        n_src, n_dst = src.num_devices, dst.num_devices
        if isinstance(src, NamedSharding) and n_dst % n_src == 0:
            devs = _device_array(dst).reshape(-1).reshape(tuple(src.mesh.shape.values()) + (n_dst // n_src,))
            mesh = Mesh(devs, tuple(src.mesh.axis_names) + ("_push_replica",),
                        axis_types=(jax.sharding.AxisType.Auto,) * (devs.ndim))
            return "via_generator", NamedSharding(mesh, src.spec)
        if isinstance(dst, NamedSharding) and n_src % n_dst == 0:
            devs = _device_array(src).reshape(-1).reshape(tuple(dst.mesh.shape.values()) + (n_src // n_dst,))
            mesh = Mesh(devs, tuple(dst.mesh.axis_names) + ("_push_replica",),
                        axis_types=(jax.sharding.AxisType.Auto,) * (devs.ndim))
            return "via_trainer", NamedSharding(mesh, dst.spec)
        raise ValueError(f"weight push: no device-to-device route for {jax.tree_util.keystr(path)} from {n_src} "
                         f"trainer devices to {n_dst} generator devices (one count must divide the other)")

    pairs = jax.tree_util.tree_map_with_path(one, src_shardings, dst_shardings, shapes,
                                             is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)  # noqa: E731
    return PushPlan(routes=jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
                    intermediate=jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair))


def tree_bytes(tree: Any) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


_RESHARD_CACHE: dict[Any, Any] = {}


def _reshard(xs: list, shardings: list) -> list:
    """Jitted identity with out_shardings: an on-device reshard among the devices the arrays live on."""
    key = tuple(shardings)
    fn = _RESHARD_CACHE.get(key)
    if fn is None:
        fn = _RESHARD_CACHE[key] = jax.jit(lambda a: [x + jnp.zeros((), x.dtype) for x in a], out_shardings=list(shardings))
    return fn(xs)


class NewestWinsPusher:
    """The push protocol shared by ``WeightPusher`` (one process) and
    ``distributed.remote_generator.TransferPusher`` (across processes).

    The trainer thread posts ``(payload, stats)`` into a one-slot mailbox (``_post``): newest wins,
    a version still waiting when a newer one arrives is skipped and recorded in
    ``skipped_versions``. One push thread takes the mailbox and calls ``_deliver(payload, stats, t0)``
    (the subclass: move the weights, fill the stats' times), then ``on_applied(version)``, and records
    the stats in ``history`` and the version in ``applied_version``. The first error is kept and
    re-raised (as ``WeightPushError``) by ``push`` and ``wait``. Subclasses set their own attributes
    and then call ``_start()``.
    """

    _applier = "the generator"  # who applies the weights (``wait``'s timeout message)

    def __init__(self, *, on_applied: Callable[[int], None] | None, timeout_s: float, guard: bool,
                 initial_version: int | None, thread_name: str):
        self.on_applied = on_applied
        self.timeout_s = float(timeout_s)
        self.guard = guard
        self._cond = threading.Condition()
        self._mailbox: tuple[Any, Any, float] | None = None
        self._closed = False
        self.error: BaseException | None = None
        self.history: list[Any] = []
        self.skipped_versions: list[int] = []
        self.applied_version: int | None = initial_version
        self._tasks: list[tuple[Callable[[], Any], Any]] = []  # ``run_on_push_thread``
        self._thread = threading.Thread(target=self._main, name=thread_name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def _deliver(self, payload: Any, stats: Any, t0: float) -> None:
        raise NotImplementedError

    def _post(self, payload: Any, stats: Any, t0: float) -> None:
        """Put a dispatched push into the mailbox (trainer thread)."""
        with self._cond:
            if self._closed:
                raise WeightPushError(f"{type(self).__name__} is closed")
            if self._mailbox is not None:
                self.skipped_versions.append(self._mailbox[1].version)
            self._mailbox = (payload, stats, t0)
            self._cond.notify_all()

    def wait(self, version: int | None = None, timeout: float | None = None) -> None:
        """Block until ``version`` (default: the newest pushed) is applied by the generator."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            target = version
            if target is None:
                target = self._mailbox[1].version if self._mailbox is not None else self.applied_version
            while self.error is None:
                if target is None or (self.applied_version is not None and self.applied_version >= target):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"weight push of version {target} not applied by {self._applier} after "
                                       f"{timeout:.0f} s (applied: {self.applied_version})")
                self._cond.wait(min(left, 0.5))
        self._raise_if_failed()

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._fail_tasks()

    def _fail_tasks(self) -> None:
        with self._cond:
            tasks, self._tasks = self._tasks, []
        for _fn, fut in tasks:
            if not fut.done():
                fut.set_exception(WeightPushError(f"{type(self).__name__} closed or failed before the task ran"))

    def run_on_push_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the push thread between two deliveries (before the next one); returns a
        ``concurrent.futures.Future`` of its value. Its error is the future's, not the pusher's."""
        import concurrent.futures as cf

        fut: cf.Future = cf.Future()
        with self._cond:
            if self._closed or self.error is not None:
                fut.set_exception(WeightPushError(f"{type(self).__name__} is closed or failed"))
                return fut
            self._tasks.append((fn, fut))
            self._cond.notify_all()
        return fut

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise WeightPushError(f"weight push failed: {type(self.error).__name__}: {self.error}") from self.error

    # -- push thread --------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._mailbox is None and not self._tasks and not self._closed:
                        self._cond.wait(0.5)
                    task = self._tasks.pop(0) if self._tasks else None
                    if task is None and self._mailbox is None:
                        return
                    if task is None:
                        payload, stats, t0 = self._mailbox
                        self._mailbox = None
                if task is not None:
                    fn, fut = task
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - the task's caller gets it
                        fut.set_exception(e)
                    continue
                self._deliver(payload, stats, t0)
                if self.on_applied is not None:
                    self.on_applied(stats.version)
                with self._cond:
                    self.history.append(stats)
                    self.applied_version = stats.version
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to the trainer through push()/wait()
            with self._cond:
                self.error = e
                self._cond.notify_all()
            self._fail_tasks()


class WeightPusher(NewestWinsPusher):
    """Pushes trainer parameters to a generator (see the module docstring).

    Args:
      generator: object with ``update_params(params, version, wait=True, timeout=...)``.
      target_shardings: pytree of NamedShardings on the generator mesh (``PagedEngine.param_shardings``).
      dtype: generator parameter dtype (None: keep the trainer's).
      on_applied: called with the version once the generator uses it (``StalenessManager.set_version``).
      timeout_s: limit of each wait (copy completion, generator apply).
      guard: disallow host<->device transfers during a push.
      initial_version: the version the generator already has (``wait`` for it returns at once).
      lora: ``LoraPush``: push only the adapters onto the generator's base (None: all parameters).
    """

    def __init__(self, generator: Any, target_shardings: Any, *, dtype: Any = None,
                 on_applied: Callable[[int], None] | None = None, timeout_s: float = 300.0, guard: bool = True,
                 initial_version: int | None = None, lora: LoraPush | None = None):
        super().__init__(on_applied=on_applied, timeout_s=timeout_s, guard=guard, initial_version=initial_version,
                         thread_name="weight-push")
        self.generator = generator
        self.lora = lora
        if lora is not None:
            from jaxrl_async.models import lora as lora_lib

            target_shardings, base_shardings = lora_lib.split(target_shardings)
            spec = lora.spec
            # merged: W + s A B on the generator devices, into the base's shardings (a new buffer: the
            # generator may still decode with the previous merged copy)
            self._merge = jax.jit(lambda a, b: lora_lib.merge(lora_lib.join(a, b), spec),
                                  out_shardings=base_shardings)
        self.target_shardings = target_shardings
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self._cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(self.dtype), p))
        self._plan: tuple[Any, PushPlan] | None = None
        self.routes: collections.Counter[str] = collections.Counter()
        self._start()

    # -- trainer side -------------------------------------------------------------------------
    def push(self, params: Any, version: int) -> PushStats:
        """Dispatch the copy of ``params`` (version ``version``) to the generator; returns at once."""
        self._raise_if_failed()
        t0 = time.perf_counter()
        with transfer_guard(self.guard):
            src = params
            if self.lora is not None:
                from jaxrl_async.models import lora as lora_lib

                src = lora_lib.split(params)[0]  # the adapters only: the generator holds the base
            if self.dtype is not None and any(x.dtype != self.dtype for x in jax.tree.leaves(src)):
                src = self._cast(src)
            out = self._move(src)
        stats = PushStats(version=int(version), bytes=tree_bytes(out), dispatch_s=time.perf_counter() - t0)
        self._post(out, stats, t0)
        return stats

    def _move(self, src: Any) -> Any:
        """Device-to-device move + reshard of ``src`` onto the target shardings (see ``plan_push``)."""
        key = jax.tree.structure(src), tuple(x.sharding for x in jax.tree.leaves(src))
        if self._plan is None or self._plan[0] != key:
            plan = plan_push(jax.tree.map(lambda x: x.sharding, src), self.target_shardings,
                             jax.tree.map(lambda x: x.shape, src))
            self._plan = (key, plan)
            self.routes = collections.Counter(jax.tree.leaves(plan.routes))
        plan = self._plan[1]
        leaves, treedef = jax.tree.flatten(src)
        routes = treedef.flatten_up_to(plan.routes)
        inter = treedef.flatten_up_to(plan.intermediate)
        dst = treedef.flatten_up_to(self.target_shardings)
        out = [None] * len(leaves)
        # via_trainer: reshard on the trainer devices first (one jitted identity over those leaves)
        vt = [i for i, r in enumerate(routes) if r == "via_trainer"]
        if vt:
            moved = _reshard([leaves[i] for i in vt], [inter[i] for i in vt])
            for i, x in zip(vt, moved):
                leaves[i] = x
        # shard-wise device-to-device copies
        hop = [i for i, r in enumerate(routes) if r in ("direct", "via_trainer")]
        if hop:
            copied = jax.device_put([leaves[i] for i in hop], [dst[i] for i in hop], may_alias=False)
            for i, x in zip(hop, copied):
                out[i] = x
        vg = [i for i, r in enumerate(routes) if r == "via_generator"]
        if vg:
            staged = jax.device_put([leaves[i] for i in vg], [inter[i] for i in vg], may_alias=False)
            for i, x in zip(vg, _reshard(staged, [dst[i] for i in vg])):
                out[i] = x
        return jax.tree.unflatten(treedef, out)

    # -- push thread --------------------------------------------------------------------------
    def _deliver(self, params: Any, stats: PushStats, t0: float) -> None:
        with transfer_guard(self.guard):
            self._wait_ready(params, stats.version)
        t1 = time.perf_counter()
        stats.transfer_s = t1 - t0
        if self.lora is not None:
            params = self._with_base(params)
        self.generator.update_params(params, stats.version, wait=True, timeout=self.timeout_s)
        t2 = time.perf_counter()
        stats.apply_s, stats.total_s = t2 - t1, t2 - t0

    def _with_base(self, adapters: Any) -> Any:
        """The generator's parameters for pushed ``adapters``: base + adapters, or the merged copy."""
        from jaxrl_async.models import lora as lora_lib

        if self.lora.decode == "unmerged":
            return lora_lib.join(adapters, self.lora.base)
        with transfer_guard(self.guard):
            merged = self._merge(adapters, self.lora.base)
            jax.block_until_ready(merged)
        return merged

    def _wait_ready(self, params: Any, version: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        for leaf in jax.tree.leaves(params):
            while not leaf.is_ready():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weight push of version {version}: copy not complete after {self.timeout_s} s")
                time.sleep(0.001)
