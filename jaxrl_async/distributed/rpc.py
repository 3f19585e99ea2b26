"""A small authenticated RPC between role processes (controller <-> generator), with timeouts everywhere.

Why not Ray (or gRPC): the roles are a handful of long-lived processes with a static topology that
the cluster's own launcher (``srun``, a TPU pod's ``--worker=all``, a shell on one node) already
starts, one per host; the only traffic here is small (requests, token ids, log-probs, stats,
weight-push control messages: weights themselves travel device-to-device through
``jax.experimental.transfer``). ``multiprocessing.connection`` gives authenticated (HMAC
challenge), framed, pickled messages over TCP in the standard library; this module adds request
ids, replies that may come later (a generation request), a heartbeat, and one rule: **every wait
has a timeout, and every error names the peer** (``PeerLostError("generator-0 (pid 1234 on
node7, 10.0.0.7:41000) closed the connection ...")``). See ``NOTES.md`` (Multi-process) for the
comparison with Ray.

Security: messages are pickles, so the port must only accept peers that know the shared
``authkey`` (``JAXRL_RPC_AUTHKEY``, hex); ``authkey_from_env`` refuses to run without one.

Wire format: ``("call", id, method, args)`` and ``("reply", id, ok, value)``; ``value`` of a failed
call is ``(exception type name, message, remote traceback)``.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable

log = logging.getLogger("jaxrl_async.distributed")

AUTHKEY_ENV = "JAXRL_RPC_AUTHKEY"

__all__ = ["PeerLostError", "PeerTimeoutError", "RemoteError", "Peer", "listen", "accept", "connect",
           "authkey_from_env", "parse_address"]


class PeerLostError(ConnectionError):
    """The peer process closed the connection, died, or stopped answering heartbeats."""


class PeerTimeoutError(TimeoutError):
    """A call to the peer got no reply within its timeout (the message names peer and method)."""


class RemoteError(RuntimeError):
    """The peer's handler raised; ``remote_type`` / ``remote_traceback`` describe the original."""

    def __init__(self, peer: str, method: str, remote_type: str, message: str, remote_traceback: str = ""):
        super().__init__(f"{peer}: {method} failed: {remote_type}: {message}")
        self.peer, self.method, self.remote_type, self.remote_traceback = peer, method, remote_type, remote_traceback


