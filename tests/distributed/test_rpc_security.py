"""The RPC against a hostile network and hostile peers (issue 17, "RPC and transfer"), in one process:

* a relay on the path that flips a byte or injects bytes (a pickle that would create a file, or a
  forged TLS record) after the handshake: the receiving side drops the connection with
  ``TamperedMessageError`` naming the peer, and nothing is unpickled;
* a silent connection, a garbage one and a wrong-key one during startup: dropped by the listener
  (handshake timeout / TLS failure) while the real peer joins at once; the wrong-key client gets
  ``AuthenticationError``;
* ``connect`` against a server that accepts and stays silent returns within its timeout;
* an authenticated peer that sends a malformed message (a pickle, a msgpack value that is no call,
  an unknown type, a lying frame header) is closed at once with ``MalformedMessageError`` naming it;
* keys shorter than 16 bytes are refused; the codec round-trips the wire types and refuses others;
* a port reserved by ``launch.reserve_port`` cannot be bound by anyone else but the RPC listener.
"""
from __future__ import annotations

import os
import pickle
import secrets
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from jaxrl_async.distributed import codec, rpc

KEY = secrets.token_bytes(32)


class _MakesFile:
    """Unpickling this creates ``path`` (what an attacker's pickle would do, harmlessly)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pair(listener, key=KEY, name="client", server_handler=None, on_lost=None):
    """(client Peer, server Peer) over ``listener``; ``on_lost`` observes the server side."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", rpc.connect(
        "127.0.0.1:%d" % listener.address[1], key, 10, "the server")))
    t.start()
    sconn = listener.accept(10, "the client")
    t.join()
    server = rpc.Peer(sconn, name, handler=server_handler or (lambda m, a, reply: reply(True, a)), on_lost=on_lost)
    client = rpc.Peer(box["c"], "server")
    return client, server


class Relay:
    """A TCP relay (the man in the middle): forwards both ways; ``tamper(fn)`` rewrites the next
    client -> server chunk with ``fn(bytes) -> bytes``."""

    def __init__(self, target_port):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.target = target_port
        self._next = None
        self.tampered = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def tamper(self, fn):
        self._next = fn

    def _run(self):
        a, _ = self.sock.accept()
        b = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(a, b, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(b, a, False), daemon=True).start()

    def _pump(self, src, dst, to_server):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if to_server and self._next is not None:
                    data, self._next = self._next(data), None
                    self.tampered.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("attack", ["flip", "inject_pickle", "inject_tls_record"])
def test_relay_that_changes_bytes_after_the_handshake_is_dropped_and_runs_nothing(tmp_path, attack):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_MakesFile(str(marker)))
    tamper = {"flip": _flip,
              "inject_pickle": lambda d: struct.pack(">I", len(evil)) + evil + d,  # multiprocessing's old framing
              "inject_tls_record": lambda d: b"\x17\x03\x03" + struct.pack(">H", len(evil)) + evil + d}[attack]
    lst = rpc.listen("127.0.0.1:0", KEY)
    relay = Relay(lst.address[1])
    lost = []
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", rpc.connect(f"127.0.0.1:{relay.port}", KEY, 10, "srv")))
    t.start()
    server = rpc.Peer(lst.accept(10, "client"), "generator-7 (pid 1 on evil)",
                      handler=lambda m, a, reply: reply(True, a), on_lost=lost.append)
    t.join()
    client = rpc.Peer(box["c"], "controller")
    try:
        assert client.call("echo", 1, timeout=10) == (1,)  # the real traffic works through the relay
        relay.tamper(tamper)
        with pytest.raises(rpc.PeerLostError):
            client.call("echo", np.arange(1000), timeout=10)
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.tampered.is_set()
        assert lost and isinstance(lost[0], rpc.TamperedMessageError), lost
        assert "generator-7 (pid 1 on evil)" in str(lost[0]) and "connection closed" in str(lost[0])
        assert isinstance(server.error, rpc.TamperedMessageError)
        assert not marker.exists()  # nothing was unpickled
    finally:
        client.close()
        server.close()
        lst.close()


def test_silent_garbage_and_wrong_key_connections_do_not_stop_the_real_peer():
    lst = rpc.listen("127.0.0.1:0", KEY, handshake_timeout_s=2.0)
    port = lst.address[1]
    silent = socket.create_connection(("127.0.0.1", port))
    garbage = socket.create_connection(("127.0.0.1", port))
    garbage.sendall(os.urandom(4096))
    t0 = time.monotonic()
    with pytest.raises(rpc.AuthenticationError, match="different \\$JAXRL_RPC_AUTHKEY"):
        rpc.connect(f"127.0.0.1:{port}", secrets.token_bytes(32), 5, "the controller")
    assert time.monotonic() - t0 < 3
    try:
        t0 = time.monotonic()
        client, server = _pair(lst)
        joined_s = time.monotonic() - t0
        assert joined_s < 1.5, joined_s  # not behind the silent connection's handshake timeout
        assert client.call("echo", "hi", timeout=5) == ("hi",)
        deadline = time.monotonic() + 6
        while len(lst.dropped) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        why = "\n".join(lst.dropped)
        assert len(lst.dropped) == 3, why  # wrong key, garbage, silent (after its 2 s)
        assert "no TLS handshake in time" in why and "TLS handshake failed" in why
        client.close()
        server.close()
    finally:
        silent.close()
        garbage.close()
        lst.close()


