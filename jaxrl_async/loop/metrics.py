"""Observability of a run: TensorBoard scalars, ``metrics.jsonl``, a console progress bar, a final plot, and
optionally a Weights & Biases run (``loop/wandb_logger.py``).

Files in the run directory:

* ``metrics.jsonl`` — one JSON object per ``log()`` call: ``step``, ``wall_time`` (the run's
  cumulative wall clock in seconds: by default the time since the logger started; the RL loop passes
  a clock that adds the time of the processes before a resume), ``time`` (Unix time) and every
  metric, nested dicts flattened with ``/`` (``staleness/hist/2``). Non-finite numbers are written as
  ``null`` (strict JSON).
* ``tb/events.out.tfevents.*`` — the same scalars through ``tensorboard.summary.Writer`` (no
  TensorFlow needed); view with ``tensorboard --logdir <run_dir>/tb``. Event wall times are the
  run's start plus ``wall_time``, so TensorBoard's "relative" axis is the cumulative clock too.
* ``wandb/`` (``logging.wandb``) — the same scalars in a W&B run, at the same steps (``WandbRun``).
* ``curves.png`` — written by ``close()`` (``plot_run``): reward (raw points and a smoothed trend),
  held-out accuracy, response length and staleness against the step, wall time on a secondary axis,
  resumes marked.

A resumed run (``keep_until_step``) rewrites ``metrics.jsonl`` and the TensorBoard events from the rows
of the earlier processes up to the checkpoint it resumed from (rows of steps that are redone are
dropped), so both hold one continuous history.

The progress bar (tqdm, on stderr) shows step/total, ETA and a few labelled numbers (``console_keys``:
metric -> label); ``progress="lines"`` prints the same as one line per step (``console.ProgressLines``: for
a console that is not a terminal, e.g. the multi-process launcher's). ``MetricsLogger`` is thread-safe.
"""

from __future__ import annotations

import glob
import json
import math
import numbers
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxrl_async.console import ProgressLines, progress_style

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
PLOT_FILE = "curves.png"
# metric -> label on the progress bar
DEFAULT_CONSOLE_KEYS = {"reward/mean": "reward_mean", "eval/accuracy": "eval_acc", "response/length_mean": "len_mean",
                        "staleness/max": "lag_max", "gen/tokens_per_s": "gen_tok/s", "train/loss": "loss"}


def _scalar(value: Any) -> float | int | bool | str | None:
    """A JSON-able scalar from Python/numpy/jax scalars and 0-d arrays; non-finite → None."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else None
    arr = np.asarray(value)
    if arr.ndim == 0 and arr.dtype.kind in "biuf":
        return _scalar(arr.item())
    raise TypeError(f"metric value of type {type(value).__name__} (shape {getattr(arr, 'shape', None)}) is not a scalar")


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": 2} → {"a/b": 1, "c": 2}; values become JSON scalars (non-finite → None)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
        else:
            try:
                out[key] = _scalar(v)
            except TypeError as e:
                raise TypeError(f"metric {key!r}: {e}") from None
    return out


def read_metrics(path: str | os.PathLike, *, skip_partial_last: bool = False) -> list[dict[str, Any]]:
    """Parse a ``metrics.jsonl`` (a run directory or the file itself). ``skip_partial_last``: ignore an
    unterminated last line (a writer killed mid-line)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    rows = []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    if skip_partial_last and lines and lines[-1].strip():
        lines = lines[:-1]
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e})") from None
    return rows


# =============================================================================================
# The plot
# =============================================================================================
def ema(values: Sequence[float], weight: float = 0.9) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing); NaN entries restart it."""
    out = np.full(len(values), np.nan)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(values):
        if v is None or not math.isfinite(v):
            acc, norm = 0.0, 0.0
            continue
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[i] = acc / norm
    return out


def _series(rows: Sequence[Mapping[str, Any]], key: str, domain: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key`` over the rows of ``domain`` (missing/null -> NaN), with a NaN point
    inserted wherever steps are missing, so lines break at gaps instead of bridging them."""
    pts = sorted({int(r["step"]): (np.nan if r.get(key) is None else float(r[key])) for r in domain}.items())
    if not pts:
        return np.zeros(0), np.zeros(0)
    xs, ys = [pts[0][0]], [pts[0][1]]
    diffs = np.diff([p[0] for p in pts])
    spacing = float(np.median(diffs)) if len(diffs) else 1.0
    for (x0, _), (x, y) in zip(pts, pts[1:]):
        if x - x0 > 1.5 * spacing:
            xs.append((x0 + x) / 2)
            ys.append(np.nan)
        xs.append(x)
        ys.append(y)
    return np.asarray(xs, float), np.asarray(ys, float)


