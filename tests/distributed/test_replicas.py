"""The replica router (``distributed.replicas.RemoteGenerator``) on fake replica connections: routing by
samples in flight, re-queue of a dead replica's requests (whole, same id/prompt/sampling: the caller's
handle never fails), the queue while no replica is live, rejoin, the all-down timeout, stats that never
go back when a replica restarts; and the pusher's push-thread tasks (``run_on_push_thread``) that a
rejoin's catch-up runs on. The real processes: ``test_replicas_launch.py``."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time

import pytest

from jaxrl_async.distributed import rpc
from jaxrl_async.distributed.replicas import RemoteGenerator
from jaxrl_async.generator.orchestrator import GeneratorClosedError, GeneratorError, GeneratorStats
from jaxrl_async.generator.weight_sync import NewestWinsPusher


@dataclasses.dataclass(frozen=True)
class Sampling:
    n: int = 1
    seed: int = 0


def stats(version=0, steps=0, tokens=0, busy=0.0, util=0.0) -> GeneratorStats:
    return GeneratorStats(version=version, steps=steps, generated_tokens=tokens, prefills=0, prefill_tokens=0,
                          weight_updates=0, preemptions=0, recomputed_sequences=0, finished_samples=0, live_slots=1,
                          queued_requests=0, stream_backlog=0, busy_s=busy, tokens_per_s=0.0, slot_utilisation=util,
                          step_s=0.01, host_s_per_step=0.0, device_wait_s_per_step=0.0, host_overhead_fraction=0.0)


class FakePeer:
    """A replica's connection: records submits; ``finish`` answers one; ``kill`` is a lost connection."""

    def __init__(self, name: str, st: GeneratorStats | None = None):
        self.name, self.error, self.st = f"{name} (pid 1 on test)", None, st or stats()
        self.submits: dict[str, tuple[cf.Future, tuple]] = {}
        self.aborted: list[str] = []
        self.closed = False
        self.lock = threading.Lock()

    def call_async(self, method, *args):
        fut: cf.Future = cf.Future()
        if self.error is not None:
            fut.set_exception(self.error)
            return fut
        if method == "submit":
            with self.lock:
                self.submits[args[0]] = (fut, args)
        elif method == "abort":
            self.aborted.append(args[0])
            fut.set_result(None)
        elif method == "stats":
            fut.set_result((self.st, None))
        else:
            fut.set_result(None)
        return fut

    def call(self, method, *args, timeout):
        return self.call_async(method, *args).result(timeout)

    def finish(self, rid: str, value="done") -> None:
        with self.lock:
            fut, _ = self.submits.pop(rid)
        fut.set_result(f"{value}:{rid}")

    def kill(self) -> None:
        self.error = rpc.PeerLostError(f"{self.name} closed the connection (EOFError)")
        with self.lock:
            pending, self.submits = list(self.submits.values()), {}
        for fut, _ in pending:
            fut.set_exception(self.error)

    def close(self) -> None:
        self.closed = True
        if self.error is None:
            self.kill()


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def router(n=2, **kw):
    peers = [FakePeer(f"generator-{i}") for i in range(n)]
    lines: list[str] = []
    return RemoteGenerator(peers, call_timeout_s=5.0, say=lines.append, monitor_s=0.02, **kw), peers, lines


def test_routes_by_samples_in_flight():
    r, (a, b), _ = router()
    try:
        r.submit([1], Sampling(n=4), request_id="big")  # a: 4 samples
        r.submit([1], Sampling(n=1), request_id="s1")  # b: 1
        r.submit([1], Sampling(n=1), request_id="s2")  # b: 2
        r.submit([1], Sampling(n=1), request_id="s3")  # b: 3
        r.submit([1], Sampling(n=1), request_id="s4")  # b: 4
        r.submit([1], Sampling(n=1), request_id="s5")  # a: 5 (a tie: the lowest index)
        assert set(a.submits) == {"big", "s5"} and set(b.submits) == {"s1", "s2", "s3", "s4"}
        a.finish("big")
        r.submit([1], Sampling(n=2), request_id="s6")  # a: 1 in flight < b: 4
        assert "s6" in a.submits
        assert r.submitted == [3, 4]
        m = r.replica_metrics()
        assert (m["generator/0/inflight"], m["generator/1/inflight"]) == (3, 4)
    finally:
        r.stop()