def parse_address(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)`` (ValueError naming the string otherwise)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {addr!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def authkey_from_env(env: str = AUTHKEY_ENV) -> bytes:
    """The shared secret of the role processes (hex in ``$JAXRL_RPC_AUTHKEY``)."""
    v = os.environ.get(env)
    if not v:
        raise RuntimeError(f"${env} is not set: every role process needs the same secret (e.g. "
                           f"`export {env}=$(python -c 'import secrets; print(secrets.token_hex(16))')` in the job script)")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise RuntimeError(f"${env} must be hex (got {len(v)} characters that are not)") from None


def listen(address: str, authkey: bytes) -> Listener:
    host, port = parse_address(address)
    return Listener((host, port), family="AF_INET", authkey=authkey, backlog=64)


def accept(listener: Listener, timeout: float, what: str) -> Connection:
    """``listener.accept()`` with a timeout (the standard one has none): the accept and its HMAC
    handshake run on a helper thread; on timeout the caller gets a TimeoutError naming ``what``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["conn"] = listener.accept()
        except BaseException as e:  # noqa: BLE001 - reported below
            box["error"] = e

    t = threading.Thread(target=run, name="rpc-accept", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no {what} connected to {listener.address[0]}:{listener.address[1]} within {timeout:.0f} s")
    if "error" in box:
        raise ConnectionError(f"accepting {what} on {listener.address}: {type(box['error']).__name__}: {box['error']}")
    return box["conn"]


def connect(address: str, authkey: bytes, timeout: float, what: str) -> Connection:
    """Connect to ``address``, retrying until ``timeout`` (the peer may still be starting)."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            return Client((host, port), family="AF_INET", authkey=authkey)
        except (ConnectionRefusedError, OSError) as e:
            last = e
            time.sleep(0.2)
    raise TimeoutError(f"could not connect to {what} at {address} within {timeout:.0f} s (last error: {last})")


def answer(fn: Callable, args: tuple, reply: Callable[[bool, Any], None]) -> None:
    """Run ``fn(*args)`` and reply with its value, or with the error (type, message, traceback) that
    the caller's future raises as ``RemoteError`` (for handlers that run calls on worker threads)."""
    try:
        reply(True, fn(*args))
    except BaseException as e:  # noqa: BLE001 - sent back to the caller
        reply(False, (type(e).__name__, str(e), traceback.format_exc()))


class Peer:
    """One connection to a named peer: concurrent calls (each with a timeout), served calls, heartbeat.

    Args:
      conn: an authenticated ``Connection``.
      name: how errors name the peer (``"generator-0 (pid 1234 on node7)"``).
      handler: serves the peer's calls: ``handler(method, args, reply)``; it must return quickly
        (it runs on the reader thread) and call ``reply(ok, value)`` exactly once, now or later
        from any thread (slow work goes to a thread of the handler's choosing). None: this side
        serves nothing.
      heartbeat_s / heartbeat_timeout_s: ping the peer every ``heartbeat_s`` (0: never); a ping
        unanswered after ``heartbeat_timeout_s`` declares the peer lost (a hung or stopped process).
      on_lost: called once with the ``PeerLostError`` when the connection breaks.
    """

    def __init__(self, conn: Connection, name: str, *, handler: Callable[[str, tuple, Callable], None] | None = None,
                 heartbeat_s: float = 0.0, heartbeat_timeout_s: float = 60.0,
                 on_lost: Callable[[BaseException], None] | None = None):
        self.conn, self.name = conn, name
        self.handler = handler
        self.heartbeat_s, self.heartbeat_timeout_s = float(heartbeat_s), float(heartbeat_timeout_s)
        self.on_lost = on_lost
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, cf.Future]] = {}
        self._error: BaseException | None = None
        self._closed = threading.Event()
        self.last_reply_t = time.monotonic()
        self._reader = threading.Thread(target=self._read_loop, name=f"rpc-read[{name}]", daemon=True)
        self._reader.start()
        self._beat = None
        if self.heartbeat_s > 0:
            self._beat = threading.Thread(target=self._heartbeat_loop, name=f"rpc-heartbeat[{name}]", daemon=True)
            self._beat.start()

    # -- calls ------------------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        """The ``PeerLostError`` once the connection is gone (None while it is up)."""
        return self._error

    def call_async(self, method: str, *args: Any) -> cf.Future:
        """Send a call; its future gets the value, a ``RemoteError`` or a ``PeerLostError``."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._error is not None:
                fut.set_exception(self._error)
                return fut
            cid = next(self._ids)
            self._pending[cid] = (method, fut)
        try:
            self._send(("call", cid, method, args))
        except PeerLostError as e:
            with self._lock:
                self._pending.pop(cid, None)
            if not fut.done():
                fut.set_exception(e)
        return fut

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        """Blocking call with a timeout (``PeerTimeoutError`` naming peer and method)."""
        fut = self.call_async(method, *args)
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            raise PeerTimeoutError(f"{self.name}: no reply to {method!r} within {timeout:.0f} s") from None

    def close(self) -> None:
        """Close the connection (pending calls fail with PeerLostError; the peer sees EOF)."""
        self._closed.set()
        try:
            self.conn.close()
        except OSError:
            pass
        self._lost(PeerLostError(f"{self.name}: connection closed by this side"), report=False)

    # -- internals --------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, EOFError, ValueError) as e:
            err = PeerLostError(f"{self.name}: connection lost while sending ({type(e).__name__}: {e})")
            self._lost(err)
            raise err from e

    def _reply(self, cid: int) -> Callable[[bool, Any], None]:
        done = threading.Event()

        def reply(ok: bool, value: Any) -> None:
            if done.is_set():
                return
            done.set()
            try:
                self._send(("reply", cid, bool(ok), value))
            except PeerLostError:
                pass  # the reader reports the loss

        return reply

    def _read_loop(self) -> None:
        while not self._closed.is_set():
            try:
                msg = self.conn.recv()
            except (EOFError, OSError) as e:
                if not self._closed.is_set():
                    self._lost(PeerLostError(f"{self.name} closed the connection ({type(e).__name__}): the process "
                                             "exited, was killed or its host is unreachable"))
                return
            except Exception as e:  # noqa: BLE001 - an unpicklable message: report, keep reading
                if self._closed.is_set():  # close() from another thread while recv() ran (handle gone)
                    return
                log.error("%s: undecodable message: %s: %s", self.name, type(e).__name__, e)
                continue
            self.last_reply_t = time.monotonic()
            kind = msg[0]
            if kind == "reply":
                _, cid, ok, value = msg
                with self._lock:
                    entry = self._pending.pop(cid, None)
                if entry is None:
                    continue
                method, fut = entry
                if ok:
                    fut.set_result(value)
                else:
                    rtype, rmsg, rtb = value
                    fut.set_exception(RemoteError(self.name, method, rtype, rmsg, rtb))
            elif kind == "call":
                _, cid, method, args = msg
                reply = self._reply(cid)
                if method == "__ping__":
                    reply(True, time.time())
                elif self.handler is None:
                    reply(False, ("NotImplementedError", f"this side serves no calls ({method})", ""))
                else:
                    try:
                        self.handler(method, args, reply)
                    except BaseException as e:  # noqa: BLE001 - sent back to the caller
                        reply(False, (type(e).__name__, str(e), traceback.format_exc()))

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.heartbeat_s):
            if self._error is not None:
                return
            fut = self.call_async("__ping__")
            try:
                fut.result(self.heartbeat_timeout_s)
            except cf.TimeoutError:
                self._lost(PeerLostError(f"{self.name} did not answer a heartbeat within {self.heartbeat_timeout_s:.0f} s "
                                         "(process hung, stopped or its host unreachable)"))
                return
            except BaseException:  # noqa: BLE001 - the loss is reported by the reader
                return

    def _lost(self, err: BaseException, report: bool = True) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = err
            pending, self._pending = list(self._pending.values()), {}
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(err)
        if report and self.on_lost is not None:
            try:
                self.on_lost(err)
            except Exception:  # noqa: BLE001
                log.exception("%s: on_lost callback failed", self.name)