def test_connect_returns_within_its_timeout_against_a_silent_server():
    srv = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) and never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="within 1 s"):
            rpc.connect("127.0.0.1:%d" % srv.getsockname()[1], KEY, 1.0, "the controller")
        assert time.monotonic() - t0 < 2.0
    finally:
        srv.close()


def _frame(body: bytes, bufs=()) -> bytes:
    return codec.HEADER.pack(len(body), len(bufs)) + b"".join(codec.BUFLEN.pack(len(b)) for b in bufs) + body + \
        b"".join(bufs)


@pytest.mark.parametrize("payload", ["pickle", "not_a_call", "unknown_type", "bad_arity", "lying_header"])
def test_malformed_message_from_an_authenticated_peer_closes_it_at_once_naming_it(tmp_path, payload):
    marker = tmp_path / "pwned"
    frames = {
        "pickle": _frame(pickle.dumps(("call", 1, "x", (_MakesFile(str(marker)),)))),
        "not_a_call": _frame(msgpack.packb({"hello": 1})),
        "unknown_type": _frame(msgpack.packb(["call", 1, "x", [[msgpack.ExtType(
            codec.EXT_DATACLASS, b"os:system"), {"command": "true"}]]])),
        "bad_arity": _frame(msgpack.packb(["reply", 1, False, ["only", "two"]])),
        "lying_header": codec.HEADER.pack(1 << 30, 0),
    }
    lst = rpc.listen("127.0.0.1:0", KEY)
    lost = []
    client, server = _pair(lst, name="generator-3 (pid 42 on node9)", on_lost=lost.append)
    try:
        assert client.call("echo", 1, timeout=5) == (1,)
        t0 = time.monotonic()
        with client.conn._send_lock:
            client.conn._write(frames[payload])  # an authenticated peer that writes what it likes
        while not lost and time.monotonic() - t0 < 5:
            time.sleep(0.005)
        assert lost, "the server did not notice"
        assert time.monotonic() - t0 < 1.0  # at once, not after a heartbeat timeout
        err = lost[0]
        assert isinstance(err, rpc.MalformedMessageError), err
        assert "generator-3 (pid 42 on node9)" in str(err) and "malformed message" in str(err)
        assert not server._reader.is_alive() or server._reader.join(2) is None and not server._reader.is_alive()
        with pytest.raises(rpc.PeerLostError):  # the peer sees its connection closed
            client.call("echo", 2, timeout=5)
        assert not marker.exists()
    finally:
        client.close()
        server.close()
        lst.close()


def test_short_or_missing_keys_are_refused(monkeypatch):
    monkeypatch.setenv("JAXRL_RPC_AUTHKEY", "ab")
    with pytest.raises(RuntimeError, match="at least 16 random bytes"):
        rpc.authkey_from_env()
    monkeypatch.setenv("JAXRL_RPC_AUTHKEY", "zz" * 16)
    with pytest.raises(RuntimeError, match="must be hex"):
        rpc.authkey_from_env()
    monkeypatch.setenv("JAXRL_RPC_AUTHKEY", secrets.token_hex(16))
    assert len(rpc.authkey_from_env()) == 16
    with pytest.raises(ValueError, match="at least 16"):
        rpc.listen("127.0.0.1:0", b"short")


def test_codec_round_trips_the_wire_types_and_refuses_others():
    from jaxrl_async.distributed.transfer import Layout, LeafPlan
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.orchestrator import RequestOutput, SampleOutput

    lay = Layout((("fsdp", 2),), (("fsdp",), None))
    msg = {"layout": lay, "plan": LeafPlan("['w']", (4, 2), "bfloat16", "direct", lay, lay, (((0, 2), (0, 2)),)),
           "sampling": SamplingParams(temperature=0.5, stop_token_ids=(1, 2)),
           "out": RequestOutput("r", [1, 2], [SampleOutput(0, [1, 2], [3], [-0.5], [4], "stop", None, 1.0, None, 2.0)],
                                {"k": (1, "a")}),
           (1, 2): {3, 4}, "tokens": np.arange(12, dtype=np.int32).reshape(3, 4),
           "logprobs": np.linspace(-1, 0, 5, dtype=np.float32), "empty": np.zeros((0, 3), np.int64),
           "scalar": np.float32(1.5), "big": 2**63 + 5, "blob": b"\x00\x01"}
    chunks = codec.encode(msg)
    body_len, nbuf = codec.frame_sizes(chunks[0][:codec.HEADER.size])
    assert nbuf == 3 and body_len == len(chunks[1])
    got = codec.decode(bytes(chunks[1]), [bytearray(c) for c in chunks[2:]])
    for k in ("tokens", "logprobs", "empty"):
        np.testing.assert_array_equal(got.pop(k), msg.pop(k))
    assert got == msg and type(got["scalar"]) is np.float32 and type(got["layout"].axes) is tuple
    with pytest.raises(codec.EncodeError, match="_thread.lock"):
        codec.encode({"s": threading.Lock()})
    with pytest.raises(codec.EncodeError, match="object"):
        codec.encode(np.array([None]))
    with pytest.raises(codec.DecodeError, match="not one the RPC decodes"):
        codec.decode(msgpack.packb([msgpack.ExtType(codec.EXT_DATACLASS, b"os:system"), {}]), [])
    with pytest.raises(codec.DecodeError, match="buffer of"):
        codec.decode(msgpack.packb([msgpack.ExtType(codec.EXT_ARRAY, b""), "<i4", [4], 0]), [bytearray(3)])
    with pytest.raises(codec.DecodeError, match="bad array header"):
        codec.decode(msgpack.packb([msgpack.ExtType(codec.EXT_ARRAY, b""), "|O", [1], 0]), [bytearray(8)])