def test_dead_replica_requests_are_resubmitted_whole_and_the_handles_never_fail():
    r, (a, b), lines = router()
    try:
        hs = [r.submit([7, k], Sampling(n=1, seed=k), request_id=f"r{k}") for k in range(4)]
        on_a = sorted(a.submits)
        assert on_a == ["r0", "r2"]
        sent = {rid: args for rid, (_, args) in a.submits.items()}
        a.kill()  # the replies fail with PeerLostError: re-queued to b at once
        assert sorted(b.submits) == ["r0", "r1", "r2", "r3"]
        for rid in on_a:  # same id, prompt, sampling (seed), metadata
            assert b.submits[rid][1] == sent[rid]
        for k in range(4):
            b.finish(f"r{k}")
        assert [h.result(1) for h in hs] == [f"done:r{k}" for k in range(4)]
        m = r.replica_metrics()
        assert m["generator/replica_failures"] == 1 and m["generator/requeued"] == 2
        assert m["generator/replicas_live"] == 1 and m["generator/0/live"] == 0
        assert r.error is None
        assert any("generator replica lost: generator-0 (pid 1 on test) closed the connection" in x for x in lines)
        assert a.closed
    finally:
        r.stop()


def test_queue_while_no_replica_is_live_then_rejoin_drains_it_and_counts_the_recovery():
    clock = Clock()
    r, (a,), lines = router(n=1, clock=clock, replica_timeout_s=60.0)
    try:
        h = r.submit([1], Sampling(), request_id="x")
        a.kill()
        deadline = time.monotonic() + 5
        while r.replica_metrics()["generator/0/live"] and time.monotonic() < deadline:
            time.sleep(0.01)
        h2 = r.submit([2], Sampling(), request_id="y")  # nothing live: queued
        assert not h.done() and not h2.done()
        clock.t += 12.5
        a2 = FakePeer("generator-0")
        assert r.begin_join("generator-1", a2) is None  # no such replica
        rep = r.begin_join("generator-0", a2)
        assert rep is not None and r.begin_join("generator-0", FakePeer("generator-0")) is None  # already joining
        assert r.push_targets() == []  # a joining replica is not pushed to by the regular pushes
        assert r.activate(rep, a2)
        assert sorted(a2.submits) == ["x", "y"]
        a2.finish("x")
        a2.finish("y")
        assert (h.result(1), h2.result(1)) == ("done:x", "done:y")
        m = r.replica_metrics()
        assert m["generator/recovery_s"] == pytest.approx(12.5) and m["generator/lost_s"] == pytest.approx(12.5)
        assert m["generator/0/rejoins"] == 1 and m["generator/0/requests_since_join"] == 2
        assert m["generator/0/requests"] == 3 and r.push_targets() == [a2]
        assert any("back in service" in x for x in lines)
    finally:
        r.stop()


def test_all_replicas_down_past_the_timeout_is_fatal_and_fails_the_queue():
    r, (a, b), _ = router(replica_timeout_s=0.2)
    try:
        h = r.submit([1], Sampling(), request_id="x")
        a.kill()
        b.kill()
        with pytest.raises(GeneratorError, match="no generator replica in service for 0 s"):
            h.result(5)
        assert r.error is not None and "closed the connection" in str(r.error)
        with pytest.raises(GeneratorError, match="generator lost"):
            r.submit([1], Sampling())
    finally:
        r.stop()


def test_abort_of_a_queued_request_and_stop_fails_what_is_left():
    r, (a,), _ = router(n=1, replica_timeout_s=60.0)
    h = r.submit([1], Sampling(), request_id="x")
    r.abort("x")
    assert a.aborted == ["x"]
    a.kill()
    time.sleep(0.1)
    h2 = r.submit([1], Sampling(), request_id="y")
    r.abort("y")
    with pytest.raises(GeneratorError, match="aborted while waiting"):
        h2.result(1)
    h3 = r.submit([1], Sampling(), request_id="z")
    r.stop()
    with pytest.raises(GeneratorClosedError):
        h3.result(1)
    with pytest.raises(GeneratorError):  # x was aborted on a replica that then died: not resubmitted
        h.result(1)


