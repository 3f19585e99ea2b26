"""Several generator replicas behind one ``Generator`` interface (``api.generator.GeneratorService``),
and what happens when one dies (issue 26 items 2 and 3).

``RemoteGenerator`` routes each request to the live replica with the fewest samples in flight and
keeps every admitted request until it has a result:

* **death**: a replica is lost when its connection breaks (EOF: the process exited or was killed) or
  its heartbeat goes unanswered (``rpc.Peer``: bounded by ``--heartbeat-timeout``), or when a weight
  push to it times out (the pusher closes it). A monitor thread polls the peers (``monitor_s``); a
  request whose reply fails with ``PeerLostError`` marks its replica dead at once.
* **re-queue**: a request that was in flight on a dead replica is RESUBMITTED, whole (same request id,
  prompt, sampling and seed) to the least-loaded live replica; its partial output is dropped. The
  workflow's handle never sees the failure, so its group is neither rejected nor replayed and the data
  ledger is unchanged (one draw, one group, trained once). Staleness holds: every live replica has
  applied the advertised version (the pusher advertises a version only once every live replica
  applied it, and a replica joins only with the newest pushed version), so the resubmitted request's
  head version is >= its group's admission version, and newer than the lost attempt's, never older.
  With no live replica the request waits in a queue (bounded, below).
* **rejoin** (``RemoteGenerators.join`` drives it): a restarted process that registers under the name of a
  dead replica is ``joining`` (not routed to, not pushed to by the regular pushes) until it holds the
  newest pushed weights and is started; the push thread then activates it (between two pushes, so it
  never misses one) and the queue drains onto it.
* **all down**: when no replica has been live for ``replica_timeout_s``, ``error`` is set (the
  dispatcher's fatal-error check ends the run with the emergency checkpoint, as before) and the queued
  requests fail.

Counters for the metrics (``replica_metrics``): failures, re-queued requests, the last recovery time
(death to back in service) and the replica-seconds lost; per replica its requests (in all and since it
last joined), samples in flight, failures, rejoins and generated tokens. ``stats`` sums the replicas'
``GeneratorStats``; the counters of a replica's earlier incarnations are kept, so they never go back.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Sequence

from jaxrl_async.distributed import rpc

__all__ = ["RemoteGenerator", "RemoteHandle", "Replica"]

# GeneratorStats fields that add up over replicas and over a replica's incarnations
COUNTERS = ("steps", "generated_tokens", "prefills", "prefill_tokens", "weight_updates", "preemptions",
            "recomputed_sequences", "finished_samples", "busy_s", "recompute_fallbacks", "partial_admissions",
            "dispatches")
GAUGES = ("live_slots", "queued_requests", "stream_backlog")  # add up over the live replicas only
MEANS = ("step_s", "host_s_per_step", "device_wait_s_per_step", "host_overhead_fraction")
MAX_ATTEMPTS = 8  # submissions of one request (each failed one lost a replica: a bound, not a policy)


@dataclasses.dataclass
class Replica:
    """One generator replica (a slot; its process may have been restarted, ``peer`` is the current one)."""

    index: int
    name: str  # "generator-k": what its processes register as
    peer: Any = None
    state: str = "dead"  # "live" (routed to, pushed to), "joining" (catching up), "dead"
    inflight: int = 0  # samples in flight
    requests: int = 0  # requests routed to it, all incarnations
    since_join: int = 0  # requests routed to it since it last joined
    failures: int = 0
    rejoins: int = 0
    down_since: float | None = None
    last_stats: Any = None
    base: dict = dataclasses.field(default_factory=lambda: collections.Counter())  # earlier incarnations


class _Request:
    __slots__ = ("rid", "prompt", "sampling", "metadata", "n", "future", "replica", "peer", "aborted", "attempts",
                 "images")

    def __init__(self, rid: str, prompt: list[int], sampling: Any, metadata: Any, images: Any = None):
        self.rid, self.prompt, self.sampling, self.metadata = rid, prompt, sampling, metadata
        self.images = images  # `data.images.ImageInputs` (travels as its encoded bytes + grids) or None
        self.n = max(1, int(getattr(sampling, "n", 1) or 1))
        self.future: cf.Future = cf.Future()
        self.replica: Replica | None = None
        self.peer: Any = None
        self.aborted = False
        self.attempts = 0


class RemoteHandle:
    def __init__(self, request_id: str, req: _Request, gen: "RemoteGenerator"):
        self.request_id, self._req, self._gen = request_id, req, gen

    def done(self) -> bool:
        return self._req.future.done()

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._req.future.result(timeout)
        except cf.TimeoutError:
            where = self._req.replica.name if self._req.replica is not None else "no replica (queued)"
            raise TimeoutError(f"request {self.request_id!r} not finished after {timeout} s (on {where})") from None

    def abort(self) -> None:
        self._gen.abort(self.request_id)


def _set(fut: cf.Future, value: Any = None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except cf.InvalidStateError:
        pass


class RemoteGenerator:
    """The generator service over replicas (module docstring). ``peers``: the replicas' first processes,
    in replica order (``peer.name`` starts with the replica's name)."""

    def __init__(self, peers: Sequence[Any], *, call_timeout_s: float = 120.0, replica_timeout_s: float = 300.0,
                 say: Callable[[str], None] | None = None, monitor_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic):
        self.replicas = [Replica(i, str(p.name).split(" ")[0], peer=p, state="live") for i, p in enumerate(peers)]
        self.call_timeout_s, self.replica_timeout_s = float(call_timeout_s), float(replica_timeout_s)
        self.say = say or (lambda msg: None)
        self.clock = clock
        self._lock = threading.RLock()
        self._reqs: dict[str, _Request] = {}
        self._queue: collections.deque[_Request] = collections.deque()
        self._ids = itertools.count()
        self._version = 0
        self._closed = False
        self._fatal: BaseException | None = None
        self._last_loss: BaseException | None = None
        self._all_down_since: float | None = None
        self.failures = 0
        self.requeued = 0
        self.last_recovery_s: float | None = None
        self.recovered_s = 0.0  # replica-seconds out of service, replicas back in service
        self.start_info: list[dict] = []
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, args=(monitor_s,), name="replica-monitor", daemon=True)
        self._monitor.start()

    # -- the service ----------------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        """Set once no replica has been in service for ``replica_timeout_s`` (the run then stops)."""
        return self._fatal

    @property
    def version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peers(self) -> list[Any]:
        """The live replicas' connections."""
        with self._lock:
            return [r.peer for r in self.replicas if r.state == "live"]

    @property
    def submitted(self) -> list[int]:
        return [r.requests for r in self.replicas]

    def start(self) -> "RemoteGenerator":
        return self  # started in RemoteGenerators.start (after the first weights)

    def set_version(self, version: int) -> None:
        """The version every live replica now decodes with (the pusher's ``on_applied``)."""
        self._version = int(version)

    def submit(self, prompt_ids: Sequence[int], sampling: Any = None, request_id: str | None = None,
               metadata: Any = None, *, stream: bool = False, images: Any = None) -> RemoteHandle:
        """``images``: the prompt's `data.images.ImageInputs` (sent as encoded bytes + grids; the replica's
        generator decodes them once and checks them against the prompt's placeholders)."""
        from jaxrl_async.generator.orchestrator import GeneratorClosedError, GeneratorError

        if stream:
            raise NotImplementedError("streaming requests are not served across processes")
        if self._fatal is not None:
            raise GeneratorError(f"generator lost: {self._fatal}") from self._fatal
        if self._closed:
            raise GeneratorClosedError("the generator replicas were stopped")
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        req = _Request(rid, [int(t) for t in prompt_ids], sampling, metadata, images)
        with self._lock:
            self._reqs[rid] = req
        req.future.add_done_callback(lambda _f, rid=rid: self._forget(rid, req))
        self._dispatch(req)
        return RemoteHandle(rid, req, self)

    def _forget(self, rid: str, req: _Request) -> None:
        with self._lock:
            if self._reqs.get(rid) is req:
                del self._reqs[rid]

    def abort(self, request_id: str) -> None:
        from jaxrl_async.generator.orchestrator import GeneratorError

        with self._lock:
            req = self._reqs.get(str(request_id))
            if req is None:
                return
            req.aborted = True
            queued = req in self._queue
            if queued:
                self._queue.remove(req)
            peer = None if queued else req.peer
        if queued:
            _set(req.future, exc=GeneratorError(f"request {request_id!r} aborted while waiting for a replica"))
        elif peer is not None and peer.error is None:
            peer.call_async("abort", str(request_id))

    # -- routing --------------------------------------------------------------------------------
    def _pick(self) -> Replica | None:
        """The live replica with the fewest samples in flight (ties: the lowest index)."""
        live = [r for r in self.replicas if r.state == "live"]
        return min(live, key=lambda r: (r.inflight, r.index)) if live else None

    def _dispatch(self, req: _Request) -> None:
        from jaxrl_async.generator.orchestrator import GeneratorClosedError, GeneratorError

        with self._lock:
            if self._closed or self._fatal is not None:
                err = (GeneratorError(f"request {req.rid!r}: generator lost: {self._fatal}") if self._fatal is not None
                       else GeneratorClosedError(f"request {req.rid!r}: the generator replicas were stopped"))
                rep = None
            else:
                err = None
                rep = self._pick()
                if rep is None:
                    self._queue.append(req)
                    return
                rep.inflight += req.n
                rep.requests += 1
                rep.since_join += 1
                req.replica, req.peer, req.attempts = rep, rep.peer, req.attempts + 1
                peer = rep.peer
        if err is not None:
            _set(req.future, exc=err)
            return
        fut = peer.call_async("submit", req.rid, req.prompt, req.sampling, req.metadata,
                              *(() if req.images is None else (req.images,)))
        fut.add_done_callback(lambda f: self._on_reply(req, rep, peer, f))

    def _on_reply(self, req: _Request, rep: Replica, peer: Any, fut: cf.Future) -> None:
        from jaxrl_async.generator.orchestrator import GeneratorClosedError, GeneratorError

        with self._lock:
            if rep.peer is peer:
                rep.inflight = max(0, rep.inflight - req.n)
        exc = fut.exception()
        if exc is None:
            _set(req.future, fut.result())
            return
        if isinstance(exc, rpc.PeerLostError) and not req.aborted and not self._closed:
            self._mark_dead(rep, peer, exc)
            if req.attempts >= MAX_ATTEMPTS:
                _set(req.future, exc=GeneratorError(f"request {req.rid!r} failed: {req.attempts} replicas lost under "
                                                    f"it; last: {exc}"))
                return
            with self._lock:
                self.requeued += 1
            self._dispatch(req)  # whole, to another replica (or queued until one is back)
            return
        if self._closed and isinstance(exc, rpc.PeerLostError):
            err: BaseException = GeneratorClosedError(f"request {req.rid!r}: the generator replicas were stopped")
        else:
            err = GeneratorError(f"request {req.rid!r} failed: {exc}")
        err.__cause__ = exc
        _set(req.future, exc=err)

    # -- membership -----------------------------------------------------------------------------
    def replica_named(self, name: str) -> Replica | None:
        return next((r for r in self.replicas if r.name == name), None)

    def mark_lost(self, peer: Any, err: BaseException) -> None:
        """``peer`` is unusable (e.g. a weight push to it timed out): close it, take its replica out."""
        rep = next((r for r in self.replicas if r.peer is peer), None)
        if rep is not None:
            self._mark_dead(rep, peer, err)

    def _mark_dead(self, rep: Replica, peer: Any, err: BaseException) -> bool:
        with self._lock:
            if rep.peer is not peer or rep.state == "dead" or self._closed:  # closed: stop() closes them all
                return False
            was = rep.state
            rep.state, rep.inflight = "dead", 0
            rep.failures += 1
            self.failures += 1
            rep.down_since = self.clock() if was == "live" else rep.down_since
            if rep.last_stats is not None:  # keep this incarnation's counters
                for k in COUNTERS:
                    rep.base[k] += getattr(rep.last_stats, k)
                rep.base["util_steps"] += rep.last_stats.slot_utilisation * rep.last_stats.steps
                rep.last_stats = None
            self._last_loss = err
            live = sum(r.state == "live" for r in self.replicas)
        self.say(f"generator replica lost: {err}; its requests go to the {live} live replica(s)"
                 if was == "live" else f"generator replica lost while rejoining: {err}")
        try:
            peer.close()  # a hung process sees EOF and exits (its launcher restarts it)
        except Exception:  # noqa: BLE001
            pass
        return True

    def begin_join(self, name: str, peer: Any) -> Replica | None:
        """A restarted process registered as ``name``: its replica (dead) is now joining; None when no
        dead replica has that name (or the run is ending)."""
        with self._lock:
            rep = self.replica_named(name)
            if rep is None or rep.state != "dead" or self._closed or self._fatal is not None:
                return None
            rep.peer, rep.state, rep.inflight = peer, "joining", 0
            return rep

    def activate(self, rep: Replica, peer: Any) -> bool:
        """The joining ``peer`` holds the newest pushed weights and runs: back in the routing set (the
        push thread calls this between two pushes); the queued requests go out."""
        with self._lock:
            if rep.peer is not peer or rep.state != "joining" or self._closed or peer.error is not None:
                return False
            now = self.clock()
            rep.state, rep.since_join = "live", 0
            rep.rejoins += 1
            if rep.down_since is not None:
                self.last_recovery_s = now - rep.down_since
                self.recovered_s += self.last_recovery_s
                rep.down_since = None
            queued = list(self._queue)
            self._queue.clear()
        self.say(f"generator replica {peer.name} back in service (recovered in {self.last_recovery_s or 0.0:.1f} s)"
                 + (f"; {len(queued)} queued request(s) sent to the replicas" if queued else ""))
        for req in queued:
            self._dispatch(req)
        return True

    def abandon_join(self, rep: Replica, peer: Any, err: BaseException) -> None:
        self._mark_dead(rep, peer, err)

    def push_targets(self) -> list[Any]:
        """The live replicas' connections (what a regular weight push goes to)."""
        return self.peers

    def _watch(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            for rep in list(self.replicas):
                p = rep.peer
                if rep.state != "dead" and p is not None and p.error is not None:
                    self._mark_dead(rep, p, p.error)
            self._check_all_down()

    def _check_all_down(self) -> None:
        from jaxrl_async.generator.orchestrator import GeneratorError

        with self._lock:
            if self._closed or self._fatal is not None:
                return
            if any(r.state == "live" for r in self.replicas):
                self._all_down_since = None
                return
            now = self.clock()
            if self._all_down_since is None:
                self._all_down_since = now
                return
            if now - self._all_down_since < self.replica_timeout_s:
                return
            self._fatal = rpc.PeerLostError(f"no generator replica in service for {self.replica_timeout_s:.0f} s "
                                            f"(--replica-timeout); last lost: {self._last_loss}")
            queued = list(self._queue)
            self._queue.clear()
        for req in queued:
            _set(req.future, exc=GeneratorError(f"request {req.rid!r}: {self._fatal}"))

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> Any:
        """The replicas' ``GeneratorStats`` summed (counters include the replicas' earlier incarnations;
        version: the minimum over the live ones). A replica that does not answer keeps its last value."""
        from jaxrl_async.generator.orchestrator import GeneratorStats

        with self._lock:
            live = [(r, r.peer) for r in self.replicas if r.state == "live"]
        futs = [(r, p, p.call_async("stats")) for r, p in live]
        deadline = time.monotonic() + self.call_timeout_s
        for r, p, f in futs:
            try:
                s = f.result(max(0.0, deadline - time.monotonic()))[0]
            except (cf.TimeoutError, rpc.PeerLostError, rpc.RemoteError):
                continue  # a loss is handled by the monitor
            with self._lock:
                if r.peer is p and r.state == "live":
                    r.last_stats = s
        with self._lock:
            cur = [r.last_stats for r in self.replicas if r.last_stats is not None and r.state == "live"]
            tot = {k: sum(r.base[k] for r in self.replicas) + sum(getattr(s, k) for s in cur) for k in COUNTERS}
            util_steps = sum(r.base["util_steps"] for r in self.replicas) + sum(s.slot_utilisation * s.steps
                                                                                for s in cur)
        for k in ("steps", "generated_tokens", "prefills", "prefill_tokens", "weight_updates", "preemptions",
                  "recomputed_sequences", "finished_samples", "recompute_fallbacks", "partial_admissions",
                  "dispatches"):
            tot[k] = int(tot[k])
        tot.update({k: int(sum(getattr(s, k) for s in cur)) for k in GAUGES})
        tot.update({k: (sum(getattr(s, k) for s in cur) / len(cur)) if cur else 0.0 for k in MEANS})
        tot["slot_utilisation"] = util_steps / tot["steps"] if tot["steps"] else 0.0
        tot["tokens_per_s"] = tot["generated_tokens"] / tot["busy_s"] if tot["busy_s"] else 0.0
        version = min(s.version for s in cur) if cur else self._version
        return GeneratorStats(version=version, **tot)

    def replica_metrics(self) -> dict[str, float]:
        """The replicas' row of the step metrics (module docstring)."""
        with self._lock:
            now = self.clock()
            down = sum(now - r.down_since for r in self.replicas if r.down_since is not None)
            row: dict[str, float] = {
                "generator/replicas_live": sum(r.state == "live" for r in self.replicas),
                "generator/replica_failures": self.failures, "generator/requeued": self.requeued,
                "generator/recovery_s": self.last_recovery_s if self.last_recovery_s is not None else float("nan"),
                "generator/lost_s": self.recovered_s + down}
            for r in self.replicas:
                tokens = r.base["generated_tokens"] + (r.last_stats.generated_tokens if r.last_stats is not None else 0)
                row.update({f"generator/{r.index}/requests": r.requests,
                            f"generator/{r.index}/requests_since_join": r.since_join,
                            f"generator/{r.index}/inflight": r.inflight, f"generator/{r.index}/live": int(r.state == "live"),
                            f"generator/{r.index}/failures": r.failures, f"generator/{r.index}/rejoins": r.rejoins,
                            f"generator/{r.index}/generated_tokens": int(tokens)})
        return row

    # -- end ------------------------------------------------------------------------------------
    def stop(self) -> None:
        from jaxrl_async.generator.orchestrator import GeneratorClosedError

        with self._lock:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            reps = [(r, r.peer, r.state) for r in self.replicas]
        self._stop.set()
        for req in queued:
            _set(req.future, exc=GeneratorClosedError(f"request {req.rid!r}: the generator replicas were stopped"))
        for _r, p, state in reps:
            if p is None:
                continue
            if state == "live" and p.error is None:
                try:
                    p.call("stop", timeout=60.0)
                except (rpc.PeerLostError, rpc.PeerTimeoutError, rpc.RemoteError):
                    pass
            p.close()
