"""LoRA: weight-push bytes and seconds, adapters vs full weights, and the generator's decode step with the
adapters unmerged (low-rank matmuls next to the base) vs merged (one weight copy per push).

    python benchmarks/bench_lora.py --model default --rank 8 --repeats 5
    python benchmarks/bench_lora.py --model qwen3-0.6b --rank 32 --repeats 3
    python benchmarks/bench_lora.py --model moe-small --rank 8 --moe-kernel tiled   # expert adapters too

Layout (simulated CPU devices, one process): trainer mesh fsdp=2 (fp32 master weights; with LoRA the base
frozen in float32 and fp32 adapters), generator mesh data=1 x tensor=2 (weights in the compute dtype).
Per push, ``weight_sync.WeightPusher`` to a generator that takes the weights at once: seconds = dispatch
-> the generator holds the new weights (``PushStats.total_s``): for full weights the copy; for LoRA
unmerged the adapters' copy; for LoRA merged the copy plus ``W + s A B`` for every target on the
generator devices. The first push (compilation) is excluded; the median of the rest is reported.
Decode: ``PagedEngine.generate`` (jitted decode step of all slots) on the generator mesh, median of
``--steps`` steps after warm-up, unmerged (adapters in the params) vs merged (base-shaped params).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time


def _model_cfg(name: str, dtype: str):
    from jaxrl_async.models.config import ModelConfig, preset

    if name == "default":  # the embedded default's model (config/default.py; vocabulary of its tokenizer)
        return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512, dtype=dtype)
    if name == "moe-small":  # a small Qwen3-MoE (16 experts, top 4): adapters on attention and every expert
        return ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512,
                           num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
                           max_position_embeddings=512, num_experts=16, num_experts_per_tok=4,
                           moe_intermediate_size=128, qk_norm=True, dtype=dtype)
    return preset(name).replace(dtype=dtype)


class _Sink:
    """A generator that takes new weights at once (the push's own cost, no decode thread to wait for)."""

    def __init__(self):
        self.params, self.lock = None, threading.Lock()

    def update_params(self, params, version, wait=True, timeout=None):
        with self.lock:
            self.params = params


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' (the embedded default's model) or a Qwen3 preset")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--dtype", default="float32", help="compute dtype (the generator's weights)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--moe-kernel", default="auto", help="mixture of experts: the grouped matmul (model.moe_kernel)")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models import lora
    from jaxrl_async.models.transformer import init_params
    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.generator.weight_sync import LoraPush, WeightPusher

    d = jax.devices()
    tmesh = make_mesh({"fsdp": 2}, devices=d[2:4])
    gmesh = make_mesh({"data": 1, "tensor": 2}, devices=d[:2])
    base_cfg = _model_cfg(args.model, args.dtype)
    if base_cfg.num_experts:
        base_cfg = base_cfg.replace(moe_kernel=args.moe_kernel)
    cfg = base_cfg.replace(lora=lora.LoraSpec(rank=args.rank, alpha=args.alpha))
    gdt = jnp.dtype(args.dtype)
    params = jax.device_put(init_params(cfg.replace(param_dtype="float32"), jax.random.key(0)),
                            model_shardings(cfg, tmesh, "trainer"))
    adapters, base = lora.split(params)
    adapters = {st: {k: v + (0.01 if k.endswith("_b") else 0.0) for k, v in a.items()} for st, a in adapters.items()}
    params = lora.join(adapters, base)
    n_base = sum(x.size for x in jax.tree.leaves(base))
    n_ad = sum(x.size for x in jax.tree.leaves(adapters))
    gen_full_sh = model_shardings(cfg, gmesh, "generator")
    gen_base = jax.device_put(jax.tree.map(lambda x: x.astype(gdt), base), lora.split(gen_full_sh)[1])
    rows = []

    def run_pushes(name, pusher, tree):
        times, nbytes = [], None
        for v in range(1, args.repeats + 2):
            st = pusher.push(tree, v)
            pusher.wait(v, timeout=600)
            nbytes = st.bytes
            if v > 1:
                times.append(pusher.history[-1].total_s)
        pusher.close()
        rows.append({"what": name, "push_bytes": nbytes, "push_s_median": statistics.median(times)})

    run_pushes("full weights", WeightPusher(_Sink(), model_shardings(base_cfg, gmesh, "generator"), dtype=gdt), base)
    for decode in ("unmerged", "merged"):
        run_pushes(f"LoRA adapters ({decode})",
                   WeightPusher(_Sink(), gen_full_sh, dtype=gdt, lora=LoraPush(cfg.lora, gen_base, decode)), params)

    # decode step: unmerged (base + adapters) vs merged (base-shaped weights)
    gen_params = jax.device_put(jax.tree.map(lambda x: x.astype(gdt), params), gen_full_sh)
    merged = jax.jit(lambda p: lora.merge(p, cfg.lora), out_shardings=lora.split(gen_full_sh)[1])(gen_params)
    decode_rows = []
    from jaxrl_async.generator.engine_api import SamplingParams

    for name, ecfg, ps in (("unmerged", cfg.replace(param_dtype=args.dtype), gen_params),
                           ("merged", base_cfg.replace(param_dtype=args.dtype), merged)):
        eng = build_engine(EngineConfig(max_concurrent_decodes=args.slots, max_sequence_length=256,
                                        prefill_buckets=(16,), page_size=16,
                                        num_pages=args.slots * 16), ecfg, gmesh, attention="gather")
        state = eng.init_decode_state()
        sp = SamplingParams(temperature=1.0, max_new_tokens=200)
        for s in range(args.slots):
            state = eng.insert(eng.prefill(ps, list(range(3, 13)), sp), state, s)
        for _ in range(2):
            state, step = eng.generate(ps, state)
            jax.block_until_ready(step.tokens)
        ts = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, step = eng.generate(ps, state)
            jax.block_until_ready(step.tokens)
            ts.append(time.perf_counter() - t0)
        decode_rows.append({"decode": name, "step_s_median": statistics.median(ts), "slots": args.slots})
    out = {"model": args.model, "params_base": int(n_base), "params_adapters": int(n_ad), "rank": args.rank,
           "dtype": args.dtype, "pushes": rows, "decode": decode_rows}
    print(f"{args.model}: base {n_base / 1e6:.2f} M params, rank-{args.rank} adapters {n_ad / 1e6:.3f} M "
          f"({100 * n_ad / n_base:.1f} %), generator dtype {args.dtype}")
    print("| push | bytes | s per push (median) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['push_bytes']:,} | {r['push_s_median']:.4f} |")
    print(f"| decode step ({args.slots} slots) | s (median) |\n|---|---|")
    for r in decode_rows:
        print(f"| {r['decode']} | {r['step_s_median']:.4f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
