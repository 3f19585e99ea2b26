"""Staleness manager: AReaL's capacity rule, per-group head-lag bound, accounting, recovery."""
import random
import threading
import time

import pytest

from jaxrl_async.rollout.staleness import (
    StalenessClosedError, StalenessManager, StalenessViolation, capacity_formula, lag_histogram,
)


def test_capacity_formula_hand_values():
    # min(C - running, (eta + v + 1) * B - (accepted + running))
    assert capacity_formula(4, 8, 16, 2, 45, 10) == min(16 - 10, 7 * 8 - 55) == 1
    assert capacity_formula(4, 8, 16, 2, 30, 14) == min(2, 56 - 44) == 2
    assert capacity_formula(0, 4, 100, 0, 0, 0) == 4
    assert capacity_formula(0, 4, 100, 0, 0, 4) == 0


def test_eta0_admits_exactly_one_batch_per_version():
    m = StalenessManager(0, batch_size=2, max_concurrent=100)
    t = [m.try_acquire() for _ in range(3)]
    assert t[2] is None and all(x.admit_version == 0 for x in t[:2])
    for x in t[:2]:
        m.accept(x, x.id, head_version=0)
    assert m.try_acquire() is None  # accepted + running = 2 = (0 + 0 + 1) * 2
    batch = m.get_batch(0, timeout=1)
    assert [g.item for g in batch] == [0, 1] and [g.lag for g in batch] == [0, 0]
    assert m.try_acquire() is None  # still version 0: consumed groups keep counting as accepted
    m.set_version(1)
    assert m.capacity() == 2


def test_max_concurrent_binds():
    m = StalenessManager(4, batch_size=8, max_concurrent=3)
    assert [m.try_acquire() is not None for _ in range(4)] == [True, True, True, False]


def test_rejection_gives_budget_back_and_is_counted():
    m = StalenessManager(0, batch_size=2)
    a, b = m.try_acquire(), m.try_acquire()
    assert m.try_acquire() is None
    m.reject(a, "filtered")
    c = m.try_acquire()
    assert c is not None and m.try_acquire() is None
    m.reject(b, "error:ValueError")
    m.reject(c, "filtered")
    counts = m.counts()
    assert counts.rejected_by_reason == {"filtered": 2, "error:ValueError": 1}
    assert counts.admitted == 3 and counts.balanced()
    with pytest.raises(KeyError):
        m.reject(c, "twice")


def test_straggler_is_waited_for_at_its_deadline():
    """eta=2, B=1: the case where AReaL's oldest-finished-first rule would exceed the bound."""
    m = StalenessManager(2, batch_size=1, max_concurrent=100)
    t1, t2, t3 = (m.try_acquire() for _ in range(3))
    assert m.try_acquire() is None  # (2 + 0 + 1) * 1 = 3
    m.accept(t3, "t3", head_version=0)
    assert [g.item for g in m.get_batch(0, timeout=1)] == ["t3"]  # finished first among equal deadlines
    m.set_version(1)
    t4 = m.try_acquire()
    assert t4.admit_version == 1 and m.try_acquire() is None
    m.accept(t4, "t4", head_version=1)
    # t1, t2 (admitted at version 0) come before t4 although t4 finished: the trainer waits.
    assert not m.ready()
    with pytest.raises(TimeoutError, match="still running"):
        m.get_batch(1, timeout=0.05)
    m.accept(t1, "t1", head_version=0)
    assert [(g.item, g.lag) for g in m.get_batch(1, timeout=1)] == [("t1", 1)]
    m.set_version(2)
    m.accept(t2, "t2", head_version=0)
    assert [(g.item, g.lag) for g in m.get_batch(2, timeout=1)] == [("t2", 2)]
    assert [(g.item, g.lag) for g in m.get_batch(3, timeout=1)] == [("t4", 2)]


def test_violations_are_detected():
    m = StalenessManager(1, batch_size=1)
    t = m.try_acquire()
    m.set_version(1)
    with pytest.raises(StalenessViolation, match="head version 0 < admission version"):
        m.accept(m.try_acquire(), "x", head_version=0)
    m.accept(t, "old", head_version=0)
    with pytest.raises(StalenessViolation, match=r"lag 3 outside \[0, η=1\]"):
        m.get_batch(3, timeout=1)


