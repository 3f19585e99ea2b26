"""A small authenticated RPC between role processes (controller <-> generators, leader <-> trainer
followers), with timeouts everywhere.

Why not Ray (or gRPC): the roles are a handful of long-lived processes with a static topology that
the cluster's own launcher (``srun``, a TPU pod's ``--worker=all``, a shell on one node) already
starts, one per host; the only traffic here is small (requests, token ids, log-probs, stats,
weight-push control messages: weights themselves travel device-to-device through
``jax.experimental.transfer``). This module gives request ids, replies that may come later (a
generation request), a heartbeat, and one rule: **every wait has a timeout, and every error names
the peer** (``PeerLostError("generator-0 (pid 1234 on node7, 10.0.0.7:41000) closed the connection
...")``). See ``NOTES.md`` (Multi-process) for the comparison with Ray.

Security (the ports are on a cluster network): every connection is mutual TLS 1.3 keyed by the
run's shared secret (``JAXRL_RPC_AUTHKEY``, hex, >= 16 random bytes; ``distributed.tls``), so only
processes that know the secret connect, and every message is encrypted and authenticated: a byte
changed or injected on the way ends the connection with ``TamperedMessageError``. Messages are
decoded without pickle (``distributed.codec``: msgpack + raw numpy buffers + a fixed list of
dataclasses), so even an authenticated peer cannot make this process run code; a message that does
not decode closes that peer at once with ``MalformedMessageError`` naming it. The listener
accepts in the background: each connection gets ``handshake_timeout_s`` to complete the handshake
on a thread of its own, so a silent, garbage or wrong-key connection is dropped (and logged) while
the real peers keep joining.

Unauthenticated peers (issue 27): anyone who reaches the port can open connections, so they cannot
be allowed to starve the listener. A connection must send its first bytes within
``first_bytes_timeout_s`` (3 s; a real client sends its ClientHello at once) and finish the
handshake within ``handshake_timeout_s`` (10 s); one source address holds at most
``max_handshakes_per_host`` handshakes at once (8) and all together at most ``max_handshakes`` (32);
a new connection beyond either limit is accepted and **evicts** the oldest connection of that
address / of all (silent ones before those that sent something), never refused. A real client
sends its ClientHello within a round trip, so a flood of silent connections evicts itself; and
``connect`` retries a handshake that the listener closed (backoff, within its own timeout) instead
of failing at once, so being evicted costs a retry, not the run.

Message sizes per type (issue 27; frames are read incrementally, ``tls.Connection.recv``, so a
header alone allocates nothing large): heartbeats (``__ping__`` and its reply) ``PING_LIMIT``
(4 KiB, no arrays); control calls and replies (``submit``, ``stats``, ``configure_push``,
``pull_weights``, ``register``, ... everything not listed below) ``CONTROL_LIMIT`` (64 MiB of
msgpack body, 64 MiB of arrays: the largest, a trainer group's fallback shard list or the push plans
of a large model, are a few MB); bulk data (``BULK_CALLS``: the trainer group's ``train``, ``save``,
``initial_state``, which carry trajectory batches; ``BULK_REPLIES``: ``submit``'s generation
output, which may carry MoE routing arrays) ``tls.MAX_BODY`` (256 MiB) of body and
``tls.MAX_MESSAGE`` (8 GiB) in all. Weights never cross the RPC (``jax.experimental.transfer`` or
the disk fallback). A frame whose sender stops mid-way is given up after ``frame_timeout_s``.

Wire format (after the handshake): ``["call", id, method, [args]]`` and ``["reply", id, ok, value]``;
``value`` of a failed call is ``[exception type name, message, remote traceback]``.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import queue
import random
import select
import socket
import threading
import time
import traceback
from typing import Any, Callable

import msgpack

from jaxrl_async.distributed import codec, tls
from jaxrl_async.distributed.tls import Connection

log = logging.getLogger("jaxrl_async.distributed")

PING_LIMIT = 4096  # a heartbeat call or reply: body bytes (no arrays)
CONTROL_LIMIT = 64 << 20  # a control call or reply: body bytes, and array bytes
BULK_CALLS = frozenset({"train", "save", "initial_state"})  # calls that carry data (trainer group batches)
BULK_REPLIES = frozenset({"submit"})  # replies that carry data (generation outputs, MoE routing)

AUTHKEY_ENV = "JAXRL_RPC_AUTHKEY"
MIN_KEY_BYTES = tls.MIN_KEY_BYTES

__all__ = ["PeerLostError", "PeerTimeoutError", "RemoteError", "TamperedMessageError", "MalformedMessageError",
           "AuthenticationError", "Peer", "Listener", "Connection", "listen", "accept", "connect", "authkey_from_env",
           "parse_address", "answer", "is_wildcard"]


class PeerLostError(ConnectionError):
    """The peer process closed the connection, died, or stopped answering heartbeats."""


class TamperedMessageError(PeerLostError):
    """A message from the peer failed its TLS authentication (bytes changed or injected on the way):
    the connection was dropped."""


class MalformedMessageError(PeerLostError):
    """The (authenticated) peer sent a message that does not decode or is not a call/reply: the
    connection was closed."""


class AuthenticationError(ConnectionError):
    """The other side is not a process of this run (the mutual-TLS handshake failed)."""


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


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``, ``::`` or empty: every interface of the host."""
    return host.strip("[]") in ("", "0.0.0.0", "::", "0:0:0:0:0:0:0:0", "*")


