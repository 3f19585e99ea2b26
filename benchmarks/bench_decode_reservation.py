"""Decode step time vs the engine's reservation (`max_sequence_length`) at the same live lengths.

    python benchmarks/bench_decode_reservation.py [--slots 64] [--live 192] [--max-seq 320] [--factor 8]
        [--attention gather,blocked] [--steps 20] [--json out.json]

Issue 16's acceptance: same prompts, seeds and live lengths, engine `max_sequence_length` `--factor` times
larger -> decode step time within 1.2x. One process builds, for every decode attention in `--attention`,
two `PagedEngine`s (max_sequence_length `--max-seq` and `--factor` x that, explicit pools of
slots x max pages so nothing is short), fills all `--slots` slots with the same random prompts (prefill + insert,
`--live` tokens each), then times `--steps` decode steps (after one compile step) and reports the median
step, the step per live token and the ratio large / small, measured side by side (the engines alternate,
one step each, so machine load hits both alike).

Model: random Qwen3-shaped weights (`--hidden 512 --layers 6`, 8 q / 4 kv heads of 64, MLP 3x, vocab 16384:
~27M parameters), float32, one CPU device.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def build(cfg, params, max_seq, attention, slots, page):
    from jaxrl_async.generator import kv_cache
    from jaxrl_async.generator.factory import EngineConfig, build_engine

    eng = build_engine(EngineConfig(max_concurrent_decodes=slots, max_sequence_length=max_seq, prefill_buckets=(64,),
                                    page_size=page,
                                    num_pages=slots * kv_cache.pages_for(max_seq, page)), cfg, attention=attention)
    return eng, eng.place_params(params)


def fill(eng, params, prompts, live):
    """Every slot gets one prompt; decode until each slot holds `live` tokens (not timed)."""
    from jaxrl_async.generator.engine_api import SamplingParams

    state = eng.init_decode_state()
    for s, p in enumerate(prompts):
        sp = SamplingParams(temperature=1.0, max_new_tokens=10**6, seed=s)
        state = eng.insert(eng.prefill(params, p, sp), state, s)
    while int(state.host.pos.max()) + 1 < live:
        state, step = eng.generate(params, state)
    import jax

    jax.block_until_ready(step.tokens)
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--live", type=int, default=192, help="tokens per slot when the timing starts")
    ap.add_argument("--max-seq", type=int, default=320)
    ap.add_argument("--factor", type=int, default=8)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--attention", default="gather,blocked")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax

    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.models.transformer import init_params

    cfg = ModelConfig(model_type="qwen3", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                      num_kv_heads=max(args.hidden // 128, 1), head_dim=64, max_position_embeddings=1 << 16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, args.vocab, int(rng.integers(8, 64))).tolist() for _ in range(args.slots)]
    small, large = args.max_seq, args.max_seq * args.factor
    rows = []
    for att in args.attention.split(","):
        runs = {}
        for ms in (small, large):
            eng, p = build(cfg, params, ms, att, args.slots, args.page)
            st = fill(eng, p, prompts, args.live)
            st, step = eng.generate(p, st)  # compile happened in fill; one more warm step
            jax.block_until_ready(step.tokens)
            runs[ms] = [eng, p, st, []]
        for _ in range(args.steps):  # alternate the two engines step by step
            for ms in (small, large):
                eng, p, st, times = runs[ms]
                t0 = time.perf_counter()
                st, step = eng.generate(p, st)
                jax.block_until_ready(step.tokens)
                times.append(time.perf_counter() - t0)
                runs[ms][2] = st
        med = {ms: float(np.median(runs[ms][3])) for ms in runs}
        live_end = int(runs[small][2].host.pos.max()) + 1
        rows.append(dict(attention=att, max_seq_small=small, max_seq_large=large, step_ms_small=1e3 * med[small],
                         step_ms_large=1e3 * med[large], ratio=med[large] / med[small],
                         live_tokens=f"{args.live}..{live_end}",
                         compiles_generate=runs[small][0].compile_counts()["generate"]))
    out = dict(params=n_params, slots=args.slots, page=args.page, steps=args.steps, rows=rows,
               device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"model {n_params / 1e6:.1f}M params, {args.slots} slots, live {rows[0]['live_tokens']} tokens, "
          f"page {args.page}, median of {args.steps} steps")
    print(f"{'attention':>10} {'max_seq':>8} {'step ms':>9} {'max_seq':>8} {'step ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['attention']:>10} {r['max_seq_small']:>8} {r['step_ms_small']:>9.1f} {r['max_seq_large']:>8} "
              f"{r['step_ms_large']:>9.1f} {r['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
