"""Console progress of the training loops: a tqdm bar on a terminal, one plain line per step elsewhere.

A tqdm bar redraws itself with carriage returns. Where stderr is a pipe or a file (the multi-process
launcher streams each role's output line by line behind a role prefix; a cluster job's log file) the
redraws arrive as one long line when the bar closes: nothing shows while the run runs.
``ProgressLines`` prints what the bar would show as one line per step instead::

    train: 3/150 [00:09<04:50, 2.01s/step] reward_mean=0.0156, eval_acc=0, lag_max=2, loss=-0.0399

(this process's elapsed time, the ETA, the time per step smoothed as the bar smooths it: an
exponential moving average of the time between updates with tqdm's bias correction, ``smoothing``
0.1). The style is the caller's choice (``progress_style``): the single-process run keeps the bar,
the multi-process controller (``distributed.controller``) prints lines when its stderr is not a terminal.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Mapping

__all__ = ["PROGRESS_STYLES", "ProgressLines", "progress_style", "format_interval"]

PROGRESS_STYLES = ("bar", "lines")


def progress_style(progress: bool | str | None) -> str | None:
    """``progress`` as a style: True or ``"bar"``: a tqdm bar; ``"lines"``: ``ProgressLines``; False / None:
    no progress output. Anything else is a ``ValueError``."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return "bar"
    if progress in PROGRESS_STYLES:
        return str(progress)
    raise ValueError(f"progress: {progress!r} is not one of True, False, {', '.join(map(repr, PROGRESS_STYLES))}")


def format_interval(seconds: float) -> str:
    """``MM:SS`` below an hour, ``H:MM:SS`` from one (tqdm's format)."""
    m, s = divmod(int(max(seconds, 0.0)), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ProgressLines:
    """Progress as one line per update (module docstring), written to ``file`` (default: ``sys.stderr``
    at each write). Thread-safe.

    Args:
      desc: the line's label (``train``, ``sft``).
      total: the last step (None: no total, no ETA).
      initial: the step the count starts from (a resumed run continues its count).
      unit: the unit of the rate.
      every: print every ``every``-th step (counted from ``initial``) and the last one; the others only
        advance the count and the rate.
      smoothing: of the time per step (tqdm's: 0 the mean since the start, 1 the last interval).
      clock: seconds, monotonic (tests inject one).
    """

    def __init__(self, desc: str, total: int | None = None, *, initial: int = 0, unit: str = "step", every: int = 1,
                 smoothing: float = 0.1, file: Any = None, clock: Callable[[], float] = time.monotonic):
        if every < 1:
            raise ValueError(f"ProgressLines: every must be >= 1, got {every}")
        if not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"ProgressLines: smoothing must be in [0, 1], got {smoothing}")
        self.desc, self.total, self.unit, self.every = desc, total, unit, int(every)
        self.initial = self.n = int(initial)
        self.smoothing, self.file, self.clock = float(smoothing), file, clock
        self._t0 = self._last_t = clock()
        self._ema, self._ema_calls = 0.0, 0
        self._lock = threading.Lock()

    def seconds_per_unit(self) -> float | None:
        """The smoothed time per step (None before the first update). Smoothing 0 is the mean since the start."""
        if self._ema_calls == 0:
            return None
        if self.smoothing == 0.0:
            return (self._last_t - self._t0) / max(self.n - self.initial, 1)
        return self._ema / (1.0 - (1.0 - self.smoothing) ** self._ema_calls)

    def update(self, n: int = 1, postfix: Mapping[str, Any] | None = None) -> str | None:
        """Advance by ``n`` steps; returns the line printed (None when this step is not one of ``every``).
        ``postfix``: label -> value shown after the counts (``label=value``, in order)."""
        with self._lock:
            now = self.clock()
            if n > 0:
                a = self.smoothing
                self._ema = a * (now - self._last_t) / n + (1.0 - a) * self._ema
                self._ema_calls += 1
                self._last_t = now
                self.n += int(n)
            if (self.n - self.initial) % self.every and self.n != self.total:
                return None
            line = self.format(postfix, now)
            self.write(line)
            return line

    def format(self, postfix: Mapping[str, Any] | None = None, now: float | None = None) -> str:
        """The line of the current count: ``desc: n/total [elapsed<eta, rate] postfix``."""
        elapsed = (self.clock() if now is None else now) - self._t0
        rate = self.seconds_per_unit()
        times = format_interval(elapsed)
        if self.total is not None:
            eta = "?" if rate is None else format_interval(rate * max(self.total - self.n, 0))
            times += f"<{eta}"
        times += ", ?" if rate is None else f", {rate:.3g}s/{self.unit}"
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        shown = ", ".join(f"{k}={v}" for k, v in (postfix or {}).items())
        return f"{self.desc}: {count} [{times}]" + (f" {shown}" if shown else "")

    def write(self, text: str) -> None:
        """Print ``text`` as one line (flushed: a pipe's reader sees it at once)."""
        f = self.file if self.file is not None else sys.stderr
        try:
            print(text, file=f, flush=True)
        except (OSError, ValueError):  # stderr closed (the launcher gone): the run goes on
            pass