def authkey_from_env(env: str = AUTHKEY_ENV) -> bytes:
    """The shared secret of the role processes (hex in ``$JAXRL_RPC_AUTHKEY``, >= 16 bytes)."""
    v = os.environ.get(env)
    hint = f"`export {env}=$(python -c 'import secrets; print(secrets.token_hex(32))')` in the job script"
    if not v:
        raise RuntimeError(f"${env} is not set: every role process needs the same secret (e.g. {hint})")
    try:
        key = bytes.fromhex(v)
    except ValueError:
        raise RuntimeError(f"${env} must be hex (got {len(v)} characters that are not)") from None
    if len(key) < MIN_KEY_BYTES:
        raise RuntimeError(f"${env} holds {len(key)} bytes: the secret must be at least {MIN_KEY_BYTES} random bytes "
                           f"({2 * MIN_KEY_BYTES} hex characters; e.g. {hint})")
    return key


class _Unauthenticated:
    """An accepted connection in its handshake (the listener's bookkeeping)."""

    __slots__ = ("sock", "addr", "t0", "spoke", "evicted")

    def __init__(self, sock: socket.socket, addr: Any):
        self.sock, self.addr, self.t0 = sock, addr, time.monotonic()
        self.spoke = False  # sent its first bytes
        self.evicted = ""  # why the listener closed it to make room


