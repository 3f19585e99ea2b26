"""Observability of a run: TensorBoard scalars, ``metrics.jsonl``, a console progress bar, a final plot.

Files in the run directory:

* ``metrics.jsonl`` — one JSON object per ``log()`` call: ``step``, ``wall_time`` (seconds since the
  logger started), ``time`` (Unix time) and every metric, nested dicts flattened with ``/``
  (``staleness/hist/2``). Non-finite numbers are written as ``null`` (strict JSON).
* ``tb/events.out.tfevents.*`` — the same scalars through ``tensorboard.summary.Writer`` (no
  TensorFlow needed); view with ``tensorboard --logdir <run_dir>/tb``.
* ``curves.png`` — written by ``close()``: reward and eval accuracy against wall time (matplotlib, Agg).

The progress bar (tqdm, on stderr) shows step/total, ETA and a few key numbers (``console_keys``).
``MetricsLogger`` is thread-safe.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
PLOT_FILE = "curves.png"
DEFAULT_CONSOLE_KEYS = ("reward/mean", "eval/accuracy", "staleness/max", "gen/tokens_per_s", "train/loss")
DEFAULT_PLOT_KEYS = ("reward/mean", "eval/accuracy")


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


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Parse a ``metrics.jsonl`` (a run directory or the file itself)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: invalid JSON ({e})") from None
    return rows


def plot_curves(rows: Sequence[Mapping[str, Any]], out_path: str | os.PathLike,
                keys: Sequence[str] = DEFAULT_PLOT_KEYS, x_key: str = "wall_time", title: str | None = None) -> str:
    """One panel per key: value against ``x_key`` (points where the key is present and not null)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r[x_key], r[key]) for r in rows if r.get(key) is not None and r.get(x_key) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("wall time (s)" if x_key == "wall_time" else x_key)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = os.fspath(out_path)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


class MetricsLogger:
    """Writes every logged step to ``metrics.jsonl`` and TensorBoard and updates the progress bar.

    Args:
      run_dir: output directory (created).
      total_steps: length of the progress bar (None: no total, no ETA).
      tensorboard / progress: enable the TB writer / the tqdm bar.
      console_keys: metrics shown on the bar.
      plot_keys: panels of the final plot.
      start_step: first step (a resumed run continues its bar and appends to metrics.jsonl).
    """

    def __init__(self, run_dir: str | os.PathLike, total_steps: int | None = None, *, tensorboard: bool = True,
                 progress: bool = True, console_keys: Iterable[str] = DEFAULT_CONSOLE_KEYS,
                 plot_keys: Sequence[str] = DEFAULT_PLOT_KEYS, start_step: int = 0, desc: str = "train"):
        self.run_dir = os.fspath(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.run_dir, METRICS_FILE)
        self.console_keys = tuple(console_keys)
        self.plot_keys = tuple(plot_keys)
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._unix0 = time.time()
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboard.summary import Writer

            self._tb = Writer(os.path.join(self.run_dir, TB_DIR))
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, file=sys.stderr, dynamic_ncols=True,
                             smoothing=0.1)
        self._closed = False
        self.last: dict[str, Any] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def log(self, step: int, metrics: Mapping[str, Any], *, advance: bool = True) -> dict[str, Any]:
        """Record ``metrics`` for ``step`` (advance=False: e.g. an eval row that does not move the bar)."""
        flat = flatten(metrics)
        wall = self.elapsed()
        row = {"step": int(step), "wall_time": round(wall, 4), "time": round(self._unix0 + wall, 3), **flat}
        line = json.dumps(row, allow_nan=False)
        with self._lock:
            if self._closed:
                raise RuntimeError("MetricsLogger.log() after close()")
            self._file.write(line + "\n")
            self._file.flush()
            if self._tb is not None:
                for k, v in flat.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        self._tb.add_scalar(k, v, int(step), wall_time=self._unix0 + wall)
                    elif isinstance(v, bool):
                        self._tb.add_scalar(k, float(v), int(step), wall_time=self._unix0 + wall)
                self._tb.flush()
            self.last.update({k: v for k, v in flat.items() if v is not None})
            if self._bar is not None:
                shown = {k.split("/")[-1] if k.count("/") == 1 else k: _fmt(self.last[k])
                         for k in self.console_keys if k in self.last}
                self._bar.set_postfix(shown, refresh=False)
                if advance:
                    self._bar.update(1)
                else:
                    self._bar.refresh()
        return row

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self, plot: bool = True) -> str | None:
        """Flush and close; with ``plot`` write ``curves.png`` and return its path."""
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
        return plot_curves(rows, os.path.join(self.run_dir, PLOT_FILE), self.plot_keys,
                           title=os.path.basename(os.path.normpath(self.run_dir)))

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
