"""Metrics: metrics.jsonl rows, TensorBoard events read back, the final PNG."""
import glob
import io
import json
import os

import numpy as np
import pytest

from jaxrl_async.loop.metrics import METRICS_FILE, PLOT_FILE, MetricsLogger, flatten, read_metrics


def test_flatten_and_scalar_conversion():
    out = flatten({"a": {"b": np.float32(1.5), "c": {"d": np.int64(3)}}, "e": float("nan"), "f": True,
                   "g": np.array(2.0)})
    assert out == {"a/b": 1.5, "a/c/d": 3, "e": None, "f": True, "g": 2.0}
    assert isinstance(out["a/c/d"], int)
    with pytest.raises(TypeError, match="metric 'x'"):
        flatten({"x": np.zeros(3)})


def test_logger_writes_jsonl_tensorboard_and_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    with MetricsLogger(tmp_path, total_steps=3, progress=True) as m:
        for s in range(3):
            m.log(s, {"reward": {"mean": 0.1 * s, "std": 0.5}, "staleness": {"hist": {0: 2, 1: 1}},
                      "bad": float("inf")})
        m.log(2, {"eval/accuracy": 0.75}, advance=False)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 2]
    assert rows[1]["reward/mean"] == pytest.approx(0.1) and rows[0]["staleness/hist/1"] == 1
    assert rows[0]["bad"] is None and rows[3]["eval/accuracy"] == 0.75
    assert all(rows[i]["wall_time"] <= rows[i + 1]["wall_time"] for i in range(3))
    with open(os.path.join(tmp_path, METRICS_FILE)) as f:  # strict JSON (no NaN/Infinity tokens)
        for line in f:
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))

    events = glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(os.path.dirname(events[0]), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"reward/mean", "reward/std", "eval/accuracy", "staleness/hist/0"} <= set(tags["tensors"])
    series = {tag: [(e.step, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
              for tag in ("reward/mean", "eval/accuracy")}  # Writer stores v2 scalar summaries as tensors
    assert [s for s, _ in series["reward/mean"]] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in series["reward/mean"]], [0.0, 0.1, 0.2], rtol=1e-6)
    assert series["eval/accuracy"] == [(2, 0.75)]

    png = os.path.join(tmp_path, PLOT_FILE)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 1000


