"""Checkpointer: save/restore round trips, mesh changes, corruption handling, kill -9 during a save,
encoding of loop state and trajectories, signal handling and non-finite step accounting."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_async.checkpoint import (
    HOST, CheckpointConfig, CheckpointCorruptError, CheckpointError, CheckpointIncompatibleError,
    CheckpointNotFoundError, Checkpointer, NonFiniteTracker, SignalHandler, TrainingDivergedError, TrainMeta,
    abstract_like, from_jsonable, pack_records, rng_from_json, rng_to_json, to_jsonable, unpack_records,
)
from jaxrl_async.models import ModelConfig, init_params, param_shapes
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import make_mesh
from jaxrl_async.testing import subprocess_xla_flags

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
OPT = optax.adamw(1e-3)


@jax.jit
def _adam_state(params):
    # Non-trivial mu/nu/count: one adam update with a gradient equal to the params.
    return OPT.update(params, OPT.init(params), params)[1]


def _state(step: int, mesh):
    """params + adamw state on `mesh` (trainer rules), with values that depend on `step`.
    (numpy init: compiling jax.random for every leaf takes seconds on a loaded CPU)"""
    rng = np.random.default_rng(step)
    host = jax.tree.map(lambda s: rng.normal(0.0, 0.5, s.shape).astype(s.dtype), param_shapes(CFG))
    params = jax.device_put(host, model_shardings(CFG, mesh, "trainer"))
    return params, _adam_state(params)


def _meta(step: int, **kw) -> TrainMeta:
    return TrainMeta(step=step, policy_version=step + 100, rng={"train": rng_to_json(jax.random.key(step))},
                     data_state={"next_index": 7 * step, "blob": bytes([step % 256, 0, 255])},
                     staleness={"accepted": 32 * step, "running": 3}, config={"lr": 1e-3, "eta": 2}, **kw)


def _trajs(step: int):
    return [{"prompt_ids": [1, 5, 9], "completion_ids": list(range(step, step + 6)),
             "logprobs": [-0.1 * i - 1e-17 for i in range(6)], "versions": [step - 1] * 3 + [step] * 3,
             "reward": 0.5 * step, "finish_reason": "stop", "group": ("g", step)},
            {"prompt_ids": [2], "completion_ids": [], "logprobs": [], "versions": [], "reward": float("nan"),
             "finish_reason": "length", "group": ("g", step)}]


def _assert_tree_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_trajs_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in w:
            wv = list(w[k]) if isinstance(w[k], tuple) else w[k]
            if isinstance(wv, float) and np.isnan(wv):
                assert np.isnan(g[k])
            else:
                assert g[k] == wv and type(g[k]) is type(wv), k


@pytest.fixture(scope="module")
def mesh4():
    return make_mesh({"fsdp": 4}, devices=jax.devices()[:4])


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Sample:
    ids: list
    score: float


def test_pack_records_round_trip_is_exact():
    big = 2**70
    recs = [{"ints": [3, -(2**62), 0], "floats": [0.1, 1e-300, -2.5], "mixed": [1, 2.0], "bools": [True, False],
             "huge": [big, 1], "empty": [], "tuple": (4, 5), "nd": np.arange(6, dtype=np.int16).reshape(2, 3),
             "npl": [np.float32(0.25), np.float32(1.5)], "s": "x", "none": None, "nested": {"k": [[1, 2], [3]]}},
            _Sample(ids=[7, 8], score=0.75)]
    skel, pools = pack_records(recs)
    # Spilled: ints (3), tuple (2), nested (2 + 1), _Sample.ids (2) -> 10 int64; floats (3) -> float64.
    assert pools["int64"].shape == (10,) and pools["float64"].shape == (3,)
    assert pools["int16"].tolist() == list(range(6)) and pools["float32"].tolist() == [0.25, 1.5]
    json.dumps(skel)  # the skeleton is plain JSON
    out = unpack_records(json.loads(json.dumps(skel)), pools)
    r = out[0]
    assert r["ints"] == [3, -(2**62), 0] and all(type(v) is int for v in r["ints"])
    assert r["floats"] == [0.1, 1e-300, -2.5]
    assert r["mixed"] == [1, 2.0] and type(r["mixed"][0]) is int and type(r["mixed"][1]) is float
    assert r["bools"] == [True, False] and type(r["bools"][0]) is bool
    assert r["huge"] == [big, 1] and r["empty"] == [] and r["tuple"] == [4, 5]
    assert r["nd"].dtype == np.int16 and r["nd"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert r["npl"] == [0.25, 1.5] and type(r["npl"][0]) is np.float32
    assert r["s"] == "x" and r["none"] is None and r["nested"] == {"k": [[1, 2], [3]]}
    assert out[1] == {"ids": [7, 8], "score": 0.75}


def test_to_jsonable_errors_name_the_path():
    with pytest.raises(TypeError, match=r"meta\.data_state\['a'\]\[1\]: dict keys must be str"):
        to_jsonable({"a": [0, {3: "x"}]}, "meta.data_state")
    with pytest.raises(TypeError, match=r"meta\.extra\['f'\]: cannot encode object"):
        to_jsonable({"f": object()}, "meta.extra")
    with pytest.raises(TypeError, match="typed PRNG key"):
        to_jsonable({"k": jax.random.key(0)}, "meta.rng")
    back = from_jsonable(json.loads(json.dumps(to_jsonable({"b": b"\x00\xff", "a": np.arange(3.0)}))))
    assert back["b"] == b"\x00\xff" and back["a"].dtype == np.float64 and back["a"].tolist() == [0.0, 1.0, 2.0]


def test_rng_round_trip_continues_the_same_stream():
    key = jax.random.key(42)
    k2 = rng_from_json(json.loads(json.dumps(rng_to_json(key))))
    np.testing.assert_array_equal(jax.random.uniform(key, (4,)), jax.random.uniform(k2, (4,)))
    raw = jax.random.PRNGKey(3)
    np.testing.assert_array_equal(rng_from_json(rng_to_json(raw)), raw)
    g = np.random.default_rng(5)
    g.random(3)
    g2 = rng_from_json(json.loads(json.dumps(rng_to_json(g))))
    np.testing.assert_array_equal(g.random(5), g2.random(5))
    r = random.Random(9)
    r.random()
    r2 = rng_from_json(json.loads(json.dumps(rng_to_json(r))))
    assert [r.random() for _ in range(3)] == [r2.random() for _ in range(3)]


# ---------------------------------------------------------------------------------------------
# Save / restore
# ---------------------------------------------------------------------------------------------
def test_save_restore_round_trip_keep_last_and_manifest(tmp_path, mesh4):
    run = str(tmp_path / "run")
    states = {}
    with Checkpointer(run, CheckpointConfig(keep_last=2), model_config=CFG) as ck:
        assert ck.latest_committed_step() is None
        for step in (10, 20, 30):
            states[step] = _state(step, mesh4)
            stats = ck.save({"params": states[step][0], "opt_state": states[step][1]}, _meta(step),
                            trajectories=_trajs(step))
            assert stats.step == step and stats.blocking_s >= 0
        ck.wait()
        assert ck.last_save.total_s is not None and ck.last_save.total_s >= ck.last_save.blocking_s
        assert ck.last_save.bytes == 3 * sum(x.size * 4 for x in jax.tree.leaves(states[30][0])) + 4  # params, mu, nu, count
        assert ck.all_steps() == [20, 30]
        with pytest.raises(CheckpointError, match="cannot save step 25: committed step 30 is not older"):
            ck.save({"params": states[30][0]}, _meta(25))
    manifest = json.load(open(os.path.join(run, "checkpoints", "30", "jaxrl_manifest.json")))
    assert manifest["step"] == 30 and any(f.startswith("params/") for f in manifest["files"])
    assert not glob.glob(os.path.join(run, "checkpoints", "*tmp*"))

    ck = Checkpointer(run, model_config=CFG)
    params, opt_state = states[30]
    r = ck.restore(targets={"params": abstract_like(params), "opt_state": abstract_like(opt_state)})
    assert r.step == 30 and r.skipped == () and r.model_config == CFG
    _assert_tree_equal(r.arrays["params"], params)
    _assert_tree_equal(r.arrays["opt_state"], opt_state)
    assert jax.tree.structure(r.arrays["opt_state"]) == jax.tree.structure(opt_state)
    m = r.meta
    assert (m.step, m.policy_version) == (30, 130)
    assert m.data_state == {"next_index": 210, "blob": bytes([30, 0, 255])}
    assert m.staleness == {"accepted": 960, "running": 3} and m.config == {"lr": 1e-3, "eta": 2}
    np.testing.assert_array_equal(jax.random.key_data(rng_from_json(m.rng["train"])),
                                  jax.random.key_data(jax.random.key(30)))
    _assert_trajs_equal(r.trajectories, _trajs(30))
    # Older step, host restore (no target): same values, numpy-compatible leaves on the CPU device.
    r20 = ck.restore(20, targets={"params": HOST}, items=["params"], restore_trajectories=False)
    _assert_tree_equal(r20.arrays["params"], states[20][0])
    assert {d for x in jax.tree.leaves(r20.arrays["params"]) for d in x.sharding.device_set} == {
        jax.local_devices(backend="cpu")[0]}
    assert r20.trajectories is None and set(r20.arrays) == {"params"}
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint at step 10"):
        ck.restore(10)
    ck.close()


def test_should_save_by_steps_and_seconds(tmp_path):
    ck = Checkpointer(str(tmp_path / "r"), CheckpointConfig(every_steps=5, every_seconds=100.0))
    # an exactly representable origin: with the real clock (large uptimes) (t0 + 200) - (t0 + 100) can be 99.99999999999
    t0 = ck._last_save_time = 1024.0
    assert [s for s in range(1, 12) if ck.should_save(s, now=t0 + 1)] == [5, 10]
    assert ck.should_save(7, now=t0 + 100.0) and not ck.should_save(7, now=t0 + 99.9)
    x = {"w": jnp.arange(3.0)}
    ck.save({"params": x}, TrainMeta(7, 7), now=t0 + 100.0)
    assert not ck.should_save(7, now=t0 + 1e6)  # already saved
    assert not ck.should_save(8, now=t0 + 150.0) and ck.should_save(8, now=t0 + 200.0)  # clock reset at the save
    assert ck.should_save(10, now=t0 + 101.0)
    ck.close()
    with pytest.raises(ValueError, match="CheckpointConfig.keep_last"):
        CheckpointConfig(keep_last=0)


@pytest.mark.parametrize("new_mesh", [{"fsdp": 4, "tensor": 2}, {"fsdp": 8}])
def test_restore_onto_a_different_mesh(tmp_path, mesh4, new_mesh):
    run = str(tmp_path / "run")
    params, opt_state = _state(3, mesh4)
    assert len(jax.tree.leaves(params)[0].sharding.device_set) == 4
    with Checkpointer(run, model_config=CFG) as ck:
        ck.save({"params": params, "opt_state": opt_state}, _meta(3))
    mesh8 = make_mesh(new_mesh)
    target_p = abstract_like(params, model_shardings(CFG, mesh8, "trainer"))
    target_o = abstract_like(jax.jit(OPT.init)(jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), target_p)))
    r = Checkpointer(run).restore(targets={"params": target_p, "opt_state": target_o})
    _assert_tree_equal(r.arrays["params"], params)
    _assert_tree_equal(r.arrays["opt_state"], opt_state)
    for got, want in zip(jax.tree.leaves(r.arrays["params"]), jax.tree.leaves(target_p)):
        assert got.sharding == want.sharding and len(got.sharding.device_set) == 8
    q = r.arrays["params"]["layers"]["q"]  # [L, D, H, E]: embed over fsdp, heads over tensor
    assert q.sharding.spec == (jax.sharding.PartitionSpec(None, "fsdp", "tensor", None) if "tensor" in new_mesh
                               else jax.sharding.PartitionSpec(None, "fsdp", None, None))
    for got, want in zip(jax.tree.leaves(r.arrays["opt_state"]), jax.tree.leaves(target_o)):
        assert got.sharding == want.sharding


# ---------------------------------------------------------------------------------------------
# Corrupt / incompatible checkpoints
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def two_steps(tmp_path, mesh4):
    run = str(tmp_path / "run")
    states = {s: _state(s, mesh4) for s in (1, 2)}
    with Checkpointer(run, model_config=CFG) as ck:
        for s in (1, 2):
            ck.save({"params": states[s][0], "opt_state": states[s][1]}, _meta(s), trajectories=_trajs(s))
    return run, states


def _targets(states, s):
    return {"params": abstract_like(states[s][0]), "opt_state": abstract_like(states[s][1])}


def _largest_data_file(run, step, item):
    files = [f for f in glob.glob(os.path.join(run, "checkpoints", str(step), item, "**", "d", "*"), recursive=True)]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_array_file_is_reported_and_fallback_uses_previous(two_steps, damage):
    run, states = two_steps
    f = _largest_data_file(run, 2, "params")
    rel = os.path.relpath(f, os.path.join(run, "checkpoints", "2"))
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
        pattern = "truncated"
    else:
        os.remove(f)
        pattern = "missing"
    ck = Checkpointer(run)
    with pytest.raises(CheckpointCorruptError) as ei:
        ck.restore(targets=_targets(states, 2))
    msg = str(ei.value)
    assert os.path.join(run, "checkpoints", "2") in msg and rel in msg and pattern in msg and "step 2" in msg
    r = ck.restore(targets=_targets(states, 1), fallback=True)
    assert r.step == 1 and [s for s, _ in r.skipped] == [2] and rel in r.skipped[0][1]
    _assert_tree_equal(r.arrays["params"], states[1][0])
    # The skipped step was moved aside: step 2 can be saved again by the resumed run.
    assert ck.all_steps() == [1] and len(glob.glob(os.path.join(run, "quarantine", "2-*"))) == 1
    assert ck.last_saved_step == 1  # so should_save(2) / a final save of step 2 are not refused as "not new"
    ck.save({"params": states[2][0]}, _meta(2))
    ck.close()


def test_damaged_file_without_manifest_still_reports_step_and_item(two_steps):
    run, states = two_steps
    os.remove(os.path.join(run, "checkpoints", "2", "jaxrl_manifest.json"))
    f = _largest_data_file(run, 2, "opt_state")
    os.remove(f)
    with pytest.raises(CheckpointCorruptError, match=r"checkpoints/2: reading arrays of step 2 failed"):
        Checkpointer(run).restore(targets=_targets(states, 2))


def test_garbled_metadata(two_steps):
    run, states = two_steps
    meta_dir = os.path.join(run, "checkpoints", "2", "meta")
    (meta_file,) = [os.path.join(meta_dir, f) for f in os.listdir(meta_dir) if f != "commit_success.txt"]
    size = os.path.getsize(meta_file)
    with open(meta_file, "w") as fh:  # same size: the manifest cannot tell, the JSON parser can
        fh.write(("{garbage" + " " * size)[:size])
    ck = Checkpointer(run)
    with pytest.raises(CheckpointCorruptError, match=r"checkpoints/2/meta: checkpoint step 2 has unreadable metadata"):
        ck.restore(targets=_targets(states, 2))
    assert ck.restore(targets=_targets(states, 1), fallback=True, items=["params", "opt_state"]).step == 1


def test_incompatible_tree_and_shapes(two_steps, mesh4):
    run, states = two_steps
    ck = Checkpointer(run, read_only=True)
    params = abstract_like(states[2][0])
    wrong_tree = dict(params, extra=jax.ShapeDtypeStruct((2,), jnp.float32))
    del wrong_tree["final_norm"]
    with pytest.raises(CheckpointIncompatibleError) as ei:
        ck.restore(targets={"params": wrong_tree}, items=["params"])
    msg = str(ei.value)
    assert "checkpoints/2/params" in msg and "not in checkpoint (1): extra" in msg
    assert "in checkpoint but not requested (1): final_norm" in msg
    bigger = CFG.replace(hidden_size=48)
    target = abstract_like(jax.eval_shape(lambda: init_params(bigger, jax.random.key(0))),
                           model_shardings(bigger, mesh4, "trainer"))
    with pytest.raises(CheckpointIncompatibleError, match=r"embed: saved \(64, 32\) float32, requested \(64, 48\) float32"):
        ck.restore(targets={"params": target}, items=["params"])
    # fallback tries step 1 too (same shapes -> also incompatible): the error lists both steps.
    with pytest.raises(CheckpointCorruptError, match=r"no usable checkpoint among steps \[2, 1\].*step 2: .*step 1: "):
        ck.restore(targets={"params": target}, items=["params"], fallback=True)
    assert ck.all_steps() == [1, 2]  # read-only: nothing moved
    with pytest.raises(CheckpointIncompatibleError, match=r"no array item\(s\) \['ema'\]"):
        ck.restore(items=["ema"])


# ---------------------------------------------------------------------------------------------
# kill -9 in the middle of saves
# ---------------------------------------------------------------------------------------------
_SAVER = textwrap.dedent("""
    import itertools, os, sys
    import jax, numpy as np
    from jaxrl_async.checkpoint import Checkpointer, CheckpointConfig, TrainMeta
    N = int(sys.argv[2])
    ck = Checkpointer(sys.argv[1], CheckpointConfig(keep_last=2))
    start = (ck.latest_committed_step() or 0) + 1
    for step in itertools.count(start):
        w = jax.device_put(np.arange(N, dtype=np.float32) + step)
        ck.save({"params": {"w": w, "b": np.full((3,), step, np.int64)}}, TrainMeta(step, step, extra={"n": N}),
                trajectories=[{"tokens": list(range(step))}])
        print(step, flush=True)
