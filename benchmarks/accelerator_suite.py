"""One command for a lent accelerator (H100/H200/TPU): decode speed against the HBM roofline with the host's
share of a step, and train-step MFU of every attention implementation at reasoning lengths. Sized for a
~15-minute device lease (``--budget-s``: points that would start after it are reported as skipped, not
dropped); a reduced mode runs on CPU.

    python benchmarks/accelerator_suite.py                  # on the accelerator: decode, then 4k / 16k / 32k train rows
    python benchmarks/accelerator_suite.py --reduced        # CPU: tiny models, short lengths
    python benchmarks/accelerator_suite.py --json out.json  # also write the results (after every point)

**Decode** (``--sections decode``): the real ``PagedEngine`` (built by ``generator.factory.build_engine``) of a
Qwen3-0.6B-shaped model (random weights, bf16 on accelerators), every slot filled with a ~448-token prompt,
for each decode attention of the platform. Per step: ``sync`` = ``engine.generate`` + the tokens copied to the
host (what a step costs when nothing overlaps), ``pipelined`` = steps dispatched back to back and waited for
once (the device's time when the host keeps ahead), ``host`` = the time inside ``engine.generate`` before it
returns (the host's own work per step: page bookkeeping, dispatch). ``roofline`` = bytes a step must read
(weights once + the live KV) / the device's HBM bandwidth (datasheet); ``pipelined`` / ``roofline`` says how far
decode is from memory-bound. A one-layer model with hidden size 64 (``fixed``) shows the per-step cost that does
not depend on the model (issue 28).

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
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_rows import run_steps  # noqa: E402

from jaxrl_async.models.config import ModelConfig  # noqa: E402
from jaxrl_async.trainer.flops import train_step_flops  # noqa: E402
from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig  # noqa: E402

#: dense bf16 matmul peak per device (FLOP/s), datasheets
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12,
             "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12, "TPU v4": 275e12}

#: HBM bandwidth per device (bytes/s), datasheets (H100 SXM, H200)
HBM_BW = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "TPU v5 lite": 8.2e11, "TPU v5e": 8.2e11,
          "TPU v5p": 2.76e12, "TPU v5": 2.76e12, "TPU v6 lite": 1.64e12, "TPU v6e": 1.64e12, "TPU v4": 1.2e12}

# Qwen3-1.7B's shapes (28 layers, hidden 2048, 16 heads / 8 kv heads, head_dim 128): fp32 master weights +
# Adam fit one 80 GB device with room for 32k-token activations under full remat
ACCEL_MODEL = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                   num_kv_heads=8, head_dim=128, tie_word_embeddings=True)
CPU_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=64)


# decode: Qwen3-0.6B's shapes (28 layers, hidden 1024, 16 / 8 heads of 128, vocab 151936, tied embeddings)
DECODE_MODEL = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                    num_kv_heads=8, head_dim=128, tie_word_embeddings=True)
DECODE_CPU_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
FIXED_MODEL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=32, tie_word_embeddings=True)


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


def hbm_bandwidth(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, bw in HBM_BW.items():
        if name.lower() in kind.lower():
            return bw
    return None


def decode_attentions(platform: str) -> list[str]:
    kernel = {"gpu": ["gpu_paged"], "cuda": ["gpu_paged"], "tpu": ["tpu_ragged"]}.get(platform, [])
    return [*kernel, "blocked", "gather"]


def decode_point(dims: dict, dtype: str, attention: str, slots: int, prompt_len: int, steps: int,
                 profile_dir: str | None = None, page_size: int = 16, kernel_options: dict | None = None,
                 num_steps: int = 1) -> dict:
    """One engine: fill every slot, then time ``steps`` decode steps three ways (module doc); ``profile_dir``: then
    8 more pipelined steps under ``jax.profiler.trace`` (XProf/TensorBoard trace of host and device). ``num_steps``:
    multi-step decode, K steps per dispatch (figures stay per decode step: a dispatch's time / K)."""
    from jaxrl_async.generator import kv_cache
    from jaxrl_async.generator.engine_api import PrefillRequest, SamplingParams
    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.models.transformer import init_params

    max_seq = prompt_len + 4 * steps + 64
    cfg = ModelConfig(**dims, max_position_embeddings=max(max_seq, 4096), dtype=dtype, param_dtype=dtype)
    eng = build_engine(EngineConfig(max_concurrent_decodes=slots, max_sequence_length=max_seq,
                                    prefill_buckets=(prompt_len,), max_prefill_pack=1, page_size=page_size,
                                    num_pages=slots * kv_cache.pages_for(max_seq, page_size) + 1,
                                    decode_steps=num_steps), cfg,
                       attention=attention, kernel_options=kernel_options)
    params = eng.place_params(jax.tree.map(lambda x: x.astype(dtype), init_params(cfg, jax.random.key(0))))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    state = eng.init_decode_state()
    reqs = [PrefillRequest(rng.integers(3, dims["vocab_size"], prompt_len - 8).tolist(),
                           SamplingParams(temperature=1.0, max_new_tokens=10**6, seed=s)) for s in range(slots)]
    for s, pre in enumerate(eng.prefill_many(params, reqs)):
        state = eng.insert(pre, state, s)
    k = num_steps
    gen = (lambda p, st: eng.generate(p, st, k)) if k > 1 else eng.generate  # noqa: E731
    dispatches = max(1, steps // k)
    for _ in range(3):  # compiles the step
        state, step = gen(params, state)
    np.asarray(step.tokens)
    fill_s = time.perf_counter() - t0
    sync, host = [], []
    for _ in range(dispatches):
        t0 = time.perf_counter()
        state, step = gen(params, state)
        t1 = time.perf_counter()
        np.asarray(step.tokens), np.asarray(step.logprobs)
        sync.append((time.perf_counter() - t0) / k)
        host.append((t1 - t0) / k)
    t0 = time.perf_counter()
    for _ in range(dispatches):
        state, step = gen(params, state)
    np.asarray(step.tokens)
    pipelined = (time.perf_counter() - t0) / (dispatches * k)
    if profile_dir:
        with jax.profiler.trace(profile_dir):
            for _ in range(max(1, 8 // k)):
                state, step = gen(params, state)
            np.asarray(step.tokens)
    live = float(state.host.pos[state.host.live].mean()) - dispatches * k
    kv_bytes = slots * live * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    bw = hbm_bandwidth(jax.devices()[0])
    roof = (weight_bytes + kv_bytes) / bw if bw else None
    return {"attention": attention, "decode_steps": k, "page_size": page_size, "kernel_options": kernel_options,
            "slots": slots,
            "layers": cfg.num_layers, "hidden": cfg.hidden_size,
            "live_tokens": round(live), "sync_ms": 1e3 * statistics.median(sync),
            "pipelined_ms": 1e3 * pipelined, "host_ms": 1e3 * statistics.median(host),
            "tok_s": slots / pipelined, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "roofline_ms": 1e3 * roof if roof else None, "of_roofline": roof / pipelined if roof else None,
            "fill_and_compile_s": fill_s, "compiles": eng.compile_counts()["generate_plain"]}


def implementations(platform: str) -> list[str]:
    kernel = {"gpu": ["gpu_flash"], "cuda": ["gpu_flash"], "tpu": ["splash"]}.get(platform, [])
    return ["xla", "blockwise", *kernel]


def time_step(cfg: ModelConfig, T: int, steps: int) -> float:
    """Median seconds of ``steps`` train steps on one packed row of T tokens (after a compiling one)."""
    return statistics.median(run_steps(Trainer(cfg, TrainStepConfig(logprob_chunk=2048)), T, steps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reduced", action="store_true", help="CPU mode: tiny models at short lengths")
    ap.add_argument("--sections", default="decode,train", help="comma-separated: decode, train")
    ap.add_argument("--lengths", type=int, nargs="*", default=None, help="tokens per training row")
    ap.add_argument("--steps", type=int, default=3, help="timed train steps per point (after one compiling step)")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per point and way")
    ap.add_argument("--budget-s", type=float, default=480.0, help="no new point starts after this many seconds")
    ap.add_argument("--prompt-lens", type=int, nargs="*", default=None,
                    help="decode: prompt lengths of the model points (default 448; 64 on CPU)")
    ap.add_argument("--profile", default=None, help="decode: a jax.profiler trace of the first model point here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    reduced = args.reduced or dev.platform == "cpu"
    lengths = args.lengths or ([256, 512, 1024] if reduced else [4096, 16384, 32768])
    dims = CPU_MODEL if reduced else ACCEL_MODEL
    dtype = "float32" if dev.platform == "cpu" else "bfloat16"
    peak, peak_src = device_peak(dev)
    import flax
    import optax

    out = {"date": datetime.date.today().isoformat(), "device": str(getattr(dev, "device_kind", dev)),
           "platform": dev.platform, "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(
               jax.lib, "__version__") else None, "flax": flax.__version__, "optax": optax.__version__},
           "peak_flops": peak, "peak_source": peak_src, "hbm_bandwidth": hbm_bandwidth(dev), "dtype": dtype,
           "train_model": dims, "decode": [], "rows": []}
    print(f"device: {out['device']} ({dev.platform}); peak {peak / 1e12:.2f} TFLOP/s ({peak_src}); "
          f"versions {out['versions']}; compute {dtype}", file=sys.stderr, flush=True)

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    sections = args.sections.split(",")
    if "decode" in sections:
        big = DECODE_CPU_MODEL if reduced else DECODE_MODEL
        prompts = args.prompt_lens or [64 if reduced else 448]
        first = prompts[0]
        points = [(FIXED_MODEL, att, 64, first) for att in decode_attentions(dev.platform)[:1]]
        points += [(big, att, 64, first) for att in decode_attentions(dev.platform)]
        points += [(big, decode_attentions(dev.platform)[0], 16 if reduced else 256, first)]
        points += [(big, decode_attentions(dev.platform)[0], 64, p) for p in prompts[1:]]
        for i, (d, att, slots, prompt) in enumerate(points):
            if over_budget():
                row = {"attention": att, "slots": slots, "hidden": d["hidden_size"], "skipped": "time budget"}
            else:
                try:
                    row = decode_point(d, dtype, att, slots, prompt, args.decode_steps,
                                       profile_dir=args.profile if i == 1 else None)
                except Exception as e:  # noqa: BLE001 - a failing implementation is a result, reported as such
                    row = {"attention": att, "slots": slots, "hidden": d["hidden_size"],
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            out["decode"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            save()
    if "multistep" in sections:  # multi-step decode: K = 1, 4, 8, 16 steps per dispatch (one program, one copy)
        big = DECODE_CPU_MODEL if reduced else DECODE_MODEL
        att = decode_attentions(dev.platform)[0]
        for d in (FIXED_MODEL, big):
            for k in (1, 4, 8, 16):
                if over_budget():
                    row = {"attention": att, "decode_steps": k, "hidden": d["hidden_size"], "skipped": "time budget"}
                else:
                    try:
                        row = decode_point(d, dtype, att, 64, 64 if reduced else 448, args.decode_steps, num_steps=k)
                    except Exception as e:  # noqa: BLE001 - reported as a result
                        row = {"attention": att, "decode_steps": k, "hidden": d["hidden_size"],
                               "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                out.setdefault("multistep", []).append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                save()
    if "sweep" in sections:  # the platform's decode kernel: page size x kernel block options (Qwen3-0.6B, 64 slots)
        big = DECODE_CPU_MODEL if reduced else DECODE_MODEL
        att = decode_attentions(dev.platform)[0]
        grid = [(16, None), (16, {"pages_per_block": 8}), (16, {"pages_per_block": 16}), (32, None),
                (32, {"pages_per_block": 4}), (32, {"pages_per_block": 8}), (64, None), (64, {"pages_per_block": 4}),
                (16, {"k_splits": 4}), (32, {"pages_per_block": 4, "k_splits": 4})]
        if att != "gpu_paged":
            grid = [(p, None) for p in (16, 32, 64)]
        for page, opts in grid:
            if over_budget():
                row = {"attention": att, "page_size": page, "kernel_options": opts, "skipped": "time budget"}
            else:
                try:
                    row = decode_point(big, dtype, att, 64, (64 if reduced else 448), args.decode_steps,
                                       page_size=page, kernel_options=opts)
                except Exception as e:  # noqa: BLE001 - an option the kernel refuses is a result
                    row = {"attention": att, "page_size": page, "kernel_options": opts,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            out.setdefault("sweep", []).append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            save()
    if "train" in sections:
        for T in lengths:
            for impl in implementations(dev.platform):
                if over_budget():
                    row = {"T": T, "attention": impl, "skipped": "time budget"}
                    out["rows"].append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    continue
                cfg = ModelConfig(**dims, max_position_embeddings=max(T, 4096), dtype=dtype, remat="full",
                                  attention=impl, attention_block=512 if impl != "gpu_flash" else 128)
                flops = train_step_flops(cfg, 1, T)["total"]
                try:
                    t = time_step(cfg, T, args.steps)
                    row = {"T": T, "attention": impl, "step_s": t, "tflops": flops / t / 1e12,
                           "mfu": flops / t / peak}
                except Exception as e:  # noqa: BLE001 - out of memory is a result, reported as such
                    msg = str(e).splitlines()[0][:200] if str(e) else ""
                    row = {"T": T, "attention": impl, "error": f"{type(e).__name__}: {msg}"}
                out["rows"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                save()
    out["wall_s"] = time.perf_counter() - t_start
    save()
    if out["decode"]:
        print("| model | decode attention | slots | live tokens | sync step | pipelined step | host per step | "
              "tok/s | HBM roofline | of roofline |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in out["decode"]:
            name = f"{r.get('layers', '?')}L h{r['hidden']}"
            if "error" in r or "skipped" in r:
                print(f"| {name} | {r['attention']} | {r['slots']} | {r.get('error', r.get('skipped'))} | | | | | | |")
                continue
            roof = f"{r['roofline_ms']:.2f} ms | {r['of_roofline']:.0%}" if r["roofline_ms"] else "- | -"
            print(f"| {name} | {r['attention']} | {r['slots']} | {r['live_tokens']} | {r['sync_ms']:.2f} ms | "
                  f"{r['pipelined_ms']:.2f} ms | {r['host_ms']:.2f} ms | {r['tok_s']:.0f} | {roof} |")
    if out["rows"]:
        print("| T | attention | step | model TFLOP/s | MFU |\n|---:|---|---:|---:|---:|")
        for r in out["rows"]:
            if "error" in r or "skipped" in r:
                print(f"| {r['T']} | {r['attention']} | {r.get('error', r.get('skipped'))} | | |")
            else:
                print(f"| {r['T']} | {r['attention']} | {r['step_s']:.3f} s | {r['tflops']:.2f} | {r['mfu']:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