def test_stats_sum_replicas_and_keep_a_restarted_replicas_counters():
    r, (a, b), _ = router()
    try:
        a.st, b.st = stats(3, 10, 100, 1.0, 0.5), stats(2, 30, 300, 3.0, 1.0)
        s = r.stats()
        assert (s.version, s.steps, s.generated_tokens, s.live_slots) == (2, 40, 400, 2)
        assert s.slot_utilisation == pytest.approx((5 + 30) / 40) and s.tokens_per_s == pytest.approx(100.0)
        a.kill()
        time.sleep(0.1)
        s = r.stats()  # a's last counters stay in the sum
        assert (s.steps, s.generated_tokens, s.live_slots) == (40, 400, 1)
        a2 = FakePeer("generator-0", stats(3, 5, 7))
        r.activate(r.begin_join("generator-0", a2), a2)
        s = r.stats()
        assert (s.steps, s.generated_tokens) == (45, 407)
        assert r.replica_metrics()["generator/0/generated_tokens"] == 107
    finally:
        r.stop()


class _Recorder(NewestWinsPusher):
    def __init__(self):
        super().__init__(on_applied=None, timeout_s=5.0, guard=False, initial_version=0, thread_name="t")
        self.order: list = []
        self._start()

    def _deliver(self, payload, stats, t0):
        time.sleep(0.05)
        self.order.append(("push", stats.version))


@dataclasses.dataclass
class _St:
    version: int


def test_push_thread_tasks_run_between_pushes_and_their_errors_stay_theirs():
    p = _Recorder()
    p._post(None, _St(1), 0.0)
    p.wait(1)
    f1 = p.run_on_push_thread(lambda: p.order.append(("task", p.applied_version)) or "ok")
    assert f1.result(5) == "ok"
    f2 = p.run_on_push_thread(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        f2.result(5)
    p._post(None, _St(2), 0.0)
    p.wait(2)
    assert p.error is None and p.order[-1] == ("push", 2)
    assert p.order == [("push", 1), ("task", 1), ("push", 2)]
    p.close()
    with pytest.raises(Exception, match="closed"):
        p.run_on_push_thread(lambda: None).result(1)


def test_images_travel_to_the_replica_as_encoded_bytes():
    """A request's images (`ImageInputs`) go to the replica with the submit (and again, whole, when a dead
    replica's request is resubmitted), through the RPC codec as bytes + grids: the replica decodes the same pixels;
    a text request's submit is unchanged (4 arguments)."""
    import io

    import numpy as np
    from PIL import Image

    from jaxrl_async.data.images import ImageInputs, ImageProcessorConfig, decode_image, process_image
    from jaxrl_async.distributed import codec

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 28, 3), dtype=np.uint8)).save(buf, format="PNG")
    proc = ImageProcessorConfig(min_pixels=128, max_pixels=768, patch_size=4)
    images = ImageInputs((buf.getvalue(),), np.asarray([process_image(decode_image(buf.getvalue()), proc)[1]]), proc)
    r, (a, b), _ = router()
    try:
        r.submit([1, 2], Sampling(), request_id="img", images=images)
        r.submit([1], Sampling(), request_id="txt")
        assert a.submits["img"][1][4] is images and len(b.submits["txt"][1]) == 4
        a.kill()
        time.sleep(0.1)
        assert b.submits["img"][1][4] is images  # resubmitted whole
    finally:
        r.stop()
    chunks = codec.encode(["submit", [1, 2], images])
    got = codec.decode(bytes(chunks[1]), [bytearray(c) for c in chunks[2:]])[2]
    assert isinstance(got, ImageInputs) and got.images == images.images and got.digest == images.digest
    np.testing.assert_array_equal(got.pixel_values(), images.pixel_values())
    assert sum(len(c) for c in chunks) < images.pixel_values().nbytes  # bytes + grids, not pixels
