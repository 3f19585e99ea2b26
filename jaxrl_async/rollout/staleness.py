"""Staleness-aware admission control and the result buffer of the asynchronous RL loop.

AReaL's rule (`areal/infra/staleness_manager.py::get_capacity`, paper §4.1), with
η = ``max_head_offpolicyness``, B = train batch size in prompt groups, v = current policy
version (number of completed weight updates that the generator already uses), C = maximum
number of groups in flight:

    capacity = min( C − running,  (η + v + 1)·B − (accepted + running) )

A new prompt group is started only while capacity > 0. ``accepted`` counts groups that finished
and were accepted (consumed or still buffered), ``running`` groups in flight. Rejected groups
(filtered, failed, timed out) are not counted: they give their budget back.

Per-group guarantee (stronger than AReaL)
=========================================

AReaL consumes the oldest *finished* groups first; a straggler admitted at version m can then
be consumed at any later version, so its head lag is not bounded per sample (SkyRL's docs say
the same of their bound). Here the bound holds for every group, by construction:

* a group's *admission version* m is v at ``acquire``; since the loop advertises version v
  only after the generator uses the weights of version v, the group's *head version* h (the
  version of its first generated token) satisfies h ≥ m;
* the consumer forms batch k (trained by the weights of version k) from the B outstanding
  groups (running or finished) with the smallest admission versions, earliest-deadline-first
  with deadline m + η; it waits for running groups among them (ties at equal m prefer finished
  groups, then older head versions, then admission order).

Claim: every group in batch k has k − h ≤ k − m ≤ η. Let D_k be the groups ever accepted
with m ≤ k − η. Admission kept accepted + running ≤ (η + m + 1)·B, so |D_k| ≤ (k + 1)·B.
If some batch j < k took a group with m' > k − η, earliest-deadline-first means no group of
D_k was outstanding then, and since m' ≤ v at that time, no group of D_k can be admitted
later either: D_k is empty at batch k. Otherwise all k·B consumed groups lie in D_k and at
most B of D_k remain, all of which batch k takes (it takes the smallest m first). So no group
of D_k is left after batch k, i.e. none is consumed later than m + η. ∎ The check is still
made at consumption (``StalenessViolation``), so a broken version protocol is caught.

With η = 0, batch k consists exactly of the groups admitted at version k: synchronous
on-policy RL. Waiting for stragglers happens only when a group reaches its deadline, i.e.
after η training steps of generation time.

Resume: ``on_version_recovered(v)`` sets accepted = v·B and running = 0 (AReaL fix #1345 for
issue #1388, where staleness grew unbounded after recovery). Finished groups saved by a checkpoint
come back through ``restore_buffered`` with their original admission and head versions (accepted
= v·B + restored, as in the saving run); one whose lag under v already exceeds η is refused.

Accounting: every admitted group ends consumed, rejected (with a reason) or outstanding
(running or buffered); ``counts()`` exposes ``admitted == consumed + rejected + running + buffered``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable


class StalenessViolation(AssertionError):
    """A group's head version lags the consuming version by more than η (must be impossible)."""


class StalenessClosedError(RuntimeError):
    """The manager was closed while a consumer waited for a batch."""


def capacity_formula(max_head_offpolicyness: int, batch_size: int, max_concurrent: int, version: int,
                     accepted: int, running: int) -> int:
    """min(C − running, (η + v + 1)·B − (accepted + running)) — AReaL's admission capacity."""
    return min(max_concurrent - running,
               (max_head_offpolicyness + version + 1) * batch_size - (accepted + running))


@dataclasses.dataclass(frozen=True)
class Ticket:
    """Admission of one prompt group. ``admit_version`` = policy version v at admission."""

    id: int
    admit_version: int
    admit_time: float


@dataclasses.dataclass(frozen=True)
class ConsumedGroup:
    """One group of a training batch: the producer's ``item``, its versions and its lag."""

    ticket: Ticket
    item: Any
    head_version: int
    finish_time: float
    lag: int  # consuming version − head version


@dataclasses.dataclass(frozen=True)
class StalenessCounts:
    version: int
    admitted: int
    accepted: int  # finished and accepted (buffered + consumed); AReaL's counter, reset on recovery
    running: int
    buffered: int
    consumed: int
    rejected: int
    rejected_by_reason: dict[str, int]
    capacity: int

    def balanced(self) -> bool:
        """Nothing lost or duplicated: admitted == consumed + rejected + running + buffered."""
        return self.admitted == self.consumed + self.rejected + self.running + self.buffered


@dataclasses.dataclass
class _Finished:
    ticket: Ticket
    item: Any
    head_version: int
    finish_time: float


