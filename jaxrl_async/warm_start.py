"""The SFT warm start of an RL run, interruptible and resumable (``WarmStartMixin`` of ``rl_loop.RLLoop``).

Policy: the warm start is checkpointed, not restarted. ``SFTRun`` trains step by step; its state
(params, AdamW state, step) is saved to ``RUN/warm_start/checkpoints/<SFT step>`` every
``checkpoint.every_seconds`` (a kill loses at most that much) and, on SIGTERM/SIGINT, after the
current step (then the run ends with ``StopRequested``: exit 0, one line). The next process restores
it and continues the warm start exactly where it stopped (same batches, same learning-rate schedule).
When the warm start is done, its result is saved as RL checkpoint 0 (waited for) and
``RUN/warm_start`` is removed: from then on the run resumes from the RL checkpoints. The cumulative
wall clock travels in the checkpoints' metadata (``extra["wall_s"]``).

A trainer group (``distributed``) runs the warm start whole on every process, in step: there it is
neither stopped nor checkpointed part-way (a stop waits for its end; an interrupted one restarts).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Sequence

from jaxrl_async.config import to_dict
from jaxrl_async.data.ledger import DataLedger
from jaxrl_async.run_state import _state_from_items, _state_items, restore_train_state

__all__ = ["WARM_START_DIR", "WarmStartMixin", "committed_steps"]

WARM_START_DIR = "warm_start"  # RUN/warm_start/checkpoints/<SFT step>: an interrupted warm start


def committed_steps(directory: str) -> list[int]:
    """Committed checkpoint steps under ``directory`` (a listing, no Orbax)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isfile(os.path.join(directory, n, "commit_success.txt")))


class WarmStartMixin:
    """``_warm_start`` / ``_save_warm_start`` of ``RLLoop`` (which provides cfg, model_cfg, trainer_mesh,
    run_dir, wall(), _say, _phase, _stop_requested, _stopped, resume_rows, wall0 and the checkpoint hooks)."""

    def _warm_start(self, params: Any, examples: Sequence[Any], model_cfg: Any = None) -> Any:
        """The SFT warm start (``SFTRun``), checkpointed in ``RUN/warm_start`` every
        ``checkpoint.every_seconds`` and when a stop signal arrives (after the current step: then
        ``StopRequested``), and continued from there by the next process. On a trainer group (the
        followers run the warm start whole, in step) it is neither stopped nor checkpointed part-way:
        a stop there waits for its end and an interrupted one restarts. ``model_cfg``: of ``params``
        (default the run's; LoRA runs warm-start the base without adapters)."""
        from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer, TrainMeta
        from jaxrl_async.trainer.sft import SFTRun

        c, tr, ck = self.cfg, self.cfg.trainer, self.cfg.checkpoint
        t0 = time.monotonic()
        sft = SFTRun(params, model_cfg or self.model_cfg, examples, tr.sft, mesh=self.trainer_mesh, seed=c.seed)
        N = sft.total_steps
        if getattr(self, "group", None) is not None:
            self._phase("the SFT warm start of a trainer group", "stopping once the warm start is done")
            sft.run(progress=c.logging.progress)
            self._say(f"SFT warm start: {N} steps in {time.monotonic() - t0:.1f} s")
            return sft.state.params
        wdir = os.path.join(self.run_dir, WARM_START_DIR)
        sck = Checkpointer(wdir, CheckpointConfig(every_seconds=ck.every_seconds, keep_last=2, async_save=ck.async_save))
        try:
            if sck.latest_committed_step() is not None:
                r = restore_train_state(sck, sft.trainer, params)
                sft.load(_state_from_items(r.arrays), r.step)
                self.wall0 = float((r.meta.extra or {}).get("wall_s", 0.0))
                self.resume_rows.append({"resume/sft_step": r.step, "resume/sft_steps": N,
                                         "resume/checkpoint": os.path.relpath(sck.step_dir(r.step), self.run_dir)})
                self._say(f"warm start resumed from {sck.step_dir(r.step)}: SFT step {r.step} of {N}")
            self._phase("the SFT warm start", "saving the warm-start state after the current step, then exiting")

            def save(k: int, why: str) -> None:
                sck.save(_state_items(sft.state), TrainMeta(step=k, policy_version=0, config=to_dict(c),
                                                            extra={"why": why, "wall_s": self.wall(), "sft_steps": N}))

            def periodic(k: int) -> None:
                if k < N and sck.should_save(k):
                    save(k, "periodic")

            k0 = sft.step
            if not sft.run(progress=c.logging.progress, should_stop=self._stop_requested, after_step=periodic):
                if sft.step > max(sck.last_saved_step, 0):
                    save(sft.step, "signal")
                sck.wait()
                latest = sck.latest_committed_step()
                raise self._stopped(None if latest is None else
                                    f"warm-start checkpoint {sck.step_dir(latest)} (SFT step {latest} of {N}) is "
                                    "committed, the warm start continues from there")
        finally:
            sck.close()
        hist = sft.history
        self._say(f"SFT warm start: steps {k0 + 1}..{N} in {time.monotonic() - t0:.1f} s, "
                  f"loss {hist[0]['loss']:.3f} -> {hist[-1]['loss']:.3f}" if hist else "SFT warm start: done")
        return sft.state.params

    def _save_warm_start(self, ckpt: Any, state: Any, data_iter: Any, nonfinite: Any) -> None:
        """The warm-started state as RL checkpoint 0 (waited for: the warm start is costly to redo); the
        warm start's own checkpoints are then removed."""
        from jaxrl_async.checkpoint import TrainMeta

        meta = TrainMeta(step=0, policy_version=0, data_state=DataLedger(data_iter).state(), staleness=None,
                         config=to_dict(self.cfg), extra={"nonfinite": nonfinite.state_dict(), "why": "warm start done",
                                                          "wall_s": self.wall()})
        self._phase("saving the warm-started model", "stopping once it is saved")
        st = self._save_checkpoint(ckpt, _state_items(state), meta, [])
        self._wait_checkpoint(ckpt)
        shutil.rmtree(os.path.join(self.run_dir, WARM_START_DIR), ignore_errors=True)
        self._say(f"checkpoint {ckpt.step_dir(0)}: the warm-started model (blocking {st.blocking_s:.2f} s)")
