"""One RL step as a unit (``StepRunner``): the one place where the trained state, the policy version, the
data ledger and the step counter advance together.

    batch (B groups) -> advantages -> TrainerService.train -> non-finite check -> COMMIT -> push

The commit (ledger ``consumed``, ``step += 1``, ``version += 1``) follows the update immediately, with
no call in between that can fail for another role's reason, so every checkpoint (periodic, on a stop,
or the emergency one after a failure) holds a state and a ledger of the same step: a step whose
update ran has consumed its data; a step that raised before its update (a failed train call) has
consumed nothing and its batch is replayed after a resume. The weight push comes after the commit: a
push that fails (a generator timed out or died) stops the run with the trained step saved, so the
resumed run trains every prompt exactly once. A step whose update was skipped as non-finite is a step
too (its data consumed, as AReaL counts it); the n-th in a row commits and then stops the run
(``FatalRunError``) with that state.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from jaxrl_async.api import TrainerService
from jaxrl_async.rl.batch import build_training_batch
from jaxrl_async.trainer.train_step import step_metrics

__all__ = ["FatalRunError", "StepOutcome", "StepRunner"]


class FatalRunError(RuntimeError):
    """The run cannot continue (message says why); a checkpoint is attempted before raising."""


@dataclasses.dataclass
class StepOutcome:
    row: dict[str, Any]  # the batch's metrics (rewards, lengths, staleness, advantages)
    stats: list[dict[str, Any]]  # per minibatch
    summary: dict[str, Any]  # ``step_metrics`` of every minibatch
    finite: bool
    train_s: float
    groups: Sequence[Any]


class StepRunner:
    """Holds ``step`` and ``version`` (a resumed run uses version = step) and advances them with the
    trainer's state and the ledger (module docstring)."""

    def __init__(self, trainer: TrainerService, ledger: Any, nonfinite: Any, *, advantage: Any, n_samples: int,
                 step: int, version: int):
        self.trainer, self.ledger, self.nonfinite = trainer, ledger, nonfinite
        self.advantage, self.n_samples = advantage, n_samples
        self.step, self.version = step, version

    def run(self, groups: Sequence[Any]) -> StepOutcome:
        from jaxrl_async.checkpoint import TrainingDivergedError

        # batch order = draw order: independent of finish timing and of ticket numbering after a resume
        # (part of the eta = 0 bitwise resume determinism)
        groups = sorted(groups, key=lambda g: self.ledger.draw_index(g.ticket))
        trajs, row = build_training_batch(groups, self.advantage, self.n_samples)
        t0 = time.monotonic()
        stats = self.trainer.train(trajs, self.version)
        summary = step_metrics(stats)  # every minibatch of the step, not only the last
        diverged = None
        try:
            finite = self.nonfinite.update(self.step + 1, loss=summary["loss"], grad_norm=summary["grad_norm"])
        except TrainingDivergedError as e:
            finite, diverged = False, e
        self._commit(groups)
        if diverged is not None:  # stop with a checkpoint of this (skipped, so last finite) state
            raise FatalRunError(f"training diverged: {diverged}") from diverged
        return StepOutcome(row, stats, summary, finite, time.monotonic() - t0, groups)

    def _commit(self, groups: Sequence[Any]) -> None:
        """The update happened (applied, or skipped as non-finite): its data is consumed by the step it
        made, and the step and policy version advance, together."""
        self.ledger.consumed([g.ticket.id for g in groups], step=self.step + 1, version=self.version,
                             lags=[g.lag for g in groups])
        self.step += 1
        self.version += 1
