"""Cross-process weight transfer pieces, in one process (two transfer servers on one CPU client):
per-shard wire plan for every route, exact arrays after the pull, checksums, disk fallback."""
from __future__ import annotations

import datetime

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import transfer as jtransfer
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_async.distributed.transfer import (ChecksumMismatch, WireReceiver, WireSender, checksum_fn, layout_of,
                                              plan_transfer, read_weights, verify, wait_ready,
                                              write_weights)
from jaxrl_async.sharding.mesh import make_mesh


_SERVERS = []  # a server must outlive the pulls from it (in the real roles they live as long as the process)


def _server():
    srv = jtransfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    _SERVERS.append(srv)
    return srv


def _push(src_leaves, dst_shardings, keys):
    plans = plan_transfer(keys, [x.shape for x in src_leaves], str(src_leaves[0].dtype),
                          [layout_of(x.sharding, x.ndim) for x in src_leaves],
                          [layout_of(s, x.ndim) for s, x in zip(dst_shardings, src_leaves)])
    sender = WireSender(plans, [x.sharding for x in src_leaves])
    receiver = WireReceiver(plans, dst_shardings)
    trainer_srv, gen_srv = _server(), _server()
    wire = sender.prepare(src_leaves)
    trainer_srv.await_pull(7, sender.shards(wire))
    conn = gen_srv.connect(trainer_srv.address())
    out = receiver.pull(conn, 7, timeout_s=60)
    return plans, out


@pytest.mark.parametrize("n_trainer, n_gen, t_spec, g_spec, route", [
    (4, 4, P("fsdp", None), P("tensor", None), "direct"),
    (2, 4, P("fsdp", None), P(None, "tensor"), "via_generator"),
    (4, 2, P("fsdp", None), P(None, "tensor"), "via_trainer"),
    (4, 1, P("fsdp", None), P(), "via_trainer"),
])
def test_pull_lands_exact_arrays_on_the_target_sharding(n_trainer, n_gen, t_spec, g_spec, route):
    d = jax.devices()
    tm = make_mesh({"fsdp": n_trainer}, devices=d[8 - n_trainer:])
    gm = make_mesh({"data": 1, "tensor": n_gen}, devices=d[:n_gen])
    rng = np.random.default_rng(0)
    ref = [rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)]
    src = [jax.device_put(r, NamedSharding(tm, t_spec)).astype(jnp.bfloat16) for r in ref]
    dst = [NamedSharding(gm, g_spec)] * 2
    plans, out = _push(src, dst, ["['a']", "['b']"])
    assert {p.route for p in plans} == {route}
    for x, y, s in zip(src, out, dst):
        assert y.sharding == s and y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert checksum_fn(out) == checksum_fn(src)  # sharding-independent


def test_checksum_catches_a_changed_or_moved_element(tmp_path):
    tm = make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(tm, P("fsdp", None)))
    base = checksum_fn([x])
    assert checksum_fn([x.at[3, 3].add(1e-6)]) != base
    swapped = jnp.asarray(np.asarray(x)[[1, 0] + list(range(2, 8))])  # two rows swapped: same multiset
    assert checksum_fn([swapped]) != base
    with pytest.raises(ChecksumMismatch, match="version 5.*\\['w'\\]"):
        verify([x.at[0, 0].add(1.0)], base, ["['w']"], 5)
    # disk fallback round trip onto another sharding, checksum carried in the manifest
    key = b"k" * 32
    path = write_weights(str(tmp_path), 5, ["['w']"], [x.astype(jnp.bfloat16)], checksum_fn([x.astype(jnp.bfloat16)]),
                         key=key)
    gm = make_mesh({"tensor": 4}, devices=jax.devices()[4:])
    leaves, sums = read_weights(path, ["['w']"], [NamedSharding(gm, P(None, "tensor"))], key=key, version=5)
    assert verify(leaves, sums, ["['w']"], 5) == sums
    np.testing.assert_array_equal(np.asarray(leaves[0]), np.asarray(x.astype(jnp.bfloat16)))


