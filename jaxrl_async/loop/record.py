"""The outcome of an RL run (``RunResult``): what ``loop.RLRun.run`` returns and ``main``'s last line."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RunResult"]


@dataclasses.dataclass
class RunResult:
    run_dir: str
    steps: int
    version: int
    wall_s: float
    eval_history: list[tuple[int, float, float]]  # (step, wall time, accuracy)
    counts: dict[str, Any]
    lag_by_group: list[tuple[int, int, int]]  # (step, ticket id, lag) of every trained group
    last_metrics: dict[str, Any]
    checkpoint_step: int | None = None
    export_dir: str | None = None
    stopped_by: str = "completed"
    resumes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # of the whole run (metrics rows)
    warm_start: bool = False  # the step-0 evaluation is the warm-started policy's
    process_wall_s: float = 0.0  # this process (wall_s: the whole run, cumulative over resumes)

    def final_line(self) -> str | None:
        """The one line ``main`` ends a completed run with: held-out accuracy at the start (the warm
        start's when there was one) and at the end, over the whole run, and its resumes."""
        if self.stopped_by != "completed":
            return None
        text = f"[jaxrl_async] done: {self.steps} steps in {self.wall_s:.0f} s"
        if self.eval_history:
            (s0, _, a0), (s1, _, a1) = self.eval_history[0], self.eval_history[-1]
            start = "after the warm start" if (self.warm_start and s0 == 0) else f"at step {s0}"
            text += f"; held-out accuracy {a0:.3f} {start} -> {a1:.3f} at step {s1}"
        if self.resumes:
            at = ", ".join(f"warm-start step {r['at_sft_step']}" if r.get("phase") == "warm_start"
                           else f"step {r['at_step']}" for r in self.resumes)
            text += f"; resumed {len(self.resumes)}x ({at})"
        return text + f"; run directory {self.run_dir}"