def resumes_from_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The resumes a run's metrics record (rows with ``resume/checkpoint_step`` or ``resume/sft_step``)."""
    out = []
    for r in rows:
        if r.get("resume/checkpoint_step") is not None:
            out.append({"at_step": int(r["step"]), "from_checkpoint": r.get("resume/checkpoint")
                        or f"checkpoints/{int(r['resume/checkpoint_step'])}", "phase": "rl",
                        "wall_time": r.get("wall_time")})
        elif r.get("resume/sft_step") is not None:
            out.append({"at_step": int(r["step"]), "from_checkpoint": r.get("resume/checkpoint"),
                        "phase": "warm_start", "at_sft_step": int(r["resume/sft_step"]),
                        "wall_time": r.get("wall_time")})
    return out


def _step_to_wall(rows: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray] | None:
    """Monotone (steps, cumulative wall time) pairs: the train row's wall time for each step (else the
    first row of that step)."""
    by_step: dict[int, float] = {}
    for r in rows:
        if r.get("wall_time") is None or r.get("step") is None:
            continue
        s, w = int(r["step"]), float(r["wall_time"])
        if "train/loss" in r or s not in by_step:
            by_step[s] = w
    if len(by_step) < 2:
        return None
    steps = np.asarray(sorted(by_step), float)
    walls = np.maximum.accumulate(np.asarray([by_step[int(s)] for s in steps], float))
    if walls[-1] <= walls[0]:
        return None
    return steps, walls


def _wall_axis(ax_r: Any, ax_e: Any, steps: np.ndarray, walls: np.ndarray) -> None:
    """Cumulative wall time as a top axis of the top panels: "nice" wall times placed at the step where
    the run reached them (so uneven spacing shows where time went), thinned so labels do not collide."""
    from matplotlib.ticker import MaxNLocator

    scale, unit = (60.0, "min") if walls[-1] > 300 else (1.0, "s")
    lo, hi = walls[0] / scale, walls[-1] / scale
    cand = [w for w in MaxNLocator(nbins=8).tick_values(lo, hi) if lo <= w <= hi]
    x0, x1 = ax_r.get_xlim()
    min_gap = (x1 - x0) / 14
    pos, labels = [], []
    for w in cand:
        x = float(np.interp(w * scale, walls, steps))
        if not pos or x - pos[-1] >= min_gap:
            pos.append(x)
            labels.append(f"{w:g}")
    for ax in (ax_r, ax_e):
        top = ax.twiny()
        top.set_xlim(x0, x1)
        top.set_xticks(pos)
        top.set_xticklabels(labels, fontsize=8)
        top.set_xlabel(f"cumulative wall time ({unit})", fontsize=8)