def test_pull_of_an_unregistered_uuid_times_out():
    gm = make_mesh({"tensor": 2}, devices=jax.devices()[:2])
    trainer_srv, gen_srv = _server(), _server()
    conn = gen_srv.connect(trainer_srv.address())
    spec = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(gm, P()))
    pulled = conn.pull(99, [spec], timeout=datetime.datetime.now() + datetime.timedelta(seconds=1))
    with pytest.raises(TimeoutError, match="uuid 99 not complete after 2 s"):  # never registered: no hang
        wait_ready(pulled, 2.0, "pull of uuid 99")


def test_pull_with_a_wrong_id_fails_and_leaves_the_registered_pull_intact():
    from jaxrl_async.distributed.transfer import new_pull_id

    ids = [new_pull_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids) and max(ids) >= 2**60  # 64 random bits, not a counter
    assert sorted(ids) != ids and sum(b - a == 1 for a, b in zip(ids, ids[1:])) == 0
    d = jax.devices()
    trainer_srv, gen_srv = _server(), _server()
    x = jax.device_put(jnp.arange(8, dtype=jnp.float32), d[0])
    good = new_pull_id()
    trainer_srv.await_pull(good, [x])
    conn = gen_srv.connect(trainer_srv.address())
    spec = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(d[1]))
    wrong = conn.pull(good ^ 1, [spec], timeout=datetime.datetime.now() + datetime.timedelta(seconds=1))
    with pytest.raises(TimeoutError, match="not complete"):  # a guess one bit off gets nothing
        wait_ready(wrong, 1.5, "pull with a wrong id")
    got = conn.pull(good, [spec], timeout=datetime.datetime.now() + datetime.timedelta(seconds=30))
    wait_ready(got, 30, "the real pull")
    np.testing.assert_array_equal(np.asarray(got[0]), np.arange(8, dtype=np.float32))


def _fallback(tmp_path, key):
    tm = make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(tm, P("fsdp", None)))
    path = write_weights(str(tmp_path / "weight_push"), 3, ["['w']"], [x], checksum_fn([x]), key=key)
    return path, [NamedSharding(tm, P())]


