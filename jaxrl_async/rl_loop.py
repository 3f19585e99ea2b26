"""The asynchronous RL loop (AReaL's design on two meshes of one JAX program).

Threads and queues
==================

::

    data ──► DataLedger ──► [rollout-dispatcher thread] ── acquire ticket (StalenessManager: capacity > 0)
                                 │                          draw item, run its group on a worker pool
                                 ▼
         [rollout-group / rollout-episode / reward pools]  workflow.run_group → Generator.submit (n samples)
                                 │                          reward_fn in the reward pool (off the decode thread)
                                 ▼
         [generator-decode + generator-stream threads]     continuous batching on the GENERATOR mesh
                                 │
                                 ▼  accept(group, head version) / reject(reason)
                        StalenessManager buffer  (host, bounded by η: AReaL's max_head_offpolicyness)
                                 │
                                 ▼  get_batch(version k): B groups, earliest deadline first
         [main thread = trainer]   advantages → proximal log-probs → update(s) on the TRAINER mesh
                                 │        → metrics / eval / checkpoint
                                 ▼  WeightPusher.push(params, k + 1)  (dispatch: device_put, async)
         [weight-push thread]      copy complete → Generator.update_params(wait) → staleness.set_version(k + 1)

* The **main thread** is the trainer. It blocks only in ``StalenessManager.get_batch`` (polled
  every second, so it notices a fatal rollout error, a signal or a stall with a timeout that names
  what it waits for), in eval (waiting for its own requests, with a timeout) and in checkpoint
  saves.
* The **dispatcher** admits a group only while AReaL's capacity
  ``min(C − running, (η + v + 1)·B − (accepted + running))`` is positive, with v the version the
  generator already uses. Rejected groups (reward/workflow errors, timeouts, filters) give their
  budget back; every admitted group ends consumed, rejected with a reason, or outstanding.
* The **weight-push thread** (``weight_sync.WeightPusher``) completes device-to-device copies; the
  version is advertised (``set_version``) only after the generator uses it, so a group's head
  version is never below its admission version, and earliest-deadline-first consumption then
  bounds every trained group's lag by η (proof in ``rollout/staleness.py``). η = 0 is synchronous
  on-policy RL; ``rollout.mode=sync`` is the classic synchronous system (one batch in flight,
  wait for the longest sequence, train).

Data accounting: ``DataLedger`` records every drawn item. At a checkpoint the items drawn but not
yet consumed (running or buffered groups) are saved with their draw indices, and the finished
groups themselves are saved too. A resume puts the finished groups back into the staleness buffer
(or drops them with a reason when their lag under the restored version exceeds η) and replays the
other items first (with the same group seeds), so resuming loses and duplicates nothing; the event
log ``RUN/data_ledger.jsonl`` (``read_data_ledger``) is the audit trail that shows it.

Stops and resumes: a SIGTERM/SIGINT at any moment ends the run in order (``main`` installs the
handler before anything else; the loop polls it between phases and steps): during setup nothing is
saved; during the SFT warm start its state is checkpointed after the current step
(``RUN/warm_start/checkpoints``) and the rerun continues the warm start there; once the warm start is
done it is checkpointed as step 0; during RL the current step finishes and is checkpointed; an
evaluation in progress is abandoned (the resumed run redoes it); the final evaluation, checkpoint and
export of a finished run complete. The last line says what was saved and that the same command
resumes. Periodic checkpoints (``checkpoint.every_steps`` / ``every_seconds``) bound what a SIGKILL
loses. A resumed run reads as one run: ``wall_time`` is cumulative over the processes (the checkpoint
stores it), ``metrics.jsonl``/TensorBoard/``curves.png`` keep the earlier rows up to the checkpoint
(redone steps dropped), and ``summary.json`` lists the whole ``eval_history`` and the ``resumes``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import jax
import numpy as np

from jaxrl_async.config import RunConfig, save_config, to_dict
# the ledger, batch building and run-state conversions live in their own modules; re-exported here
from jaxrl_async.data.ledger import (
    LEDGER_LOG, DataLedger, LedgerHistory, read_data_ledger, record_from_json, repair_jsonl_tail,
)
from jaxrl_async.rl.batch import build_training_batch
from jaxrl_async.trainer.train_step import step_metrics
from jaxrl_async.run_record import RunResult
from jaxrl_async.run_state import (
    _group_record, _state_from_items, _state_items, build_checkpointer, initial_params,
    restore_buffered_groups, restore_train_state,
)
from jaxrl_async.run_components import RunComponentsMixin
from jaxrl_async.warm_start import WARM_START_DIR, WarmStartMixin, committed_steps

log = logging.getLogger("jaxrl_async")

__all__ = ["RLLoop", "RunResult", "DataLedger", "LedgerHistory", "LEDGER_LOG", "build_training_batch",
           "read_data_ledger", "restore_buffered_groups", "initial_params", "build_checkpointer",
           "restore_train_state", "run"]


# =============================================================================================
# The run
# =============================================================================================
class FatalRunError(RuntimeError):
    """The run cannot continue (message says why); a checkpoint is attempted before raising."""


class RLLoop(WarmStartMixin, RunComponentsMixin):
    """One run of ``RunConfig`` (build everything in ``__init__``, train in ``run()``).

    ``cfg`` must be validated (``config.validate``). Everything the run writes lives in
    ``cfg.resolved_run_dir``: ``config.json``, ``tokenizer/``, ``data/`` (generated tasks),
    ``metrics.jsonl``, ``data_ledger.jsonl``, ``tb/``, ``curves.png``, ``checkpoints/``, ``hf/`` (export),
    ``summary.json``.
    """

    def __init__(self, cfg: RunConfig, *, log_fn: Callable[[str], None] | None = None, signals: Any = None):
        from jaxrl_async.checkpoint import SignalHandler

        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.resolved_run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self._say = log_fn or (lambda s: print(f"[jaxrl_async] {s}", file=sys.stderr, flush=True))
        self.t_start = time.monotonic()
        self.wall0 = 0.0  # wall time of the run before this process (from the checkpoint it resumes)
        self.resume_rows: list[dict[str, Any]] = []  # this process's resume, logged as a metrics row
        # stop signals: the handler ``main`` installed (every phase stops cleanly), else run() installs
        # one for the RL phase when it runs on the main thread
        self.signals = signals if signals is not None else SignalHandler.active()
        self._phase("setup (devices, tokenizer, data, model)", "stopping when this phase ends")
        self._check_stop()
        self._setup_devices()
        self._check_stop()
        self._setup_tokenizer_and_data()
        self._check_stop()
        self._setup_model()
        self._check_stop()
        save_config(cfg, self.run_dir, extra={
            "generator_devices": list(self.gen_ids), "trainer_devices": list(self.trainer_ids),
            "vocab_size": self.model_cfg.vocab_size, "tokenizer_dir": self.tokenizer_dir,
            "attention": self._attention_choice(),
            "train_records": len(self.train_ds), "eval_records": len(self.eval_records)})
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.init_params))
        tr, ro = cfg.trainer, cfg.rollout
        self._say(f"run {self.run_dir}: {self.model_cfg.num_layers}-layer model, {n_params / 1e6:.2f} M parameters; "
                  + (f"SFT warm start {tr.sft.steps} steps, then " if tr.sft.steps > 0 else "")
                  + f"RL {tr.total_steps} steps ({ro.mode}, eta {ro.effective_max_head_offpolicyness}, "
                  f"{tr.batch_size} prompts x {ro.n_samples} samples); config in config.json (--print-config "
                  "prints it)")

    # -- time and stops -----------------------------------------------------------------------
    def wall(self) -> float:
        """The run's wall time: the processes before a resume (``wall0``) plus this one."""
        return self.wall0 + time.monotonic() - self.t_start

    def _phase(self, name: str, plan: str) -> None:
        self.phase = name
        if self.signals is not None:
            self.signals.set_phase(name, plan)

    def _stop_requested(self) -> bool:
        return self.signals is not None and self.signals.requested

    def _check_stop(self) -> None:
        """Between the phases before RL: a stop signal ends the run here (``StopRequested``)."""
        if self._stop_requested():
            raise self._stopped(self._saved_before())

    def _stopped(self, saved: str | None) -> Exception:
        from jaxrl_async.checkpoint import StopRequested

        again = "resume" if saved else "start the run"
        return StopRequested(f"stopped by {self.signals.signal_name} during {self.phase}: "
                             f"{saved or 'nothing to save yet (no training step had run)'}; "
                             f"run the same command again to {again}")

    def _saved_before(self) -> str | None:
        """What earlier processes left to resume from (a listing of the run directory)."""
        rl = committed_steps(os.path.join(self.run_dir, "checkpoints"))
        if rl:
            return f"nothing new to save, checkpoint {os.path.join(self.run_dir, 'checkpoints', str(rl[-1]))} is the latest"
        ws = committed_steps(os.path.join(self.run_dir, WARM_START_DIR, "checkpoints"))
        if ws:
            return (f"nothing new to save, warm-start checkpoint "
                    f"{os.path.join(self.run_dir, WARM_START_DIR, 'checkpoints', str(ws[-1]))} is the latest")
        return None


    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> RunResult:
        from jaxrl_async.checkpoint import NonFiniteTracker, SignalHandler, TrainingDivergedError, TrainMeta
        from jaxrl_async.data.datasets import make_train_iterator
        from jaxrl_async.metrics import METRICS_FILE, MetricsLogger, resumes_from_rows
        from jaxrl_async.rewards.registry import make_reward
        from jaxrl_async.rollout.staleness import StalenessManager
        from jaxrl_async.rollout.workflow import RolloutDispatcher, derive_seed

        c, ro, tr = self.cfg, self.cfg.rollout, self.cfg.trainer
        eta = ro.effective_max_head_offpolicyness
        B, n = tr.batch_size, ro.n_samples
        self._phase("the trainer's setup", "stopping when this phase ends")
        trainer = self._build_trainer()
        self.trainer = trainer
        ck = c.checkpoint
        ckpt = self._build_checkpointer()
        latest = ckpt.latest_committed_step()
        if ck.resume == "must" and latest is None:
            raise ValueError(f"checkpoint.resume='must' but {ckpt.directory} has no committed checkpoint")
        resume = latest is not None and ck.resume != "never"
        data_iter = make_train_iterator(self.train_ds, seed=c.seed, shuffle=c.data.shuffle)
        nonfinite = NonFiniteTracker()
        start_step, replay, next_draw, extra0, log_records, saved_groups = 0, [], 0, {}, 0, []
        resumed_from: int | None = None
        try:
            if resume:
                r = self._restore_checkpoint(ckpt, trainer)
                state = _state_from_items(r.arrays)
                start_step = int(r.meta.step)
                ds = r.meta.data_state or {}
                if ds.get("source") is not None:
                    data_iter.set_state(ds["source"])
                replay = [(int(o["draw"]), record_from_json(o["item"])) for o in ds.get("outstanding", [])]
                next_draw = int(ds.get("next_draw", 0))
                log_records = ds.get("log_records")
                saved_groups = list(r.trajectories or [])
                resumed_from = r.step
                extra0 = r.meta.extra or {}
                self.wall0 = float(extra0.get("wall_s", 0.0))
                if "nonfinite" in extra0:
                    nonfinite.load_state_dict(extra0["nonfinite"])
                self._say(f"resumed from {ckpt.step_dir(r.step)}: step {start_step}, policy version "
                          f"{r.meta.policy_version}, {len(replay)} outstanding prompts ({len(saved_groups)} with "
                          "finished groups in the checkpoint)"
                          + (f" (skipped unusable steps {[s for s, _ in r.skipped]})" if r.skipped else ""))
            else:
                state = self._initial_state(trainer)  # a stop during the warm start: StopRequested
                if tr.sft.steps > 0:  # costly to redo: checkpoint 0 at once
                    self._save_warm_start(ckpt, state, data_iter, nonfinite)
        except BaseException:
            self._close_checkpoint(ckpt)
            raise
        self.init_params = None  # (on the trainer devices when read from model.path: free them either way)
        version = start_step
        if start_step >= tr.total_steps:
            return self._already_complete(ckpt, start_step, latest)

        self._phase("the generator's start (engine compile)", "stopping once it is ready")
        generator = self._start_generator(state.params, version)
        self._phase("RL", "finishing the current step, saving a checkpoint and exiting")
        staleness = StalenessManager(eta, B, ro.effective_max_concurrent(B), version=version)
        reward_fn = make_reward(ro.reward)
        workflow = self._build_workflow(reward_fn)
        repair_jsonl_tail(os.path.join(self.run_dir, METRICS_FILE))
        ledger = DataLedger(data_iter, replay=replay, next_draw=next_draw, log_path=os.path.join(self.run_dir, LEDGER_LOG),
                            log_records=log_records or 0)
        if resumed_from is not None:
            ledger.log_resume(start_step, version, log_records, checkpoint=resumed_from)
        restore_info = restore_buffered_groups(saved_groups, staleness, ledger, version, eta, B)
        if saved_groups:
            self._say(f"checkpointed finished groups: {restore_info['restored_groups']} reused, "
                      f"{restore_info['dropped_groups']} dropped (too stale for eta={eta} or unusable; their "
                      "prompts are regenerated)")
        should_accept = None
        if ro.filter_zero_signal_groups:
            from jaxrl_async.rl.advantages import group_has_signal

            should_accept = lambda g: group_has_signal(g.rewards)  # noqa: E731
        dispatcher = RolloutDispatcher(
            workflow, generator, staleness, ledger, n_samples=n,
            sampling=ro.sampling.params(n=n, seed=c.seed, stop_token_ids=self.eos_ids), should_accept=should_accept,
            allow_partial_groups=ro.allow_partial_groups, seed=c.seed, group_timeout_s=ro.group_timeout_s,
            reward_timeout_s=ro.group_timeout_s, reward_workers=ro.reward_workers,
            max_consecutive_failures=ro.max_consecutive_failures, tokenizer=self.tokenizer,
            group_seed=lambda t, item: derive_seed(c.seed, ledger.draw_index(t)),
            on_draw=ledger.on_draw, on_reject=ledger.on_reject)
        pusher = self._build_pusher(generator, on_applied=staleness.set_version,
                                    timeout_s=max(300.0, ro.group_timeout_s or 0), initial_version=version)
        # one history across resumes: the rows up to the checkpoint stay, the redone ones go
        metrics = MetricsLogger(self.run_dir, tr.total_steps, tensorboard=c.logging.tensorboard,
                                progress=c.logging.progress, start_step=start_step, clock=self.wall,
                                keep_until_step=start_step if resumed_from is not None else -1,
                                title=f"{c.name}: {os.path.basename(self.run_dir)}", eta=eta)
        if resumed_from is not None:
            self.resume_rows.append({"resume/checkpoint_step": resumed_from, "resume/replayed_prompts": len(replay),
                                     "resume/checkpoint": os.path.relpath(ckpt.step_dir(resumed_from), self.run_dir),
                                     **{f"resume/{k}": v for k, v in restore_info.items()}})
        resume_rows = [metrics.log(start_step, row, advance=False) for row in self.resume_rows]
        eval_pool = cf.ThreadPoolExecutor(ro.reward_workers, thread_name_prefix="eval-reward")
        result = RunResult(self.run_dir, start_step, version, 0.0, [], {}, [], {}, warm_start=tr.sft.steps > 0)
        result.eval_history = [(int(r["step"]), float(r["wall_time"]), float(r["eval/accuracy"]))
                               for r in metrics.history if r.get("eval/accuracy") is not None]
        stop_reason = "completed"
        step = start_step
        t_loop0 = time.monotonic()
        idle_s = 0.0
        last = {"t": t_loop0, "gen": generator.stats(), "trained_tokens": 0}
        save_stats: list[Any] = []

        def snapshot_stats() -> dict[str, Any]:
            sc = staleness.counts()
            return {"admitted": sc.admitted, "consumed": sc.consumed, "rejected": sc.rejected,
                    "rejected_by_reason": sc.rejected_by_reason, "running": sc.running, "buffered": sc.buffered,
                    "balanced": sc.balanced(), "ledger_drawn": ledger.n_drawn, "ledger_consumed": ledger.n_consumed,
                    "ledger_rejected": dict(ledger.n_rejected), "ledger_outstanding": ledger.outstanding,
                    "replayed": ledger.n_replayed, "restored": ledger.n_restored,
                    "dropped_on_restore": dict(ledger.n_dropped), "aborted_at_shutdown": ledger.n_aborted}

        def save(step_: int, version_: int, why: str) -> None:
            # buffered groups first, then the ledger: a group accepted in between is only replayed
            buffered = [_group_record(g, ledger.draw_index(g.ticket)) for g in staleness.buffered_groups()]
            extra = {"nonfinite": nonfinite.state_dict(), "why": why, "wall_s": self.wall()}
            base_ref = getattr(self, "_base_ref", None)
            if base_ref is not None:  # LoRA: the adapters are saved, the base is referenced
                extra["lora_base"] = base_ref
            meta = TrainMeta(step=step_, policy_version=version_, data_state=ledger.state(),
                             staleness=snapshot_stats(), config=to_dict(c), extra=extra)
            st = self._save_checkpoint(ckpt, _state_items(state, base_ref), meta, buffered)
            result.checkpoint_step = step_
            save_stats.append(st)
            if why == "periodic":  # quiet: the cost goes to the metrics
                metrics.log(step_, {"checkpoint/blocking_s": st.blocking_s, "checkpoint/wait_s": st.wait_s},
                            advance=False)
            else:
                metrics.message(f"checkpoint {ckpt.step_dir(step_)} ({why}; {len(buffered)} finished groups saved; "
                                f"blocking {st.blocking_s:.2f} s)")

        def do_eval(step_: int, final: bool = False) -> None:
            pusher.wait(version)
            row = self.evaluate(generator, reward_fn, eval_pool, version,
                                stop=None if final else self._stop_requested)
            if row:
                metrics.log(step_, row, advance=False)
                result.eval_history.append((step_, metrics.elapsed(), row["eval/accuracy"]))
                metrics.message(f"eval @ step {step_} (version {version}): accuracy {row['eval/accuracy']:.3f} "
                                f"({row['eval/n']} held-out, {row['eval/seconds']:.1f} s)")

        def eval_due(step_: int) -> bool:  # (also the one a stop or a kill left undone at the resumed step)
            return ((step_ == 0 and c.eval.at_start) or bool(c.eval.every_steps and step_ % c.eval.every_steps == 0
                                                            and 0 < step_ < tr.total_steps))

        signals, own_signals = self.signals, False
        if signals is None and threading.current_thread() is threading.main_thread():
            signals, own_signals = SignalHandler(), True
            signals.__enter__()
        if signals is not None:
            signals.set_phase("RL", "finishing the current step, saving a checkpoint and exiting")
        try:
            generator.start()
            dispatcher.start()
            if eval_due(step) and step not in {s for s, _, _ in result.eval_history}:
                do_eval(step)
            stall_limit = (ro.group_timeout_s or 600.0) + 120.0
            while step < tr.total_steps:
                # 1. wait for B accepted groups (earliest deadline first), watching for failures
                t_wait = time.monotonic()
                groups = None
                while groups is None:
                    err = dispatcher.fatal_error or pusher.error
                    if err is not None:
                        raise FatalRunError(f"rollout failed: {type(err).__name__}: {err}") from err
                    if signals is not None and signals.requested:
                        break
                    if c.max_wall_time_s is not None and time.monotonic() - self.t_start > c.max_wall_time_s:
                        break
                    try:
                        groups = staleness.get_batch(version=version, timeout=1.0)
                    except TimeoutError as e:
                        sc = staleness.counts()
                        if dispatcher.data_exhausted and sc.running == 0:
                            raise FatalRunError(f"data exhausted at step {step}: {sc.buffered} groups buffered, "
                                                f"{B} needed per step") from None
                        if time.monotonic() - t_wait > stall_limit:
                            raise FatalRunError(f"no training batch for {stall_limit:.0f} s: {e}") from None
                if groups is None:
                    stop_reason = "signal" if (signals is not None and signals.requested) else "max_wall_time"
                    break
                wait_s = time.monotonic() - t_wait
                idle_s += wait_s
                # batch order = draw order: independent of finish timing and of ticket numbering after a
                # resume (part of the eta = 0 bitwise resume determinism)
                groups.sort(key=lambda g: ledger.draw_index(g.ticket))
                # 2. advantages, proximal log-probs, update(s)
                trajs, row = build_training_batch(groups, tr.advantage, n)
                t_train = time.monotonic()
                state, mstats = self._train_batch(trainer, state, trajs, version)
                version += 1
                # 3. push the new weights (dispatch now, before the next step donates the params)
                push = pusher.push(state.params, version)
                m0 = step_metrics(mstats)  # every minibatch of the step, not only the last
                train_s = time.monotonic() - t_train
                try:
                    finite = nonfinite.update(step + 1, loss=m0["loss"], grad_norm=m0["grad_norm"])
                except TrainingDivergedError as e:  # stop with a checkpoint of the last finite state
                    raise FatalRunError(f"training diverged: {e}") from e
                if not finite:
                    metrics.message(f"step {step + 1}: non-finite loss/gradient, update skipped ({m0['skipped']} of "
                                    f"{m0['minibatches']} minibatch updates; {nonfinite.consecutive} steps in a row, "
                                    f"{nonfinite.total_skipped} in total)")
                # the step happened (update applied, or skipped as non-finite): its data is consumed. A
                # batch whose step failed stays outstanding in the ledger and is replayed after a resume.
                ledger.consumed([g.ticket.id for g in groups], step=step + 1, version=version - 1,
                                lags=[g.lag for g in groups])
                result.lag_by_group.extend((step, g.ticket.id, g.lag) for g in groups)
                step += 1
                # 4. metrics
                now = time.monotonic()
                gs = generator.stats()
                dt = max(now - last["t"], 1e-9)
                d_steps = gs.steps - last["gen"].steps
                util = ((gs.slot_utilisation * gs.steps - last["gen"].slot_utilisation * last["gen"].steps)
                        / d_steps) if d_steps > 0 else 0.0
                trained_tokens = sum(int(m["tokens"]) for m in mstats)
                hist = pusher.history[-1] if pusher.history else None
                sc = staleness.counts()
                row.update({
                    "version": version, "train/loss": m0["loss"], "train/grad_norm": m0["grad_norm"],
                    "train/lr": m0["lr"], "train/clip_frac": m0.get("clip_frac", float("nan")),
                    "train/entropy": m0.get("entropy", float("nan")),
                    "train/behave_kl": m0.get("behave_approx_kl", float("nan")),
                    "train/behave_prox_abs_max": m0.get("behave_prox_abs_max", float("nan")),
                    "train/behave_mask_frac": m0.get("behave_mask_frac", float("nan")),
                    "train/skipped": int(m0.get("skipped", 0)), "train/seconds": train_s,
                    "train/tokens_per_s": trained_tokens / max(train_s, 1e-9),
                    "gen/tokens_per_s": (gs.generated_tokens - last["gen"].generated_tokens) / dt,
                    "gen/slot_utilisation": util, "gen/busy_fraction": min(1.0, (gs.busy_s - last["gen"].busy_s) / dt),
                    "gen/preemptions": gs.preemptions, "gen/version": gs.version,
                    "trainer/idle_fraction": idle_s / max(now - t_loop0, 1e-9), "trainer/wait_s": wait_s,
                    "push/dispatch_s": push.dispatch_s, "push/total_s": hist.total_s if hist else float("nan"),
                    "push/bytes": push.bytes,
                    "rollout/running": sc.running, "rollout/buffered": sc.buffered, "rollout/rejected": sc.rejected,
                })
                # MoE router metrics (train_step._moe_metrics): load per layer, entropy, aux loss, top-k mismatch
                row.update({f"train/{k}": v for k, v in m0.items() if k.startswith("moe/")})
                last.update(t=now, gen=gs)
                if step % c.logging.log_every == 0 or step == tr.total_steps:
                    metrics.log(step, row)
                result.last_metrics = row
                # 5. eval and checkpoint hooks
                if eval_due(step):
                    do_eval(step)
                if ckpt.should_save(step) and step < tr.total_steps:
                    save(step, version, "periodic")
            if stop_reason == "completed" and signals is not None:
                signals.set_phase("the final evaluation, checkpoint and export",
                                  "the run is complete: finishing them, then exiting")
            if c.eval.at_end and stop_reason == "completed":
                do_eval(step, final=True)
        except BaseException as e:
            stop_reason = f"error: {type(e).__name__}"
            metrics.message(f"run stopped by {type(e).__name__}: {e}")
            if not isinstance(e, (FatalRunError, KeyboardInterrupt)):
                metrics.message(traceback.format_exc())
            ledger.freeze()
            self._shutdown(dispatcher, staleness, pusher, generator, eval_pool, metrics,
                           signals if own_signals else None)
            if step > max(start_step, ckpt.last_saved_step):
                self._emergency_save(save, state, step, step)  # a resumed run uses version = step
            self._close_checkpoint(ckpt)
            ledger.close()
            raise
        # graceful end: stop rollouts, save, export
        ledger.freeze()
        self._shutdown(dispatcher, staleness, pusher, generator, eval_pool, None, None)
        result.counts = snapshot_stats()
        final_data = ledger.state()
        ledger.close()
        signal_name = signals.signal_name if (signals is not None and stop_reason == "signal") else None
        stop_line = None
        try:
            # a stop by signal or time limit always saves (preemption); a periodic save of this very
            # step already holds a consistent state
            if (ck.save_at_end or stop_reason != "completed") and step > max(start_step, ckpt.last_saved_step):
                save(step, version, stop_reason)
            self._wait_checkpoint(ckpt)
            if stop_reason != "completed":
                latest_now = ckpt.latest_committed_step()
                stop_line = (f"stopped by {signal_name or stop_reason} after step {step}: "
                             + (f"checkpoint {ckpt.step_dir(latest_now)} is committed; run the same command again "
                                "to resume" if latest_now is not None
                                else "nothing saved (no step completed); run the same command again to start"))
            if ck.export_hf and result.checkpoint_step is not None and stop_reason == "completed":
                ex = self._export(ckpt, result.checkpoint_step)
                result.export_dir = ex.out_dir
                metrics.message(f"Hugging Face export: {ex.out_dir}")
        finally:
            self._close_checkpoint(ckpt)
            plot = metrics.close()
            if own_signals:
                signals.__exit__(None, None, None)
        result.steps, result.version = step, version
        result.wall_s, result.process_wall_s = self.wall(), time.monotonic() - self.t_start
        result.stopped_by = stop_reason
        result.resumes = resumes_from_rows(metrics.history + resume_rows)
        blocking = [st.blocking_s for st in save_stats]
        evals = result.eval_history
        summary = {"steps": step, "version": version, "wall_s": result.wall_s, "process_wall_s": result.process_wall_s,
                   "stopped_by": stop_reason, "signal": signal_name, "resumed_from": resumed_from,
                   "resumes": result.resumes,
                   "warm_start_accuracy": evals[0][2] if (evals and evals[0][0] == 0 and result.warm_start) else None,
                   "final_accuracy": evals[-1][2] if (evals and stop_reason == "completed") else None,
                   "data": {"next_draw": final_data["next_draw"], "log_records": final_data["log_records"],
                            "outstanding_draws": [o["draw"] for o in final_data["outstanding"]]},
                   "eval_history": evals, "counts": result.counts,
                   "max_lag": max((l for _, _, l in result.lag_by_group), default=0), "eta": eta,
                   "checkpoint_step": result.checkpoint_step, "export_dir": result.export_dir, "plot": plot,
                   "checkpoint_blocking_s": {"saves": len(blocking), "max": max(blocking, default=None),
                                             "mean": float(np.mean(blocking)) if blocking else None},
                   "push_s_mean": float(np.mean([h.total_s for h in pusher.history])) if pusher.history else None}
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if stop_line is not None:
            self._say(stop_line)
        return result

    def _already_complete(self, ckpt: Any, step: int, latest: int | None) -> RunResult:
        """A rerun of a finished run: nothing to train; the export is redone if it is missing (a kill
        during the export)."""
        ck, export_dir = self.cfg.checkpoint, None
        summary_path = os.path.join(self.run_dir, "summary.json")
        try:
            with open(summary_path) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            summary = {}
        try:
            if ck.export_hf and latest is not None and not summary.get("export_dir"):
                self._phase("the export", "finishing it, then exiting")
                export_dir = self._export(ckpt, latest).out_dir
                self._say(f"Hugging Face export: {export_dir}")
                if summary:
                    summary["export_dir"] = export_dir
                    with open(summary_path, "w") as f:
                        json.dump(summary, f, indent=2)
        finally:
            self._close_checkpoint(ckpt)
        self._say(f"{self.run_dir} is already complete at step {step} (trainer.total_steps="
                  f"{self.cfg.trainer.total_steps}); raise trainer.total_steps to continue, or use a new run_dir")
        return RunResult(self.run_dir, step, step, 0.0, [], {}, [], {}, checkpoint_step=latest, export_dir=export_dir,
                         stopped_by="already_complete")

    def _emergency_save(self, save: Callable, state: Any, step: int, version: int) -> None:
        try:
            leaves = jax.tree.leaves(state)
            if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
                self._say("no emergency checkpoint: the training state was consumed by the failed step")
                return
            save(step, version, "emergency")
        except Exception as e:  # noqa: BLE001
            self._say(f"emergency checkpoint failed: {type(e).__name__}: {e}")

    def _shutdown(self, dispatcher, staleness, pusher, generator, pool, metrics, signals) -> None:
        dispatcher.stop(timeout=10.0)
        staleness.close()
        pusher.close(timeout=10.0)
        try:
            generator.stop()
        except RuntimeError as e:
            self._say(str(e))
        pool.shutdown(wait=False, cancel_futures=True)
        if metrics is not None:
            metrics.close(plot=False)
        if signals is not None:
            signals.__exit__(None, None, None)


def run(cfg: RunConfig, **kw: Any) -> RunResult:
    """Build and run ``cfg`` (validated)."""
    return RLLoop(cfg, **kw).run()
