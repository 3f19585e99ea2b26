"""Resuming with changed settings (issue 24, Found 2): the allowed changes are listed in one line; a changed
group size (``rollout.n_samples``) drops the checkpoint's finished groups with a ledger reason (their prompts
are replayed) instead of restoring groups of the old size into a buffer of the new one."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_rl_loop import tiny_run_config  # noqa: E402

from jaxrl_async.checkpoint import Checkpointer  # noqa: E402
from jaxrl_async.data.ledger import read_data_ledger  # noqa: E402
from jaxrl_async.loop import RLRun  # noqa: E402


def test_resume_with_another_group_size_drops_the_saved_groups_and_trains_on(tmp_path):
    run = tmp_path / "run"
    first = RLRun(tiny_run_config(run, eta=2, steps=3)).run()
    assert first.stopped_by == "completed"
    saved = Checkpointer(str(run), read_only=True).restore(3, items=[]).trajectories or []
    assert saved, "the test needs finished groups in the checkpoint (eta = 2 keeps some buffered)"
    lines = []
    second = RLRun(tiny_run_config(run, eta=2, steps=5, **{"rollout.n_samples": 2}), log_fn=lines.append).run()
    assert second.stopped_by == "completed" and second.steps == 5
    changed = [line for line in lines if line.startswith("resumed with changed settings: ")]
    assert len(changed) == 1 and "rollout.n_samples 4 -> 2" in changed[0] and "trainer.total_steps 3 -> 5" in changed[0]
    drops = [e for e in read_data_ledger(str(run)).events("drop")]
    assert len(drops) == len(saved) and all(e["reason"] == "group_size_changed" for e in drops), drops
    consumed = [e for e in read_data_ledger(str(run)).events("consume") if e["step"] > 3]
    assert [e["step"] for e in consumed] == [4, 5]
    # every dropped group's prompt was replayed: trained, rejected, or still outstanding at the end
    led = read_data_ledger(str(run))
    after = ({d for e in consumed for d in e["draws"]} | {e["draw"] for e in led.events("reject")}
             | {o["draw"] for o in Checkpointer(str(run), read_only=True).read_meta(5)["data_state"]["outstanding"]})
    assert {e["draw"] for e in drops} <= after
