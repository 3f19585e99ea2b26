"""``RLRun``: one run of a ``RunConfig``, composed from role services (``api``), in four phases:

    setup   devices / meshes (``services.place``), tokenizer and data, model    -> ``RunSetup``
    resume  the trainer service built; the newest checkpoint restored, or the initial state (+ the SFT
            warm start, saved as checkpoint 0)                                   -> ``ResumePoint``
    steps   the generator role started; rollouts, steps, evaluations, checkpoints (``session.TrainingSession``)
    finish  the final evaluation, checkpoint, export and ``summary.json``        -> ``RunResult``

The single-process run uses ``services.LocalServices``; ``distributed.controller.DistributedServices``
runs the generators in other processes and the trainer over a group of processes. The loop itself is
the same code for both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Callable

import jax
import numpy as np

from jaxrl_async.config import RunConfig, save_config, to_dict
from jaxrl_async.data.ledger import DataLedger, record_from_json
from jaxrl_async.loop.control import WARM_START_DIR, RunControl
from jaxrl_async.loop.services import LocalServices
from jaxrl_async.loop.setup import RunSetup, attention_choice, load_model, load_tokenizer_and_data, sft_examples
from jaxrl_async.loop.record import RunResult

__all__ = ["RLRun", "ResumePoint", "run"]


@dataclasses.dataclass
class ResumePoint:
    """Where the RL steps start: the step (= policy version), the data iterator's position, the prompts
    to replay first, the finished groups a checkpoint held, and the non-finite tracker."""

    data_iter: Any
    nonfinite: Any
    latest: int | None  # the newest committed checkpoint (even when not resumed from)
    step: int = 0
    replay: list = dataclasses.field(default_factory=list)
    next_draw: int = 0
    log_records: int | None = None
    saved_groups: list = dataclasses.field(default_factory=list)
    resumed_from: int | None = None
    groups_unusable: str | None = None  # why the checkpoint's finished groups cannot be reused (ledger reason)


class RLRun:
    """One run of ``cfg`` (validated by ``config.validate``): ``RLRun(cfg).run()``. Everything the run writes
    lives in ``cfg.resolved_run_dir``: ``config.json``, ``tokenizer/``, ``data/`` (generated tasks),
    ``metrics.jsonl``, ``data_ledger.jsonl``, ``tb/``, ``curves.png``, ``checkpoints/``, ``hf/`` (export),
    ``summary.json``; with ``logging.wandb`` also ``wandb_id`` and ``wandb/``. The setup runs in the constructor
    (``self.setup``). ``progress_style``: how the console shows the steps when ``logging.progress`` is on
    (``RunControl``)."""

    def __init__(self, cfg: RunConfig, services: Any = None, *, log_fn: Callable[[str], None] | None = None,
                 signals: Any = None, progress_style: str = "bar"):
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.resolved_run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.control = RunControl(self.run_dir, log_fn=log_fn, signals=signals, progress_style=progress_style)
        self.services = services if services is not None else LocalServices()
        self.trainer = None
        self.wandb = None  # the W&B run (``logging.wandb``), started by ``run``
        self.setup = self._setup()

    # -- setup ------------------------------------------------------------------------------------------
    def _setup(self) -> RunSetup:
        cfg, ctl = self.cfg, self.control
        ctl.set_phase("setup (devices, tokenizer, data, model)", "stopping when this phase ends")
        ctl.check_stop()
        placement = self.services.place(cfg, ctl)
        ctl.check_stop()
        tokenizer, tok_dir, train_ds, eval_records = load_tokenizer_and_data(cfg, self.run_dir, ctl.say)
        ctl.check_stop()
        model_cfg, params, base_ref, eos_ids = load_model(cfg, tokenizer, placement.trainer_mesh)
        ctl.check_stop()
        setup = RunSetup(cfg, self.run_dir, placement, tokenizer, tok_dir, train_ds, eval_records, model_cfg, params,
                         base_ref, eos_ids)
        self.services.after_setup(setup, ctl)
        self.resolved = {
            "generator_devices": list(placement.gen_ids), "trainer_devices": list(placement.trainer_ids),
            "vocab_size": model_cfg.vocab_size, "tokenizer_dir": tok_dir,
            "attention": attention_choice(cfg, model_cfg, placement.trainer_mesh),
            "train_records": len(train_ds), "eval_records": len(eval_records)}
        save_config(cfg, self.run_dir, extra=self.resolved)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        tr, ro = cfg.trainer, cfg.rollout
        ctl.say(f"run {self.run_dir}: {model_cfg.num_layers}-layer model, {n_params / 1e6:.2f} M parameters; "
                + (f"SFT warm start {tr.sft.steps} steps, then " if tr.sft.steps > 0 else "")
                + f"RL {tr.total_steps} steps ({ro.mode}, eta {ro.effective_max_head_offpolicyness}, "
                f"{tr.batch_size} prompts x {ro.n_samples} samples); config in config.json (--print-config prints it)")
        return setup

    # -- the run --------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Resume, train, finish. With ``logging.wandb`` the W&B run starts first (before the trainer is
        compiled: a failing start is a one-line ``ConfigError``) and is finished at the end (failed if the run
        raised)."""
        from jaxrl_async.loop.session import TrainingSession

        ok = False
        try:
            if self.cfg.logging.wandb:
                from jaxrl_async.loop.wandb_logger import WandbRun

                self.wandb = WandbRun.start(self.cfg, self.run_dir, {**to_dict(self.cfg), "resolved": self.resolved},
                                            say=self.control.say)
            point = self._resume()
            if point.step >= self.cfg.trainer.total_steps:
                result = self._already_complete(point)
            else:
                result = TrainingSession(self, point).run()
            ok = True
            return result
        finally:
            self.services.close()
            if self.wandb is not None:
                self.wandb.finish(exit_code=0 if ok else 1)

    # -- resume ---------------------------------------------------------------------------------------
    def _resume(self) -> ResumePoint:
        from jaxrl_async.checkpoint import NonFiniteTracker
        from jaxrl_async.data.datasets import make_train_iterator

        c, ctl = self.cfg, self.control
        ctl.set_phase("the trainer's setup", "stopping when this phase ends")
        self.trainer = trainer = self.services.trainer(self.setup, ctl)
        trainer.build()
        latest = trainer.latest_checkpoint()
        if c.checkpoint.resume == "must" and latest is None:
            raise ValueError(f"checkpoint.resume='must' but {trainer.checkpointer.directory} has no committed "
                             "checkpoint")
        point = ResumePoint(make_train_iterator(self.setup.train_ds, seed=c.seed, shuffle=c.data.shuffle),
                            NonFiniteTracker(), latest)
        try:
            if latest is not None and c.checkpoint.resume != "never":
                self._restore(point)
            else:
                sft = c.trainer.sft.steps > 0
                trainer.initial_state(sft_examples(self.setup) if sft else None)  # a stop: StopRequested
                if sft:  # costly to redo: checkpoint 0 at once
                    self._save_warm_start(point)
        except BaseException:
            trainer.close_checkpoint()
            raise
        self.setup.init_params = None  # (on the trainer devices when read from model.path: free them either way)
        return point

    def _restore(self, point: ResumePoint) -> None:
        r = self.trainer.restore()
        ds = r.meta.data_state or {}
        if ds.get("source") is not None:
            point.data_iter.set_state(ds["source"])
        point.step = int(r.meta.step)
        point.replay = [(int(o["draw"]), record_from_json(o["item"])) for o in ds.get("outstanding", [])]
        point.next_draw = int(ds.get("next_draw", 0))
        point.log_records = ds.get("log_records")
        point.saved_groups = list(r.trajectories or [])
        point.resumed_from = r.step
        self._note_changes(point, r.meta.config)
        extra = r.meta.extra or {}
        self.control.wall0 = float(extra.get("wall_s", 0.0))
        if "nonfinite" in extra:
            point.nonfinite.load_state_dict(extra["nonfinite"])
        self.control.say(
            f"resumed from {self.trainer.checkpointer.step_dir(r.step)}: step {point.step}, policy version "
            f"{r.meta.policy_version}, {len(point.replay)} outstanding prompts ({len(point.saved_groups)} with "
            "finished groups in the checkpoint)"
            + (f" (skipped unusable steps {[s for s, _ in r.skipped]})" if r.skipped else ""))

    def _note_changes(self, point: ResumePoint, saved: Any) -> None:
        """Settings changed since the checkpoint (the ones that would change its meaning were refused by
        ``config.check_resume``): one line; a changed group size makes its finished groups unusable."""
        from jaxrl_async.config.resume import changed_fields

        changed = changed_fields(saved or {}, self.cfg) if saved else {}
        if changed:
            self.control.say("resumed with changed settings: " + ", ".join(f"{k} {a!r} -> {b!r}"
                                                                            for k, (a, b) in changed.items()))
        if "rollout.n_samples" in changed:
            point.groups_unusable = "group_size_changed"

    def _save_warm_start(self, point: ResumePoint) -> None:
        """The warm-started state as RL checkpoint 0 (waited for: the warm start is costly to redo); the warm
        start's own checkpoints are then removed."""
        from jaxrl_async.checkpoint import TrainMeta

        ctl = self.control
        meta = TrainMeta(step=0, policy_version=0, data_state=DataLedger(point.data_iter).state(), staleness=None,
                         config=to_dict(self.cfg), extra={"nonfinite": point.nonfinite.state_dict(),
                                                          "why": "warm start done", "wall_s": ctl.wall()})
        ctl.set_phase("saving the warm-started model", "stopping once it is saved")
        st = self.trainer.save(meta, [])
        self.trainer.wait_checkpoint()
        shutil.rmtree(os.path.join(self.run_dir, WARM_START_DIR), ignore_errors=True)
        ctl.say(f"checkpoint {self.trainer.checkpointer.step_dir(0)}: the warm-started model "
                f"(blocking {st.blocking_s:.2f} s)")

    def _already_complete(self, point: ResumePoint) -> RunResult:
        """A rerun of a finished run: nothing to train; the export is redone if it is missing (a kill
        during the export)."""
        ck, latest, export_dir = self.cfg.checkpoint, point.latest, None
        summary_path = os.path.join(self.run_dir, "summary.json")
        try:
            with open(summary_path) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            summary = {}
        try:
            if ck.export_hf and latest is not None and not summary.get("export_dir"):
                self.control.set_phase("the export", "finishing it, then exiting")
                export_dir = self.trainer.export(latest).out_dir
                self.control.say(f"Hugging Face export: {export_dir}")
                if summary:
                    summary["export_dir"] = export_dir
                    with open(summary_path, "w") as f:
                        json.dump(summary, f, indent=2)
        finally:
            self.trainer.close_checkpoint()
        self.control.say(f"{self.run_dir} is already complete at step {point.step} (trainer.total_steps="
                         f"{self.cfg.trainer.total_steps}); raise trainer.total_steps to continue, or use a new run_dir")
        return RunResult(self.run_dir, point.step, point.step, 0.0, [], {}, [], {}, checkpoint_step=latest,
                         export_dir=export_dir, stopped_by="already_complete")


def run(cfg: RunConfig, **kw: Any) -> RunResult:
    """Build and run ``cfg`` (validated)."""
    return RLRun(cfg, **kw).run()
