"""``max_wall_time_s`` bounds the run's cumulative wall time (every process of a resumed run), as every other
time a resumed run reports does (issue 24, Found 4)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_rl_loop import tiny_run_config  # noqa: E402

from jaxrl_async.checkpoint import Checkpointer  # noqa: E402
from jaxrl_async.loop import RLRun  # noqa: E402


def test_max_wall_time_counts_the_processes_before_a_resume(tmp_path):
    run = tmp_path / "run"
    first = RLRun(tiny_run_config(run, steps=2)).run()
    assert first.stopped_by == "completed" and first.wall_s > 0
    # The resumed run's clock starts at the wall time its checkpoint recorded (what the processes before it ran up
    # to that save), not at the first process's whole wall time: that also counts its export and exit after the
    # save, which on a loaded CI machine was 60% of this tiny run (a limit of 0.5 x first.wall_s then lay above
    # the recorded time). Resumed with a limit the checkpoint's time alone already used up: no further step.
    recorded = float(Checkpointer(str(run), read_only=True).read_meta(2)["extra"]["wall_s"])
    assert 0 < recorded <= first.wall_s
    limit = recorded * 0.5
    second = RLRun(tiny_run_config(run, steps=6, max_wall_time_s=limit)).run()
    assert second.stopped_by == "max_wall_time" and second.steps == 2, (second.stopped_by, second.steps)
    # wall_s = the recorded time + this process's (read one after the other: microseconds apart)
    assert abs(second.wall_s - (recorded + second.process_wall_s)) < 0.05, (second.wall_s, recorded,
                                                                          second.process_wall_s)
    assert second.wall_s > limit
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "max_wall_time" and summary["steps"] == 2
