"""The fixed cost of a decode step (issue 28): a one-layer, hidden-64 model at 64 slots, this tree vs a baseline
revision, side by side in one process.

    python benchmarks/bench_decode_fixed_cost.py [--baseline main] [--rounds 5] [--ks 1 8 16] [--json out.json]

Model: `accelerator_suite.FIXED_MODEL` (1 layer, hidden 64, 2 / 1 heads of 32, MLP 128, vocab 1024, tied
embeddings, random weights, float32), so the model's arithmetic is almost nothing and what a step costs is the
step's fixed cost. Engine: 64 slots, page 16, each tree's default decode attention on CPU ("auto": `cpu_paged` since
session 16, `blocked` before), temperature 1, no top-k / top-p (the lean sampling program).

The baseline is `git archive BASELINE jaxrl_async`, imported in this same process as the package
`jaxrl_async_baseline` (its imports renamed), so both trees' engines run interleaved, chunk by chunk, in one
process: on a shared, noisy machine each baseline figure has a current one measured next to it, and the ratios
are medians of those pairs. Reported per K (decode steps per dispatch):

* **engine**: every slot filled with a 48-token prompt (both engines, the same prompts and seeds), then
  `engine.generate` dispatches of K steps in chunks of `--chunk` steps, alternating baseline / current chunks;
  `sync` = a dispatch + its tokens and log-probs copied to the host, per step (dispatch / K); `cpu` = the process's
  CPU time per step over the chunk (less sensitive to other processes than the wall clock).
* **generator**: the real orchestrator (`Generator`, the path of `python -m jaxrl_async.generate`), 64 prompts of
  8-63 random tokens, every one to `--new-tokens` tokens (no stop token), dispatches of up to K steps, one run
  per tree per round, alternating; time per decode step = live slots / decode tokens/s (the issue's definition:
  the mean live slots over the steps / `GeneratorStats.tokens_per_s`). The two trees' tokens are compared.
* **program**: the compiled single-step decode program's HLO: top-level instructions that run as XLA:CPU thunks
  (everything but parameters, constants, tuples, get-tuple-element and bitcasts), fusions, copies and while loops
  over all computations.
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


def load_baseline(repo: str, rev: str, into: str) -> str:
    """`git archive rev jaxrl_async`, unpacked under `into` as the package `jaxrl_async_baseline` (every
    `jaxrl_async` name in its sources renamed), importable next to this tree's."""
    tar = os.path.join(into, "base.tar")
    subprocess.run(["git", "-C", repo, "archive", "-o", tar, rev, "jaxrl_async"], check=True)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    pkg = os.path.join(into, "jaxrl_async_baseline")
    os.rename(os.path.join(into, "jaxrl_async"), pkg)
    for root, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    text = fh.read()
                with open(path, "w") as fh:
                    fh.write(re.sub(r"\bjaxrl_async\b", "jaxrl_async_baseline", text))
    return into


