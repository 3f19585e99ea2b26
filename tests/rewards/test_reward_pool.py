"""WorkerPool: results, errors not retried, crash → retry on a fresh worker, hang → kill + replace."""
import os
import threading
import time

import pytest

import reward_pool_targets as targets
from jaxrl_async.rewards.pool import PoolConfig, WorkerPool

T = targets.__name__


def test_value_and_function_error_not_retried():
    with WorkerPool(f"{T}:add", PoolConfig(num_workers=1, retries=2)) as pool:
        out = pool.call(2, 3)
        assert out.ok and out.value == 5 and out.attempts == 1
        assert pool.call("a", "b").value == "ab"
    with WorkerPool(f"{T}:boom", PoolConfig(num_workers=1, retries=2)) as pool:
        out = pool.call("nope")
        assert not out.ok and out.attempts == 1 and out.error == "ValueError: nope"
        assert pool.stats() == dict(calls=1, timeouts=0, errors=1, worker_restarts=0, failed_calls=1)


def test_hung_worker_is_killed_and_replaced():
    with WorkerPool(f"{T}:sleep_then_pid", PoolConfig(num_workers=1, timeout_s=0.5, retries=1)) as pool:
        first_pid = pool.call(0).value
        t0 = time.monotonic()
        out = pool.call(30)
        elapsed = time.monotonic() - t0
        assert not out.ok and out.timed_out and out.attempts == 2
        assert elapsed < 5, elapsed  # two 0.5 s attempts + a worker start, never the 30 s sleep
        with pytest.raises(ProcessLookupError):
            os.kill(first_pid, 0)  # the wedged worker is gone
        second_pid = pool.call(0).value  # pool still serves, on a replacement worker
        assert second_pid != first_pid
        assert pool.stats() == dict(calls=3, timeouts=2, errors=0, worker_restarts=2, failed_calls=1)


def test_crashed_worker_retried_on_fresh_worker(tmp_path):
    marker = str(tmp_path / "crashed-once")
    with WorkerPool(f"{T}:die_once", PoolConfig(num_workers=1, retries=1)) as pool:
        out = pool.call(marker)
        assert out.ok and out.value == "survived" and out.attempts == 2
        assert pool.stats()["errors"] == 1 and pool.stats()["worker_restarts"] == 1
    with WorkerPool(f"{T}:die", PoolConfig(num_workers=1, retries=1)) as pool:
        out = pool.call(7)
        assert not out.ok and "worker exited" in out.error
        assert pool.stats() == dict(calls=1, timeouts=0, errors=2, worker_restarts=2, failed_calls=1)


def test_threads_share_bounded_workers_and_close():
    pool = WorkerPool(f"{T}:sleep_then_pid", PoolConfig(num_workers=2, timeout_s=10))
    pool.call(0)  # warm one worker
    pids, lock = [], threading.Lock()

    def work():
        out = pool.call(0.3)
        with lock:
            pids.append(out.value)

    threads = [threading.Thread(target=work) for _ in range(6)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert len(pids) == 6 and None not in pids
    assert len(set(pids)) <= 2  # never more than num_workers processes
    assert elapsed >= 0.9 - 0.05  # 6 calls × 0.3 s over 2 workers
    pool.close()
    out = pool.call(0)
    assert not out.ok and "closed" in out.error
    for pid in set(pids):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"worker {pid} still alive after close()")


def test_bad_target_reports_import_error():
    with WorkerPool("no_such_module_xyz:fn", PoolConfig(num_workers=1, retries=0)) as pool:
        out = pool.call()
        assert not out.ok and "no_such_module_xyz" in out.error
    with pytest.raises(ValueError, match="module:function"):
        WorkerPool("no_colon")