def test_unsendable_value_fails_the_call_not_the_connection():
    lst = rpc.listen("127.0.0.1:0", KEY)
    client, server = _pair(lst, server_handler=lambda m, a, reply: reply(True, object() if m == "bad" else a))
    try:
        with pytest.raises(codec.EncodeError):
            client.call("echo", object(), timeout=5)
        with pytest.raises(rpc.RemoteError, match="EncodeError"):
            client.call("bad", timeout=5)
        assert client.call("echo", 3, timeout=5) == (3,)  # still connected
    finally:
        client.close()
        server.close()
        lst.close()


def test_reserved_port_is_held_against_others_but_shared_with_the_role_listener():
    from jaxrl_async.distributed.launch import reserve_port

    port = reserve_port()
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", port))
    lst = rpc.listen(f"127.0.0.1:{port}", KEY, reuse_port=True)
    try:
        client, server = _pair(lst)
        assert client.call("echo", 1, timeout=5) == (1,)
        client.close()
        server.close()
    finally:
        lst.close()


def test_coordinator_and_transfer_listeners_refuse_every_interface(monkeypatch):
    from jaxrl_async.distributed.controller import coordinator_bind_address
    from jaxrl_async.distributed.transfer import check_bind_host

    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert coordinator_bind_address("10.1.2.3:4567") == "10.1.2.3:4567"  # not jax's default [::]:4567
    assert coordinator_bind_address("node0:4567", "10.9.9.9:4567") == "10.9.9.9:4567"
    assert coordinator_bind_address("node0:4567", "10.9.9.9") == "10.9.9.9:4567"
    assert coordinator_bind_address("node0:4567", "[fd00::7]") == "[fd00::7]:4567"
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "127.0.0.1:99")
    assert coordinator_bind_address("node0:4567") == "127.0.0.1:99"
    for bad in ("0.0.0.0:1", "[::]:1"):
        with pytest.raises(ValueError, match="every interface"):
            coordinator_bind_address("node0:1", bad)
    assert check_bind_host("10.0.0.7") == "10.0.0.7"
    with pytest.raises(ValueError, match="every interface"):
        check_bind_host("0.0.0.0")


def test_large_and_pipelined_messages_arrive_intact():
    """Frames larger than a TLS record and than the read buffer, many arrays, many in flight."""
    from jaxrl_async.trainer.packing import TrainSequence

    lst = rpc.listen("127.0.0.1:0", KEY)
    client, server = _pair(lst)
    rng = np.random.default_rng(0)
    try:
        big = rng.standard_normal((3, 1 << 20)).astype(np.float32)  # 12 MiB
        batch = [TrainSequence(tokens=rng.integers(0, 1 << 17, 700, dtype=np.int32), loss_mask=np.ones(700, np.int8),
                            behaviour_logprobs=rng.standard_normal(700).astype(np.float32),
                            advantages=rng.standard_normal(700).astype(np.float32)) for _ in range(100)]
        (got_big,) = client.call("echo", big, timeout=30)
        np.testing.assert_array_equal(got_big, big)
        (got,) = client.call("echo", batch, timeout=30)
        assert len(got) == 100 and type(got[0]) is TrainSequence and got[0].versions is None
        for a, b in zip(got, batch):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.behaviour_logprobs, b.behaviour_logprobs)
        futs = [client.call_async("echo", np.full(k % 300, k, np.int32), [k] * (k % 7)) for k in range(3000)]
        for k, f in enumerate(futs):
            arr, lst_ = f.result(30)
            assert arr.shape == (k % 300,) and (arr == k).all() and lst_ == [k] * (k % 7)
    finally:
        client.close()
        server.close()
        lst.close()


def test_every_wire_type_resolves_to_its_class():
    """WIRE_TYPES names classes by module path: a module split must move the names with the classes."""
    from jaxrl_async.distributed.codec import WIRE_TYPES, _name, _resolve

    for name in WIRE_TYPES:
        cls = _resolve(name)
        assert _name(cls) == name, (name, _name(cls))