class StalenessManager:
    """Thread-safe admission controller + result buffer (see the module docstring).

    Producer side: ``acquire(timeout)`` → ``Ticket`` (blocks while capacity ≤ 0), then exactly one
    of ``accept(ticket, item, head_version)`` or ``reject(ticket, reason)``.
    Trainer side: ``get_batch(version, timeout)`` → B ``ConsumedGroup``s, earliest deadline first;
    after the generator uses the weights of version v: ``set_version(v)``.

    Args:
      max_head_offpolicyness: η ≥ 0.
      batch_size: B, prompt groups per training batch (≥ 1).
      max_concurrent: C, groups in flight at most (≥ 1); None ⇒ (η + 1)·B (never binding).
      version: initial policy version.
      clock: time source for admission/finish times.
    """

    def __init__(self, max_head_offpolicyness: int, batch_size: int, max_concurrent: int | None = None,
                 version: int = 0, clock: Callable[[], float] = time.monotonic):
        if max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_concurrent is None:
            max_concurrent = (max_head_offpolicyness + 1) * batch_size
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self.eta = int(max_head_offpolicyness)
        self.batch_size = int(batch_size)
        self.max_concurrent = int(max_concurrent)
        self._clock = clock
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._version = int(version)
        self._accepted = version * batch_size  # as if recovered at `version`
        self._running: dict[int, Ticket] = {}
        self._buffer: dict[int, _Finished] = {}
        self._admitted = self._consumed = 0
        self._rejected: collections.Counter[str] = collections.Counter()
        self._closed = False

    # -- producer side ------------------------------------------------------------------------
    def capacity(self) -> int:
        with self._cond:
            return self._capacity()

    def _capacity(self) -> int:
        return capacity_formula(self.eta, self.batch_size, self.max_concurrent, self._version,
                                self._accepted, len(self._running))

    def try_acquire(self) -> Ticket | None:
        """Admit one group if capacity > 0 (running += 1), else None. Never blocks."""
        with self._cond:
            return self._admit() if not self._closed and self._capacity() > 0 else None

    def acquire(self, timeout: float | None = None) -> Ticket | None:
        """Block until capacity > 0 and admit one group; None on timeout or when closed."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or self._capacity() > 0, timeout)
            if not ok or self._closed:
                return None
            return self._admit()

    def _admit(self) -> Ticket:
        t = Ticket(next(self._ids), self._version, self._clock())
        self._running[t.id] = t
        self._admitted += 1
        self._cond.notify_all()
        return t

    def _pop_running(self, ticket: Ticket, what: str) -> None:
        if self._running.pop(ticket.id, None) is None:
            raise KeyError(f"StalenessManager.{what}: ticket {ticket.id} is not running "
                           "(already accepted/rejected, or issued before a recovery)")

    def accept(self, ticket: Ticket, item: Any, head_version: int | None = None) -> None:
        """The group finished and is accepted: buffer it for training (accepted += 1).

        ``head_version`` is the version of the group's first generated token (the minimum over
        its samples); None (no token generated) means the admission version.
        """
        with self._cond:
            h = ticket.admit_version if head_version is None else int(head_version)
            if h < ticket.admit_version:
                raise StalenessViolation(
                    f"group {ticket.id}: head version {h} < admission version {ticket.admit_version}; the "
                    "loop advertised a version (set_version) before the generator used its weights")
            self._pop_running(ticket, "accept")
            self._buffer[ticket.id] = _Finished(ticket, item, h, self._clock())
            self._accepted += 1
            self._cond.notify_all()

    def reject(self, ticket: Ticket, reason: str) -> None:
        """The group failed or was filtered: it gives its staleness budget back."""
        with self._cond:
            self._pop_running(ticket, "reject")
            self._rejected[str(reason)] += 1
            self._cond.notify_all()

    # -- trainer side -------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """Advertise version v (call only once the generator uses the weights of version v)."""
        with self._cond:
            if version < self._version:
                raise ValueError(f"set_version: version must not decrease ({self._version} -> {version})")
            self._version = int(version)
            self._cond.notify_all()

    def on_version_recovered(self, version: int) -> None:
        """After resuming at `version`: accepted = version·B; in-flight and buffered groups are
        forgotten (they are not checkpointed; AReaL fix #1345 / issue #1388)."""
        with self._cond:
            self._version = int(version)
            self._accepted = int(version) * self.batch_size
            lost = len(self._running) + len(self._buffer)
            if lost:
                self._rejected["lost_on_recovery"] += lost
            self._running.clear()
            self._buffer.clear()
            self._cond.notify_all()

    def buffered_groups(self) -> list[ConsumedGroup]:
        """Snapshot (not removed) of the finished, unconsumed groups in consumption order; ``lag`` is
        against the current version. The loop checkpoints them so a resume reuses them."""
        with self._cond:
            return [ConsumedGroup(f.ticket, f.item, f.head_version, f.finish_time, self._version - f.head_version)
                    for f in (self._buffer[i] for i, done in self._edf_order() if done)]

    def restore_buffered(self, item: Any, admit_version: int, head_version: int) -> Ticket:
        """Put back a finished group saved by a checkpoint (call after ``on_version_recovered`` /
        construction at the restored version, before producers start).

        The group keeps its original admission version (so earliest-deadline-first still serves it
        by its original deadline) and counts as admitted and accepted, as it did in the saving run
        (accepted = v·B + restored). A group whose head lag under the current version already
        exceeds η is refused with ``StalenessViolation``: the caller drops it (and regenerates its
        prompt) instead of training it — the guard against AReaL issue #1388.
        """
        with self._cond:
            m, h = int(admit_version), int(head_version)
            if not 0 <= m <= h:
                raise ValueError(f"restore_buffered: need 0 <= admit_version <= head_version, got {m}, {h}")
            if h > self._version:
                raise ValueError(f"restore_buffered: head_version {h} is newer than the current version {self._version}")
            lag = self._version - h
            if lag > self.eta:
                raise StalenessViolation(f"restored group (head version {h}) has lag {lag} > η={self.eta} at version "
                                         f"{self._version}")
            t = Ticket(next(self._ids), m, self._clock())
            self._buffer[t.id] = _Finished(t, item, h, self._clock())
            self._admitted += 1
            self._accepted += 1
            self._cond.notify_all()
            return t

    @property
    def version(self) -> int:
        return self._version

    def _edf_order(self) -> list[tuple[int, bool]]:
        """Outstanding groups as (ticket id, finished) in consumption order (earliest deadline first)."""
        keys = [((t.admit_version, 1, 0, t.id), t.id, False) for t in self._running.values()]
        keys += [((f.ticket.admit_version, 0, f.head_version, f.ticket.id), i, True) for i, f in self._buffer.items()]
        keys.sort(key=lambda k: k[0])
        return [(i, done) for _, i, done in keys]

    def _ready(self) -> bool:
        head = self._edf_order()[: self.batch_size]
        return len(head) == self.batch_size and all(done for _, done in head)

    def ready(self) -> bool:
        """Whether get_batch would return without waiting."""
        with self._cond:
            return self._ready()

    def get_batch(self, version: int | None = None, timeout: float | None = None) -> list[ConsumedGroup]:
        """Remove and return the next B groups for training at `version` (default: current version).

        Waits until the B outstanding groups with the earliest deadlines have all finished.
        Raises TimeoutError (naming what it waits for), StalenessClosedError when closed, and
        StalenessViolation if a group's head lag exceeds η (impossible unless the version
        protocol was broken).
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or self._ready(), timeout)
            if self._closed and not self._ready():
                raise StalenessClosedError("StalenessManager closed while waiting for a batch")
            if not ok:
                raise TimeoutError(f"no training batch after {timeout} s: {self._waiting_for()}")
            k = self._version if version is None else int(version)
            ids = [i for i, _ in self._edf_order()[: self.batch_size]]
            batch = [self._buffer[i] for i in ids]
            for f in batch:
                lag = k - f.head_version
                if lag > self.eta or lag < 0:
                    raise StalenessViolation(
                        f"group {f.ticket.id}: head version {f.head_version} (admitted at version "
                        f"{f.ticket.admit_version}) consumed at version {k}: lag {lag} outside [0, η={self.eta}]")
            for i in ids:
                del self._buffer[i]
            self._consumed += len(batch)
            self._cond.notify_all()
            return [ConsumedGroup(f.ticket, f.item, f.head_version, f.finish_time, k - f.head_version) for f in batch]

    def _waiting_for(self) -> str:
        head = self._edf_order()[: self.batch_size]
        running = [self._running[i] for i, done in head if not done]
        c = self._counts()
        if len(head) < self.batch_size:
            return (f"only {len(head)} of {self.batch_size} groups outstanding (running {c.running}, buffered "
                    f"{c.buffered}, capacity {c.capacity}, version {c.version}); is the producer running?")
        oldest = min(running, key=lambda t: t.admit_time)
        return (f"{len(running)} of the next {self.batch_size} groups still running (oldest: group {oldest.id} "
                f"admitted at version {oldest.admit_version}, {self._clock() - oldest.admit_time:.1f} s ago)")

    # -- lifecycle / introspection ------------------------------------------------------------
    def close(self) -> None:
        """Wake every waiter: acquire returns None, get_batch raises StalenessClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def counts(self) -> StalenessCounts:
        with self._cond:
            return self._counts()

    def _counts(self) -> StalenessCounts:
        return StalenessCounts(
            version=self._version, admitted=self._admitted, accepted=self._accepted, running=len(self._running),
            buffered=len(self._buffer), consumed=self._consumed, rejected=sum(self._rejected.values()),
            rejected_by_reason=dict(self._rejected), capacity=self._capacity())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no group is running (e.g. after the producer stopped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)


def lag_histogram(groups: list[ConsumedGroup]) -> dict[int, int]:
    """{lag: number of groups} of one batch (for the staleness metrics)."""
    return dict(sorted(collections.Counter(g.lag for g in groups).items()))
