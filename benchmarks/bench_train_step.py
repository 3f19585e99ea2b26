"""Train-step FLOP/s vs this machine's measured fp32 matmul peak, in one run.

    python benchmarks/bench_train_step.py [--json out.json] [--preset cpu-31m] [--steps 4]

1. Peak: best FLOP/s of a jitted fp32 square matmul (2 N^3 FLOPs) over a few sizes, repeated.
2. Train step: `Trainer.step` (packed micro-batches, lax.scan gradient accumulation, decoupled PPO
   loss, AdamW, non-finite guard, donated state) on a benchmark model; rows are filled exactly
   (no padding), proximal log-probs recomputed once beforehand (not timed: it is the separate
   forward pass of `compute_logprobs`). Model FLOPs per step from `jaxrl_async.trainer.flops`
   (MaxText's `calculate_tflops_training_per_device`: 6 N_matmul tokens-equivalent + causal attention,
   forward + backward, remat not counted).
3. Ratio = step model FLOP/s / peak FLOP/s. Peak and step timings are interleaved (peak, step,
   peak, step, ...) and medians reported, so that load from other processes on a shared machine
   affects both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import init_params
from jaxrl_async.rl.losses import PolicyLossConfig
from jaxrl_async.trainer import OptimizerConfig, PackingConfig, Trainer, TrainStepConfig, TrainSequence, train_step_flops

# Benchmark models. cpu-31m: ~31M parameters (4 layers, d=768, GQA 12/4 heads, vocab 8192).
PRESETS = {
    "cpu-31m": dict(model=ModelConfig(model_type="qwen3", vocab_size=8192, hidden_size=768, intermediate_size=2048,
                                      num_layers=4, num_heads=12, num_kv_heads=4, head_dim=64, rope_theta=1e6,
                                      dtype="float32", param_dtype="float32", remat="none"),
                    row_len=512, tokens_per_micro=4096, n_micro=2, seq_len=256),
    "tiny": dict(model=ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
                                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32),
                 row_len=128, tokens_per_micro=512, n_micro=2, seq_len=64),
}


def matmul_peak(sizes=(1024, 2048, 3072), reps: int = 3, dtype=jnp.float32) -> dict:
    """Best FLOP/s of x @ y over `sizes` (2 N^3 FLOPs per product), `reps` timed calls each."""
    best = {}
    for n in sizes:
        x = jax.random.normal(jax.random.key(0), (n, n), dtype)
        y = jax.random.normal(jax.random.key(1), (n, n), dtype)
        f = jax.jit(lambda a, b: a @ b)
        f(x, y).block_until_ready()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            f(x, y).block_until_ready()
            times.append(time.perf_counter() - t)
        best[n] = 2.0 * n ** 3 / min(times)
    return {"flops": max(best.values()), "by_size": best}


def make_trajectories(cfg: ModelConfig, n: int, seq_len: int, seed: int = 0) -> list[TrainSequence]:
    """n sequences of exactly seq_len tokens (prompt 1/4, completion 3/4), random tokens/advantages."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        mask = (np.arange(seq_len) >= seq_len // 4).astype(np.int32)
        out.append(TrainSequence(tokens=rng.integers(0, cfg.vocab_size, seq_len), loss_mask=mask,
                              behaviour_logprobs=np.where(mask > 0, -rng.uniform(5, 12, seq_len), 0.0),
                              advantages=np.where(mask > 0, rng.normal(size=seq_len), 0.0),
                              versions=np.where(mask > 0, 0, -1)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-31m", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=4, help="timed train steps (after one compile step)")
    ap.add_argument("--dtype", default=None, help="override the compute dtype (float32 | bfloat16)")
    ap.add_argument("--remat", default=None, help="override ModelConfig.remat (none | dots | full)")
    ap.add_argument("--chunk", type=int, default=None, help="logprob_chunk (default: all positions of a micro-batch)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    p = PRESETS[args.preset]
    cfg: ModelConfig = p["model"]
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    if args.remat:
        cfg = cfg.replace(remat=args.remat)
    row_len, tpm, n_micro, seq_len = p["row_len"], p["tokens_per_micro"], p["n_micro"], p["seq_len"]
    rows = tpm // row_len
    n_seqs = n_micro * rows * (row_len // seq_len)
    packing = PackingConfig(tokens_per_micro=tpm, row_len_buckets=(row_len,), max_seqs_per_row=row_len // seq_len)
    tcfg = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-6), packing=packing,
                         logprob_chunk=args.chunk or tpm)
    trainer = Trainer(cfg, tcfg, loss_cfg=PolicyLossConfig())
    state = trainer.init_state(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)))
    trajs = make_trajectories(cfg, n_seqs, seq_len)
    packed = trainer.pack(trajs)
    assert packed.n_micro == n_micro and packed.n_real_micro == n_micro and packed.n_tokens == n_micro * tpm
    batch = trainer.with_recomputed_proximal(state.params, trainer.put_batch(packed))
    flops = train_step_flops(cfg, n_micro * rows, row_len)

    t0 = time.perf_counter()
    state, m = trainer.step(state, packed, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0

    peaks, steps = [], []
    for _ in range(args.steps):
        peaks.append(matmul_peak()["flops"])
        t = time.perf_counter()
        state, m = trainer.step(state, packed, batch)
        jax.block_until_ready((state, m))
        steps.append(time.perf_counter() - t)
    peak = statistics.median(peaks)
    step_s = statistics.median(steps)
    achieved = flops["total"] / step_s
    res = {
        "preset": args.preset, "dtype": cfg.dtype, "remat": cfg.remat, "logprob_chunk": tcfg.logprob_chunk,
        "n_params": cfg.num_params(), "tokens_per_step": n_micro * tpm, "n_micro": n_micro, "rows_per_micro": rows,
        "row_len": row_len, "model_tflops_per_step": flops["total"] / 1e12,
        "attention_share": flops["attention"] / flops["total"],
        "compile_plus_first_step_s": compile_s, "step_s_median": step_s, "step_s_all": steps,
        "peak_gflops_median": peak / 1e9, "peak_gflops_all": [x / 1e9 for x in peaks],
        "step_gflops": achieved / 1e9, "ratio": achieved / peak, "tokens_per_s": n_micro * tpm / step_s,
        "loss": float(m["loss"]), "skipped": int(m["skipped"]),
        "device": str(jax.devices()[0].device_kind), "n_devices": jax.device_count(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(json.dumps(res, indent=1))
    print(f"\n{args.preset}: {res['n_params'] / 1e6:.1f}M params, {res['tokens_per_step']} tokens/step, "
          f"step {step_s:.2f} s -> {achieved / 1e9:.1f} GFLOP/s model; matmul peak {peak / 1e9:.1f} GFLOP/s; "
          f"ratio {100 * res['ratio']:.1f}%", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
