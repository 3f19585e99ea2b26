"""The RL phase of a run (``TrainingSession``): the generator role started, rollouts admitted under the
staleness bound, one ``StepRunner`` step per batch, evaluations and checkpoints between steps, and the
end (graceful, by a stop signal or the time limit, or by a failure with an emergency checkpoint).

Threads and queues (see ``jaxrl_async.loop``'s docstring for the picture): the main thread is the
trainer; it blocks only in ``StalenessManager.get_batch`` (polled every second, so it notices a fatal
rollout error, a signal or a stall with a timeout that names what it waits for), in evaluation
(its own requests, with a timeout) and in checkpoint saves.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

from jaxrl_async.config import to_dict
from jaxrl_async.data.ledger import LEDGER_LOG, DataLedger, repair_jsonl_tail
from jaxrl_async.generator.weight_sync import WeightPushError
from jaxrl_async.loop.evaluation import evaluate_held_out
from jaxrl_async.loop.step import FatalRunError, StepRunner
from jaxrl_async.loop.summary import StepClock, run_counts, step_row, write_summary
from jaxrl_async.loop.record import RunResult
from jaxrl_async.loop.state import group_record, restore_buffered_groups

__all__ = ["TrainingSession"]


class TrainingSession:
    """Built by ``RLRun.run`` after the resume phase; ``run()`` trains to ``trainer.total_steps`` (or a
    stop) and returns the ``RunResult``."""

    def __init__(self, run: Any, point: Any):
        from jaxrl_async.rewards.registry import make_reward
        from jaxrl_async.rollout.staleness import StalenessManager

        self.point, self.cfg, self.control = point, run.cfg, run.control
        self.setup, self.trainer, self.run_dir = run.setup, run.trainer, run.run_dir
        self.wandb = run.wandb
        ro, tr = self.cfg.rollout, self.cfg.trainer
        self.eta = ro.effective_max_head_offpolicyness
        self.ckpt = self.trainer.checkpointer
        self.control.set_phase("the generator's start (engine compile)", "stopping once it is ready")
        self.role = run.services.generators(self.setup, self.control)
        self.generator = self.role.start(self.trainer.params, point.step)
        self.control.set_phase("RL", "finishing the current step, saving a checkpoint and exiting")
        self.staleness = StalenessManager(self.eta, tr.batch_size, ro.effective_max_concurrent(tr.batch_size),
                                          version=point.step)
        self.reward_fn = make_reward(ro.reward)
        self._reward_failed = 0  # completions the reward failed on so far (``_reward_failures``)
        self.ledger = self._ledger()
        self.steps = StepRunner(self.trainer, self.ledger, point.nonfinite, advantage=tr.advantage,
                                n_samples=ro.n_samples, step=point.step, version=point.step)
        self.dispatcher = self._dispatcher()
        self.pusher = self.role.pusher(self.generator, on_applied=self.staleness.set_version,
                                       timeout_s=max(300.0, ro.group_timeout_s or 0), initial_version=point.step)
        self.metrics = self._metrics()
        self.result = RunResult(self.run_dir, point.step, point.step, 0.0, [], {}, [], {}, warm_start=tr.sft.steps > 0)
        self.result.eval_history = [(int(r["step"]), float(r["wall_time"]), float(r["eval/accuracy"]))
                                    for r in self.metrics.history if r.get("eval/accuracy") is not None]
        self.save_stats: list[Any] = []
        self.stop_reason = "completed"
        self.clock = StepClock(self.generator.stats())

    # -- building ---------------------------------------------------------------------------------------
    def _ledger(self) -> DataLedger:
        p = self.point
        ledger = DataLedger(p.data_iter, replay=p.replay, next_draw=p.next_draw,
                            log_path=os.path.join(self.run_dir, LEDGER_LOG), log_records=p.log_records or 0)
        if p.resumed_from is not None:
            ledger.log_resume(p.step, p.step, p.log_records, checkpoint=p.resumed_from)
        B = self.cfg.trainer.batch_size
        self.restore_info = restore_buffered_groups(p.saved_groups, self.staleness, ledger, p.step, self.eta, B,
                                                    unusable=p.groups_unusable)
        if p.saved_groups:
            why = p.groups_unusable or f"too stale for eta={self.eta} or unusable"
            self.control.say(f"checkpointed finished groups: {self.restore_info['restored_groups']} reused, "
                             f"{self.restore_info['dropped_groups']} dropped ({why}; their prompts are regenerated)")
        return ledger

    def _dispatcher(self) -> Any:
        from jaxrl_async.loop.setup import build_workflow
        from jaxrl_async.rollout.workflow import RolloutDispatcher, derive_seed

        c, ro, ledger = self.cfg, self.cfg.rollout, self.ledger
        should_accept = None
        if ro.filter_zero_signal_groups:
            from jaxrl_async.rl.advantages import group_has_signal

            should_accept = lambda g: group_has_signal(g.rewards)  # noqa: E731
        workflow = build_workflow(ro.workflow, self.reward_fn, self.setup.tokenizer, ro, self.setup.eos_ids,
                                  say=self.control.say, system_prompt=c.data.system_prompt)
        self.workflow = workflow
        return RolloutDispatcher(
            workflow, self.generator, self.staleness, ledger, n_samples=ro.n_samples,
            sampling=ro.sampling.params(n=ro.n_samples, seed=c.seed, stop_token_ids=self.setup.eos_ids),
            should_accept=should_accept, allow_partial_groups=ro.allow_partial_groups, seed=c.seed,
            group_timeout_s=ro.group_timeout_s, reward_timeout_s=ro.group_timeout_s, reward_workers=ro.reward_workers,
            max_consecutive_failures=ro.max_consecutive_failures, tokenizer=self.setup.tokenizer,
            group_seed=lambda t, item: derive_seed(c.seed, ledger.draw_index(t)),
            on_draw=ledger.on_draw, on_reject=ledger.on_reject)

    def _metrics(self) -> Any:
        from jaxrl_async.loop.metrics import METRICS_FILE, MetricsLogger

        c, p = self.cfg, self.point
        repair_jsonl_tail(os.path.join(self.run_dir, METRICS_FILE))
        # one history across resumes: the rows up to the checkpoint stay, the redone ones go
        metrics = MetricsLogger(self.run_dir, c.trainer.total_steps, tensorboard=c.logging.tensorboard,
                                progress=self.control.progress(c.logging.progress), start_step=p.step,
                                clock=self.control.wall,
                                keep_until_step=p.step if p.resumed_from is not None else -1,
                                title=f"{c.name}: {os.path.basename(self.run_dir)}", eta=self.eta,
                                wandb=self.wandb)
        if p.resumed_from is not None:
            self.control.resume_rows.append({
                "resume/checkpoint_step": p.resumed_from, "resume/replayed_prompts": len(p.replay),
                "resume/checkpoint": os.path.relpath(self.ckpt.step_dir(p.resumed_from), self.run_dir),
                **{f"resume/{k}": v for k, v in self.restore_info.items()}})
        self.resume_rows = [metrics.log(p.step, row, advance=False) for row in self.control.resume_rows]
        return metrics

    # -- the RL phase ---------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        from jaxrl_async.checkpoint import SignalHandler

        signals, own = self.control.signals, False
        if signals is None and threading.current_thread() is threading.main_thread():
            signals, own = SignalHandler(), True
            signals.__enter__()
            self.control.signals = signals
        self.own_signals = own
        if signals is not None:
            signals.set_phase("RL", "finishing the current step, saving a checkpoint and exiting")
        try:
            self._train()
        except BaseException as e:
            self._fail(e)
            raise
        return self._finish()

    def _train(self) -> None:
        c, tr, signals = self.cfg, self.cfg.trainer, self.control.signals
        self.generator.start()
        if hasattr(self.workflow, "ensure_endpoint"):  # openai_agent: its endpoint up (and its URL said) before rollouts
            try:
                self.workflow.ensure_endpoint(self.generator)
            except (ValueError, OSError) as e:
                raise FatalRunError(f"rollout.workflow={c.rollout.workflow}: {e}") from None
        self.dispatcher.start()
        step = self.steps.step
        if self._eval_due(step) and step not in {s for s, _, _ in self.result.eval_history}:
            self._evaluate(step)
        while self.steps.step < tr.total_steps:
            groups, wait_s = self._wait_batch()
            if groups is None:
                self.stop_reason = "signal" if (signals is not None and signals.requested) else "max_wall_time"
                break
            self._step(groups, wait_s)
        if self.stop_reason == "completed" and signals is not None:
            signals.set_phase("the final evaluation, checkpoint and export",
                              "the run is complete: finishing them, then exiting")
        if c.eval.at_end and self.stop_reason == "completed":
            self._evaluate(self.steps.step, final=True)

    def _wait_batch(self) -> tuple[list | None, float]:
        """B accepted groups (earliest deadline first), watching for failures, a stop and the time limit
        (None: stop). A stall longer than the group timeout (+ 120 s) or exhausted data is fatal."""
        c, ro, B = self.cfg, self.cfg.rollout, self.cfg.trainer.batch_size
        stall_limit = (ro.group_timeout_s or 600.0) + 120.0
        t0 = time.monotonic()
        while True:
            err = self.dispatcher.fatal_error or self.pusher.error
            if err is not None:
                raise FatalRunError(f"rollout failed: {type(err).__name__}: {err}") from err
            if self.control.stop_requested():
                return None, time.monotonic() - t0
            if c.max_wall_time_s is not None and self.control.wall() > c.max_wall_time_s:
                return None, time.monotonic() - t0
            try:
                return self.staleness.get_batch(version=self.steps.version, timeout=1.0), time.monotonic() - t0
            except TimeoutError as e:
                sc = self.staleness.counts()
                if self.dispatcher.data_exhausted and sc.running == 0:
                    raise FatalRunError(f"data exhausted at step {self.steps.step}: {sc.buffered} groups buffered, "
                                        f"{B} needed per step") from None
                if time.monotonic() - t0 > stall_limit:
                    raise FatalRunError(f"no training batch for {stall_limit:.0f} s: {e}") from None

    def _step(self, groups: list, wait_s: float) -> None:
        """One step (``StepRunner``: train and commit), then the push of the new weights (dispatched now,
        before the next step donates the params), metrics, and the evaluation / checkpoint hooks."""
        c, tr = self.cfg, self.cfg.trainer
        out = self.steps.run(groups)
        step, version = self.steps.step, self.steps.version
        try:
            push = self.pusher.push(self.trainer.params, version)
        except WeightPushError as e:  # the step is committed (StepRunner): the run ends with it, in one line
            raise FatalRunError(f"{e} (step {step} is committed; the run resumes from it)") from e
        if not out.finite:
            nf = self.steps.nonfinite
            self.metrics.message(f"step {step}: non-finite loss/gradient, update skipped ({out.summary['skipped']} of "
                                 f"{out.summary['minibatches']} minibatch updates; {nf.consecutive} steps in a row, "
                                 f"{nf.total_skipped} in total)")
        self.result.lag_by_group.extend((step - 1, g.ticket.id, g.lag) for g in out.groups)
        row = step_row(out, push, self.pusher, self.generator.stats(), self.staleness.counts(), self.clock,
                       version=version, wait_s=wait_s)
        row.update(self._reward_failures(step))
        if hasattr(self.workflow, "step_metrics"):  # e.g. openai_agent: turns, stitched / fallen-back episodes
            row.update(self.workflow.step_metrics(out.groups))
        replica_metrics = getattr(self.generator, "replica_metrics", None)  # several generator replicas (distributed)
        if replica_metrics is not None:
            row.update(replica_metrics())
        if step % c.logging.log_every == 0 or step == tr.total_steps:
            self.metrics.log(step, row)
        self.result.last_metrics = row
        if self._eval_due(step):
            self._evaluate(step)
        if self.ckpt.should_save(step) and step < tr.total_steps:
            self._save("periodic")

    def _reward_failures(self, step: int) -> dict[str, int]:
        """Completions the reward function failed on since the last step (it raised, or returned a non-number: each
        scored 0 by ``SafeReward``), as ``reward/failed`` with one line naming the last error; never silent."""
        st = self.reward_fn.stats()  # a SafeReward (make_reward)
        total = st["errors"] + st["invalid"]
        new, self._reward_failed = total - self._reward_failed, total
        if new > 0:
            self.metrics.message(f"step {step}: the reward failed on {new} completion(s), scored "
                                 f"{self.reward_fn.default:g} ({total} in this process; last: "
                                 f"{self.reward_fn.last_error})")
        return {"reward/failed": new}

    # -- evaluation and checkpoints -----------------------------------------------------------------------
    def _eval_due(self, step: int) -> bool:  # (also the one a stop or a kill left undone at the resumed step)
        ev, total = self.cfg.eval, self.cfg.trainer.total_steps
        return (step == 0 and ev.at_start) or bool(ev.every_steps and step % ev.every_steps == 0 and 0 < step < total)

    def _evaluate(self, step: int, final: bool = False) -> None:
        version = self.steps.version
        self.pusher.wait(version)
        row = evaluate_held_out(self.generator, self.setup.eval_records, self.reward_fn, version, cfg=self.cfg,
                                eos_ids=self.setup.eos_ids, tokenizer=self.setup.tokenizer,
                                stop=None if final else self.control.stop_requested)
        if row:
            self.metrics.log(step, row, advance=False)
            self.result.eval_history.append((step, self.metrics.elapsed(), row["eval/accuracy"]))
            self.metrics.message(f"eval @ step {step} (version {version}): accuracy {row['eval/accuracy']:.3f} "
                                 f"({row['eval/n']} held-out, {row['eval/seconds']:.1f} s)")

    def _save(self, why: str) -> None:
        """Checkpoint the trainer's state at the current step with the ledger and the buffered groups of the
        same moment (the step runner committed them together)."""
        from jaxrl_async.checkpoint import TrainMeta

        step, ledger = self.steps.step, self.ledger
        # buffered groups first, then the ledger: a group accepted in between is only replayed
        buffered = [group_record(g, ledger.draw_index(g.ticket)) for g in self.staleness.buffered_groups()]
        extra = {"nonfinite": self.steps.nonfinite.state_dict(), "why": why, "wall_s": self.control.wall()}
        meta = TrainMeta(step=step, policy_version=self.steps.version, data_state=ledger.state(),
                         staleness=self.counts(), config=to_dict(self.cfg), extra=extra)
        st = self.trainer.save(meta, buffered)
        self.result.checkpoint_step = step
        self.save_stats.append(st)
        if why == "periodic":  # quiet: the cost goes to the metrics
            self.metrics.log(step, {"checkpoint/blocking_s": st.blocking_s, "checkpoint/wait_s": st.wait_s},
                             advance=False)
        else:
            self.metrics.message(f"checkpoint {self.ckpt.step_dir(step)} ({why}; {len(buffered)} finished groups "
                                 f"saved; blocking {st.blocking_s:.2f} s)")

    def _has_new_step(self) -> bool:
        return self.steps.step > max(self.point.step, self.ckpt.last_saved_step)

    def counts(self) -> dict[str, Any]:
        return run_counts(self.staleness.counts(), self.ledger)

    # -- the end ----------------------------------------------------------------------------------------------
    def _shutdown(self, close_metrics: bool) -> None:
        self.ledger.freeze()
        self.dispatcher.stop(timeout=10.0)
        if hasattr(self.workflow, "close"):  # e.g. openai_agent's endpoint
            self.workflow.close()
        self.staleness.close()
        self.pusher.close(timeout=10.0)
        try:
            self.generator.stop()
        except RuntimeError as e:
            self.control.say(str(e))
        self.role.close()
        if close_metrics:
            self.metrics.close(plot=False)

    def _fail(self, e: BaseException) -> None:
        """A failure: stop the roles, save the committed step (emergency checkpoint), close, re-raise."""
        self.stop_reason = f"error: {type(e).__name__}"
        self.metrics.message(f"run stopped by {type(e).__name__}: {e}")
        if not isinstance(e, (FatalRunError, KeyboardInterrupt)):
            self.metrics.message(traceback.format_exc())
        self._shutdown(close_metrics=True)
        if self.own_signals:
            self.control.signals.__exit__(None, None, None)
        if self._has_new_step():
            self._emergency_save()
        self.trainer.close_checkpoint()
        self.ledger.close()

    def _emergency_save(self) -> None:
        try:
            if self.trainer.state_consumed():
                self.control.say("no emergency checkpoint: the training state was consumed by the failed step")
                return
            self._save("emergency")
        except Exception as e:  # noqa: BLE001
            self.control.say(f"emergency checkpoint failed: {type(e).__name__}: {e}")

    def _finish(self) -> RunResult:
        """Graceful end: stop rollouts, save, export, summary."""
        self._shutdown(close_metrics=False)
        self.result.counts = self.counts()
        final_data = self.ledger.state()
        self.ledger.close()
        signals = self.control.signals
        signal_name = signals.signal_name if (signals is not None and self.stop_reason == "signal") else None
        stop_line = None
        try:
            stop_line = self._final_checkpoint_and_export(signal_name)
        finally:
            self.trainer.close_checkpoint()
            plot = self.metrics.close()
            if self.own_signals:
                signals.__exit__(None, None, None)
        r = self.result
        r.steps, r.version = self.steps.step, self.steps.version
        r.wall_s, r.process_wall_s = self.control.wall(), self.control.process_wall()
        r.stopped_by = self.stop_reason
        write_summary(self, final_data, signal_name, plot)
        if stop_line is not None:
            self.control.say(stop_line)
        return r

    def _final_checkpoint_and_export(self, signal_name: str | None) -> str | None:
        """A stop by signal or time limit always saves (preemption); a periodic save of this very step already
        holds a consistent state. Returns the stop line (None for a completed run)."""
        step, ck = self.steps.step, self.cfg.checkpoint
        if (ck.save_at_end or self.stop_reason != "completed") and self._has_new_step():
            self._save(self.stop_reason)
        self.trainer.wait_checkpoint()
        if self.stop_reason != "completed":
            latest = self.ckpt.latest_committed_step()
            return (f"stopped by {signal_name or self.stop_reason} after step {step}: "
                    + (f"checkpoint {self.ckpt.step_dir(latest)} is committed; run the same command again to resume"
                       if latest is not None else "nothing saved (no step completed); run the same command again "
                       "to start"))
        if ck.export_hf and self.result.checkpoint_step is not None:
            ex = self.trainer.export(self.result.checkpoint_step)
            self.result.export_dir = ex.out_dir
            self.metrics.message(f"Hugging Face export: {ex.out_dir}")
        return None
