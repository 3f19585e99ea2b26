"""Failure-handling helpers for the training loop: graceful signals and non-finite step accounting.

`SignalHandler` turns SIGTERM/SIGINT into a flag the loop polls between steps (preemption notice:
finish or abort the step, save a checkpoint, exit 0). A second signal while the first is being
handled forces the process out immediately (exit code 128 + signum, the shell convention), so a
wedged save can always be interrupted. Handlers are installed on `__enter__` and the previous
ones restored on `__exit__`; Python only allows this on the main thread. `handle_signals` installs
one around a command's whole ``main`` (so every phase, from data preparation to export, stops
cleanly) and turns a `StopRequested` into its one line and exit status 0.

`NonFiniteTracker` counts steps whose loss/gradient norm is NaN/Inf (the loop skips the update)
and raises `TrainingDivergedError` after `max_consecutive` such steps in a row, so the loop stops
with a checkpoint of the last good state instead of burning accelerator time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger(__name__)


class StopRequested(Exception):
    """A stop signal ended the work in an orderly way; the message is the one line that says what was
    saved and how to continue (``handle_signals`` prints it and returns exit status 0)."""


class SignalHandler:
    """Context manager: the first SIGTERM/SIGINT sets `requested`; the second forces exit.

    with SignalHandler() as stop:
        for step in ...:
            train_step()
            if stop.requested:
                checkpointer.save(...); checkpointer.wait()
                print(stop.message); sys.exit(0)

    Signals are noticed at once, whatever the main thread is doing: besides the Python-level handler
    (which only runs when the main thread executes bytecode, i.e. not during an XLA compile or a
    blocking device call), a watcher thread reads the signal numbers that CPython's C-level handler
    writes to a wakeup pipe (`signal.set_wakeup_fd`). So the first signal's message and flag, and the
    second signal's forced exit, never wait for a long compile to end.

    `phase` (set by the loop, e.g. "the SFT warm start") and `plan` (what the first signal will do
    there) make the first message specific. `force_exit(code)` is called on the second signal
    (default `os._exit`, which skips cleanup: committed checkpoints are safe by construction, an
    unfinished one is ignored on restart).
    """

    _active: list["SignalHandler"] = []  # entered handlers, innermost last

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT), *,
                 force_exit: Callable[[int], Any] = os._exit, prefix: str = "[jaxrl_async]"):
        self.signals = tuple(signals)
        self._force_exit = force_exit
        self._prefix = prefix
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self._count_lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup_fd: int | None = None
        self._watcher: threading.Thread | None = None
        self.signum: int | None = None
        self.count = 0
        self.phase: str | None = None
        self.plan = "finishing the current step, saving a checkpoint and exiting"

    @classmethod
    def active(cls) -> "SignalHandler | None":
        """The innermost entered handler (e.g. the one ``handle_signals`` installed for a command), or None."""
        return cls._active[-1] if cls._active else None

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived (thread-safe; other threads may poll or `wait` it)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def set_phase(self, phase: str | None, plan: str | None = None) -> None:
        """Name the phase of the run the process is in (and what a first signal does there)."""
        self.phase = phase
        if plan is not None:
            self.plan = plan

    @property
    def signal_name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    @property
    def message(self) -> str:
        if self.signum is None:
            return "no stop signal received"
        return f"received {self.signal_name}: stopped after saving a checkpoint"

    def _say(self, text: str) -> None:
        line = f"{self._prefix} {text}"
        try:
            bars = list(getattr(getattr(sys.modules.get("tqdm"), "tqdm", None), "_instances", ()))
        except RuntimeError:  # changed while copied (another thread)
            bars = []
        if any(not getattr(b, "disable", True) for b in bars):
            line = "\n" + line  # a progress bar is on the line: start a new one (no lock: never blocks)
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed: the flag and the exit still work
            pass

    def _received(self, signum: int) -> None:
        with self._count_lock:
            self.count += 1
            first = self.count == 1
            if first:
                self.signum = signum
        name = signal.Signals(signum).name
        if first:
            self._event.set()
            where = f" during {self.phase}" if self.phase else ""
            self._say(f"received {name}{where}: {self.plan} (send it again to exit at once without saving)")
            return
        self._say(f"received {name} again: exiting now without saving (exit code {128 + signum}); committed "
                  "checkpoints are kept and the same command resumes from the latest")
        self._force_exit(128 + signum)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._watcher is None:  # no wakeup pipe: count here (the watcher counts otherwise)
            self._received(signum)

    def _watch(self, rfd: int) -> None:
        while True:
            try:
                data = os.read(rfd, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.signals:
                    self._received(signum)

    def __enter__(self) -> "SignalHandler":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SignalHandler must be entered on the main thread (Python delivers signals there)")
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        try:
            self._old_wakeup_fd = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        except (ValueError, OSError):  # e.g. not allowed here: the Python-level handler counts
            os.close(rfd)
            os.close(wfd)
        else:
            self._pipe = (rfd, wfd)
            self._watcher = threading.Thread(target=self._watch, args=(rfd,), name="signal-watcher", daemon=True)
            self._watcher.start()
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        SignalHandler._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self in SignalHandler._active:
            SignalHandler._active.remove(self)
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._pipe is not None:
            rfd, wfd = self._pipe
            signal.set_wakeup_fd(self._old_wakeup_fd if self._old_wakeup_fd is not None else -1)
            os.close(wfd)  # the watcher reads EOF and ends
            if self._watcher is not None:
                self._watcher.join(timeout=5.0)
            os.close(rfd)
            self._pipe, self._watcher = None, None


def handle_signals(fn: Callable[..., int]) -> Callable[..., int]:
    """Decorator for a command's ``main``: SIGTERM/SIGINT are handled from its first line on (a
    `SignalHandler`, found by the code it runs through `SignalHandler.active()`), so no phase of the
    command dies by a signal or a KeyboardInterrupt traceback; a `StopRequested` it raises is printed
    as its one line and the command returns 0. Off the main thread it only calls ``fn``."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> int:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        with SignalHandler():
            try:
                return fn(*args, **kwargs)
            except StopRequested as e:
                print(f"[jaxrl_async] {e}", file=sys.stderr, flush=True)
                return 0

    return run


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
