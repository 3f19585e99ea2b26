"""Async (η = 4) vs synchronous RL on a long-tail workload: wall time to consume the same trajectories.

    python benchmarks/bench_async_vs_sync.py [--steps 20] [--out /tmp/bench_async] [key=value ...]

Both runs use the embedded default (tiny Qwen3 policy, arithmetic task, SFT warm start, 2 simulated
CPU devices: 1 generator, 1 trainer) with the same seeds and the same number of training steps
(hence the same number of consumed trajectories), and differ only in ``rollout.mode``:

* ``sync``: one batch in flight; the generator decodes the batch until its longest sequence ends,
  then the trainer trains while the generator idles (the classic synchronous system);
* ``async`` with ``rollout.max_head_offpolicyness=4``: AReaL's decoupled loop.

Long-tail lengths: :class:`LongTailWorkflow` gives every sample its own generation budget
L = min(max_new_tokens, ⌈base·(1 + Pareto(α))⌉) and decodes all L tokens (EOS does not stop it), so
the decode time of a sample is heavy-tailed, like long reasoning traces. The trajectory is then cut
at the first EOS for the reward and the trainer (the extra tokens only cost decode time), so both
modes learn from the same kind of data. Each mode runs in a fresh process; the ratio is measured in
one invocation. Results: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from jaxrl_async.rollout.workflow import RLVRWorkflow, Trajectory, item_field

BASE_TOKENS = 40
PARETO_ALPHA = 1.2


class LongTailWorkflow(RLVRWorkflow):
    """RLVR with heavy-tailed per-sample decode budgets (see the module docstring)."""

    def run_episode(self, item, ctx):
        rng = np.random.default_rng(ctx.sampling.seed)
        budget = int(min(ctx.sampling.max_new_tokens, math.ceil(BASE_TOKENS * (1 + rng.pareto(PARETO_ALPHA)))))
        eos = set(ctx.sampling.stop_token_ids)
        s = ctx.generate(item_field(item, "prompt_ids"), n=1, max_new_tokens=budget, stop_token_ids=())[0]
        comp = list(s.completion_ids)
        cut = next((i + 1 for i, t in enumerate(comp) if t in eos), len(comp))
        text = self._text_of(comp[:cut], ctx)
        reward = ctx.reward(self.reward_fn, item_field(item, "prompt", ""), text, item_field(item, "answer"))
        return Trajectory.from_completion(s.prompt_ids, comp[:cut], s.logprobs[:cut], s.versions[:cut], reward,
                                          "stop" if cut < len(comp) else "length", decoded_tokens=len(comp))

    def run_group(self, item, ctx, n):
        from jaxrl_async.rollout.workflow import RolloutWorkflow

        return RolloutWorkflow.run_group(self, item, ctx, n)

    def _text_of(self, ids, ctx):
        tok = self.tokenizer if self.tokenizer is not None else ctx.tokenizer
        return tok.decode(list(ids), skip_special_tokens=True)


def run_mode(mode: str, out: str, steps: int, extra: list[str], eval_every: int = 0, target: float = 0.7) -> dict:
    run_dir = os.path.join(out, mode)
    args = [sys.executable, "-m", "jaxrl_async.main", f"run_dir={run_dir}", f"rollout.mode={mode}",
            f"trainer.total_steps={steps}", "rollout.workflow=bench_async_vs_sync:LongTailWorkflow",
            "rollout.sampling.max_new_tokens=256", "rollout.engine.max_sequence_length=320",
            "model.max_position_embeddings=320", "trainer.packing.row_len_buckets=(64,128,320)",
            "checkpoint.resume=never", "checkpoint.export_hf=false", "logging.progress=false",
            "logging.print_config=false", f"eval.every_steps={eval_every}"]
    if mode == "async":
        args.append("rollout.max_head_offpolicyness=4")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.run(args + extra, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    # loop time: from the first training row's predecessor (after SFT + compile) to the last step
    first_t = train[0]["wall_time"] - train[0]["train/seconds"] - train[0]["trainer/wait_s"]
    return {
        "mode": mode, "process_wall_s": wall, "rl_wall_s": train[-1]["wall_time"] - first_t,
        "steps": len(train),
        "eval_start": evals[0]["eval/accuracy"] if evals else None,
        "eval_end": evals[-1]["eval/accuracy"] if evals else None,
        # RL wall seconds until held-out accuracy first reaches `target` (None: never)
        "time_to_target_s": next((e["wall_time"] - first_t for e in evals if e["eval/accuracy"] >= target), None),
        "eval_curve": [(e["step"], round(e["wall_time"] - first_t, 1), e["eval/accuracy"]) for e in evals],
        "reward_last5": float(np.mean([r["reward/mean"] for r in train[-5:]])),
        "slot_util": float(np.mean([r["gen/slot_utilisation"] for r in train])),
        "gen_busy": float(np.mean([r["gen/busy_fraction"] for r in train])),
        "trainer_idle": train[-1]["trainer/idle_fraction"],
        "gen_tok_s": float(np.mean([r["gen/tokens_per_s"] for r in train])),
        "max_lag": max(r["staleness/max"] for r in train),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="/tmp/bench_async_vs_sync")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out evaluation period (steps); 0 = start/end")
    ap.add_argument("--target", type=float, default=0.7, help="accuracy for the time-to-accuracy column")
    args, extra = ap.parse_known_args()
    results = [run_mode(m, args.out, args.steps, extra, args.eval_every, args.target) for m in args.modes.split(",")]
    print(f"| mode | RL wall s | speedup | s to acc >= {args.target} | eval acc start -> end | reward (last 5) "
          "| slot util (per step) | "
          "generator busy | trainer idle | gen tok/s | max lag |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = next((r for r in results if r["mode"] == "sync"), results[0])
    for r in results:
        tt = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}"
        print(f"| {r['mode']} | {r['rl_wall_s']:.1f} | {base['rl_wall_s'] / r['rl_wall_s']:.2f}x | {tt} | "
              f"{r['eval_start']} -> {r['eval_end']} | {r['reward_last5']:.3f} | {r['slot_util']:.2f} | "
              f"{r['gen_busy']:.2f} | {r['trainer_idle']:.2f} | {r['gen_tok_s']:.0f} | {r['max_lag']} |")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