def plot_run(rows: Sequence[Mapping[str, Any]], out_path: str | os.PathLike, title: str | None = None,
             eta: int | None = None) -> str:
    """The run at a glance (2 x 2 panels, x = RL step, cumulative wall time on the top axis):
    reward (faint raw points, smoothed trend), held-out accuracy (markers, first and last values
    annotated), response length (mean, max) and staleness (mean, max lag; ``eta`` dashed). Missing
    steps are left as gaps; resumes are dashed vertical lines."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    train = [r for r in rows if "train/loss" in r or "reward/mean" in r]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    resumes = resumes_from_rows(rows)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    (ax_r, ax_e), (ax_l, ax_s) = axes

    def no_data(ax):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")

    # reward
    xs, ys = _series(rows, "reward/mean", train)
    if len(xs):
        ax_r.plot(xs, ys, ".", color="tab:blue", alpha=0.25, markersize=4, label="batch mean (raw)")
        ax_r.plot(xs, ema(ys), color="tab:blue", linewidth=2, label="smoothed (EMA 0.9)")
        ax_r.legend(loc="lower right", fontsize=8)
    else:
        no_data(ax_r)
    ax_r.set_ylabel("reward (mean of the batch)")
    # held-out accuracy
    if evals:
        xs, ys = _series(rows, "eval/accuracy", evals)
        ax_e.plot(xs, ys, "-o", color="tab:green", markersize=5)
        first, last = evals[0], evals[-1]
        ax_e.annotate(f"{first['eval/accuracy']:.3f}", (first["step"], first["eval/accuracy"]),
                      textcoords="offset points", xytext=(4, -12), fontsize=8)
        if last is not first:
            ax_e.annotate(f"{last['eval/accuracy']:.3f}", (last["step"], last["eval/accuracy"]),
                          textcoords="offset points", xytext=(-10, 6), fontsize=8, fontweight="bold")
        lo = min(r["eval/accuracy"] for r in evals)
        ax_e.set_ylim(max(0.0, min(lo - 0.05, 0.5)), 1.02)
    else:
        no_data(ax_e)
    ax_e.set_ylabel("held-out accuracy")
    # response length
    xs, ys = _series(rows, "response/length_mean", train)
    if len(xs):
        ax_l.plot(xs, ys, color="tab:purple", label="mean")
        xm, ym = _series(rows, "response/length_max", train)
        ax_l.plot(xm, ym, color="tab:purple", alpha=0.3, linewidth=1, label="max")
        ax_l.legend(loc="upper left", fontsize=8)
    else:
        no_data(ax_l)
    ax_l.set_ylabel("response length (tokens)")
    # staleness
    xs, ys = _series(rows, "staleness/mean", train)
    if len(xs):
        ax_s.plot(xs, ys, color="tab:orange", label="mean lag")
        xm, ym = _series(rows, "staleness/max", train)
        ax_s.step(xm, ym, where="mid", color="tab:red", alpha=0.6, linewidth=1, label="max lag")
        if eta is not None:
            ax_s.axhline(eta, color="tab:red", linestyle=":", linewidth=1, label=f"eta = {eta}")
        ax_s.legend(loc="lower right", fontsize=8)
        top = max([float(v) for v in ym if np.isfinite(v)] + [float(eta or 0), 1.0])
        ax_s.set_ylim(-0.1, top * 1.25)
    else:
        no_data(ax_s)
    ax_s.set_ylabel("staleness (policy versions)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        for rs in resumes:
            ax.axvline(rs["at_step"], color="0.4", linestyle="--", linewidth=1)
    for rs in resumes:
        what = (f"resumed (warm start, SFT step {rs['at_sft_step']})" if rs["phase"] == "warm_start"
                else f"resumed from step {rs['at_step']}")
        ax_r.annotate(what, (rs["at_step"], 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                      va="top", ha="right", color="0.3", xytext=(-2, -2), textcoords="offset points")
    for ax in (ax_l, ax_s):
        ax.set_xlabel("RL step")
    mapping = _step_to_wall(rows)
    if mapping is not None:
        _wall_axis(ax_r, ax_e, *mapping)
    facts = []
    if train:
        facts.append(f"{max(int(r['step']) for r in train)} RL steps")
    walls = [float(r["wall_time"]) for r in rows if r.get("wall_time") is not None]
    if walls:
        w = max(walls)
        facts.append(f"{w / 60:.1f} min" if w > 300 else f"{w:.0f} s")
    if resumes:
        facts.append(f"{len(resumes)} resume{'s' if len(resumes) > 1 else ''}")
    if title or facts:
        fig.suptitle(" | ".join(([title] if title else []) + facts))
    fig.tight_layout()
    out_path = os.fspath(out_path)
    tmp = out_path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_path)
    return out_path


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


class MetricsLogger:
    """Writes every logged step to ``metrics.jsonl``, TensorBoard and W&B and updates the progress bar.

    Args:
      run_dir: output directory (created).
      total_steps: length of the progress bar (None: no total, no ETA).
      tensorboard: enable the TB writer.
      progress: True or "bar": the tqdm bar; "lines": one line per step (``console.ProgressLines``);
        False: none. Either shows the ``console_keys``.
      console_keys: metrics shown on the bar: {metric: label} (or a sequence of metric names,
        labelled by the name with ``/`` -> ``_``).
      start_step: first step (a resumed run continues its bar).
      clock: the run's cumulative wall time in seconds (default: seconds since this logger started).
      keep_until_step: None: append to an existing ``metrics.jsonl``. An int s: the run starts (s = -1)
        or resumes from step s: earlier rows of steps <= s are kept (``history``), later ones (redone
        steps) dropped; ``metrics.jsonl`` and the TensorBoard events are rewritten from the kept rows.
      title / eta: of the final plot.
      wandb: a ``WandbRun`` (or anything with ``fresh`` and ``log_row(row)``) that gets every row too; a
        ``fresh`` one gets the kept ``history`` first. Not closed by ``close()`` (its owner finishes it).
    """

    def __init__(self, run_dir: str | os.PathLike, total_steps: int | None = None, *, tensorboard: bool = True,
                 progress: bool | str = True, console_keys: Mapping[str, str] | Iterable[str] = DEFAULT_CONSOLE_KEYS,
                 start_step: int = 0, desc: str = "train", clock: Callable[[], float] | None = None,
                 keep_until_step: int | None = None, title: str | None = None, eta: int | None = None,
                 wandb: Any = None):
        style = progress_style(progress)  # a bad value fails before anything is opened
        self.run_dir = os.fspath(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.run_dir, METRICS_FILE)
        self.console_keys = (dict(console_keys) if isinstance(console_keys, Mapping)
                             else {k: k.replace("/", "_") for k in console_keys})
        self.title, self.eta = title, eta
        self._lock = threading.Lock()
        t0 = time.monotonic()
        self._clock = clock if clock is not None else (lambda: time.monotonic() - t0)
        self.history: list[dict[str, Any]] = []
        self.dropped_rows = 0
        if keep_until_step is not None and os.path.exists(self.metrics_path):
            rows = read_metrics(self.metrics_path, skip_partial_last=True)
            self.history = [r for r in rows if int(r.get("step", 0)) <= keep_until_step]
            self.dropped_rows = len(rows) - len(self.history)
            tmp = self.metrics_path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in self.history)
            os.replace(tmp, self.metrics_path)
        # the run's start in Unix time: TensorBoard's relative time axis is then the cumulative clock
        first = next((r for r in self.history if r.get("time") is not None and r.get("wall_time") is not None), None)
        self._run_unix0 = (first["time"] - first["wall_time"]) if first else time.time() - self._clock()
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboard.summary import Writer

            tb_dir = os.path.join(self.run_dir, TB_DIR)
            if keep_until_step is not None:  # one continuous history: rewrite it from the kept rows
                for p in glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")):
                    os.remove(p)
            self._tb = Writer(tb_dir)
            for r in self.history:
                self._tb_row(r)
            self._tb.flush()
        self._wandb = wandb
        if wandb is not None and wandb.fresh:  # a new W&B run of a run with history: the curves from the start
            for r in self.history:
                wandb.log_row(r)
        self._bar = self._lines = None
        if style == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, file=sys.stderr, dynamic_ncols=True,
                             smoothing=0.1)
        elif style == "lines":
            self._lines = ProgressLines(desc, total_steps, initial=start_step, smoothing=0.1)
        self._closed = False
        self.last: dict[str, Any] = {}
        for r in self.history:
            self.last.update({k: v for k, v in r.items() if v is not None})

    def elapsed(self) -> float:
        """The run's cumulative wall time (the ``wall_time`` of a row logged now)."""
        return self._clock()

    def _tb_row(self, row: Mapping[str, Any]) -> None:
        wall = self._run_unix0 + float(row.get("wall_time") or 0.0)
        for k, v in row.items():
            if k in ("step", "wall_time", "time") or v is None or isinstance(v, str):
                continue
            self._tb.add_scalar(k, float(v), int(row["step"]), wall_time=wall)

    def log(self, step: int, metrics: Mapping[str, Any], *, advance: bool = True) -> dict[str, Any]:
        """Record ``metrics`` for ``step`` (advance=False: e.g. an eval row that does not move the bar)."""
        flat = flatten(metrics)
        wall = self.elapsed()
        row = {"step": int(step), "wall_time": round(wall, 4), "time": round(time.time(), 3), **flat}
        line = json.dumps(row, allow_nan=False)
        with self._lock:
            if self._closed:
                raise RuntimeError("MetricsLogger.log() after close()")
            self._file.write(line + "\n")
            self._file.flush()
            if self._tb is not None:
                self._tb_row(row)
                self._tb.flush()
            if self._wandb is not None:
                self._wandb.log_row(row)
            self.last.update({k: v for k, v in flat.items() if v is not None})
            if self._bar is not None or self._lines is not None:
                shown = {label: _fmt(self.last[k]) for k, label in self.console_keys.items() if k in self.last}
            if self._bar is not None:
                self._bar.set_postfix(shown, refresh=False)
                if advance:
                    self._bar.update(1)
                else:
                    self._bar.refresh()
            elif self._lines is not None and advance:  # a row that does not advance (eval) shows on the next line
                self._lines.update(1, shown)
        return row

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self, plot: bool = True) -> str | None:
        """Flush and close; with ``plot`` write ``curves.png`` (the whole history) and return its path."""
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            self._file.close()
            if self._tb is not None:
                self._tb.close()
            if self._bar is not None:
                self._bar.close()
        if not plot:
            return None
        rows = read_metrics(self.metrics_path)
        return plot_run(rows, os.path.join(self.run_dir, PLOT_FILE),
                        title=self.title or os.path.basename(os.path.normpath(self.run_dir)), eta=self.eta)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
