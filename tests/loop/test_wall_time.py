"""``max_wall_time_s`` bounds the run's cumulative wall time (every process of a resumed run), as every other
time a resumed run reports does (issue 24, Found 4)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_rl_loop import tiny_run_config  # noqa: E402

from jaxrl_async.loop import RLRun  # noqa: E402


def test_max_wall_time_counts_the_processes_before_a_resume(tmp_path):
    run = tmp_path / "run"
    first = RLRun(tiny_run_config(run, steps=2)).run()
    assert first.stopped_by == "completed" and first.wall_s > 0
    # resumed with a limit the first process alone already used up: no further step. The cumulative clock carries
    # the wall time the last checkpoint recorded, not what the process spent after it (its export and exit: up to
    # ~10% of this tiny run on a loaded machine, where 0.9 x the process's wall time once let the resumed run,
    # whose setup is instant in this warm process, train on); half of it is used up by any account
    limit = first.wall_s * 0.5
    second = RLRun(tiny_run_config(run, steps=6, max_wall_time_s=limit)).run()
    assert second.stopped_by == "max_wall_time" and second.steps == 2, (second.stopped_by, second.steps)
    assert second.wall_s > limit and second.wall_s > second.process_wall_s + limit, (second.wall_s,
                                                                                       second.process_wall_s)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "max_wall_time" and summary["steps"] == 2