def test_log_after_close_fails_and_resume_appends(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    m.log(0, {"x": 1})
    assert m.close(plot=False) is None
    with pytest.raises(RuntimeError, match="after close"):
        m.log(1, {"x": 2})
    m2 = MetricsLogger(tmp_path, tensorboard=False, progress=False, start_step=1)
    m2.log(1, {"x": 2})
    m2.close(plot=False)
    assert [r["x"] for r in read_metrics(os.path.join(tmp_path, METRICS_FILE))] == [1, 2]


def _tb_series(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(os.path.join(run_dir, "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, e.wall_time, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def test_a_resumed_run_keeps_one_history_with_a_cumulative_clock(tmp_path):
    """Process 1 logs steps 1-6 (10 s each) and is killed mid-line; process 2 resumes from the checkpoint
    of step 4 (saved at 40 s) and starts 5 s later: metrics.jsonl and TensorBoard hold steps 1-4 of the
    first process and 5-6 of the second, once each, on one monotonic clock; the plot marks the resume."""
    clock = {"t": 0.0}
    m = MetricsLogger(tmp_path, progress=False, clock=lambda: clock["t"], keep_until_step=-1)
    for s in range(1, 7):
        clock["t"] = 10.0 * s
        m.log(s, {"reward/mean": 0.1 * s, "staleness/max": 1, "response/length_mean": 5.0 + s})
        if s == 2:
            m.log(s, {"eval/accuracy": 0.5}, advance=False)
    m.close(plot=False)
    with open(os.path.join(tmp_path, METRICS_FILE), "a") as f:
        f.write('{"step": 7, "wall_')  # a writer killed mid-line
    clock = {"t": 45.0}
    m2 = MetricsLogger(tmp_path, progress=False, clock=lambda: clock["t"], keep_until_step=4)
    assert [r["step"] for r in m2.history] == [1, 2, 2, 3, 4] and m2.dropped_rows == 2
    m2.log(4, {"resume/checkpoint_step": 4, "resume/checkpoint": "checkpoints/4"}, advance=False)
    for s in (5, 6):
        clock["t"] = 45.0 + 10 * (s - 4)
        m2.log(s, {"reward/mean": 0.2 * s, "staleness/max": 2, "response/length_mean": 9.0})
    png = m2.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 4, 4, 5, 6]
    walls = [r["wall_time"] for r in rows]
    assert walls == sorted(walls) and walls[-1] == 65.0
    assert [r["reward/mean"] for r in rows if "reward/mean" in r] == pytest.approx([0.1, 0.2, 0.3, 0.4, 1.0, 1.2])
    series = _tb_series(tmp_path, "reward/mean")
    assert [s for s, _, _ in series] == [1, 2, 3, 4, 5, 6]  # the redone steps 5 and 6 of process 1 are gone
    tb_walls = [w for _, w, _ in series]
    np.testing.assert_allclose(np.diff(tb_walls), [10, 10, 10, 15, 10], atol=0.01)  # TensorBoard: the same clock
    from jaxrl_async.loop.metrics import resumes_from_rows

    assert resumes_from_rows(rows) == [{"at_step": 4, "from_checkpoint": "checkpoints/4", "phase": "rl",
                                        "wall_time": 45.0}]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_series_break_at_missing_steps_and_the_trend_restarts():
    from jaxrl_async.loop.metrics import _series, ema

    rows = [{"step": s, "reward/mean": float(s)} for s in (1, 2, 3, 7, 8)] + [{"step": 9, "reward/mean": None}]
    xs, ys = _series(rows, "reward/mean", rows)
    assert list(xs) == [1, 2, 3, 5, 7, 8, 9] and np.isnan(ys[3]) and np.isnan(ys[6])  # no line across 3..7
    smooth = ema(ys)
    assert smooth[0] == 1.0 and np.isnan(smooth[3]) and smooth[4] == 7.0  # restarted after the gap


def test_progress_bar_fields_are_labelled(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=2, tensorboard=False, progress=True) as m:
        m.log(1, {"reward/mean": 0.25, "staleness/max": 2, "response/length_mean": 17.5, "train/loss": 0.1})
        m.log(1, {"eval/accuracy": 0.5}, advance=False)
    err = capsys.readouterr().err
    for field in ("reward_mean=0.25", "lag_max=2", "len_mean=17.5", "loss=0.1", "eval_acc=0.5"):
        assert field in err, err
    assert " mean=" not in err and " max=" not in err


class _Sink:
    """What ``MetricsLogger`` needs of a ``WandbRun``."""

    def __init__(self, fresh):
        self.fresh, self.rows = fresh, []

    def log_row(self, row):
        self.rows.append(row)


def test_rows_go_to_wandb_and_a_fresh_wandb_run_gets_the_kept_history_first(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False, progress=False, keep_until_step=-1, wandb=_Sink(True))
    for s in (1, 2, 3):
        m.log(s, {"reward/mean": 0.1 * s})
    assert [r["step"] for r in m._wandb.rows] == [1, 2, 3] and m._wandb.rows == read_metrics(tmp_path)
    m.close(plot=False)
    continued, new = _Sink(False), _Sink(True)  # the run's own W&B run resumes; a new one (W&B enabled now)
    MetricsLogger(tmp_path, tensorboard=False, progress=False, keep_until_step=2, wandb=continued).close(plot=False)
    assert continued.rows == []
    m = MetricsLogger(tmp_path, tensorboard=False, progress=False, keep_until_step=2, wandb=new)
    m.log(3, {"reward/mean": 0.5})
    m.close(plot=False)
    assert [(r["step"], r["reward/mean"]) for r in new.rows] == [(1, 0.1), (2, 0.2), (3, 0.5)]


def test_wandb_run_sends_the_scalars_at_their_step_skips_steps_before_its_start_and_outlives_failures():
    from jaxrl_async.loop.wandb_logger import WandbRun

    class Run:
        starting_step, fail = 3, False

        def __init__(self):
            self.logged, self.finished = [], None

        def log(self, data, step):
            if self.fail:
                raise ConnectionError("server gone")
            self.logged.append((step, data))

        def finish(self, exit_code):
            self.finished = exit_code

    said, run = [], Run()
    w = WandbRun(run, "abc", fresh=False, say=said.append)
    w.log_row({"step": 2, "wall_time": 1.0, "resume/checkpoint_step": 2})  # below the resumed W&B run's start
    w.log_row({"step": 2, "reward/mean": 0.3})
    assert run.logged == [] and w.skipped_rows == 2 and len(said) == 1 and "continues at step 3" in said[0]
    w.log_row({"step": 3, "wall_time": 9.0, "time": 1e9, "reward/mean": 0.5, "eval/accuracy": None,
               "resume/checkpoint": "checkpoints/2", "train/skipped": 0, "flag": True})
    assert run.logged == [(3, {"reward/mean": 0.5, "train/skipped": 0, "flag": True})]  # what TensorBoard gets
    run.fail = True
    w.log_row({"step": 4, "reward/mean": 0.6})
    w.log_row({"step": 5, "reward/mean": 0.7})
    assert len(said) == 2 and "W&B logging failed at step 4 (ConnectionError: server gone)" in said[1]
    w.finish(exit_code=1)
    assert run.finished == 1


def test_progress_lines_one_line_per_step(tmp_path, capsys):
    """``progress="lines"`` (the multi-process controller's console when stderr is no terminal): one plain line
    per advancing row (no carriage return), the bar's labelled fields, step/total, elapsed<ETA and the
    smoothed time per step; an eval row (``advance=False``) prints nothing and shows on the next line."""
    from jaxrl_async.console import ProgressLines, format_interval

    with MetricsLogger(tmp_path, total_steps=3, tensorboard=False, progress="lines") as m:
        m.log(0, {"eval/accuracy": 0.5}, advance=False)
        m.log(1, {"reward/mean": 0.25, "staleness/max": 2, "train/loss": 0.1})
        m.log(2, {"reward/mean": 0.5, "staleness/max": 1, "train/loss": 0.2})
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("train: 1/3 [") and lines[1].startswith("train: 2/3 ["), err
    assert "s/step] reward_mean=0.25, eval_acc=0.5, lag_max=2, loss=0.1" in lines[0], lines[0]
    assert "reward_mean=0.5, eval_acc=0.5, lag_max=1, loss=0.2" in lines[1], lines[1]

    t = {"now": 100.0}
    p = ProgressLines("sft", 10, initial=2, every=4, smoothing=0.5, file=io.StringIO(),
                      clock=lambda: t["now"])
    shown = []
    for step in range(3, 11):
        t["now"] += 2.0 if step < 6 else 4.0
        shown.append(p.update(1, {"loss": "1.0"}))
    assert [s is not None for s in shown] == [False, False, False, True, False, False, False, True]  # steps 6, 10
    # EMA with tqdm's bias correction: steps 3-5 took 2 s, 6-10 4 s
    ema, calls = 0.0, 0
    for dt in [2.0] * 3 + [4.0] * 5:
        ema, calls = 0.5 * dt + 0.5 * ema, calls + 1
    assert abs(p.seconds_per_unit() - ema / (1 - 0.5 ** calls)) < 1e-9
    assert shown[-1] == f"sft: 10/10 [{format_interval(26.0)}<00:00, {ema / (1 - 0.5 ** calls):.3g}s/step] loss=1.0"
    assert format_interval(59.9) == "00:59" and format_interval(3725) == "1:02:05"
    with pytest.raises(ValueError, match="progress"):
        MetricsLogger(tmp_path / "x", tensorboard=False, progress="fancy")
