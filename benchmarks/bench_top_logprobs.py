"""The cost of ``max_top_logprobs`` (the engine's top-K log-probs per token) on the decode step.

    python benchmarks/bench_top_logprobs.py [--slots 16] [--steps 200] [--ks 0,5,20] [--vocab-sampler 151936]

1. The tiny test model (``testing.make_tiny_hf_model`` qwen3, V = 256) in a ``PagedEngine`` with every slot live:
   the mean wall time of a decode step (dispatch + the copy of its results to the host, as the generator reads
   them) for each K, the K runs interleaved in rounds so that a noisy shared machine hits them alike.
2. The sampler alone on [slots, vocab] float32 logits of a real vocabulary (default Qwen's 151936): the sampling
   step (``sampling.sample``, lean program) with and without ``sampling.top_logprobs``, the part that grows with V.
Results: NOTES.md (Issue 25: top_logprobs).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def engine_step_times(slots: int, steps: int, ks: list[int], rounds: int = 5) -> dict[int, float]:
    from jaxrl_async.generator.engine import PagedEngine
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.models import load_hf
    from jaxrl_async.testing import make_tiny_hf_model

    d = tempfile.mkdtemp()
    make_tiny_hf_model(d, "qwen3")
    cfg, params = load_hf(d)
    max_seq = steps + 32
    runs = {}
    for k in ks:
        eng = PagedEngine(cfg, max_concurrent_decodes=slots, max_sequence_length=max_seq, prefill_buckets=(16,),
                          page_size=16, num_pages=slots * (max_seq // 16 + 1), max_top_logprobs=k)
        p = eng.place_params(params)
        eng.warmup(p, max_samples=slots, truncation=False)
        runs[k] = (eng, p)
    times: dict[int, list[float]] = {k: [] for k in ks}
    per_round = max(steps // rounds, 1)
    for _ in range(rounds):
        for k, (eng, p) in runs.items():
            st = eng.init_decode_state()
            sp = SamplingParams(temperature=1.0, max_new_tokens=per_round + 2, seed=1, top_logprobs=k)
            st = eng.bulk_insert(eng.prefill(p, list(range(3, 13)), sp, num_samples=slots), st, range(slots))
            st, step = eng.generate(p, st)  # first step of the round: not timed
            step.to_host()
            t0 = time.perf_counter()
            for _ in range(per_round):
                st, step = eng.generate(p, st)
                step.to_host()
            times[k].append((time.perf_counter() - t0) / per_round)
    return {k: float(np.median(v)) for k, v in times.items()}


def sampler_times(slots: int, vocab: int, ks: list[int], iters: int = 50) -> dict[int, float]:
    from jaxrl_async.generator import sampling

    logits = jax.random.normal(jax.random.PRNGKey(0), (slots, vocab), jnp.float32) * 3
    args = (jnp.ones(slots), jnp.zeros(slots, jnp.int32), jnp.ones(slots), jnp.arange(slots, dtype=jnp.uint32),
            jnp.zeros(slots, jnp.int32), jnp.full(slots, 7, jnp.int32))

    def make(k):
        def f(x, t, tk, tp, seed, idx, pos):
            out = sampling.sample(x, t, tk, tp, seed, idx, pos, truncation=False)
            return out + sampling.top_logprobs(x, t, k) if k else out
        return jax.jit(f)

    fns = {k: make(k) for k in ks}
    for f in fns.values():
        jax.block_until_ready(f(logits, *args))
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(5):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters // 5):
                jax.device_get(f(logits, *args))
            times[k].append((time.perf_counter() - t0) / (iters // 5))
    return {k: float(np.median(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ks", default="0,5,20")
    ap.add_argument("--vocab-sampler", type=int, default=151936)
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    print(f"platform {jax.devices()[0].platform}, {a.slots} slots")
    eng = engine_step_times(a.slots, a.steps, ks)
    for k in ks:
        print(f"tiny model decode step, K={k:3d}: {eng[k] * 1e3:8.3f} ms ({(eng[k] / eng[ks[0]] - 1) * 100:+.1f}%)")
    smp = sampler_times(a.slots, a.vocab_sampler, ks)
    for k in ks:
        print(f"sampler [{a.slots}, {a.vocab_sampler}], K={k:3d}: {smp[k] * 1e3:8.3f} ms "
              f"({(smp[k] / smp[ks[0]] - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
