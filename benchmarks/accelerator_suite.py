"""One command for a lent accelerator (H100/H200/TPU): train-step MFU of every attention implementation
at reasoning lengths. Under ~20 minutes on one device; a reduced mode runs on CPU.

    python benchmarks/accelerator_suite.py                  # on the accelerator: 4k / 16k / 32k tokens per row
    python benchmarks/accelerator_suite.py --reduced        # CPU: a tiny model at 256 / 512 / 1k tokens
    python benchmarks/accelerator_suite.py --json out.json  # also write the results

For each length and each implementation available on the platform (``xla`` reference, ``blockwise``
pure-JAX flash attention, and the platform's kernel: ``gpu_flash`` on NVIDIA GPUs, ``splash`` on TPU) it
builds the real trainer (``Trainer._step_fn``: decoupled-PPO loss, in-step accumulation, AdamW, fp32 master
weights, bf16 compute on accelerators), times a few steps on one packed row, and reports

    MFU = model FLOPs of the step (``trainer/flops.py``, MaxText's count, remat not counted) / time / peak

with the peak of the device's dense bf16 matmul (datasheet table below; on CPU the measured fp32 matmul
peak of this run). An implementation that runs out of memory (``xla`` at 32k: T x T scores) is reported
as such, not skipped silently. Results go to stdout as a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import run_steps  # noqa: E402

from jaxrl_async.models.config import ModelConfig  # noqa: E402
from jaxrl_async.trainer.flops import train_step_flops  # noqa: E402
from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig  # noqa: E402

#: dense bf16 matmul peak per device (FLOP/s), datasheets
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12,
             "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12, "TPU v4": 275e12}

# Qwen3-1.7B's shapes (28 layers, hidden 2048, 16 heads / 8 kv heads, head_dim 128): fp32 master weights +
# Adam fit one 80 GB device with room for 32k-token activations under full remat
ACCEL_MODEL = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                   num_kv_heads=8, head_dim=128, tie_word_embeddings=True)
CPU_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=64)


def device_peak(device) -> tuple[float, str]:
    kind = getattr(device, "device_kind", "")
    for name, peak in PEAK_BF16.items():
        if name.lower() in kind.lower():
            return peak, f"{kind} dense bf16 datasheet"
    if device.platform == "cpu":
        return measured_matmul_peak(), "measured fp32 matmul peak (this run)"
    raise SystemExit(f"unknown device kind {kind!r}: add its peak to PEAK_BF16")


def measured_matmul_peak() -> float:
    best = 0.0
    for n in (1024, 2048):
        a = jnp.ones((n, n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        for _ in range(3):
            t0 = time.perf_counter()
            f(a).block_until_ready()
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def implementations(platform: str) -> list[str]:
    kernel = {"gpu": ["gpu_flash"], "cuda": ["gpu_flash"], "tpu": ["splash"]}.get(platform, [])
    return ["xla", "blockwise", *kernel]


def time_step(cfg: ModelConfig, T: int, steps: int) -> float:
    """Median seconds of ``steps`` train steps on one packed row of T tokens (after a compiling one)."""
    return statistics.median(run_steps(Trainer(cfg, TrainStepConfig(logprob_chunk=2048)), T, steps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reduced", action="store_true", help="CPU mode: a tiny model at short lengths")
    ap.add_argument("--lengths", type=int, nargs="*", default=None, help="tokens per row")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per point (after one compiling step)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    reduced = args.reduced or dev.platform == "cpu"
    lengths = args.lengths or ([256, 512, 1024] if reduced else [4096, 16384, 32768])
    dims = CPU_MODEL if reduced else ACCEL_MODEL
    dtype = "float32" if dev.platform == "cpu" else "bfloat16"
    peak, peak_src = device_peak(dev)
    rows = []
    print(f"device: {dev.device_kind if hasattr(dev, 'device_kind') else dev} ({dev.platform}); peak "
          f"{peak / 1e12:.2f} TFLOP/s ({peak_src}); model {dims}; compute {dtype}", file=sys.stderr)
    for T in lengths:
        for impl in implementations(dev.platform):
            cfg = ModelConfig(**dims, max_position_embeddings=max(T, 4096), dtype=dtype, remat="full",
                              attention=impl, attention_block=512 if impl != "gpu_flash" else 128)
            flops = train_step_flops(cfg, 1, T)["total"]
            try:
                t = time_step(cfg, T, args.steps)
                row = {"T": T, "attention": impl, "step_s": t, "tflops": flops / t / 1e12, "mfu": flops / t / peak}
            except Exception as e:  # noqa: BLE001 - out of memory is a result, reported as such
                msg = str(e).splitlines()[0][:160]
                row = {"T": T, "attention": impl, "error": f"{type(e).__name__}: {msg}"}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    out = {"date": datetime.date.today().isoformat(), "device": str(getattr(dev, "device_kind", dev)),
           "platform": dev.platform, "peak_flops": peak, "peak_source": peak_src, "model": dims, "dtype": dtype,
           "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print("| T | attention | step | model TFLOP/s | MFU |\n|---:|---|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['T']} | {r['attention']} | {r['error']} | | |")
        else:
            print(f"| {r['T']} | {r['attention']} | {r['step_s']:.3f} s | {r['tflops']:.2f} | {r['mfu']:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