class Tree:
    """One tree's engine on the fixed-cost model."""

    def __init__(self, pkg: str, ks: list[int], max_seq: int, params_np):
        import importlib

        import jax

        mod = lambda name: importlib.import_module(f"{pkg}.{name}")  # noqa: E731
        self.api = mod("generator.engine_api")
        self.Generator = mod("generator.orchestrator").Generator
        factory = mod("generator.factory")
        cfg = mod("models.config").ModelConfig(**FIXED_MODEL, max_position_embeddings=max_seq, dtype="float32",
                                               param_dtype="float32")
        self.eng = factory.build_engine(factory.EngineConfig(
            max_concurrent_decodes=SLOTS, max_sequence_length=max_seq, max_prefill_length=64, page_size=16,
            num_pages=SLOTS * (-(-max_seq // 16)) + 1, decode_steps=max(ks)), cfg, attention="auto")
        self.params = self.eng.place_params(jax.tree.map(jax.numpy.asarray, params_np))
        t = time.perf_counter()
        self.eng.warmup(self.params, max_samples=1, truncation=False)
        self.warmup_s = time.perf_counter() - t
        self.file = importlib.import_module(pkg).__file__

    def filled(self, prompts):
        eng, api = self.eng, self.api
        state = eng.init_decode_state()
        reqs = [api.PrefillRequest(p, api.SamplingParams(temperature=1.0, max_new_tokens=10**6, seed=s))
                for s, p in enumerate(prompts)]
        for s, pre in enumerate(eng.prefill_many(self.params, reqs)):
            state = eng.insert(pre, state, s)
        return state

    def dispatch(self, state, k):
        return self.eng.generate(self.params, state, k) if k > 1 else self.eng.generate(self.params, state)

    def program(self, state) -> dict:
        import jax

        new_pages = jax.device_put(np.full(SLOTS, -1, np.int32), self.eng.slot_sharding)
        return hlo_counts(self.eng._steps[False].lower(self.params, state.arrays, new_pages).compile().as_text())

    def generate(self, prompts, k: int, new_tokens: int) -> dict:
        with self.Generator(self.eng, self.params) as g:
            g.max_decode_steps = k
            c0, t = time.process_time(), time.perf_counter()
            hs = [g.submit(p, self.api.SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i),
                           request_id=str(i)) for i, p in enumerate(prompts)]
            outs = [h.result(3600).samples[0] for h in hs]
            wall, cpu = time.perf_counter() - t, time.process_time() - c0
            st = g.stats()
        live = st.slot_utilisation * SLOTS
        return {"tokens": sum(len(o.completion_ids) for o in outs), "wall_s": wall, "decode_tok_s": st.tokens_per_s,
                "live_slots": live, "ms_per_step": 1e3 * live / st.tokens_per_s, "cpu_ms_per_step": 1e3 * cpu / st.steps,
                "steps": st.steps, "dispatches": st.dispatches,
                "completions": [o.completion_ids for o in outs], "logprobs": [o.logprobs for o in outs]}


def run(args, base_dir: str) -> dict:
    import jax

    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), base_dir]  # this tree, baseline
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.models.transformer import init_params

    ks = sorted(set(args.ks))
    max_seq = 64 + max(args.new_tokens, args.engine_steps + 2 * max(ks)) + 8
    params_np = jax.tree.map(np.asarray, init_params(
        ModelConfig(**FIXED_MODEL, max_position_embeddings=max_seq, dtype="float32", param_dtype="float32"),
        jax.random.key(0)))
    trees = {"baseline": Tree("jaxrl_async_baseline", ks, max_seq, params_np),
             "current": Tree("jaxrl_async", ks, max_seq, params_np)}
    rng = np.random.default_rng(0)
    fill = [rng.integers(3, FIXED_MODEL["vocab_size"], 48).tolist() for _ in range(SLOTS)]
    out: dict = {"files": {n: t.file for n, t in trees.items()}, "warmup_s": {n: t.warmup_s for n, t in trees.items()},
                 "engine": {}, "generator": {}}
    for k in ks:
        states = {n: t.filled(fill) for n, t in trees.items()}
        for n, t in trees.items():  # compiles K
            for _ in range(2):
                states[n], step = t.dispatch(states[n], k)
            np.asarray(step.tokens)
        per = max(1, args.chunk // k)
        rows: dict = {n: {"sync_ms": [], "cpu_ms": []} for n in trees}
        for _ in range(max(1, args.engine_steps // (per * k))):
            for n, t in trees.items():
                sync = []
                c0 = time.process_time()
                for _ in range(per):
                    t0 = time.perf_counter()
                    states[n], step = t.dispatch(states[n], k)
                    np.asarray(step.tokens), np.asarray(step.logprobs)
                    sync.append((time.perf_counter() - t0) / k)
                rows[n]["sync_ms"].append(1e3 * statistics.median(sync))
                rows[n]["cpu_ms"].append(1e3 * (time.process_time() - c0) / (per * k))
        out["engine"][k] = rows
        if k == ks[0]:
            out["program"] = {n: t.program(states[n]) for n, t in trees.items()}
    prompts = [rng.integers(3, FIXED_MODEL["vocab_size"], int(n)).tolist() for n in rng.integers(8, 64, SLOTS)]
    for k in ks:
        runs: dict = {n: [] for n in trees}
        for _ in range(args.rounds):
            for n, t in trees.items():
                runs[n].append(t.generate(prompts, k, args.new_tokens))
        same = [a == b for a, b in zip(runs["baseline"][0]["completions"], runs["current"][0]["completions"])]
        lp = max((float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
            runs["baseline"][0]["logprobs"], runs["current"][0]["logprobs"]) if len(a) == len(b)), default=0.0)
        for n in runs:
            for r in runs[n]:
                r.pop("completions"), r.pop("logprobs")
        out["generator"][k] = {"runs": runs, "same_tokens": float(np.mean(same)), "max_logprob_diff": lp}
    out["compiles"] = {n: t.eng.compile_counts() for n, t in trees.items()}
    return out


def summarise(res: dict) -> dict:
    med = statistics.median
    rows = []
    for k, e in res["engine"].items():
        g = res["generator"][k]
        row: dict = {"K": int(k)}
        for n in ("baseline", "current"):
            row[n] = {"engine_sync_ms": med(e[n]["sync_ms"]), "engine_cpu_ms": med(e[n]["cpu_ms"]),
                      "generator_ms_per_step": med([r["ms_per_step"] for r in g["runs"][n]]),
                      "generator_best_ms_per_step": min(r["ms_per_step"] for r in g["runs"][n]),
                      "generator_cpu_ms_per_step": med([r["cpu_ms_per_step"] for r in g["runs"][n]]),
                      "generator_live_slots": med([r["live_slots"] for r in g["runs"][n]]),
                      "generator_decode_tok_s": med([r["decode_tok_s"] for r in g["runs"][n]])}
        pair = lambda xs, ys: med([a / b for a, b in zip(xs, ys)])  # noqa: E731
        row["ratio_baseline_over_current"] = {
            "engine_sync": pair(e["baseline"]["sync_ms"], e["current"]["sync_ms"]),
            "engine_cpu": pair(e["baseline"]["cpu_ms"], e["current"]["cpu_ms"]),
            "generator": pair([r["ms_per_step"] for r in g["runs"]["baseline"]],
                              [r["ms_per_step"] for r in g["runs"]["current"]]),
            "generator_cpu": pair([r["cpu_ms_per_step"] for r in g["runs"]["baseline"]],
                                  [r["cpu_ms_per_step"] for r in g["runs"]["current"]])}
        row["same_tokens"], row["max_logprob_diff"] = g["same_tokens"], g["max_logprob_diff"]
        rows.append(row)
    return {"rows": rows, "program": res["program"], "compiles": res["compiles"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git revision of the baseline tree")
    ap.add_argument("--rounds", type=int, default=5, help="generator runs per tree and K")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 8, 16], help="decode steps per dispatch")
    ap.add_argument("--engine-steps", type=int, default=192, help="timed engine decode steps per K and tree")
    ap.add_argument("--chunk", type=int, default=16, help="engine steps per alternation")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens per prompt in the generator run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        res = run(args, load_baseline(repo, args.baseline, d))
    summary = {"baseline_rev": args.baseline, **summarise(res)}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**summary, "raw": res}, fh, indent=1)


if __name__ == "__main__":
    main()
