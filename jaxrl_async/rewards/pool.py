"""Killable process pool for reward functions that may hang (math-verify/sympy, user code).

Why not ``concurrent.futures.ProcessPoolExecutor``: a task that hangs there cannot be cancelled or
killed without breaking the whole executor, and math-verify's own timeouts use ``signal.alarm``,
which works only in a process's main thread while our reward calls come from worker threads of
the RL loop.

Design:

* ``num_workers`` long-lived worker processes, each running ``_pool_worker.py`` (started with
  ``subprocess.Popen``: no fork of the multi-threaded, JAX-holding parent).  A worker imports the
  target ``"module:function"`` once, then serves one JSON request per line on stdin and answers one
  JSON line on stdout.  Inside the worker the function runs in the main thread, so ``signal.alarm``
  based timeouts of the function itself work.
* A worker is owned by exactly one calling thread at a time (idle list + condition variable), so
  :meth:`WorkerPool.call` is safe from any number of threads; at most ``num_workers`` calls run at
  once, the others wait for a worker.
* Per attempt, the caller waits for the answer with ``select`` up to ``timeout_s``.  On timeout or
  if the worker died, the worker is SIGKILLed and replaced right away (the replacement's import
  overlaps with other work; its start-up time never counts against a call's ``timeout_s``), and
  the call is retried up to ``retries`` more times.  An exception raised by the function itself is
  deterministic and not retried.
* Workers start lazily (first call) and stop on :meth:`close`, at context-manager exit, or at
  interpreter exit (``atexit``).

Counters (:meth:`WorkerPool.stats`): ``calls``, ``timeouts`` (attempts killed for exceeding
``timeout_s``), ``errors`` (attempts that raised in the function, crashed the worker or broke the
protocol), ``worker_restarts`` (workers killed and replaced), ``failed_calls`` (calls that returned
no value after all attempts).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Sequence

__all__ = ["PoolConfig", "PoolOutcome", "WorkerPool", "PoolClosedError"]

_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pool_worker.py")


class PoolClosedError(RuntimeError):
    """The pool was closed."""


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Attributes:
      num_workers: worker processes (max concurrent calls).
      timeout_s: per-attempt limit from sending the request to receiving the answer.
      retries: extra attempts after a timeout or a worker crash.
      startup_timeout_s: limit for a worker to import its target and report ready.
      worker_memory_bytes: ``RLIMIT_AS`` of each worker (``None``: unlimited); a runaway sympy
        expansion then fails with ``MemoryError`` instead of swapping the host.
      preload: modules each worker imports at start-up (e.g. ``("math_verify",)``).
    """

    num_workers: int = 2
    timeout_s: float = 5.0
    retries: int = 1
    startup_timeout_s: float = 60.0
    worker_memory_bytes: int | None = 4 << 30
    preload: Sequence[str] = ()

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"PoolConfig.num_workers must be >= 1, got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"PoolConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.retries < 0:
            raise ValueError(f"PoolConfig.retries must be >= 0, got {self.retries}")


@dataclasses.dataclass(frozen=True)
class PoolOutcome:
    """``ok`` → ``value`` holds the function's (JSON-decoded) result; else ``error`` says why."""

    ok: bool
    value: Any = None
    error: str | None = None
    timed_out: bool = False
    attempts: int = 1