""")


def _check_committed_state(run, n):
    ck = Checkpointer(run, read_only=True)
    latest = ck.latest_committed_step()
    assert latest is not None
    for s in ck.all_steps():
        r = ck.restore(s)
        w, b = np.asarray(r.arrays["params"]["w"]), np.asarray(r.arrays["params"]["b"])
        np.testing.assert_array_equal(w, np.arange(n, dtype=np.float32) + s)
        np.testing.assert_array_equal(b, np.full((3,), s, np.int64))
        assert r.meta.step == s and r.meta.extra == {"n": n} and r.trajectories == [{"tokens": list(range(s))}]
    return latest


def test_sigkill_during_save_leaves_the_previous_checkpoint_usable(tmp_path):
    run, n = str(tmp_path / "run"), 2_000_000  # 8 MB of float32 per save
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags(1), JAX_PLATFORMS="cpu")
    rng = random.Random(0)
    ckdir = os.path.join(run, "checkpoints")
    mid_write, latest_seen = 0, 0
    for rep in range(4):
        proc = subprocess.Popen([sys.executable, str(script), run, str(n)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        try:
            first = int(proc.stdout.readline())  # first save of this process launched
            assert first == latest_seen + 1 or rep == 0, (first, latest_seen)
            proc.stdout.readline()  # second launched => the first is committed
            if rep % 2 == 0:  # a random instant of the save loop (copy, write, rename, deletion of old steps)
                time.sleep(rng.uniform(0.0, 0.3))
            else:  # shortly after a write has started
                deadline = time.monotonic() + 30
                while not glob.glob(os.path.join(ckdir, "*.orbax-checkpoint-tmp*")):
                    assert time.monotonic() < deadline, "no save in progress seen"
                    time.sleep(0.001)
                time.sleep(rng.uniform(0.0, 0.03))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        mid_write += bool(glob.glob(os.path.join(ckdir, "*.orbax-checkpoint-tmp*")))
        latest = _check_committed_state(run, n)
        assert latest >= max(first, latest_seen)
        latest_seen = latest
    print(f"kills during a write: {mid_write}/4, latest committed step {latest_seen}")
    assert mid_write >= 1, "no kill landed during a write"
    Checkpointer(run).close()  # a writable start removes the leftovers of killed saves
    assert not glob.glob(os.path.join(ckdir, "*.orbax-checkpoint-tmp*"))


# ---------------------------------------------------------------------------------------------
# Signals and non-finite steps
# ---------------------------------------------------------------------------------------------
def _wait_for(pred, timeout=2.0):
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.005)
    return pred()


def test_signal_handler_sets_flag_forces_exit_on_second_and_restores_handlers():
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old_term = signal.signal(signal.SIGTERM, previous)
    old_int = signal.getsignal(signal.SIGINT)
    exits = []
    try:
        with SignalHandler(force_exit=exits.append) as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)
            assert _wait_for(lambda: stop.requested)
            assert stop.signal_name == "SIGTERM" and "SIGTERM" in stop.message and exits == []
            os.kill(os.getpid(), signal.SIGINT)
            assert _wait_for(lambda: exits == [128 + signal.SIGINT])
            assert stop.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is previous and signal.getsignal(signal.SIGINT) is old_int
        os.kill(os.getpid(), signal.SIGTERM)  # the previous handler is live again
        assert _wait_for(lambda: seen == [signal.SIGTERM]) and not seen[1:]
    finally:
        signal.signal(signal.SIGTERM, old_term)


def test_signal_is_noticed_while_the_main_thread_is_busy_in_native_code():
    """A Python-level handler waits for the main thread to leave native code (an XLA compile, a BLAS
    call); the watcher thread of the wakeup pipe sets the flag (and prints the line) at once."""
    n, rng = 512, np.random.default_rng(0)
    while True:  # one matrix product of >= 0.3 s on this machine: one native call, no bytecode in between
        x = rng.standard_normal((n, n))
        t0 = time.monotonic()
        x @ x
        if time.monotonic() - t0 >= 0.3 or n >= 8192:
            break
        n *= 2
    seen: dict[str, float] = {}
    with SignalHandler(force_exit=lambda code: None) as stop:
        waiter = threading.Thread(target=lambda: (stop.wait(30), seen.setdefault("flag", time.monotonic())))
        waiter.start()
        threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        x @ x  # numpy releases the GIL in BLAS
        t_end = time.monotonic()
        waiter.join(30)
    assert stop.requested and stop.signal_name == "SIGTERM"
    assert seen["flag"] < t_end, (seen["flag"] - t0, t_end - t0)


def test_handle_signals_installs_a_handler_for_the_whole_command_and_prints_a_stop(capsys):
    from jaxrl_async.checkpoint import StopRequested, handle_signals

    old = signal.getsignal(signal.SIGINT)
    calls = []

    @handle_signals
    def command(arg):
        h = SignalHandler.active()
        calls.append((arg, h is not None, signal.getsignal(signal.SIGINT) == h._handle))
        if arg == "stop":
            raise StopRequested("stopped by SIGINT during the test: nothing saved; run the same command again")
        return 3

    assert SignalHandler.active() is None
    assert command("go") == 3 and command("stop") == 0
    assert calls == [("go", True, True), ("stop", True, True)]
    assert SignalHandler.active() is None and signal.getsignal(signal.SIGINT) is old
    assert capsys.readouterr().err == ("[jaxrl_async] stopped by SIGINT during the test: nothing saved; run the same "
                                       "command again\n")


def test_remains_of_an_interrupted_deletion_are_removed_at_start(tmp_path):
    """A kill while keep_last deletes an old step can leave its directory without commit_success.txt; the
    next Checkpointer removes it (Orbax would warn about it on every listing), committed steps stay."""
    tree = {"w": np.arange(4, dtype=np.float32)}
    with Checkpointer(str(tmp_path), CheckpointConfig(keep_last=3)) as ck:
        for step in (1, 2, 3):
            ck.save({"params": tree}, TrainMeta(step=step, policy_version=step))
    os.remove(os.path.join(tmp_path, "checkpoints", "1", "commit_success.txt"))
    ck = Checkpointer(str(tmp_path), CheckpointConfig(keep_last=3))
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints", "1")) and ck.all_steps() == [2, 3]
    ck.close()


def test_non_finite_tracker_counts_and_raises_after_consecutive():
    t = NonFiniteTracker(max_consecutive=3)
    # finite, nan, finite (resets), inf, nan, then a third consecutive bad step raises.
    assert t.update(0, loss=1.0, grad_norm=2.0)
    assert not t.update(1, loss=float("nan"), grad_norm=1.0)
    assert t.update(2, loss=0.5, grad_norm=np.float32(3.0)) and t.consecutive == 0
    assert not t.update(3, loss=1.0, grad_norm=float("inf"))
    assert not t.update(4, loss=jnp.float32(jnp.nan), grad_norm=1.0)
    assert (t.consecutive, t.total_skipped, t.first_bad_step) == (2, 3, 3)
    state = t.state_dict()
    with pytest.raises(TrainingDivergedError, match=r"3 consecutive non-finite steps \(3\.\.5; last: loss=nan\)"):
        t.update(5, loss=float("nan"), grad_norm=1.0)
    t2 = NonFiniteTracker(max_consecutive=3)
    t2.load_state_dict(json.loads(json.dumps(state)))
    assert (t2.consecutive, t2.total_skipped, t2.first_bad_step) == (2, 3, 3)
    with pytest.raises(ValueError, match="max_consecutive"):
        NonFiniteTracker(max_consecutive=0)
