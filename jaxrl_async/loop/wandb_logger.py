"""The run's Weights & Biases run (``logging.wandb``): ``WandbRun.start`` at the start of ``RLRun.run``, before
anything is compiled; ``MetricsLogger`` sends it every row it writes; ``RLRun.run`` finishes it.

* Metrics: the scalars of every ``metrics.jsonl`` row (what TensorBoard gets: numbers and booleans; ``null``
  values, strings, ``step``, ``wall_time`` and ``time`` left out) go to ``wandb.log`` with ``step`` = the RL
  step. Several rows of one step (the train row, an evaluation, a checkpoint's cost) make one W&B history
  row.
* Config: the resolved config as ``RUN/config.json`` holds it, its ``_resolved`` part (device split, vocab
  size, attention, ...) as ``resolved`` (W&B hides keys that start with ``_``).
* Files: ``dir=RUN``, so W&B writes ``RUN/wandb/run-*`` (``offline-run-*`` offline: upload with
  ``wandb sync RUN/wandb/offline-run-*``).
* Resume: the id is kept in ``RUN/wandb_id`` and the run is opened with ``resume="allow"``. A run directory
  with a committed checkpoint (RL or warm start) resumes and reuses the id, so the W&B curves continue; one
  without (a new run, or a restart before the first checkpoint) gets a new id. W&B steps only increase, so
  the steps a resume redoes (logged before the stop, after the checkpoint) keep their first values in W&B
  (``metrics.jsonl`` and TensorBoard hold the redone ones); ``MetricsLogger`` leaves out the rows of steps
  below the W&B run's ``starting_step`` (online) rather than have W&B warn about each. A W&B run opened
  for a run that already has history (W&B enabled at a resume) gets that history first
  (``fresh``: ``MetricsLogger`` replays its kept rows).

A failing ``wandb.init`` (online without credentials, an unreachable server, a bad entity) stops the run
before anything is compiled, in one line (``ConfigError`` naming ``logging.wandb``). A failing ``log`` later
is reported once and W&B logging stops; the run and its other logs go on.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Callable, Mapping

from jaxrl_async.config import ConfigError, RunConfig
from jaxrl_async.config.resume import CHECKPOINTS_DIR, WARM_START_CHECKPOINTS, committed_steps

__all__ = ["WANDB_ID_FILE", "WandbRun", "wandb_scalars"]

WANDB_ID_FILE = "wandb_id"
_NOT_LOGGED = ("step", "wall_time", "time")


def wandb_scalars(row: Mapping[str, Any]) -> dict[str, Any]:
    """The values of a flattened metrics row that W&B gets (those TensorBoard gets)."""
    return {k: v for k, v in row.items() if k not in _NOT_LOGGED and v is not None and not isinstance(v, str)}


def _run_id(run_dir: str) -> tuple[str, bool]:
    """(id, fresh): the stored id when the run directory has a committed checkpoint (the run resumes), else a
    new one (8 characters of [0-9a-f], as W&B's own ids)."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    resumes = bool(committed_steps(os.path.join(run_dir, CHECKPOINTS_DIR))
                   or committed_steps(os.path.join(run_dir, WARM_START_CHECKPOINTS)))
    if resumes and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            stored = f.read().strip()
        if stored:
            return stored, False
    run_id = secrets.token_hex(4)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)
    return run_id, True


class WandbRun:
    """One process's handle on the run's W&B run (module docstring). ``fresh``: the W&B run id is new (the
    metrics history of earlier processes, if any, is not in it yet); ``starting_step``: W&B's first step of
    this process (> 0 when an online run resumed)."""

    def __init__(self, run: Any, run_id: str, fresh: bool, say: Callable[[str], None]):
        self.run, self.id, self.fresh, self.say = run, run_id, fresh, say
        self.starting_step = int(getattr(run, "starting_step", 0) or 0)
        self.skipped_rows = 0
        self.failed: str | None = None

    @classmethod
    def start(cls, cfg: RunConfig, run_dir: str, config: Mapping[str, Any],
              say: Callable[[str], None] = print) -> "WandbRun":
        """``wandb.init`` for ``cfg`` (``logging.wandb_*``) in ``run_dir`` with ``config`` as the W&B config;
        a failure is a one-line ``ConfigError`` naming ``logging.wandb``."""
        import wandb

        lg = cfg.logging
        run_dir = os.path.abspath(run_dir)
        run_id, fresh = _run_id(run_dir)
        project = lg.wandb_project or cfg.name
        try:
            run = wandb.init(project=project, entity=lg.wandb_entity,
                             name=lg.wandb_run_name or os.path.basename(os.path.normpath(run_dir)), id=run_id,
                             resume="allow", dir=run_dir, mode=lg.wandb_mode, config=dict(config),
                             tags=list(lg.wandb_tags) or None)
        except Exception as e:  # noqa: BLE001 - W&B raises many types (UsageError, CommError, timeouts, ...)
            why = " ".join(str(e).split())[:400].rstrip(". ") or "(no message)"
            hint = (" (log in with `wandb login` or WANDB_API_KEY, or log offline: logging.wandb_mode=offline)"
                    if lg.wandb_mode == "online" else "")
            raise ConfigError("logging.wandb", f"W&B run {project}/{run_id} ({lg.wandb_mode}) did not start: "
                              f"{type(e).__name__}: {why}{hint}") from None
        out = cls(run, run_id, fresh, say)
        where = f"{lg.wandb_entity + '/' if lg.wandb_entity else ''}{project}/{run_id}"
        say(f"W&B run {where} ({lg.wandb_mode}" + (", resumed" if not fresh else "")
            + (f" at step {out.starting_step}" if out.starting_step else "") + f"), files in {run_dir}/wandb")
        return out

    def log_row(self, row: Mapping[str, Any]) -> None:
        """Send one flattened metrics row (``MetricsLogger``'s) at its step; W&B failures do not stop the run."""
        if self.failed is not None:
            return
        step = int(row["step"])
        if step < self.starting_step:
            if not self.skipped_rows:
                self.say(f"W&B run {self.id} continues at step {self.starting_step}: rows of earlier steps (redone "
                         "after the resume) stay in metrics.jsonl and TensorBoard only")
            self.skipped_rows += 1
            return
        data = wandb_scalars(row)
        if not data:
            return
        try:
            self.run.log(data, step=step)
        except Exception as e:  # noqa: BLE001 - logging must not end a training run
            self.failed = f"{type(e).__name__}: {e}"
            self.say(f"W&B logging failed at step {step} ({self.failed}); W&B gets no more rows "
                     "(metrics.jsonl and TensorBoard continue)")

    def finish(self, exit_code: int = 0) -> None:
        """Close the W&B run (``exit_code`` != 0 marks it failed); a failure to close is reported, not raised."""
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            self.say(f"W&B run {self.id} did not finish cleanly: {type(e).__name__}: {e}")