class _Worker:
    def __init__(self, target: str, config: PoolConfig):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["JAXRL_POOL_PRELOAD"] = ",".join(config.preload)
        env["JAXRL_POOL_MEMORY_BYTES"] = str(config.worker_memory_bytes or 0)
        env.setdefault("JAX_PLATFORMS", "cpu")
        self.proc = subprocess.Popen([sys.executable, "-u", _WORKER_SCRIPT, target], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True,
                                     start_new_session=True)
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.ready = False
        self._buf = b""

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def send(self, payload: bytes, deadline: float) -> None:
        fd = self.proc.stdin.fileno()
        view = memoryview(payload)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("worker did not accept the request in time")
            _, writable, _ = select.select([], [fd], [], remaining)
            if writable:
                try:
                    view = view[os.write(fd, view[:65536]):]
                except BlockingIOError:
                    continue

    def recv_line(self, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError(f"worker exited (returncode {self.proc.poll()})")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line


class WorkerPool:
    """Runs ``target`` (``"module:function"``, JSON-able arguments and result) in killable workers."""

    def __init__(self, target: str, config: PoolConfig | None = None):
        if ":" not in target:
            raise ValueError(f"WorkerPool target must be 'module:function', got {target!r}")
        self.target = target
        self.config = config or PoolConfig()
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._n_alive = 0
        self._closed = False
        self._counters = dict(calls=0, timeouts=0, errors=0, worker_restarts=0, failed_calls=0)
        self_ref = weakref.ref(self)
        self._atexit = lambda: (p := self_ref()) is not None and p.close()
        atexit.register(self._atexit)

    # ------------------------------------------------------------------------------------ public
    def call(self, *args: Any, **kwargs: Any) -> PoolOutcome:
        """Run ``target(*args, **kwargs)`` in a worker.  Never raises for failures of the target."""
        self._bump("calls")
        try:
            payload = (json.dumps({"a": list(args), "k": kwargs}) + "\n").encode()
        except (TypeError, ValueError) as exc:
            self._bump("errors")
            self._bump("failed_calls")
            return PoolOutcome(ok=False, error=f"arguments are not JSON-serializable: {exc}")
        last_error, timed_out = "no attempt", False
        attempts = 1 + self.config.retries
        for attempt in range(1, attempts + 1):
            try:
                worker = self._acquire()
            except PoolClosedError as exc:
                last_error = str(exc)
                break
            except Exception as exc:  # noqa: BLE001 - worker start failure
                self._bump("errors")
                last_error = f"worker start failed: {exc!r}"
                continue
            healthy = False
            try:
                if not worker.ready:
                    line = worker.recv_line(time.monotonic() + self.config.startup_timeout_s)
                    if line != b'{"ready": true}':
                        raise EOFError(f"worker start-up failed: {line[:500].decode(errors='replace')}")
                    worker.ready = True
                deadline = time.monotonic() + self.config.timeout_s
                worker.send(payload, deadline)
                reply = json.loads(worker.recv_line(deadline))
                healthy = True
                if reply.get("ok"):
                    return PoolOutcome(ok=True, value=reply.get("v"), attempts=attempt)
                self._bump("errors")
                self._bump("failed_calls")
                return PoolOutcome(ok=False, error=reply.get("e", "unknown error"), attempts=attempt)
            except TimeoutError:
                self._bump("timeouts")
                last_error, timed_out = f"timed out after {self.config.timeout_s} s", True
            except (EOFError, OSError, ValueError) as exc:
                self._bump("errors")
                last_error, timed_out = f"worker failure: {exc}", False
            finally:
                self._release(worker, healthy)
        self._bump("failed_calls")
        return PoolOutcome(ok=False, error=last_error, timed_out=timed_out, attempts=attempts)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return dict(self._counters)

    def close(self) -> None:
        """Kill idle workers now and busy ones as soon as their call returns; idempotent."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._n_alive -= len(idle)
            self._cond.notify_all()
        for w in idle:
            w.kill()
        atexit.unregister(self._atexit)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internals
    def _bump(self, name: str) -> None:
        with self._cond:
            self._counters[name] += 1

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise PoolClosedError(f"WorkerPool({self.target!r}) is closed")
                if self._idle:
                    return self._idle.pop()
                if self._n_alive < self.config.num_workers:
                    self._n_alive += 1
                    break
                self._cond.wait()
        try:
            return _Worker(self.target, self.config)
        except BaseException:
            with self._cond:
                self._n_alive -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:
            worker.kill()
            with self._cond:
                self._counters["worker_restarts"] += 1
                closed = self._closed
            replacement = None
            if not closed:
                try:
                    replacement = _Worker(self.target, self.config)  # import overlaps with other calls
                except Exception:  # noqa: BLE001 - the next _acquire will try again
                    replacement = None
            with self._cond:
                if replacement is None or self._closed:
                    self._n_alive -= 1
                else:
                    self._idle.append(replacement)
                    replacement = None
                self._cond.notify()
            if replacement is not None:
                replacement.kill()
            return
        with self._cond:
            if not self._closed:
                self._idle.append(worker)
                self._cond.notify()
                return
            self._n_alive -= 1
        worker.kill()

