"""The SFT warm start of an RL run, interruptible and resumable (``WarmStart``).

Policy: the warm start is checkpointed, not restarted. ``SFTRun`` trains step by step; its state
(params, AdamW state, step) is saved to ``RUN/warm_start/checkpoints/<SFT step>`` every
``checkpoint.every_seconds`` (a kill loses at most that much) and, on SIGTERM/SIGINT, after the
current step (then the run ends with ``StopRequested``: exit 0, one line). The next process restores
it and continues the warm start exactly where it stopped (same batches, same learning-rate schedule).
When the warm start is done, the loop saves its result as RL checkpoint 0 (waited for) and removes
``RUN/warm_start`` (``RLRun``): from then on the run resumes from the RL checkpoints. The cumulative
wall clock travels in the checkpoints' metadata (``extra["wall_s"]``).

A trainer group (``distributed``) runs the warm start whole on every process, in step
(``interruptible=False``): there it is neither stopped nor checkpointed part-way (a stop waits for its
end; an interrupted one restarts).
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from jaxrl_async.config import RunConfig, to_dict
from jaxrl_async.loop.control import WARM_START_DIR, RunControl
from jaxrl_async.loop.state import restore_train_state, state_from_items, state_items

__all__ = ["WarmStart"]


class WarmStart:
    """``WarmStart(cfg, mesh, control)(params, examples, model_cfg) -> params`` (module docstring).
    ``control`` None: the whole warm start, uninterrupted and unsaved (a follower of a trainer group)."""

    def __init__(self, cfg: RunConfig, mesh: Any, control: RunControl | None, *, interruptible: bool = True):
        self.cfg, self.mesh, self.control = cfg, mesh, control
        self.interruptible = interruptible and control is not None

    def __call__(self, params: Any, examples: Sequence[Any], model_cfg: Any) -> Any:
        from jaxrl_async.trainer.sft import SFTRun

        c = self.cfg
        t0 = time.monotonic()
        sft = SFTRun(params, model_cfg, examples, c.trainer.sft, mesh=self.mesh, seed=c.seed)
        if not self.interruptible:
            if self.control is not None:
                self.control.set_phase("the SFT warm start of a trainer group", "stopping once the warm start is done")
            sft.run(progress=self.control is not None and self.control.progress(c.logging.progress))
            if self.control is not None:
                self.control.say(f"SFT warm start: {sft.total_steps} steps in {time.monotonic() - t0:.1f} s")
            return sft.state.params
        k0 = self._run_checkpointed(sft, params)
        hist = sft.history
        self.control.say(f"SFT warm start: steps {k0 + 1}..{sft.total_steps} in {time.monotonic() - t0:.1f} s, "
                         f"loss {hist[0]['loss']:.3f} -> {hist[-1]['loss']:.3f}" if hist else "SFT warm start: done")
        return sft.state.params

    def _run_checkpointed(self, sft: Any, params: Any) -> int:
        """Run ``sft`` to its end with its own checkpoints (resumed from them); returns the step it
        started from. A stop signal saves after the current step and raises ``StopRequested``."""
        from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer, TrainMeta

        c, ctl, ck = self.cfg, self.control, self.cfg.checkpoint
        N = sft.total_steps
        sck = Checkpointer(os.path.join(ctl.run_dir, WARM_START_DIR),
                           CheckpointConfig(every_seconds=ck.every_seconds, keep_last=2, async_save=ck.async_save))
        try:
            if sck.latest_committed_step() is not None:
                r = restore_train_state(sck, sft.trainer, params)
                sft.load(state_from_items(r.arrays), r.step)
                ctl.wall0 = float((r.meta.extra or {}).get("wall_s", 0.0))
                ctl.resume_rows.append({"resume/sft_step": r.step, "resume/sft_steps": N,
                                        "resume/checkpoint": os.path.relpath(sck.step_dir(r.step), ctl.run_dir)})
                ctl.say(f"warm start resumed from {sck.step_dir(r.step)}: SFT step {r.step} of {N}")
            ctl.set_phase("the SFT warm start", "saving the warm-start state after the current step, then exiting")

            def save(k: int, why: str) -> None:
                sck.save(state_items(sft.state), TrainMeta(step=k, policy_version=0, config=to_dict(c),
                                                           extra={"why": why, "wall_s": ctl.wall(), "sft_steps": N}))

            def periodic(k: int) -> None:
                if k < N and sck.should_save(k):
                    save(k, "periodic")

            k0 = sft.step
            if not sft.run(progress=ctl.progress(c.logging.progress), should_stop=ctl.stop_requested, after_step=periodic):
                if sft.step > max(sck.last_saved_step, 0):
                    save(sft.step, "signal")
                sck.wait()
                latest = sck.latest_committed_step()
                raise ctl.stopped(None if latest is None else
                                  f"warm-start checkpoint {sck.step_dir(latest)} (SFT step {latest} of {N}) is "
                                  "committed, the warm start continues from there")
        finally:
            sck.close()
        return k0