class Listener:
    """A listening socket that accepts and authenticates in the background.

    Every accepted socket gets its own handshake thread; it must send its first bytes within
    ``first_bytes_timeout_s`` and complete the handshake within ``handshake_timeout_s``.
    Authenticated connections queue up for ``accept``. At most ``max_handshakes`` connections are
    in their handshake at once, at most ``max_handshakes_per_host`` from one source address: a new
    connection beyond a limit evicts the oldest one of its address (beyond the per-address limit) or
    of all (silent ones first), so unauthenticated connections cannot keep a real peer out (module
    docstring). A failed or evicted handshake (silent, garbage, wrong key) is logged and counted in
    ``dropped`` and never reaches ``accept``.

    ``reuse_port``: bind with ``SO_REUSEPORT``, for a port that the launching process reserved by
    holding it bound (``launch.reserve_port``).
    """

    def __init__(self, address: str, authkey: bytes, *, handshake_timeout_s: float = 10.0,
                 first_bytes_timeout_s: float = 3.0, max_handshakes: int = 32, max_handshakes_per_host: int = 8,
                 reuse_port: bool = False, _evict: bool = True):
        host, port = parse_address(address)
        tls.server_context(bytes(authkey))  # fail here (key too short) rather than in a handshake
        self.authkey, self.handshake_timeout_s = bytes(authkey), float(handshake_timeout_s)
        self.first_bytes_timeout_s = min(float(first_bytes_timeout_s), self.handshake_timeout_s)
        self.max_handshakes = max(int(max_handshakes), 1)
        self.max_handshakes_per_host = max(min(int(max_handshakes_per_host), self.max_handshakes), 1)
        self._evict = bool(_evict)  # tests only: False refuses new connections when full (the first pass)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(256)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.address = sock.getsockname()[:2]
        self.dropped: list[str] = []  # why each dropped connection was dropped (newest last, capped)
        self._queue: queue.Queue = queue.Queue()
        self._pending: dict[int, _Unauthenticated] = {}  # in their handshake, by id()
        self._plock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"rpc-listen[{port}]", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                raw, addr = self._sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # EMFILE and the like: keep accepting
                continue
            u = _Unauthenticated(raw, addr)
            if not self._admit(u):
                self._drop(addr, "too many connections in their handshake")
                raw.close()
                continue
            threading.Thread(target=self._handshake, args=(u,), name="rpc-handshake", daemon=True).start()

    def _admit(self, u: _Unauthenticated) -> bool:
        """Make room for ``u`` (evict the oldest of its address beyond the per-address limit, else the
        oldest of all when full: silent ones first) and count it; False: refused (``_evict`` off)."""
        with self._plock:
            same = [p for p in self._pending.values() if p.addr[0] == u.addr[0]]
            victim, why = None, ""
            if len(same) >= self.max_handshakes_per_host:
                victim, why = same, (f"evicted: {len(same)} connections from {u.addr[0]} in their handshake (at most "
                                     f"{self.max_handshakes_per_host} per address)")
            elif len(self._pending) >= self.max_handshakes:
                victim, why = list(self._pending.values()), (f"evicted: {len(self._pending)} connections in their "
                                                             f"handshake (at most {self.max_handshakes})")
            if victim is not None:
                if not self._evict:
                    return False
                v = min(victim, key=lambda p: (p.spoke, p.t0))  # silent before spoken, oldest first
                del self._pending[id(v)]
                v.evicted = why + ("; it had sent nothing" if not v.spoke else "")
                try:
                    v.sock.shutdown(socket.SHUT_RDWR)  # its handshake thread wakes, drops and closes it
                except OSError:
                    pass
            self._pending[id(u)] = u
            return True

    def _still_pending(self, u: _Unauthenticated) -> bool:
        """Take ``u`` out of the evictable set (its handshake is done); False if it was evicted."""
        with self._plock:
            return self._pending.pop(id(u), None) is u

    def _handshake(self, u: _Unauthenticated) -> None:
        raw, addr = u.sock, u.addr
        conn = None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not select.select([raw], [], [], self.first_bytes_timeout_s)[0]:
                raise tls.HandshakeError(f"no TLS handshake in time: sent nothing within {self.first_bytes_timeout_s:g} s")
            u.spoke = True
            left = self.handshake_timeout_s - (time.monotonic() - u.t0)
            conn = tls.server_handshake(raw, self.authkey, max(left, 0.01), admit=lambda: self._still_pending(u))
        except Exception as e:  # noqa: BLE001 - any failure drops this connection only
            self._drop(addr, u.evicted or f"{type(e).__name__}: {e}")
            try:
                raw.close()
            except OSError:
                pass
            return
        finally:
            if conn is None:
                with self._plock:
                    if self._pending.get(id(u)) is u:
                        del self._pending[id(u)]
        if self._closed.is_set():
            conn.close()
        else:
            self._queue.put(conn)

    def in_handshake(self) -> dict[str, int]:
        """Connections in their handshake now, per source address."""
        with self._plock:
            out: dict[str, int] = {}
            for p in self._pending.values():
                out[p.addr[0]] = out.get(p.addr[0], 0) + 1
            return out

    def _drop(self, addr: Any, why: str) -> None:
        msg = f"dropped a connection from {addr[0]}:{addr[1]}: {why}"
        self.dropped = (self.dropped + [msg])[-100:]
        log.warning("rpc listener %s:%d: %s", self.address[0], self.address[1], msg)

    def accept(self, timeout: float, what: str) -> Connection:
        """The next authenticated connection; ``TimeoutError`` naming ``what`` after ``timeout``."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            extra = f" ({len(self.dropped)} connection(s) dropped: {self.dropped[-1]})" if self.dropped else ""
            raise TimeoutError(f"no {what} connected to {self.address[0]}:{self.address[1]} within {timeout:.0f} s"
                               f"{extra}") from None

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        except OSError:
            pass
        self._sock.close()
        with self._plock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            try:
                p.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        while True:
            try:
                self._queue.get_nowait().close()
            except queue.Empty:
                break


def listen(address: str, authkey: bytes, **kw: Any) -> Listener:
    return Listener(address, authkey, **kw)


def accept(listener: Listener, timeout: float, what: str) -> Connection:
    """The next authenticated connection of ``listener`` (``TimeoutError`` naming ``what``)."""
    return listener.accept(timeout, what)


def connect(address: str, authkey: bytes, timeout: float, what: str, *, _retry: bool = True) -> Connection:
    """Connect to ``address`` and authenticate, retrying until ``timeout``: refused connections (the
    peer may still be starting) and handshakes that the listener closed, reset or left silent (it
    may be busy with, or evicting, other connections; backoff 50 ms doubling to 1 s, jittered).
    Returns within ``timeout`` also when the server accepts and stays silent (``TimeoutError``);
    ``AuthenticationError`` at once when the server is not of this run (its certificate or alert
    says so). ``_retry=False`` (tests only): a closed handshake fails at once (the first pass)."""
    host, port = parse_address(address)
    tls.client_context(bytes(authkey))
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    backoff = 0.05
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except OSError as e:  # refused (not listening yet), unreachable, timed out
            last = e
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return tls.client_handshake(sock, bytes(authkey), deadline)
        except tls.HandshakeError as e:
            sock.close()
            last = e
            if time.monotonic() >= deadline:
                break
            if not (e.retryable and _retry):
                raise AuthenticationError(f"{what} at {address}: {e}") from None
            time.sleep(min(backoff * random.uniform(0.75, 1.25), max(deadline - time.monotonic(), 0)))
            backoff = min(backoff * 2, 1.0)
        except OSError as e:  # reset during the handshake (e.g. the listener closing): retry
            sock.close()
            last = e
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
      conn: an authenticated ``Connection`` (``connect`` / ``accept``).
      name: how errors name the peer (``"generator-0 (pid 1234 on node7)"``).
      handler: serves the peer's calls: ``handler(method, args, reply)``; it must return quickly
        (it runs on the reader thread) and call ``reply(ok, value)`` exactly once, now or later
        from any thread (slow work goes to a thread of the handler's choosing). None: this side
        serves nothing.
      heartbeat_s / heartbeat_timeout_s: ping the peer every ``heartbeat_s`` (0: never); a ping
        unanswered after ``heartbeat_timeout_s`` declares the peer lost (a hung or stopped process).
      on_lost: called once with the ``PeerLostError`` when the connection breaks.
      frame_timeout_s: a message that stops arriving in the middle for this long closes the
        connection (``MalformedMessageError``); None: ``heartbeat_timeout_s``.
      bulk_calls / bulk_replies: the methods whose calls / replies may carry bulk data (module
        docstring); every other message is capped at ``CONTROL_LIMIT``, heartbeats at ``PING_LIMIT``.
    """

    def __init__(self, conn: Connection, name: str, *, handler: Callable[[str, tuple, Callable], None] | None = None,
                 heartbeat_s: float = 0.0, heartbeat_timeout_s: float = 60.0,
                 on_lost: Callable[[BaseException], None] | None = None, frame_timeout_s: float | None = None,
                 bulk_calls: frozenset = BULK_CALLS, bulk_replies: frozenset = BULK_REPLIES):
        self.conn, self.name = conn, name
        self.frame_timeout_s = float(heartbeat_timeout_s if frame_timeout_s is None else frame_timeout_s)
        self.bulk_calls, self.bulk_replies = frozenset(bulk_calls), frozenset(bulk_replies)
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
            self._send(["call", cid, method, list(args)])
        except (PeerLostError, codec.EncodeError) as e:  # lost, or arguments the RPC does not send
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
    def _send(self, msg: list) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except codec.EncodeError:
            raise
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
                self._send(["reply", cid, bool(ok), value])
            except codec.EncodeError as e:  # a value the RPC does not send: the caller gets the error
                try:
                    self._send(["reply", cid, False, ["EncodeError", str(e), ""]])
                except (PeerLostError, codec.EncodeError):
                    pass
            except PeerLostError:
                pass  # the reader reports the loss

        return reply

    def _read_loop(self) -> None:
        while not self._closed.is_set():
            try:
                msg = self.conn.recv(caps=self._caps, stall_s=self.frame_timeout_s)
            except (tls.IntegrityError, tls.ProtocolError) as e:
                if self._closed.is_set():
                    return
                kind = TamperedMessageError if isinstance(e, tls.IntegrityError) else MalformedMessageError
                what = "message failed authentication" if kind is TamperedMessageError else "malformed message"
                self._drop(kind(f"{self.name}: {what}"
                                f" ({e}); connection closed"))
                return
            except (EOFError, OSError) as e:
                if not self._closed.is_set():
                    self._lost(PeerLostError(f"{self.name} closed the connection ({type(e).__name__}): the process "
                                             "exited, was killed or its host is unreachable"))
                return
            self.last_reply_t = time.monotonic()
            try:
                self._dispatch(msg)
            except _Malformed as e:
                self._drop(MalformedMessageError(f"{self.name}: malformed message ({e}); connection closed"))
                return

    def _caps(self, prefix: memoryview) -> tuple[int, int, str]:
        """The size limits of the message that starts with ``prefix`` (module docstring), from its
        kind and method (a reply: the method of the call it answers); before its arrays are read."""
        try:
            u = msgpack.Unpacker(raw=False, max_buffer_size=tls.PEEK)
            u.feed(prefix)
            if u.read_array_header() != 4:
                raise ValueError
            kind, cid = u.unpack(), u.unpack()
            method = u.unpack() if kind == "call" else None
        except Exception:  # noqa: BLE001 - not even the start of a call or reply
            raise tls.ProtocolError(f"not a call or reply: {bytes(prefix[:40])!r}") from None
        if kind == "reply" and type(cid) is int:
            with self._lock:
                method = self._pending.get(cid, ("?", None))[0]
            bulk = method in self.bulk_replies
        elif kind == "call" and type(method) is str:
            bulk = method in self.bulk_calls
        else:
            raise tls.ProtocolError(f"not a call or reply: {kind!r}, {type(cid).__name__} id")
        what = f"{kind} {method!r}"
        if method == "__ping__":
            return PING_LIMIT, 0, what
        return (tls.MAX_BODY, tls.MAX_MESSAGE, what) if bulk else (CONTROL_LIMIT, CONTROL_LIMIT, what)

    def _drop(self, err: PeerLostError) -> None:
        """Close the connection at once because of what the peer sent; report ``err``."""
        log.error("%s", err)
        try:
            self.conn.close()
        except OSError:
            pass
        self._lost(err)

    def _dispatch(self, msg: Any) -> None:
        if type(msg) is not list or not msg or msg[0] not in ("call", "reply") or len(msg) != 4 \
                or type(msg[1]) is not int:
            raise _Malformed(f"not a call or reply: {_short(msg)}")
        kind, cid = msg[0], msg[1]
        if kind == "reply":
            ok, value = msg[2], msg[3]
            if type(ok) is not bool:
                raise _Malformed(f"reply {cid}: ok is {type(ok).__name__}")
            if not ok and (type(value) not in (list, tuple) or len(value) != 3
                           or not all(type(v) is str for v in value)):
                raise _Malformed(f"reply {cid}: an error that is not [type, message, traceback]")
            with self._lock:
                entry = self._pending.pop(cid, None)
            if entry is None:
                return
            method, fut = entry
            if ok:
                fut.set_result(value)
            else:
                rtype, rmsg, rtb = value
                fut.set_exception(RemoteError(self.name, method, rtype, rmsg, rtb))
            return
        method, args = msg[2], msg[3]
        if type(method) is not str or type(args) is not list:
            raise _Malformed(f"call {cid}: method {type(method).__name__}, arguments {type(args).__name__}")
        reply = self._reply(cid)
        if method == "__ping__":
            reply(True, time.time())
        elif self.handler is None:
            reply(False, ("NotImplementedError", f"this side serves no calls ({method})", ""))
        else:
            try:
                self.handler(method, tuple(args), reply)
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


class _Malformed(Exception):
    pass


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."
