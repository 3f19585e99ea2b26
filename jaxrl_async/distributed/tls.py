"""Mutual TLS for the RPC, keyed by the run's shared secret; message frames over it.

Credentials: the run's secret (``$JAXRL_RPC_AUTHKEY``, >= 16 random bytes) determines the run's CA
key (HKDF-SHA256 -> a P-256 scalar), so every process of the run derives the same CA without any
file to distribute. Each process makes its own CA certificate (the same name and key), a fresh
P-256 key and a leaf certificate signed by the CA key, all with the ``cryptography`` package. A TLS
1.3 handshake in which both sides must present a leaf of the run's CA (``CERT_REQUIRED`` both ways)
therefore proves that the peer knows the secret; every record afterwards is AEAD-protected
(AES-GCM / ChaCha20-Poly1305: OpenSSL through the standard library's ``ssl``), so a flipped,
injected, dropped or replayed byte fails the record's authentication and the connection is dropped
(``IntegrityError``). Host names are not checked: the identity that matters is "a process of this
run", and hosts are whatever the cluster assigns. The leaf certificate says nothing about the
process (a fixed common name, a fixed validity window, a random serial): a TLS 1.3 server sends its
certificate before it has verified the client's, so anyone who can reach a port reads it.

Frames are read incrementally (issue 27): a buffer starts at ``_GROW`` bytes and doubles as
bytes arrive, so what a frame header claims is never allocated before the bytes are there (memory
held <= about twice the bytes received), and a frame whose sender stops in the middle is given up
after ``stall_s`` without a byte. Sizes are capped per message type (``recv``'s ``caps``, decided
from the first ``PEEK`` bytes of the body, before any array bytes are read): the server's welcome
``WELCOME_MAX``; the RPC's own classes are in ``rpc`` (heartbeats, control calls, bulk data);
absolute caps ``MAX_BODY`` (msgpack part) and ``MAX_MESSAGE`` (body + arrays).

``Connection`` drives the TLS state machine over memory BIOs (``ssl.SSLObject``), with a lock around
it: the RPC reads on one thread and sends from several, and one OpenSSL object must not be used by
two threads at once (an ``SSLSocket`` would). The socket I/O itself happens outside that lock.
"""

from __future__ import annotations

import datetime
import functools
import os
import select
import socket
import ssl
import tempfile
import threading
import time
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from jaxrl_async.distributed import codec

ALPN = "jaxrl-rpc/1"
MIN_KEY_BYTES = 16
MAX_BODY = 256 << 20  # msgpack part of one message (absolute cap; rpc caps most messages far lower)
MAX_MESSAGE = 8 << 30  # body + array buffers of one message (absolute cap: bulk data, see rpc)
WELCOME_MAX = 4096  # the server's welcome frame (the first after the handshake)
PEEK = 4096  # body bytes read before a frame's caps are decided (holds the call/reply header)
_GROW = 1 << 20  # a large read starts with a buffer of this size and doubles it as bytes arrive
_EPOCH = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
_END = datetime.datetime(9999, 12, 31, tzinfo=datetime.timezone.utc)
LEAF_NAME = "jaxrl_async role"  # every leaf certificate's common name: no pid, host or time
_NEUTRAL_CERT = True  # tests only: False restores the old leaf (pid and host in the name, issue time)
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_CHUNK = 1 << 20  # plaintext written per TLS write call
_READ = 1 << 16  # decrypted per read call (a TLS record holds at most 16 KiB)
_RECV = 1 << 18  # socket bytes per recv
_SMALL = 1 << 16  # reads up to this size come out of the decrypted buffer, larger ones go straight to their own

__all__ = ["ALPN", "MIN_KEY_BYTES", "Connection", "IntegrityError", "ProtocolError", "HandshakeError",
           "server_context", "client_context", "server_handshake", "client_handshake", "derive_key"]


