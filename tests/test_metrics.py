"""Metrics: metrics.jsonl rows, TensorBoard events read back, the final PNG."""
import glob
import json
import os

import numpy as np
import pytest

from jaxrl_async.metrics import METRICS_FILE, PLOT_FILE, MetricsLogger, flatten, read_metrics


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
