"""Trainer → generator weight push: device-to-device, resharded, off the decode path.

After each update the trainer calls :meth:`WeightPusher.push` with its (fp32, trainer-sharded)
parameters and the new policy version. The push has two halves:

1. **Dispatch, on the trainer thread** (microseconds of host time, asynchronous on the device):
   cast to the generator's parameter dtype on the trainer mesh (a jitted ``astype``; skipped when
   the dtypes agree) and ``jax.device_put`` onto the generator's ``NamedSharding``s with
   ``may_alias=False``. ``device_put`` between meshes is a device-to-device copy that also
   reshards (fsdp×tensor → data×tensor). It must be *dispatched* before the trainer's next step,
   because that step donates (frees) the trainer's parameter buffers; JAX orders the copy's reads
   before the donation. ``may_alias=False`` guarantees fresh buffers even when the two meshes share
   devices (colocated mode).
2. **Completion, on the transfer thread**: wait until the copy is on the generator devices, then
   ``Generator.update_params(params, version, wait=True)`` (the decode thread swaps them in between
   two decode steps), then ``on_applied(version)`` — the loop advertises the version to the
   staleness manager only now, which is what makes "head version ≥ admission version" hold.

Double buffering: at most one copy is being completed and one waits in a one-slot mailbox; a
newer push replaces a waiting one (its version is skipped: the generator jumps to the newer
weights). Decoding never waits for a transfer: the generator keeps decoding with the old weights
until the new ones are complete on its devices.

No host round trip: both halves run under ``jax.transfer_guard_device_to_host("disallow")`` and
``jax.transfer_guard_host_to_device("disallow")`` (``guard=True``, the default), so a change that
would route weights through host memory fails loudly instead of silently costing seconds.

Errors in the transfer thread are kept in ``error`` and re-raised by the next ``push``/``wait``;
every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

__all__ = ["WeightPusher", "PushStats", "WeightPushError"]


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


def _guard(enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(jax.transfer_guard_device_to_host("disallow"))
    stack.enter_context(jax.transfer_guard_host_to_device("disallow"))
    return stack


def tree_bytes(tree: Any) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


class WeightPusher:
    """Pushes trainer parameters to a generator (see the module docstring).

    Args:
      generator: object with ``update_params(params, version, wait=True, timeout=...)``.
      target_shardings: pytree of NamedShardings on the generator mesh (``PagedEngine.param_shardings``).
      dtype: generator parameter dtype (None: keep the trainer's).
      on_applied: called with the version once the generator uses it (``StalenessManager.set_version``).
      timeout_s: limit of each wait (copy completion, generator apply).
      guard: disallow host<->device transfers during a push.
      initial_version: the version the generator already has (``wait`` for it returns at once).
    """

    def __init__(self, generator: Any, target_shardings: Any, *, dtype: Any = None,
                 on_applied: Callable[[int], None] | None = None, timeout_s: float = 300.0, guard: bool = True,
                 initial_version: int | None = None):
        self.generator = generator
        self.target_shardings = target_shardings
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.on_applied = on_applied
        self.timeout_s = float(timeout_s)
        self.guard = guard
        self._cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(self.dtype), p))
        self._cond = threading.Condition()
        self._mailbox: tuple[Any, PushStats, float] | None = None
        self._busy = False
        self._closed = False
        self.error: BaseException | None = None
        self.history: list[PushStats] = []
        self.skipped_versions: list[int] = []
        self.applied_version: int | None = initial_version
        self._thread = threading.Thread(target=self._main, name="weight-push", daemon=True)
        self._thread.start()

    # -- trainer side -------------------------------------------------------------------------
    def push(self, params: Any, version: int) -> PushStats:
        """Dispatch the copy of ``params`` (version ``version``) to the generator; returns at once."""
        self._raise_if_failed()
        t0 = time.perf_counter()
        with _guard(self.guard):
            src = params
            if self.dtype is not None and any(x.dtype != self.dtype for x in jax.tree.leaves(params)):
                src = self._cast(params)
            out = jax.device_put(src, self.target_shardings, may_alias=False)
        stats = PushStats(version=int(version), bytes=tree_bytes(out), dispatch_s=time.perf_counter() - t0)
        with self._cond:
            if self._closed:
                raise WeightPushError("WeightPusher is closed")
            if self._mailbox is not None:
                self.skipped_versions.append(self._mailbox[1].version)
            self._mailbox = (out, stats, t0)
            self._cond.notify_all()
        return stats

    def wait(self, version: int | None = None, timeout: float | None = None) -> None:
        """Block until ``version`` (default: the newest pushed) is applied by the generator."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            target = version
            if target is None:
                target = self._mailbox[1].version if self._mailbox is not None else self.applied_version
            while True:
                if self.error is not None:
                    break
                if target is None or (self.applied_version is not None and self.applied_version >= target):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"weight push of version {target} not applied by the generator after "
                                       f"{timeout:.0f} s (applied: {self.applied_version})")
                self._cond.wait(min(left, 0.5))
        self._raise_if_failed()

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise WeightPushError(f"weight push failed: {type(self.error).__name__}: {self.error}") from self.error

    # -- transfer thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._mailbox is None and not self._closed:
                        self._cond.wait(0.5)
                    if self._mailbox is None:
                        return
                    params, stats, t0 = self._mailbox
                    self._mailbox = None
                    self._busy = True
                with _guard(self.guard):
                    self._wait_ready(params, stats.version)
                t1 = time.perf_counter()
                stats.transfer_s = t1 - t0
                self.generator.update_params(params, stats.version, wait=True, timeout=self.timeout_s)
                t2 = time.perf_counter()
                stats.apply_s, stats.total_s = t2 - t1, t2 - t0
                if self.on_applied is not None:
                    self.on_applied(stats.version)
                with self._cond:
                    self.history.append(stats)
                    self.applied_version = stats.version
                    self._busy = False
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to the trainer through push()/wait()
            with self._cond:
                self.error = e
                self._busy = False
                self._cond.notify_all()

    def _wait_ready(self, params: Any, version: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        for leaf in jax.tree.leaves(params):
            while not leaf.is_ready():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weight push of version {version}: copy not complete after {self.timeout_s} s")
                time.sleep(0.001)
