"""The engine's decode step at a model shape (issue 28): milliseconds per step with every slot live, single-step
and multi-step dispatches over the same positions, and the matmul rate that implies.

    python benchmarks/bench_decode_step.py [--hidden 512 --layers 6 --vocab 16384] [--slots 64] [--k 16]
        [--fill 48] [--warm-steps 32] [--steps 96] [--positions 48,112,176,240] [--block-pages N]
        [--attention auto,blocked] [--matmul-rows auto,0]

Model: a random Qwen3-shaped model like `bench_generate_static.py`'s (heads of 64, hidden / 64 query and
hidden / 128 KV heads, MLP 3 x hidden, tied embeddings), float32; the generator's default engine (page 16, the
platform's decode attention). Every slot gets a `--fill`-token prompt; then, for K = 1 and K = `--k`, from a fresh
fill: `--warm-steps` steps untimed, `--steps` steps timed (dispatches of K), so both cover the same positions.
GFLOP/s counts 2 x parameters x slots per step (the matmuls; attention not counted). `--positions`: the
single-step cost measured in windows starting at these positions (the KV read grows with the position).
`--attention`: the decode attentions to measure, one after the other in this process (e.g. ``cpu_paged,blocked``:
the CPU kernel and the portable path side by side); the JSON has one entry per attention under "attention" and
the first one's figures at the top level. `--matmul-rows`: the engine's `stacked_matmul_rows` (auto: its default;
0: XLA's dots on the scanned weight slices; N: programs of at most N rows read the weights in place), each run with
each attention (entries "ATTENTION/ROWS" when more than one is given).

`--baseline REV`: instead, this tree against `git archive REV` (imported beside it in this process as
`jaxrl_async_baseline`, `bench_decode_fixed_cost.load_baseline`), both engines filled alike and stepped in
alternating chunks of `--chunk` steps (dispatches of K = `--k`) over `--rounds` rounds, so each baseline chunk has
a current one measured next to it at the same positions; reported: the median per-round ratio (baseline ms /
current ms; > 1: this tree is faster), by wall clock and by process CPU time, and whether the two trees sampled the
same tokens.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--fill", type=int, default=48)
    ap.add_argument("--warm-steps", type=int, default=32)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--positions", default="", help="comma-separated start positions for the per-position costs")
    ap.add_argument("--block-pages", type=int, default=None,
                    help="pages per block of the blocked decode attention (default: the engine's)")
    ap.add_argument("--attention", default="auto", help="comma-separated decode attentions (engine names or auto)")
    ap.add_argument("--matmul-rows", default="auto", help="comma-separated stacked_matmul_rows (auto or ints)")
    ap.add_argument("--baseline", default=None, help="git revision to compare against, side by side (see above)")
    ap.add_argument("--rounds", type=int, default=8, help="--baseline: alternations")
    ap.add_argument("--chunk", type=int, default=32, help="--baseline: steps per tree per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.baseline:
        import os
        import tempfile

        from bench_decode_fixed_cost import load_baseline

        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with tempfile.TemporaryDirectory() as d:
            res = compare(args, load_baseline(repo, args.baseline, d))
        print(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return

    from jaxrl_async.models.config import ModelConfig

    positions = [int(p) for p in args.positions.split(",") if p]
    window = 16
    last = max([args.fill + args.warm_steps + args.steps] + [p + window for p in positions])
    max_seq = -(-(last + 8) // 16) * 16
    cfg = ModelConfig(**model_kwargs(args, max_seq))
    res: dict = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "attention": {}}
    rows_opts = [r for r in args.matmul_rows.split(",") if r]
    for attention in [a for a in args.attention.split(",") if a]:
        for rows in rows_opts:
            r = measure(args, cfg, attention, max_seq, positions, window, None if rows == "auto" else int(rows))
            res["attention"][attention if len(rows_opts) == 1 else f"{attention}/{rows}"] = r
        if len(res["attention"]) == 1:
            res.update({k: v for k, v in r.items() if k != "attention"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def model_kwargs(args, max_seq: int) -> dict:
    """The benchmark's model (`ModelConfig` fields): Qwen3-shaped, heads of 64, tied embeddings, float32."""
    H = args.hidden
    return dict(vocab_size=args.vocab, hidden_size=H, intermediate_size=3 * H, num_layers=args.layers,
                num_heads=H // 64, num_kv_heads=max(H // 128, 1), head_dim=64, tie_word_embeddings=True,
                max_position_embeddings=max_seq, dtype="float32", param_dtype="float32", model_type="qwen3")


