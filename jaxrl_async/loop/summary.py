"""What a run reports: the metrics row of one step, the run's counts, and ``summary.json``."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from jaxrl_async.rollout.agent import agent_metrics

__all__ = ["StepClock", "run_counts", "step_row", "write_summary"]


class StepClock:
    """Time and generator counters at the previous row (for rates between rows) and the trainer's idle time."""

    def __init__(self, gen_stats: Any):
        self.t0 = self.t = time.monotonic()
        self.gen = gen_stats
        self.idle_s = 0.0


def step_row(out: Any, push: Any, pusher: Any, gs: Any, sc: Any, clock: StepClock, *, version: int,
             wait_s: float) -> dict[str, Any]:
    """The metrics row of a step (``out``: its ``StepOutcome``; ``gs`` the generator's stats, ``sc`` the
    staleness counts); advances ``clock``."""
    m0 = out.summary
    clock.idle_s += wait_s
    now = time.monotonic()
    dt = max(now - clock.t, 1e-9)
    d_steps = gs.steps - clock.gen.steps
    util = ((gs.slot_utilisation * gs.steps - clock.gen.slot_utilisation * clock.gen.steps) / d_steps
            if d_steps > 0 else 0.0)
    trained_tokens = sum(int(m["tokens"]) for m in out.stats)
    hist = pusher.history[-1] if pusher.history else None
    row = dict(out.row)
    row.update({
        "version": version, "train/loss": m0["loss"], "train/grad_norm": m0["grad_norm"],
        "train/lr": m0["lr"], "train/clip_frac": m0.get("clip_frac", float("nan")),
        "train/entropy": m0.get("entropy", float("nan")),
        "train/behave_kl": m0.get("behave_approx_kl", float("nan")),
        "train/behave_prox_abs_max": m0.get("behave_prox_abs_max", float("nan")),
        "train/behave_mask_frac": m0.get("behave_mask_frac", float("nan")),
        "train/skipped": int(m0.get("skipped", 0)), "train/seconds": out.train_s,
        "train/tokens_per_s": trained_tokens / max(out.train_s, 1e-9),
        "gen/tokens_per_s": (gs.generated_tokens - clock.gen.generated_tokens) / dt,
        "gen/slot_utilisation": util, "gen/busy_fraction": min(1.0, (gs.busy_s - clock.gen.busy_s) / dt),
        "gen/preemptions": gs.preemptions, "gen/version": gs.version,
        "trainer/idle_fraction": clock.idle_s / max(now - clock.t0, 1e-9), "trainer/wait_s": wait_s,
        "push/dispatch_s": push.dispatch_s, "push/total_s": hist.total_s if hist else float("nan"),
        "push/bytes": push.bytes,
        "rollout/running": sc.running, "rollout/buffered": sc.buffered, "rollout/rejected": sc.rejected,
    })
    # MoE router metrics (train_step's moe metrics): load per layer, entropy, aux loss, top-k mismatch
    row.update({f"train/{k}": v for k, v in m0.items() if k.startswith("moe/")})
    # multi-turn agent episodes (AgentWorkflow): turns, tokens per turn, tool calls and errors, how episodes ended
    row.update(agent_metrics(t for g in out.groups for t in g.item.trajectories))
    clock.t, clock.gen = now, gs
    return row


def run_counts(sc: Any, ledger: Any) -> dict[str, Any]:
    """Admission and data accounting (staleness manager counts ``sc`` and the ledger's)."""
    return {"admitted": sc.admitted, "consumed": sc.consumed, "rejected": sc.rejected,
            "rejected_by_reason": sc.rejected_by_reason, "running": sc.running, "buffered": sc.buffered,
            "balanced": sc.balanced(), "ledger_drawn": ledger.n_drawn, "ledger_consumed": ledger.n_consumed,
            "ledger_rejected": dict(ledger.n_rejected), "ledger_outstanding": ledger.outstanding,
            "replayed": ledger.n_replayed, "restored": ledger.n_restored,
            "dropped_on_restore": dict(ledger.n_dropped), "aborted_at_shutdown": ledger.n_aborted}


def write_summary(session: Any, final_data: dict[str, Any], signal_name: str | None, plot: Any) -> None:
    """``RUN/summary.json`` of a session that ended (its ``result`` filled in)."""
    from jaxrl_async.loop.metrics import resumes_from_rows

    r = session.result
    r.resumes = resumes_from_rows(session.metrics.history + session.resume_rows)
    blocking = [st.blocking_s for st in session.save_stats]
    evals, history = r.eval_history, session.pusher.history
    summary = {"steps": r.steps, "version": r.version, "wall_s": r.wall_s, "process_wall_s": r.process_wall_s,
               "stopped_by": r.stopped_by, "signal": signal_name, "resumed_from": session.point.resumed_from,
               "resumes": r.resumes,
               "warm_start_accuracy": evals[0][2] if (evals and evals[0][0] == 0 and r.warm_start) else None,
               "final_accuracy": evals[-1][2] if (evals and r.stopped_by == "completed") else None,
               "data": {"next_draw": final_data["next_draw"], "log_records": final_data["log_records"],
                        "outstanding_draws": [o["draw"] for o in final_data["outstanding"]]},
               "eval_history": evals, "counts": r.counts,
               "max_lag": max((lag for _, _, lag in r.lag_by_group), default=0), "eta": session.eta,
               "checkpoint_step": r.checkpoint_step, "export_dir": r.export_dir, "plot": plot,
               "checkpoint_blocking_s": {"saves": len(blocking), "max": max(blocking, default=None),
                                         "mean": float(np.mean(blocking)) if blocking else None},
               "push_s_mean": float(np.mean([h.total_s for h in history])) if history else None}
    with open(os.path.join(session.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
