"""The trainer side's contract: what the loop asks of the trainer, whatever runs it.

A ``TrainerService`` holds the training state (parameters, optimizer state, counters) itself, so
that the same operations can be replayed on every process of a trainer group: the group's service
(``distributed.controller.GroupTrainer``) sends each operation to the followers, which run it on their
own ``loop.services.LocalTrainer``, then runs it here. Every method that runs a program over the
trainer mesh or synchronises the checkpointer is one ordered operation; the loop calls them from its
main thread only.

Implementations: ``loop.services.LocalTrainer`` (this process) and
``distributed.controller.GroupTrainer`` (a trainer spanning several processes).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

__all__ = ["TrainerService"]


@runtime_checkable
class TrainerService(Protocol):
    def build(self) -> None:
        """Compile-ready trainer (loss, optimizer, shardings) and the checkpointer of the run directory."""

    @property
    def checkpointer(self) -> Any:
        """The run directory's ``checkpoint.Checkpointer``, for queries only (``step_dir``, ``should_save``,
        ``last_saved_step``, ``latest_committed_step``); saving and closing go through this service."""

    def latest_checkpoint(self) -> int | None:
        """The newest committed RL checkpoint step of the run directory (None: a fresh run)."""

    def restore(self) -> Any:
        """Restore the newest usable checkpoint into the held state; returns the checkpoint's
        ``Restored`` (step, meta with the data state, finished groups)."""

    def initial_state(self, sft_examples: Sequence[Any] | None) -> None:
        """Fresh state from the initial parameters, after the SFT warm start on ``sft_examples``
        (None: no warm start)."""

    @property
    def params(self) -> Any:
        """The current parameters (trainer layout): what a push sends and an export writes."""

    def train(self, trajectories: Sequence[Any], policy_version: int) -> list[dict[str, Any]]:
        """One RL step on ``trajectories`` (the proximal log-probs and every minibatch update); the held
        state becomes the updated one. Returns the per-minibatch statistics."""

    def state_consumed(self) -> bool:
        """True when a failed step left the held state's buffers donated (nothing left to save)."""

    def save(self, meta: Any, buffered: Sequence[Mapping[str, Any]]) -> Any:
        """Checkpoint the held state with ``meta`` (step, version, data state) and the finished groups."""

    def wait_checkpoint(self) -> None: ...

    def close_checkpoint(self) -> None: ...

    def export(self, step: int) -> Any:
        """The Hugging Face export of checkpoint ``step``."""
