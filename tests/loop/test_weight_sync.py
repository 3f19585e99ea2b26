"""WeightPusher: device-to-device, resharded, no host round trip (transfer guards), newest wins."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_async.sharding.mesh import make_mesh
from jaxrl_async.generator.weight_sync import WeightPusher, WeightPushError


class RecordingGenerator:
    def __init__(self):
        self.updates = []
        self.event = threading.Event()

    def update_params(self, params, version, wait=True, timeout=None):
        self.updates.append((params, version))
        self.event.set()


def _meshes():
    d = jax.devices()
    return make_mesh({"fsdp": 2, "tensor": 2}, devices=d[4:8]), make_mesh({"data": 1, "tensor": 4}, devices=d[:4])


def _params(trainer_mesh):
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.standard_normal((8, 12)).astype(np.float32), NamedSharding(trainer_mesh, P("fsdp", "tensor")))
    b = jax.device_put(rng.standard_normal((12,)).astype(np.float32), NamedSharding(trainer_mesh, P("tensor")))
    return {"w": w, "b": b}


def test_push_reshards_onto_generator_devices_without_host_round_trip():
    tm, gm = _meshes()
    params = _params(tm)
    target = {"w": NamedSharding(gm, P(None, "tensor")), "b": NamedSharding(gm, P())}
    gen, applied = RecordingGenerator(), []
    pusher = WeightPusher(gen, target, dtype=jnp.bfloat16, on_applied=applied.append, guard=True)
    try:
        pusher.push(params, 1)
        pusher.wait(1, timeout=60)
    finally:
        pusher.close()
    out, version = gen.updates[-1]
    assert version == 1 and applied == [1]
    assert out["w"].sharding == target["w"] and out["b"].sharding == target["b"]
    assert {dv.id for dv in out["w"].devices()} == {dv.id for dv in gm.devices.flat}
    assert out["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(params["w"].astype(jnp.bfloat16)))
    st = pusher.history[-1]
    assert st.bytes == (8 * 12 + 12) * 2 and st.total_s >= st.transfer_s >= 0


def test_guard_catches_the_host_path_of_a_naive_device_put():
    """jax.device_put from a tensor-sharded array to a replicated one on other devices gathers on the
    host; under the pusher's guard that raises, and the pusher's planned route does the same move."""
    from jaxrl_async.generator.weight_sync import transfer_guard

    tm, gm = _meshes()
    b = _params(tm)["b"]  # P("tensor") on the trainer mesh
    dst = NamedSharding(gm, P())
    with transfer_guard(True), pytest.raises(Exception, match="(?i)disallowed host-to-device"):
        jax.device_put(b, dst)
    gen = RecordingGenerator()
    pusher = WeightPusher(gen, {"b": dst}, guard=True)
    try:
        pusher.push({"b": b}, 1)
        pusher.wait(1, timeout=60)
    finally:
        pusher.close()
    np.testing.assert_array_equal(np.asarray(gen.updates[-1][0]["b"]), np.asarray(b))


@pytest.mark.parametrize("n_trainer, n_generator, route", [(2, 4, "via_generator"), (4, 2, "via_trainer"),
                                                             (4, 4, "direct")])
def test_routes_between_meshes_of_different_sizes(n_trainer, n_generator, route):
    d = jax.devices()
    tm = make_mesh({"fsdp": n_trainer}, devices=d[8 - n_trainer:])
    gm = make_mesh({"data": 1, "tensor": n_generator}, devices=d[:n_generator])
    x = jax.device_put(np.arange(8 * 8, dtype=np.float32).reshape(8, 8), NamedSharding(tm, P("fsdp", None)))
    target = {"x": NamedSharding(gm, P(None, "tensor") if route != "direct" else P("tensor", None))}
    gen = RecordingGenerator()
    pusher = WeightPusher(gen, target, guard=True)
    try:
        pusher.push({"x": x}, 1)
        pusher.wait(1, timeout=60)
    finally:
        pusher.close()
    assert dict(pusher.routes) == {route: 1}
    out = gen.updates[-1][0]["x"]
    assert out.sharding == target["x"]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


def test_colocated_push_copies_so_the_trainer_may_donate():
    tm, _ = _meshes()
    params = _params(tm)
    same = jax.tree.map(lambda x: x.sharding, params)
    gen = RecordingGenerator()
    pusher = WeightPusher(gen, same)
    try:
        pusher.push(params, 3)
        pusher.wait(3, timeout=60)
    finally:
        pusher.close()
    expected = np.asarray(params["w"])
    for x in jax.tree.leaves(params):
        x.delete()  # what the trainer's donated step does to its old buffers
    np.testing.assert_array_equal(np.asarray(gen.updates[-1][0]["w"]), expected)


def test_newest_push_wins_and_failures_surface():
    tm, gm = _meshes()
    params = _params(tm)
    target = jax.tree.map(lambda x: NamedSharding(gm, P()), params)
    block = threading.Event()

    class SlowGenerator(RecordingGenerator):
        def update_params(self, params, version, wait=True, timeout=None):
            block.wait(30)
            super().update_params(params, version)

    gen = SlowGenerator()
    pusher = WeightPusher(gen, target, initial_version=0)
    try:
        pusher.wait(0, timeout=1)  # the initial version is already there
        for v in (1, 2, 3, 4):
            pusher.push(params, v)
        block.set()
        pusher.wait(4, timeout=60)
        versions = [v for _, v in gen.updates]
        assert versions[-1] == 4 and versions == sorted(versions) and len(versions) < 4
        assert pusher.skipped_versions  # superseded before being applied
    finally:
        pusher.close()

    class BrokenGenerator(RecordingGenerator):
        def update_params(self, params, version, wait=True, timeout=None):
            raise RuntimeError("decode thread is gone")

    pusher = WeightPusher(BrokenGenerator(), target)
    try:
        pusher.push(params, 1)
        with pytest.raises(WeightPushError, match="decode thread is gone"):
            pusher.wait(1, timeout=30)
        with pytest.raises(WeightPushError):
            pusher.push(params, 2)
    finally:
        pusher.close()
