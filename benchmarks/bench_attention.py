"""Train-step memory and speed of the attention implementations (`model.attention`) on this machine.

The real trainer step (``Trainer._step_fn``: decoupled-PPO loss, gradient accumulation, AdamW) of a
small Qwen3-shaped model is compiled for one row of T tokens with ``xla`` (full scores) and
``blockwise`` (flash attention in pure JAX); ``memory_analysis().temp_size_in_bytes`` of each compiled
executable is the activations/temporaries figure. Then, side by side in one process, the step is timed
at the shorter lengths (median of alternating runs), and one step at the longest length runs with
``blockwise`` to show it executes.

    python benchmarks/bench_attention.py                       # 2k/8k/32k memory, 1k-8k speed, a 32k step
    python benchmarks/bench_attention.py --quick               # small, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.plan.planner import _abstract_batch, _abstract_state, _compile
from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig
from train_rows import run_steps  # noqa: E402


def model_config(attention: str, block: int) -> ModelConfig:
    return ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=1 << 16, attention=attention,
                       attention_block=block, remat="full")


def trainer_for(attention: str, block: int) -> Trainer:
    return Trainer(model_config(attention, block), TrainStepConfig(logprob_chunk=2048))


def compiled_temp_bytes(attention: str, T: int, block: int) -> tuple[int, float]:
    tr = trainer_for(attention, block)
    state = _abstract_state(tr)
    batch = _abstract_batch((1, 1, T), tr.batch_sharding)
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=tr.replicated)  # noqa: E731
    _, mem = _compile("train_step", tr._step_fn(1), (state, batch, scalar(jnp.float32), scalar(jnp.int32)), "float32")
    return mem.temp_bytes, mem.compile_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small lengths (a smoke run of the script)")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    mem_lengths = [512, 2048] if args.quick else [2048, 8192, 32768]
    speed_lengths = [256, 512] if args.quick else [1024, 2048, 4096, 8192]
    run_long = 2048 if args.quick else 32768
    reps = 2 if args.quick else 3
    out = {"device": str(jax.devices()[0]), "block": args.block, "memory": {}, "speed": {}}
    print(f"model: {model_config('xla', args.block)}", file=sys.stderr)
    for T in mem_lengths:
        row = {}
        for impl in ("xla", "blockwise"):
            b, s = compiled_temp_bytes(impl, T, args.block)
            row[impl] = b
            print(f"T={T:6d} {impl:9s}: train-step temporaries {b / 2**20:10.1f} MiB (compiled in {s:.1f} s)",
                  file=sys.stderr)
        out["memory"][T] = row
    base = mem_lengths[0]
    for impl in ("xla", "blockwise"):
        growth = out["memory"][mem_lengths[-1]][impl] / out["memory"][base][impl]
        print(f"{impl}: temporaries x{growth:.1f} from {base} to {mem_lengths[-1]} tokens", file=sys.stderr)
        out.setdefault("growth", {})[impl] = growth
    for T in speed_lengths:
        res = {impl: [] for impl in ("xla", "blockwise")}
        trainers = {impl: trainer_for(impl, args.block) for impl in res}
        for _ in range(reps):  # alternate, so machine noise hits both alike
            for impl in res:
                res[impl] += run_steps(trainers[impl], T, 1)
        med = {k: statistics.median(v) for k, v in res.items()}
        out["speed"][T] = {**med, "ratio_blockwise_over_xla": med["blockwise"] / med["xla"]}
        print(f"T={T:6d} step: xla {med['xla']:.3f} s, blockwise {med['blockwise']:.3f} s "
              f"(blockwise/xla {med['blockwise'] / med['xla']:.2f})", file=sys.stderr)
    t = run_steps(trainer_for("blockwise", args.block), run_long, 1)[0]
    out["long_step"] = {"T": run_long, "seconds": t}
    print(f"T={run_long} blockwise train step executed in {t:.1f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
