"""Failure-handling helpers for the training loop: graceful signals and non-finite step accounting.

`SignalHandler` turns SIGTERM/SIGINT into a flag the loop polls between steps (preemption notice:
finish or abort the step, save a checkpoint, exit 0). A second signal while the first is being
handled forces the process out immediately (exit code 128 + signum, the shell convention), so a
wedged save can always be interrupted. Handlers are installed on `__enter__` and the previous
ones restored on `__exit__`; Python only allows this on the main thread.

`NonFiniteTracker` counts steps whose loss/gradient norm is NaN/Inf (the loop skips the update)
and raises `TrainingDivergedError` after `max_consecutive` such steps in a row, so the loop stops
with a checkpoint of the last good state instead of burning accelerator time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger(__name__)


class SignalHandler:
    """Context manager: the first SIGTERM/SIGINT sets `requested`; the second forces exit.

    with SignalHandler() as stop:
        for step in ...:
            train_step()
            if stop.requested:
                checkpointer.save(...); checkpointer.wait()
                print(stop.message); sys.exit(0)

    `force_exit(code)` is called on the second signal (default `os._exit`, which skips cleanup:
    committed checkpoints are safe by construction, an unfinished one is ignored on restart).
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT), *,
                 force_exit: Callable[[int], Any] = os._exit):
        self.signals = tuple(signals)
        self._force_exit = force_exit
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.signum: int | None = None
        self.count = 0

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived (thread-safe; other threads may poll or `wait` it)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    @property
    def signal_name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    @property
    def message(self) -> str:
        if self.signum is None:
            return "no stop signal received"
        return f"received {self.signal_name}: stopped after saving a checkpoint"

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            self.signum = signum
            self._event.set()
            print(f"[jaxrl_async] received {signal.Signals(signum).name}: finishing the current step, "
                  "saving a checkpoint and exiting (send it again to exit immediately)", file=sys.stderr, flush=True)
            return
        print(f"[jaxrl_async] received {signal.Signals(signum).name} again: exiting now without saving",
              file=sys.stderr, flush=True)
        self._force_exit(128 + signum)

    def __enter__(self) -> "SignalHandler":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SignalHandler must be entered on the main thread (Python delivers signals there)")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()


class TrainingDivergedError(RuntimeError):
    """Too many consecutive non-finite training steps."""


def all_finite(values: Mapping[str, Any]) -> tuple[bool, list[str]]:
    """(all finite?, names of the non-finite values). Values are host scalars or 0-d arrays."""
    bad = [k for k, v in values.items() if not math.isfinite(float(v))]
    return not bad, bad


@dataclasses.dataclass
class NonFiniteTracker:
    """Counts non-finite steps; raises TrainingDivergedError after `max_consecutive` in a row.

    `update(step, loss=..., grad_norm=...)` returns True when the step is finite (apply it) and
    False when it must be skipped. The counters are part of the checkpoint (`state_dict`).
    """

    max_consecutive: int = 5
    consecutive: int = 0
    total_skipped: int = 0
    first_bad_step: int | None = None  # first step of the current run of non-finite steps

    def __post_init__(self):
        if not isinstance(self.max_consecutive, int) or self.max_consecutive < 1:
            raise ValueError(f"NonFiniteTracker.max_consecutive: must be an int >= 1, got {self.max_consecutive!r}")

    def update(self, step: int, **values: Any) -> bool:
        ok, bad = all_finite(values)
        if ok:
            self.consecutive = 0
            self.first_bad_step = None
            return True
        self.consecutive += 1
        self.total_skipped += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        detail = ", ".join(f"{k}={float(values[k])}" for k in bad)
        log.warning("step %d: non-finite %s; update skipped (%d in a row, %d in total)",
                    step, detail, self.consecutive, self.total_skipped)
        if self.consecutive >= self.max_consecutive:
            raise TrainingDivergedError(
                f"{self.consecutive} consecutive non-finite steps ({self.first_bad_step}..{step}; last: {detail}); "
                f"max_consecutive={self.max_consecutive}. Stopping: parameters are those of the last finite step.")
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "total_skipped": self.total_skipped,
                "first_bad_step": self.first_bad_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.consecutive = int(state["consecutive"])
        self.total_skipped = int(state["total_skipped"])
        self.first_bad_step = state.get("first_bad_step")