def engine_config(factory, args, max_seq: int):
    """The engine's sizing: every slot can reach `max_seq`, pages of 16, dispatches of up to `--k` steps."""
    return factory.EngineConfig(
        max_concurrent_decodes=args.slots, max_sequence_length=max_seq, max_prefill_length=-(-args.fill // 16) * 16,
        page_size=16, num_pages=args.slots * (max_seq // 16) + 1, decode_steps=args.k)


def compare(args, base_dir: str) -> dict:
    """`--baseline`: both trees' engines at this shape, stepped in alternating chunks (see the module doc)."""
    import importlib
    import os
    import statistics
    import sys

    import jax

    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), base_dir]
    H, S, K = args.hidden, args.slots, args.k
    max_seq = -(-(args.fill + args.warm_steps + args.rounds * args.chunk + 2 * K + 8) // 16) * 16
    params_np = None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, args.vocab, args.fill).tolist() for _ in range(S)]
    trees: dict = {}
    for name, pkg in (("baseline", "jaxrl_async_baseline"), ("current", "jaxrl_async")):
        mod = lambda m, pkg=pkg: importlib.import_module(f"{pkg}.{m}")  # noqa: E731
        api, factory = mod("generator.engine_api"), mod("generator.factory")
        cfg = mod("models.config").ModelConfig(**model_kwargs(args, max_seq))
        if params_np is None:
            params_np = jax.tree.map(np.asarray, mod("models.transformer").init_params(cfg, jax.random.key(0)))
        eng = factory.build_engine(engine_config(factory, args, max_seq), cfg, attention=args.attention)
        params = eng.place_params(jax.tree.map(jax.numpy.asarray, params_np))
        state = eng.init_decode_state()
        reqs = [api.PrefillRequest(p, api.SamplingParams(temperature=1.0, max_new_tokens=10**6, seed=s))
                for s, p in enumerate(prompts)]
        for s, pre in enumerate(eng.prefill_many(params, reqs)):
            state = eng.insert(pre, state, s)
        trees[name] = {"eng": eng, "params": params, "state": state, "tokens": [], "wall": [], "cpu": [],
                       "attention": eng.attention, "stacked_matmul_rows": eng.stacked_matmul_rows}

    def run(t, steps: int, timed: bool):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps // K):
            t["state"], st = t["eng"].generate(t["params"], t["state"], K) if K > 1 else t["eng"].generate(
                t["params"], t["state"])
            t["tokens"].append(np.asarray(st.tokens))
        if timed:
            n = steps // K * K
            t["wall"].append(1e3 * (time.perf_counter() - t0) / n)
            t["cpu"].append(1e3 * (time.process_time() - c0) / n)

    for t in trees.values():
        run(t, args.warm_steps, False)
    for r in range(args.rounds):  # alternate which tree goes first
        for name in (("baseline", "current") if r % 2 == 0 else ("current", "baseline")):
            run(trees[name], args.chunk, True)
    b, c = trees["baseline"], trees["current"]
    med = statistics.median
    same = float(np.mean([np.array_equal(x, y) for x, y in zip(b["tokens"], c["tokens"])]))
    res = {"baseline_rev": args.baseline, "slots": S, "K": K, "hidden": H, "layers": args.layers, "vocab": args.vocab,
           "positions": [args.fill + args.warm_steps, args.fill + args.warm_steps + args.rounds * args.chunk],
           **{f"{n}_{k}": trees[n][k] for n in trees for k in ("attention", "stacked_matmul_rows")},
           "baseline_ms": med(b["wall"]), "current_ms": med(c["wall"]),
           "ratio_wall": med([x / y for x, y in zip(b["wall"], c["wall"])]),
           "ratio_cpu": med([x / y for x, y in zip(b["cpu"], c["cpu"])]), "same_token_dispatches": same,
           "rounds": {n: {"wall_ms": trees[n]["wall"], "cpu_ms": trees[n]["cpu"]} for n in trees}}
    return res


def measure(args, cfg, attention: str, max_seq: int, positions: list[int], window: int,
            matmul_rows: int | None = None) -> dict:
    """One attention's figures: ms per step at K = 1 and K = --k over the same positions, and per position."""
    import jax

    from jaxrl_async.generator import engine_api as api
    from jaxrl_async.generator import factory
    from jaxrl_async.models.transformer import init_params

    H, S, K = args.hidden, args.slots, args.k
    eng = factory.build_engine(engine_config(factory, args, max_seq), cfg, decode_block_pages=args.block_pages,
                               attention=attention, stacked_matmul_rows=matmul_rows)
    params = eng.place_params(init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    reqs = [api.PrefillRequest(rng.integers(3, args.vocab, args.fill).tolist(),
                               api.SamplingParams(temperature=1.0, max_new_tokens=10**6, seed=s)) for s in range(S)]
    nparams = sum(x.size for x in jax.tree.leaves(params))

    def fill():
        state = eng.init_decode_state()
        for s, pre in enumerate(eng.prefill_many(params, reqs)):
            state = eng.insert(pre, state, s)
        return state

    def run(state, k: int, steps: int):
        for _ in range(steps // k):
            state, st = eng.generate(params, state, k) if k > 1 else eng.generate(params, state)
            np.asarray(st.tokens)
        return state

    res: dict = {"params": nparams, "attention": eng.attention, "stacked_matmul_rows": eng.stacked_matmul_rows}
    name = f"{eng.attention}/{eng.stacked_matmul_rows}"
    for k in (1, K):
        state = run(fill(), k, args.warm_steps)
        t = time.perf_counter()
        run(state, k, args.steps)
        ms = 1e3 * (time.perf_counter() - t) / (args.steps // k * k)
        res[f"K={k}"] = {"ms_per_step": ms, "tok_s": S / ms * 1e3, "gflop_s": 2 * nparams * S / ms / 1e6}
        print(f"{name}: hidden {H}, {args.layers} layers, vocab {args.vocab}, {S} slots, K = {k}: {ms:.2f} ms per step "
              f"(positions {args.fill + args.warm_steps}-{args.fill + args.warm_steps + args.steps}), "
              f"{S / ms * 1e3:.0f} tok/s, {2 * nparams * S / ms / 1e6:.1f} GFLOP/s", flush=True)
    if positions:
        state, at = fill(), args.fill
        res["by_position"] = {}
        for p in sorted(positions):
            state = run(state, 1, max(p - at, 0))
            t = time.perf_counter()
            state = run(state, 1, window)
            ms = 1e3 * (time.perf_counter() - t) / window
            at = max(p, at) + window
            res["by_position"][p] = ms
            print(f"  {name} position {p}: {ms:.2f} ms per step", flush=True)
    return res


if __name__ == "__main__":
    main()
