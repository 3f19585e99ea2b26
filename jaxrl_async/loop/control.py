"""The run's clock, phases and stop signals (``RunControl``): one object the loop, the warm start and the
services share instead of attributes of one big class."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

from jaxrl_async.config.resume import committed_steps

__all__ = ["RunControl", "WARM_START_DIR"]

WARM_START_DIR = "warm_start"  # RUN/warm_start/checkpoints/<SFT step>: an interrupted warm start


class RunControl:
    """Wall clock (cumulative over resumes: ``wall0`` is what the processes before this one ran), the
    current phase, the stop signal handler that ``main`` installed (or None), and how the console shows
    progress (``progress_style``: ``"bar"``, a tqdm bar; ``"lines"``, one line per step, ``console.ProgressLines``)."""

    def __init__(self, run_dir: str, *, log_fn: Callable[[str], None] | None = None, signals: Any = None,
                 progress_style: str = "bar"):
        from jaxrl_async.checkpoint import SignalHandler
        from jaxrl_async.console import PROGRESS_STYLES

        if progress_style not in PROGRESS_STYLES:
            raise ValueError(f"RunControl: progress_style {progress_style!r} is not one of {PROGRESS_STYLES}")
        self.progress_style = progress_style
        self.run_dir = run_dir
        self.say = log_fn or (lambda s: print(f"[jaxrl_async] {s}", file=sys.stderr, flush=True))
        self.t_start = time.monotonic()
        self.wall0 = 0.0
        self.resume_rows: list[dict[str, Any]] = []  # this process's resume, logged as a metrics row
        self.signals = signals if signals is not None else SignalHandler.active()
        self.phase = ""

    def progress(self, enabled: bool) -> str | bool:
        """The ``progress`` argument of the bars of the run (``MetricsLogger``, ``SFTRun.run``): the style when
        ``enabled`` (``logging.progress``), else False."""
        return self.progress_style if enabled else False

    def wall(self) -> float:
        """The run's wall time: the processes before a resume (``wall0``) plus this one."""
        return self.wall0 + time.monotonic() - self.t_start

    def process_wall(self) -> float:
        return time.monotonic() - self.t_start

    def set_phase(self, name: str, plan: str) -> None:
        self.phase = name
        if self.signals is not None:
            self.signals.set_phase(name, plan)

    def stop_requested(self) -> bool:
        return self.signals is not None and self.signals.requested

    def check_stop(self) -> None:
        """Between the phases before RL: a stop signal ends the run here (``StopRequested``)."""
        if self.stop_requested():
            raise self.stopped(self.saved_before())

    def stopped(self, saved: str | None) -> Exception:
        from jaxrl_async.checkpoint import StopRequested

        again = "resume" if saved else "start the run"
        return StopRequested(f"stopped by {self.signals.signal_name} during {self.phase}: "
                             f"{saved or 'nothing to save yet (no training step had run)'}; "
                             f"run the same command again to {again}")

    def saved_before(self) -> str | None:
        """What earlier processes left to resume from (a listing of the run directory)."""
        ck = os.path.join(self.run_dir, "checkpoints")
        rl = committed_steps(ck)
        if rl:
            return f"nothing new to save, checkpoint {os.path.join(ck, str(rl[-1]))} is the latest"
        wck = os.path.join(self.run_dir, WARM_START_DIR, "checkpoints")
        ws = committed_steps(wck)
        if ws:
            return f"nothing new to save, warm-start checkpoint {os.path.join(wck, str(ws[-1]))} is the latest"
        return None