def test_recovery_sets_accepted_to_version_times_batch():
    m = StalenessManager(1, batch_size=4, max_concurrent=100)
    for _ in range(5):
        m.try_acquire()
    m.on_version_recovered(5)
    c = m.counts()
    assert (c.version, c.accepted, c.running, c.capacity) == (5, 20, 0, (1 + 5 + 1) * 4 - 20)
    assert c.rejected_by_reason == {"lost_on_recovery": 5} and c.balanced()
    fresh = StalenessManager(1, batch_size=4, max_concurrent=100, version=5)
    assert fresh.capacity() == 8  # constructing at a version is the same as recovering to it


def test_close_wakes_waiters():
    m = StalenessManager(0, batch_size=1)
    m.try_acquire()
    out = {}

    def consumer():
        try:
            m.get_batch(0)
        except StalenessClosedError as e:
            out["c"] = e

    threads = [threading.Thread(target=consumer), threading.Thread(target=lambda: out.update(p=m.acquire()))]
    for th in threads:
        th.start()
    time.sleep(0.05)
    m.close()
    for th in threads:
        th.join(2)
    assert isinstance(out["c"], StalenessClosedError) and out["p"] is None


def test_lag_histogram():
    m = StalenessManager(3, batch_size=3)
    ts = [m.try_acquire() for _ in range(3)]
    for t, h in zip(ts, (0, 0, 0)):
        m.accept(t, t.id, head_version=h)
    assert lag_histogram(m.get_batch(2, timeout=1)) == {2: 3}


@pytest.mark.parametrize("eta", [0, 1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_simulation_invariants(eta, seed):
    """Producers/consumer threads with random durations, rejections and an asynchronous weight push.

    Checks, at every snapshot: running <= C and accepted + running <= (eta + v + 1) * B; for every
    trained group: 0 <= lag <= eta (and lag == 0 for eta == 0); at the end: nothing lost or duplicated.
    """
    rng = random.Random(seed * 100 + eta)
    B, C, steps = 3, 7, 12
    m = StalenessManager(eta, batch_size=B, max_concurrent=C)
    gen_version = [0]  # version the simulated generator uses; advertised to the manager after it changes
    lock = threading.Lock()
    stop = threading.Event()
    errors, lags, seen = [], [], []
    durations = [rng.choice([0.0005, 0.001, 0.002, 0.02]) for _ in range(10_000)]  # long tail
    rejects = [rng.random() < 0.15 for _ in range(10_000)]

    def producer():
        try:
            while not stop.is_set():
                t = m.acquire(timeout=0.01)
                if t is None:
                    continue
                with lock:
                    head = gen_version[0]  # first token generated now
                time.sleep(durations[t.id % 10_000])
                if rejects[t.id % 10_000]:
                    m.reject(t, "filtered")
                else:
                    m.accept(t, t.id, head_version=head)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def monitor():
        while not stop.is_set():
            c = m.counts()
            if c.running > C or c.accepted + c.running > (eta + c.version + 1) * B or not c.balanced():
                errors.append(AssertionError(f"invariant broken: {c}"))
            time.sleep(0.0005)

    threads = [threading.Thread(target=producer) for _ in range(4)] + [threading.Thread(target=monitor)]
    for th in threads:
        th.start()
    try:
        for k in range(steps):
            batch = m.get_batch(k, timeout=10)
            assert len(batch) == B
            lags.extend(g.lag for g in batch)
            seen.extend(g.item for g in batch)
            time.sleep(rng.choice([0.0, 0.003]))  # training
            with lock:
                gen_version[0] = k + 1  # generator picks the new weights up ...
            time.sleep(rng.choice([0.0, 0.002]))
            m.set_version(k + 1)  # ... and only then is the version advertised
    finally:
        stop.set()
        for th in threads:
            th.join(5)
    assert not errors, errors[:3]
    assert all(0 <= lag <= eta for lag in lags), lags
    if eta == 0:
        assert set(lags) == {0}
    assert len(seen) == len(set(seen)) == steps * B
    c = m.counts()
    assert c.consumed == steps * B and c.running == 0 and c.balanced()
    assert c.admitted == c.consumed + c.buffered + c.rejected_by_reason.get("filtered", 0)
