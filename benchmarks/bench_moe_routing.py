"""MoE routing recording and rollout routing replay: what they cost.

    python benchmarks/bench_moe_routing.py --repeats 5

Decode: ``PagedEngine.generate`` (the jitted decode step of all slots, its results read to the host as the
orchestrator does) with ``record_routing`` off vs on (the step also returns the experts of the token each slot fed,
[slots, L, k] int16). Train: one ``Trainer.train_batch`` (proximal recompute + one update) on the same packed
trajectories carrying recorded routing, ``routing_replay`` off vs on (the router statistics are computed in
both). Both variants of each pair are timed alternately after warm-up; the median per variant is reported with
the on/off ratio. A random Qwen3-MoE (``--layers``, ``--experts``, ``--top-k``), fp32, on the default device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _cfg(a):
    from jaxrl_async.models.config import ModelConfig

    return ModelConfig(model_type="qwen3_moe", vocab_size=1024, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                       num_layers=a.layers, num_heads=4, num_kv_heads=2, head_dim=a.hidden // 4, qk_norm=True,
                       num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.hidden,
                       max_position_embeddings=1024, tie_word_embeddings=False)


def _decode(cfg, params, record: bool, a):
    import jax
    import numpy as np

    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.generator.engine_api import SamplingParams

    max_seq = 32 + a.steps * (a.repeats + 1) + 16  # every slot stays live through all timed steps
    eng = build_engine(EngineConfig(max_concurrent_decodes=a.slots, max_sequence_length=max_seq,
                                    prefill_buckets=(32,), page_size=16,
                                    num_pages=a.slots * (max_seq // 16 + 2)), cfg, record_routing=record)
    p = eng.place_params(params)
    state = eng.init_decode_state()
    rng = np.random.default_rng(0)
    for s in range(a.slots):
        pre = eng.prefill(p, rng.integers(3, cfg.vocab_size, 32), SamplingParams(temperature=1.0,
                                                                                 max_new_tokens=max_seq - 33, seed=s))
        state = eng.insert(pre, state, s)
    state, step = eng.generate(p, state)  # compile
    step.to_host()

    def run(n):
        nonlocal state
        t = time.perf_counter()
        for _ in range(n):
            state, step = eng.generate(p, state)
            step.to_host()
        jax.block_until_ready(state.arrays["pos"])
        return (time.perf_counter() - t) / n

    return run


def _train(cfg, params, trajs, replay: bool):
    from jaxrl_async.trainer.packing import PackingConfig
    from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig

    tr = Trainer(cfg, TrainStepConfig(packing=PackingConfig(tokens_per_micro=2048, row_len_buckets=(256,)),
                                    routing_replay=replay))
    state = tr.init_state(params)

    def run(n):
        nonlocal state
        t = time.perf_counter()
        for _ in range(n):
            state, ms = tr.train_batch(state, trajs)
            float(ms[-1]["loss"])
        return (time.perf_counter() - t) / n

    run(1)  # compile
    return run


def _trajectories(cfg, n, length, rng):
    import numpy as np

    from jaxrl_async.trainer.packing import TrainSequence

    out = []
    for i in range(n):
        m = np.r_[np.zeros(length // 2), np.ones(length - length // 2)].astype(np.int32)
        out.append(TrainSequence(tokens=rng.integers(3, cfg.vocab_size, length).astype(np.int32), loss_mask=m,
                              behaviour_logprobs=np.where(m > 0, -2.0, 0.0).astype(np.float32),
                              advantages=np.where(m > 0, 1.0 if i % 2 else -1.0, 0.0).astype(np.float32),
                              routing=rng.integers(0, cfg.num_experts, (length, cfg.num_layers,
                                                                        cfg.num_experts_per_tok)).astype(np.int16)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="decode steps per timing")
    p.add_argument("--seqs", type=int, default=16, help="trajectories per train batch")
    p.add_argument("--length", type=int, default=128, help="tokens per trajectory")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import jax
    import numpy as np

    from jaxrl_async.models.transformer import init_params

    cfg = _cfg(a)
    params = init_params(cfg, jax.random.key(0))
    rows = {}
    pairs = {"decode step (s)": (_decode(cfg, params, False, a), _decode(cfg, params, True, a), a.steps),
             "train_batch (s)": (_train(cfg, params, _trajectories(cfg, a.seqs, a.length, np.random.default_rng(0)),
                                        False),
                                 _train(cfg, params, _trajectories(cfg, a.seqs, a.length, np.random.default_rng(0)),
                                        True), 1)}
    for name, (off, on, n) in pairs.items():
        t_off, t_on = [], []
        for _ in range(a.repeats):  # alternated: both variants see the same machine load
            t_off.append(off(n))
            t_on.append(on(n))
        m_off, m_on = statistics.median(t_off), statistics.median(t_on)
        rows[name] = {"off": m_off, "on": m_on, "ratio": m_on / m_off}
    print(f"device: {jax.devices()[0].platform}; model: {a.layers} layers, {a.experts} experts, top-{a.top_k}, "
          f"hidden {a.hidden}")
    print("| | off | on | on / off |\n|---|---|---|---|")
    labels = {"decode step (s)": "decode step, record_routing", "train_batch (s)": "train_batch, routing_replay"}
    for name, r in rows.items():
        print(f"| {labels[name]} | {r['off'] * 1e3:.2f} ms | {r['on'] * 1e3:.2f} ms | {r['ratio']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
