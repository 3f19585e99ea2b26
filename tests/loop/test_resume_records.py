"""The records a resume relies on, without running the loop: checkpointed finished groups (bit-exact
round trip through an Orbax checkpoint), their return into the staleness buffer (reused while their
lag stays within eta, refused beyond: AReaL issue #1388), and the data ledger's event log (resume
markers, shutdown aborts, partial last lines of a killed writer)."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer, TrainMeta
from jaxrl_async.data.ledger import LEDGER_LOG, DataLedger, read_data_ledger, repair_jsonl_tail
from jaxrl_async.loop.state import group_from_record, group_record, restore_buffered_groups
from jaxrl_async.rollout.staleness import StalenessManager, StalenessViolation
from jaxrl_async.rollout.workflow import Trajectory, TrajectoryGroup


class _T:
    def __init__(self, i):
        self.id = i


def _group(draw: int, head: int, n: int = 3) -> TrajectoryGroup:
    rng = np.random.default_rng(draw)
    trajs = []
    for i in range(n):
        c = 2 + i
        trajs.append(Trajectory.from_completion(
            [1, 5, 9, draw], rng.integers(3, 60, c).tolist(), (rng.normal(size=c) * 3).astype(np.float32).tolist(),
            [head] * c, reward=float(i % 2), finish_reason="stop", sample_index=i, item_id=f"d{draw}",
            completion_text="7 \u2260 8", latency_s=None, odd=object()))
    return TrajectoryGroup({"id": f"d{draw}"}, trajs, group_id=draw, metadata={"dropped_episodes": 0})


def test_group_records_round_trip_bit_exactly_through_a_checkpoint(tmp_path):
    sm = StalenessManager(2, 2, version=0)
    for d in range(3):
        t = sm.acquire(timeout=1)
        sm.accept(t, _group(d, head=0), head_version=0)
    snap = sm.buffered_groups()
    assert [g.ticket.id for g in snap] == [0, 1, 2] and sm.counts().buffered == 3  # a snapshot, not removed
    records = [group_record(g, draw=10 + g.ticket.id) for g in snap]
    with Checkpointer(str(tmp_path), CheckpointConfig()) as ck:
        ck.save({"params": {"w": np.ones(3, np.float32)}}, TrainMeta(step=1, policy_version=1), trajectories=records)
    r = Checkpointer(str(tmp_path), read_only=True).restore(items=[])
    assert len(r.trajectories) == 3
    for g, rec in zip(snap, r.trajectories):
        assert (rec["draw"], rec["admit_version"], rec["head_version"]) == (10 + g.ticket.id, 0, 0)
        back = group_from_record(rec, g.item.item)
        for a, b in zip(g.item.trajectories, back.trajectories):
            for f in ("tokens", "loss_mask", "logprobs", "versions"):
                x, y = getattr(a, f), getattr(b, f)
                assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), f
            assert (a.reward, a.prompt_len, a.finish_reason) == (b.reward, b.prompt_len, b.finish_reason)
            assert b.metadata["completion_text"] == "7 \u2260 8"
            assert b.metadata["odd"].startswith("<object object")  # not storable: kept as its repr
        assert back.head_version == 0 and back.group_id == g.item.group_id


def test_restore_buffered_keeps_deadline_order_and_refuses_lag_beyond_eta():
    eta, B = 2, 2
    sm = StalenessManager(eta, B, version=5)  # resumed at version 5: accepted = 5 * B
    assert sm.capacity() == (eta + 1) * B
    t_old = sm.restore_buffered("g3", admit_version=3, head_version=3)  # lag 2 == eta: reusable
    t_new = sm.restore_buffered("g5", admit_version=4, head_version=5)
    with pytest.raises(StalenessViolation, match="lag 3 > "):
        sm.restore_buffered("g2", admit_version=2, head_version=2)
    with pytest.raises(ValueError, match="newer than the current version"):
        sm.restore_buffered("g6", admit_version=5, head_version=6)
    c = sm.counts()
    assert (c.admitted, c.buffered, c.accepted, c.capacity) == (2, 2, 5 * B + 2, (eta + 1) * B - 2)
    assert c.balanced()
    # a group admitted now (version 5) has a later deadline than both restored groups
    t = sm.acquire(timeout=1)
    sm.accept(t, "fresh", head_version=5)
    batch = sm.get_batch(version=5, timeout=1)
    assert [g.item for g in batch] == ["g3", "g5"] and [g.lag for g in batch] == [2, 0]
    assert [g.ticket.id for g in batch] == [t_old.id, t_new.id]


def test_restore_buffered_groups_keeps_only_groups_trainable_within_eta(tmp_path):
    """Resumed at version 5 with eta = 1 (the saving run had a larger eta), B = 2: a group is kept only if
    it will be trained with lag <= eta, counting the batches the kept groups before it fill."""
    eta, B, v = 1, 2, 5
    specs = {10: (3, 3), 11: (4, 4), 12: (4, 4), 13: (4, 4), 14: (5, 5)}  # draw -> (admission, head) version
    saved = [group_record(types.SimpleNamespace(item=_group(d, head=h), ticket=types.SimpleNamespace(admit_version=m),
                                                 head_version=h), d) for d, (m, h) in specs.items()]
    led = DataLedger(iter([]), replay=[(d, {"id": f"d{d}"}) for d in specs], next_draw=15,
                     log_path=str(tmp_path / LEDGER_LOG))
    sm = StalenessManager(eta, B, version=v)
    info = restore_buffered_groups(saved[::-1], sm, led, v, eta, B)
    assert info == {"restored_groups": 3, "dropped_groups": 2}
    led.close()
    h = read_data_ledger(str(tmp_path))
    # draw 10: lag 2 already; draw 13: the third group of lag 1 would be trained at version 6 (lag 2)
    assert [(e["draw"], e["reason"], e["lag_when_trained"]) for e in h.events("drop")] == [
        (10, "stale_on_restore", 2), (13, "stale_on_restore", 2)]
    assert [(e["draw"], e["lag_when_trained"]) for e in h.events("restore")] == [(11, 1), (12, 1), (14, 1)]
    assert [o["draw"] for o in led.state()["outstanding"]] == [10, 11, 12, 13, 14]  # 10 and 13 are replayed
    assert [g.item.group_id for g in sm.get_batch(version=v, timeout=1)] == [11, 12]
    sm.set_version(v + 1)
    t = sm.acquire(timeout=1)
    sm.accept(t, "fresh", head_version=v + 1)
    batch = sm.get_batch(version=v + 1, timeout=1)  # no StalenessViolation
    assert [g.lag for g in batch] == [1, 0] and batch[0].item.group_id == 14


def test_ledger_log_resume_markers_define_the_surviving_history(tmp_path):
    path = str(tmp_path / LEDGER_LOG)
    led = DataLedger(iter([f"x{i}" for i in range(100)]), log_path=path)
    tickets = []
    for k in range(6):
        item = next(led)
        led.on_draw(_T(k), item)
        tickets.append(_T(k))
    led.consumed([0, 1], step=1, version=0, lags=[0, 0])
    led.on_reject(tickets[2], "x2", "filtered")
    st = led.state()  # the checkpoint: 2 events so far, draws 3..5 outstanding
    assert st["log_records"] == 2 and [o["draw"] for o in st["outstanding"]] == [3, 4, 5]
    led.consumed([3, 4], step=2, version=1, lags=[1, 1])  # then the process dies: this step is redone
    led.close()
    with open(path, "a") as f:
        f.write('{"event": "consume", "step": 3, "dra')  # killed mid-line
    repair_jsonl_tail(path)
    assert open(path).read().endswith("\n")
    # resume from the checkpoint: draws 3..5 replayed, draw 4's finished group restored
    led2 = DataLedger(iter([f"x{i}" for i in range(6, 100)]),
                      replay=[(o["draw"], o["item"]) for o in st["outstanding"]], next_draw=st["next_draw"],
                      log_path=path, log_records=st["log_records"])
    led2.log_resume(1, 1, st["log_records"], checkpoint=1)
    assert led2.replay_item(4) == "x4" and led2.replay_item(9) is None
    assert led2.restore(_T(100), 4, head_version=1, lag=0) == "x4"
    led2.drop_restored(5, "stale_on_restore", lag=3)
    drawn = []
    for t in (_T(101), _T(102), _T(103)):
        drawn.append(next(led2))
        led2.on_draw(t, drawn[-1])
    assert drawn == ["x3", "x5", "x6"]  # draw 4 is not replayed: its group came back finished
    led2.consumed([101, 100], step=2, version=1, lags=[1, 0])
    led2.freeze()  # shutdown: a group aborted now keeps its item outstanding
    led2.on_reject(_T(102), "x5", "error:RuntimeError")
    assert [o["draw"] for o in led2.state()["outstanding"]] == [5, 6]
    led2.close()

    h = read_data_ledger(str(tmp_path))
    assert [(e["step"], e["draws"]) for e in h.events("consume")] == [(1, [0, 1]), (2, [3, 4])]
    assert h.events("consume")[1]["restored"] == [False, True]
    assert [(e["step"], e["draws"]) for e in h.events("consume", effective=False)] == [(2, [3, 4])]
    assert [e["draw"] for e in h.events("reject")] == [2]
    assert [(e["draw"], e["reason"]) for e in h.events("drop")] == [(5, "stale_on_restore")]
    assert [e["draw"] for e in h.events("abort")] == [5]
    assert [r["keep"] for r in h.resumes] == [2]


def test_read_data_ledger_rejects_a_log_that_lost_lines(tmp_path):
    with open(tmp_path / LEDGER_LOG, "w") as f:
        f.write(json.dumps({"event": "consume", "step": 1, "draws": [0]}) + "\n")
        f.write(json.dumps({"event": "resume", "step": 3, "keep": 4}) + "\n")
    with pytest.raises(ValueError, match="resume keeps 4 events but only 1 precede it"):
        read_data_ledger(str(tmp_path))


def test_a_replayed_image_prompt_keeps_its_images_through_a_checkpoint():
    """An outstanding prompt with images (``VLPromptRecord``) comes back from the checkpoint's JSON with its encoded
    images, grids and image processor (a replayed prompt must be submitted with its images: found by the VL resume
    test, where replayed prompts went to the generator without them), and a buffered group's trajectories get the
    item's images back."""
    import io

    from PIL import Image

    from jaxrl_async.checkpoint.codec import from_jsonable, to_jsonable
    from jaxrl_async.data.images import ImageProcessorConfig, VLPromptRecord
    from jaxrl_async.data.ledger import record_from_json, record_to_json

    buf = io.BytesIO()
    Image.fromarray(np.arange(16 * 48 * 3, dtype=np.uint8).reshape(16, 48, 3)).save(buf, "PNG")
    ip = ImageProcessorConfig(patch_size=4, min_pixels=256, max_pixels=81920)
    rec = VLPromptRecord(id="a", prompt="p", prompt_ids=[1] + [9] * 12 + [3], answer="4", metadata={"source": "x"},
                         images=(buf.getvalue(),), image_grid_thw=np.asarray([[1, 4, 12]]), image_processor=ip)
    back = record_from_json(from_jsonable(json.loads(json.dumps(to_jsonable(record_to_json(rec))))))
    assert isinstance(back, VLPromptRecord) and back.images == rec.images and back.image_processor == ip
    assert back.image_grid_thw.tolist() == [[1, 4, 12]] and back.prompt_ids == rec.prompt_ids
    np.testing.assert_array_equal(back.image_inputs().pixel_values(), rec.image_inputs().pixel_values())
    traj = Trajectory.from_completion(rec.prompt_ids, [5, 6], [-0.5, -0.25], [3, 3], 1.0, "stop",
                                      images=rec.image_inputs())
    g = types.SimpleNamespace(item=TrajectoryGroup(rec, [traj, traj], 7), ticket=types.SimpleNamespace(admit_version=3),
                              head_version=3)
    saved = json.loads(json.dumps(to_jsonable(group_record(g, draw=4))))
    assert "images" not in json.dumps(saved["trajectories"][0]["metadata"])  # a flag, not the bytes again
    restored = group_from_record(from_jsonable(saved), back)
    assert all(t.images is back.image_inputs() for t in restored.trajectories)