class IntegrityError(ConnectionError):
    """A TLS record failed authentication (bytes changed, injected or cut on the way)."""


class ProtocolError(ConnectionError):
    """An authenticated peer sent something that is not a well-formed message."""


class HandshakeError(ConnectionError):
    """The connection did not complete the run's mutual-TLS handshake (wrong key, silent, not TLS).

    ``retryable``: the other side closed, reset or went silent (a listener that evicted this
    connection to make room, or one still busy) rather than rejecting a certificate: ``rpc.connect``
    tries again within its timeout."""

    def __init__(self, msg: str, retryable: bool = False):
        super().__init__(msg)
        self.retryable = retryable


def derive_key(authkey: bytes, purpose: str, length: int = 32) -> bytes:
    """A key for ``purpose`` derived from the run's secret (HKDF-SHA256): the RPC CA, the disk fallback MAC."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"jaxrl_async run secret",
                info=purpose.encode()).derive(bytes(authkey))


@functools.lru_cache(maxsize=8)
def _credentials(authkey: bytes) -> tuple[bytes, bytes, bytes]:
    """(CA certificate PEM, leaf certificate PEM, leaf key PEM) of this process for ``authkey``."""
    scalar = int.from_bytes(derive_key(authkey, "rpc CA key v1", 48), "big") % (_P256_ORDER - 1) + 1
    ca_key = ec.derive_private_key(scalar, ec.SECP256R1())
    ca_pub = ca_key.public_key()
    ski = x509.SubjectKeyIdentifier.from_public_key(ca_pub)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jaxrl_async run CA " + ski.digest[:8].hex())])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_pub)
               .serial_number(int.from_bytes(ski.digest[:8], "big") | 1)
               .not_valid_before(_EPOCH).not_valid_after(_END)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(ski, critical=False)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    if _NEUTRAL_CERT:
        name, start, end = LEAF_NAME, _EPOCH, _END
    else:  # the first pass's leaf (tests only): what an unauthenticated peer used to learn
        now = datetime.datetime.now(datetime.timezone.utc)
        name = f"jaxrl_async role pid {os.getpid()} on {socket.gethostname()}"[:64]
        start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=3650)
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return (ca_cert.public_bytes(pem), leaf.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _context(authkey: bytes, server: bool) -> ssl.SSLContext:
    if len(authkey) < MIN_KEY_BYTES:
        raise ValueError(f"rpc: the run's secret has {len(authkey)} bytes; at least {MIN_KEY_BYTES} random bytes")
    ca, cert, key = _credentials(bytes(authkey))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=ca.decode())
    # load_cert_chain reads files only: a private directory, gone right after
    with tempfile.TemporaryDirectory(prefix="jaxrl_rpc_") as d:  # mode 0700
        path = os.path.join(d, "leaf.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(cert + key)
        ctx.load_cert_chain(path)
    ctx.set_alpn_protocols([ALPN])
    if server:
        ctx.num_tickets = 0  # no session tickets: nothing is written after the handshake but our frames
    return ctx


@functools.lru_cache(maxsize=8)
def server_context(authkey: bytes) -> ssl.SSLContext:
    return _context(authkey, True)


@functools.lru_cache(maxsize=8)
def client_context(authkey: bytes) -> ssl.SSLContext:
    return _context(authkey, False)


class Connection:
    """One mutually authenticated TLS connection carrying ``codec`` frames.

    ``send`` may be called from any thread; ``recv`` from one reader thread at a time. Errors:
    ``EOFError`` (the peer closed), ``OSError`` (socket), ``IntegrityError`` (a record failed
    authentication), ``ProtocolError`` (a malformed frame or message).
    """

    def __init__(self, sock: socket.socket, sslobj: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO):
        self.sock, self._ssl, self._in, self._out = sock, sslobj, incoming, outgoing
        self._ssl_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._rb, self._ro = bytearray(), 0  # decrypted bytes not yet consumed: _rb[_ro:]
        self._rawbuf = bytearray(_RECV)
        self._rawview = memoryview(self._rawbuf)
        self._closed = False
        self._preallocate = False  # tests only: allocate a frame's claimed size before its bytes (the first pass)
        try:
            self.peer_address = "%s:%d" % sock.getpeername()[:2]
        except OSError:
            self.peer_address = "?"

    # -- raw TLS -------------------------------------------------------------------------------
    def _flush(self) -> None:
        """Send what the TLS object has written (caller holds ``_send_lock``)."""
        with self._ssl_lock:
            data = self._out.read()
        if data:
            self.sock.sendall(data)

    def _pump(self, dest: memoryview | None, deadline: float | None) -> int:
        """Decrypt what has arrived: into ``dest`` (at most its size) or, None, into the buffer
        ``_rb``; when nothing is decrypted, wait for the socket (until ``deadline``) and feed it to
        the TLS object. Returns the bytes decrypted (> 0)."""
        while True:
            got = 0
            with self._ssl_lock:
                if self._in.pending or self._ssl.pending():
                    got = self._decrypt(dest)
                pending = self._out.pending
            if pending and self._send_lock.acquire(blocking=False):  # else the sender drains it after its write
                try:
                    self._flush()
                finally:
                    self._send_lock.release()
            if got:
                return got
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                    raise TimeoutError("no data from the peer in time")
            n = self.sock.recv_into(self._rawbuf)
            if not n:
                raise EOFError("the peer closed the connection")
            with self._ssl_lock:
                self._in.write(self._rawview[:n])

    def _decrypt(self, dest: memoryview | None) -> int:
        """(``_ssl_lock`` held) decrypt what the TLS object can: into ``dest`` or onto ``_rb``."""
        got = 0
        chunks = []
        try:
            if dest is not None:
                while got < len(dest) and (self._in.pending or self._ssl.pending()):
                    n = self._ssl.read(min(len(dest) - got, _CHUNK), dest[got:])
                    if not n:
                        break
                    got += n
            else:
                while self._in.pending or self._ssl.pending():
                    chunk = self._ssl.read(_READ)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            if not got:
                raise EOFError("the peer closed the TLS session") from None
        except ssl.SSLError as e:
            raise IntegrityError(f"TLS record rejected ({e.reason or e}): the bytes on the wire were changed, "
                                 "injected or cut") from None
        finally:
            if chunks:  # a new buffer: views of the old one (decoded arrays) stay valid
                self._rb = self._rb[self._ro:] + b"".join(chunks)
                self._ro = 0
        return got

    @staticmethod
    def _until(deadline: float | None, stall_s: float | None) -> float | None:
        if stall_s is None:
            return deadline
        t = time.monotonic() + stall_s
        return t if deadline is None else min(deadline, t)

    def _read_exact(self, n: int, deadline: float | None = None, stall_s: float | None = None,
                    check: Any = None, check_at: int = 0) -> memoryview:
        """The next ``n`` plaintext bytes (a writable buffer of their own when large), waiting at
        most ``stall_s`` for each piece and until ``deadline`` in all. ``check(first check_at
        bytes)`` runs once they are in, before more is read (it raises to refuse the frame).

        A large read does not allocate ``n`` at once (``n`` comes from the peer's frame header):
        its buffer starts at ``_GROW`` bytes and doubles when full, so it never holds much more than
        twice what has arrived (``_preallocate``: the first pass's behaviour, for tests)."""
        avail = len(self._rb) - self._ro
        if n <= _SMALL:
            while len(self._rb) - self._ro < n:
                self._pump(None, self._until(deadline, stall_s))
            out = memoryview(self._rb)[self._ro:self._ro + n]
            self._ro += n
            if check is not None:
                check(out[:check_at])
            return out
        have = min(avail, n)
        buf = bytearray(n if self._preallocate else max(have, min(n, _GROW)))
        buf[:have] = memoryview(self._rb)[self._ro:self._ro + have]
        self._ro += have
        while True:
            if check is not None and have >= check_at:
                check(memoryview(buf)[:check_at])
                check = None
            if have >= n:
                return memoryview(buf)
            if have == len(buf):
                buf += bytes(min(n, 2 * len(buf)) - len(buf))  # as bytes arrive: never the claimed size at once
            with memoryview(buf) as mv:
                have += self._pump(mv[have:], self._until(deadline, stall_s))

    # -- frames --------------------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Encode ``obj`` (``codec``) and send it as one frame."""
        chunks = codec.encode(obj)
        if sum(len(c) for c in chunks) <= _CHUNK:  # the common case: one write, one sendall
            data = b"".join(chunks)
            with self._send_lock:
                self._write(data)
            return
        small = bytearray()
        with self._send_lock:
            for c in chunks:
                if len(c) < 65536:
                    small += c
                    continue
                if small:
                    self._write(small)
                    small = bytearray()
                for i in range(0, len(c), _CHUNK):
                    self._write(memoryview(c)[i:i + _CHUNK])
            if small:
                self._write(small)

    def _write(self, data: Any) -> None:
        with self._ssl_lock:
            mv = memoryview(data)
            while mv.nbytes:
                n = self._ssl.write(mv)
                mv = mv[n:]
            out = self._out.read()
        self.sock.sendall(out)

    def recv(self, deadline: float | None = None, caps: Any = None, stall_s: float | None = None) -> Any:
        """The next message (blocking; ``deadline``: a ``time.monotonic()`` time for the whole frame).

        ``caps(first PEEK bytes of the body) -> (max body bytes, max array bytes, what)``: the
        limits of this kind of message (``ProtocolError`` naming ``what`` beyond them, before its
        arrays are read); None: the absolute caps. ``stall_s``: once a frame has begun, give up
        (``ProtocolError``) after this long without a byte (None: wait until ``deadline``)."""
        if self._ro and self._ro == len(self._rb):  # nothing buffered: start afresh (views of it are gone)
            self._rb, self._ro = bytearray(), 0
        if self._ro == len(self._rb):
            self._pump(None, deadline)  # between frames: an idle connection waits as long as it likes
        try:
            return self._recv_frame(deadline, caps, stall_s)
        except TimeoutError:
            if stall_s is None or (deadline is not None and time.monotonic() >= deadline):
                raise
            raise ProtocolError(f"the peer stopped sending in the middle of a frame (nothing for {stall_s:g} s)") from None

    def _recv_frame(self, deadline: float | None, caps: Any, stall_s: float | None) -> Any:
        body_len, nbuf = codec.frame_sizes(self._read_exact(codec.HEADER.size, deadline, stall_s))
        if body_len > MAX_BODY or nbuf > codec.MAX_BUFFERS:
            raise ProtocolError(f"frame header claims a {body_len}-byte body and {nbuf} buffers")
        lens = [n for (n,) in codec.BUFLEN.iter_unpack(self._read_exact(8 * nbuf, deadline, stall_s))] if nbuf else []
        arrays = sum(lens)
        total = body_len + arrays
        if total > MAX_MESSAGE:
            raise ProtocolError(f"frame header claims {total} bytes (at most {MAX_MESSAGE})")

        def check(prefix: memoryview) -> None:
            max_body, max_arrays, what = caps(prefix) if caps is not None else (MAX_BODY, MAX_MESSAGE, "a message")
            if body_len > max_body or arrays > max_arrays:
                raise ProtocolError(f"{what} of {body_len} + {arrays} bytes (body + arrays; at most {max_body} + "
                                    f"{max_arrays})")

        # body and buffers in one piece, the caps decided on the body's first bytes
        rest = self._read_exact(total, deadline, stall_s, check, min(body_len, PEEK))
        bufs, pos = [], body_len
        for n in lens:
            bufs.append(rest[pos:pos + n])
            pos += n
        try:
            return codec.decode(rest[:body_len], bufs)
        except codec.DecodeError as e:
            raise ProtocolError(str(e)) from None

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def local_host(self) -> str:
        """The IP of this end: the address the other end reaches this host by."""
        try:
            return self.sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"

    def close(self) -> None:
        """Close at once; a reader blocked in ``recv`` gets an error."""
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _handshake(sock: socket.socket, ctx: ssl.SSLContext, server: bool, deadline: float) -> Connection:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    sslobj = ctx.wrap_bio(incoming, outgoing, server_side=server)
    while True:
        try:
            sslobj.do_handshake()
            break
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLEOFError:
            raise HandshakeError("the other side closed the connection during the TLS handshake", True) from None
        except ssl.SSLError as e:
            data = outgoing.read()  # the alert, so that the other side learns why
            if data:
                try:
                    sock.sendall(data)
                except OSError:
                    pass
            raise HandshakeError(f"TLS handshake failed: {e.reason or e} (not a process of this run: a different "
                                 "$JAXRL_RPC_AUTHKEY, or not this protocol)") from None
        data = outgoing.read()
        if data:
            sock.sendall(data)
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise HandshakeError("no TLS handshake in time (a silent or stuck connection)", True)
        data = sock.recv(65536)
        if not data:
            raise HandshakeError("the other side closed the connection during the TLS handshake (a listener busy "
                                 "with other handshakes, or one that rejected this process's key)", True)
        incoming.write(data)
    data = outgoing.read()
    if data:
        sock.sendall(data)
    if sslobj.selected_alpn_protocol() != ALPN:
        raise HandshakeError(f"the peer does not speak {ALPN} (ALPN {sslobj.selected_alpn_protocol()!r})")
    return Connection(sock, sslobj, incoming, outgoing)


_WELCOME = {"rpc": ALPN, "welcome": True}


def server_handshake(sock: socket.socket, authkey: bytes, timeout: float, admit: Any = None) -> Connection:
    """TLS as the server on an accepted socket, then the welcome frame; ``HandshakeError`` within ``timeout``.
    ``admit()``: called after the TLS handshake, before the welcome; False drops the connection."""
    deadline = time.monotonic() + timeout
    sock.setblocking(True)
    sock.settimeout(max(timeout, 0.01))  # bounds a sendall to a peer that does not read
    conn = _handshake(sock, server_context(bytes(authkey)), True, deadline)
    if admit is not None and not admit():
        raise HandshakeError("evicted before its welcome")
    conn.send(_WELCOME)
    sock.settimeout(None)
    return conn


def client_handshake(sock: socket.socket, authkey: bytes, deadline: float) -> Connection:
    """TLS as the client, then wait for the server's welcome frame (TLS 1.3 tells a client that the
    server rejected its certificate only after the client's half of the handshake: the welcome says
    it was accepted)."""
    sock.settimeout(max(deadline - time.monotonic(), 0.01))
    conn = _handshake(sock, client_context(bytes(authkey)), False, deadline)
    try:
        hello = conn.recv(deadline, caps=lambda _: (WELCOME_MAX, 0, "the welcome"))
    except TimeoutError:
        raise HandshakeError("no welcome from the server in time (a silent server)", True) from None
    except IntegrityError as e:  # the server's alert: it rejected this process's certificate
        raise HandshakeError(f"the server rejected this process after the TLS handshake ({e}): a different "
                             "$JAXRL_RPC_AUTHKEY?") from None
    except (EOFError, OSError) as e:
        raise HandshakeError(f"the server closed the connection after the TLS handshake ({type(e).__name__}: {e}): a "
                             "listener busy with other handshakes, or one that rejected this process's key", True) from None
    if hello != _WELCOME:
        raise HandshakeError(f"unexpected first message from the server: {str(hello)[:80]!r}")
    sock.settimeout(None)
    return conn
