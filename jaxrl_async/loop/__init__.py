"""The asynchronous RL loop (AReaL's design on two meshes of one JAX program), composed from role services.

Layout: ``run.RLRun`` (setup -> resume -> steps -> finish), ``session.TrainingSession`` (the RL phase),
``step.StepRunner`` (one step: the one place where state, policy version, ledger and step advance
together), ``services`` (the single-process trainer and generator services; the multi-process ones are
``distributed.controller.DistributedServices``), ``setup``, ``warm_start``, ``evaluation``, ``summary``,
``control`` (clock, phases, stop signals). The contracts the services implement are in ``jaxrl_async.api``.

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

from jaxrl_async.loop.run import RLRun, run
from jaxrl_async.loop.step import FatalRunError
from jaxrl_async.loop.record import RunResult

__all__ = ["FatalRunError", "RLRun", "RunResult", "run"]
