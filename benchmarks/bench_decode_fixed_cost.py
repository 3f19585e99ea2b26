"""The fixed cost of a decode step (issue 28): a one-layer, hidden-64 model at 64 slots, this tree vs a baseline
revision, side by side in one invocation.

    python benchmarks/bench_decode_fixed_cost.py [--baseline main] [--rounds 3] [--ks 1 8 16] [--json out.json]

Model: `accelerator_suite.FIXED_MODEL` (1 layer, hidden 64, 2 / 1 heads of 32, MLP 128, vocab 1024, tied
embeddings, random weights, float32), so the model's arithmetic is almost nothing and what a step costs is the
step's fixed cost. Engine: 64 slots, page 16, `blocked` decode attention (the CPU default), temperature 1, no
top-k / top-p (the lean sampling program).

Two trees run the same worker (this file, `--worker`) in their own processes, alternating (baseline, current,
baseline, current, ...: `--rounds` rounds), so the machine's noise falls on both alike: the baseline is `git archive
BASELINE jaxrl_async` unpacked into a temporary directory and put first on PYTHONPATH; the current tree is the
repository this file is in. Each worker reports:

* **engine**: every slot filled with a 48-token prompt, then `engine.generate` dispatches of K steps; `sync` = one
  dispatch + its tokens and log-probs copied to the host, per step (dispatch / K), median over the dispatches;
  `pipelined` = the dispatches back to back, one wait at the end, per step.
* **generator**: the real orchestrator (`Generator`, the path of `python -m jaxrl_async.generate`), 64 prompts of
  8-63 random tokens, every one to `--new-tokens` tokens (no stop token), dispatches of up to K steps; time per
  decode step = live slots / decode tokens/s (the issue's definition: the mean live slots over the steps /
  `GeneratorStats.tokens_per_s`).
* **program**: the compiled single-step decode program's HLO: top-level instructions that run as XLA:CPU thunks
  (everything but parameters, constants, tuples, get-tuple-element and bitcasts), fusions and copies in all
  computations, while loops.

Figures: the median over the rounds of each tree, and current / baseline ratios.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

FIXED_MODEL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=32, tie_word_embeddings=True)
SLOTS = 64
NOT_THUNKS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def hlo_counts(text: str) -> dict:
    """Thunks at the top level of a compiled program's entry computation, and ops over all computations."""
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}\n")]
    ops: collections.Counter = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*\S+\s+([a-z][\w-]*)\(", line)
        if m:
            ops[m.group(1)] += 1
    return {"entry_thunks": sum(n for op, n in ops.items() if op not in NOT_THUNKS),
            "fusions": len(re.findall(r"= \S+ fusion\(", text)), "copies": len(re.findall(r"= \S+ copy\(", text)),
            "whiles": len(re.findall(r"\bwhile\(", text)), "parameters": ops["parameter"]}


def worker(args) -> dict:
    import jax

    import jaxrl_async
    from jaxrl_async.generator.engine_api import PrefillRequest, SamplingParams
    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.generator.orchestrator import Generator
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.models.transformer import init_params

    ks = sorted(set(args.ks))
    max_seq = 64 + args.new_tokens + 8
    cfg = ModelConfig(**FIXED_MODEL, max_position_embeddings=max_seq, dtype="float32", param_dtype="float32")
    eng = build_engine(EngineConfig(max_concurrent_decodes=SLOTS, max_sequence_length=max_seq, max_prefill_length=64,
                                    page_size=16, num_pages=SLOTS * (-(-max_seq // 16)) + 1, decode_steps=max(ks)),
                       cfg, attention="blocked")
    params = eng.place_params(init_params(cfg, jax.random.key(0)))
    t0 = time.perf_counter()
    eng.warmup(params, max_samples=1, truncation=False)
    warmup_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    fill = [PrefillRequest(rng.integers(3, FIXED_MODEL["vocab_size"], 48).tolist(),
                           SamplingParams(temperature=1.0, max_new_tokens=10**6, seed=s)) for s in range(SLOTS)]
    out: dict = {"tree": os.path.dirname(os.path.dirname(os.path.abspath(jaxrl_async.__file__))),
                 "warmup_s": warmup_s, "engine": {}, "generator": {}}
    for k in ks:
        state = eng.init_decode_state()
        for s, pre in enumerate(eng.prefill_many(params, fill)):
            state = eng.insert(pre, state, s)
        gen = (lambda p, st: eng.generate(p, st, k)) if k > 1 else eng.generate  # noqa: B023, E731
        for _ in range(2):  # compiles (K > 1 and K != the warmed-up one)
            state, step = gen(params, state)
        np.asarray(step.tokens)
        dispatches = max(2, args.engine_steps // k)
        sync = []
        for _ in range(dispatches):
            t = time.perf_counter()
            state, step = gen(params, state)
            np.asarray(step.tokens), np.asarray(step.logprobs)
            sync.append((time.perf_counter() - t) / k)
        t = time.perf_counter()
        for _ in range(dispatches):
            state, step = gen(params, state)
        np.asarray(step.tokens)
        out["engine"][k] = {"sync_ms": 1e3 * statistics.median(sync),
                            "pipelined_ms": 1e3 * (time.perf_counter() - t) / (dispatches * k)}
    new_pages = jax.device_put(np.full(SLOTS, -1, np.int32), eng.slot_sharding)
    out["program"] = hlo_counts(eng._steps[False].lower(params, state.arrays, new_pages).compile().as_text())
    prompts = [rng.integers(3, FIXED_MODEL["vocab_size"], int(n)).tolist() for n in rng.integers(8, 64, SLOTS)]
    for k in ks:
        with Generator(eng, params) as g:
            g.max_decode_steps = k
            t = time.perf_counter()
            hs = [g.submit(p, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=i),
                           request_id=str(i)) for i, p in enumerate(prompts)]
            n_tok = sum(len(h.result(3600).samples[0].completion_ids) for h in hs)
            wall = time.perf_counter() - t
            st = g.stats()
        live = st.slot_utilisation * SLOTS
        out["generator"][k] = {"tokens": n_tok, "wall_s": wall, "decode_tok_s": st.tokens_per_s, "live_slots": live,
                               "ms_per_step": 1e3 * live / st.tokens_per_s, "dispatches": st.dispatches,
                               "steps": st.steps}
    out["compiles"] = eng.compile_counts()
    return out


def baseline_tree(repo: str, rev: str, into: str) -> str:
    """`git archive rev jaxrl_async` unpacked under `into`; returns that directory."""
    tar = os.path.join(into, "base.tar")
    subprocess.run(["git", "-C", repo, "archive", "-o", tar, rev, "jaxrl_async"], check=True)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git revision of the baseline tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 8, 16], help="decode steps per dispatch")
    ap.add_argument("--engine-steps", type=int, default=96, help="timed engine decode steps per K")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens per prompt in the generator run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory() as d:
        trees = {"baseline": baseline_tree(repo, args.baseline, d), "current": repo}
        for r in range(args.rounds):
            for name in ("baseline", "current"):
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--ks", *map(str, args.ks),
                       "--engine-steps", str(args.engine_steps), "--new-tokens", str(args.new_tokens)]
                env = dict(os.environ, PYTHONPATH=trees[name])
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not line:
                    sys.exit(f"{name} worker failed:\n{p.stderr[-4000:]}")
                res = json.loads(line[-1][len("RESULT "):])
                assert os.path.samefile(res["tree"], trees[name]), (res["tree"], trees[name])
                runs[name].append(res)
                print(f"round {r} {name}: " + json.dumps({"engine": res["engine"], "generator": {
                    k: round(v["ms_per_step"], 3) for k, v in res["generator"].items()}}), flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    summary: dict = {"baseline_rev": args.baseline, "rounds": args.rounds, "rows": []}
    for k in map(str, sorted(set(args.ks))):
        row = {"K": int(k)}
        for name in runs:
            row[name] = {"engine_sync_ms": med([x["engine"][k]["sync_ms"] for x in runs[name]]),
                         "engine_pipelined_ms": med([x["engine"][k]["pipelined_ms"] for x in runs[name]]),
                         "generator_ms_per_step": med([x["generator"][k]["ms_per_step"] for x in runs[name]]),
                         "generator_live_slots": med([x["generator"][k]["live_slots"] for x in runs[name]]),
                         "generator_decode_tok_s": med([x["generator"][k]["decode_tok_s"] for x in runs[name]])}
        row["ratio_baseline_over_current"] = {m: row["baseline"][m] / row["current"][m] for m in (
            "engine_sync_ms", "engine_pipelined_ms", "generator_ms_per_step")}
        summary["rows"].append(row)
    summary["program"] = {name: runs[name][0]["program"] for name in runs}
    summary["runs"] = runs
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