def test_disk_fallback_files_are_private_and_macs_reject_tampering(tmp_path):
    import hashlib
    import hmac
    import json
    import os
    import stat

    from jaxrl_async.distributed.transfer import FallbackRejected, _manifest_mac, fallback_key

    key = fallback_key(b"r" * 32)
    path, shardings = _fallback(tmp_path, key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    files = sorted(os.listdir(path))
    assert files and all(stat.S_IMODE(os.stat(os.path.join(path, f)).st_mode) == 0o600 for f in files)
    leaves, _ = read_weights(path, ["['w']"], shardings, key=key, version=3)
    np.testing.assert_array_equal(np.asarray(leaves[0]), np.arange(64, dtype=np.float32).reshape(8, 8))
    with pytest.raises(FallbackRejected, match="MAC mismatch"):  # another run's key
        read_weights(path, ["['w']"], shardings, key=fallback_key(b"s" * 32), version=3)
    with pytest.raises(FallbackRejected, match="holds version 3, not 4"):  # an old directory replayed
        read_weights(path, ["['w']"], shardings, key=key, version=4)

    mpath = os.path.join(path, "manifest.json")
    manifest = json.loads(open(mpath).read())
    shard = os.path.join(path, manifest["leaves"][0]["shards"][0]["file"])
    orig = open(shard, "rb").read()
    # compensating edit: +d on one element, -d on another (passes the old linear checksum's structure)
    a = np.frombuffer(orig, np.uint32).copy()
    a[0] += 7
    a[1] -= 7
    open(shard, "wb").write(a.tobytes())
    with pytest.raises(FallbackRejected, match="MAC mismatch \\(the file was changed\\)"):
        read_weights(path, ["['w']"], shardings, key=key, version=3)
    open(shard, "wb").write(orig)

    def rewrite(m, sign=True):
        if sign:  # even with a valid MAC (the writer's own bug), a bad name is never opened
            m["mac"] = _manifest_mac(key, m)
        with open(mpath, "w") as f:
            json.dump(m, f)

    secret = tmp_path / "secret.bin"
    secret.write_bytes(orig)
    for name in ("../../../../etc/passwd", str(secret), "../secret.bin", "00000.0000.p0.bin/../../x"):
        m = json.loads(json.dumps(manifest))
        m["leaves"][0]["shards"][0]["file"] = name
        m["leaves"][0]["shards"][0]["mac"] = hmac.new(key, orig, hashlib.sha256).hexdigest()
        rewrite(m)
        with pytest.raises(FallbackRejected, match="shard file name"):
            read_weights(path, ["['w']"], shardings, key=key, version=3)
    m = json.loads(json.dumps(manifest))
    m["leaves"][0]["checksum"] += 1  # an unsigned change of the manifest
    rewrite(m, sign=False)
    with pytest.raises(FallbackRejected, match="manifest.json: MAC mismatch"):
        read_weights(path, ["['w']"], shardings, key=key, version=3)


# -- issue 27: the fallback's paths ---------------------------------------------------------------------
@pytest.mark.parametrize("protected", [True, False])
def test_disk_fallback_refuses_a_symlink_planted_at_weight_push(tmp_path, monkeypatch, protected):
    """Someone who can write the run directory plants ``RUN/weight_push -> a directory of theirs``
    (or of a victim) before the first fallback: the writer refuses it instead of chmod-ing the target
    and writing the weights into it. Control: the directory checks off (``_check_dir`` a no-op)."""
    import os
    import stat

    from jaxrl_async.distributed import transfer
    from jaxrl_async.distributed.transfer import FallbackRejected, fallback_key

    run, victim = tmp_path / "run", tmp_path / "victim"
    run.mkdir()
    victim.mkdir(mode=0o755)
    (victim / "keep").write_text("x")
    os.symlink(victim, run / "weight_push")
    if not protected:
        monkeypatch.setattr(transfer, "_check_dir", lambda *a, **k: None)
    x = jax.device_put(np.arange(8, dtype=np.float32), jax.devices()[0])
    key = fallback_key(b"r" * 32)
    if protected:
        with pytest.raises(FallbackRejected, match="symlink"):
            write_weights(str(run / "weight_push"), 5, ["['w']"], [x], checksum_fn([x]), key=key)
        assert sorted(os.listdir(victim)) == ["keep"] and stat.S_IMODE(os.stat(victim).st_mode) == 0o755
    else:
        write_weights(str(run / "weight_push"), 5, ["['w']"], [x], checksum_fn([x]), key=key)
        assert "v00000005" in os.listdir(victim)  # the attack: the weights went into the target


def test_disk_fallback_replaces_a_planted_version_symlink_and_the_reader_refuses_symlinks(tmp_path):
    import os

    from jaxrl_async.distributed.transfer import FallbackRejected, fallback_key, start_fallback

    key = fallback_key(b"r" * 32)
    home, victim = tmp_path / "weight_push", tmp_path / "victim"
    home.mkdir(mode=0o700)
    victim.mkdir()
    os.symlink(victim, home / "v00000003.tmp")  # where the next temporary directory will be
    tmp = start_fallback(str(home), 3)
    assert not os.path.islink(tmp) and os.path.isdir(tmp) and os.listdir(victim) == []
    os.rmdir(tmp)
    path, shardings = _fallback(tmp_path, key)
    link = tmp_path / "weight_push" / "v00000009"
    os.symlink(path, link)
    with pytest.raises(FallbackRejected, match="symlink"):
        read_weights(str(link), ["['w']"], shardings, key=key, version=3)
    if os.geteuid() == 0:  # a directory of someone else (root can chown; the first pass chmod-ed and used it)
        other = tmp_path / "other"
        other.mkdir()
        os.chown(other, 65534, 65534)
        with pytest.raises(FallbackRejected, match="belongs to uid 65534"):
            start_fallback(str(other), 1)


def test_deeply_nested_manifest_is_rejected_not_a_recursion_error(tmp_path):
    import json

    from jaxrl_async.distributed.transfer import FallbackRejected, fallback_key

    key = fallback_key(b"r" * 32)
    path, shardings = _fallback(tmp_path, key)
    deep = b'{"mac": "00", "leaves": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with open(f"{path}/manifest.json", "wb") as f:
        f.write(deep)
    with pytest.raises(FallbackRejected, match="not a manifest \\(nested 200001 deep"):
        read_weights(path, ["['w']"], shardings, key=key, version=3)
    with pytest.raises(RecursionError):  # control: what parsing it does (what read_weights raised before)
        json.loads(deep)
