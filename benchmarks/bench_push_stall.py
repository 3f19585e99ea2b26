"""The decode stall at a weight update on the CPU path: the packed copy of the layer matrices made on the thread that
hands the weights over (`Engine.prepare_params`, the default) vs at the first dispatch with them, on the decode
thread (issue 28; NOTES, session 25).

    python benchmarks/bench_push_stall.py [--hidden 1024 --layers 12] [--rounds 2] [--updates 3]

A random float32 Qwen3-shaped model (vocab 4096, MLP 3 x hidden, heads of 64) on a `PagedEngine` of 16 slots (the
in-place decode matmul and its packed copy, where the CPU kernels run), under the real `Generator`: 16 streamed
requests of 480 tokens (the programs compiled before), and after 4 s `update_params(new weights, wait=True)` every 1.5 s from
the main thread, as the weight push's thread calls it. Reported per mode, alternating in one process: the time
`update_params` blocked its caller, the median gap between two streamed tokens of one request (a decode step), and
the largest gap in a window from each update's call to 1.5 s after it returned (the stall the update caused).
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode, alternating")
    ap.add_argument("--updates", type=int, default=3, help="weight updates per run")
    args = ap.parse_args()

    import jax

    from jaxrl_async.generator.engine import PagedEngine
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.orchestrator import Generator
    from jaxrl_async.generator.packed_weights import packable_matrices
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.models.transformer import init_params

    H, L = args.hidden, args.layers
    cfg = ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=H, intermediate_size=3 * H, num_layers=L,
                      num_heads=H // 64, num_kv_heads=max(1, H // 128), head_dim=64, dtype="float32",
                      param_dtype="float32")
    eng = PagedEngine(cfg, max_concurrent_decodes=16, max_sequence_length=512, prefill_buckets=(64,), page_size=16,
                      num_pages=16 * 32)
    if not eng.packed_weights:
        raise SystemExit("this engine makes no packed copy (the CPU kernels do not run here): nothing to measure")
    params = [eng.place_params(init_params(cfg, jax.random.key(s))) for s in range(args.updates + 1)]
    eng.warmup(params[0])  # every program compiled before the first run
    mb = sum(a.nbytes for m in packable_matrices(params[0], tuple(cfg.layer_stacks())).values() for a in m.values())
    print(f"model: hidden {H}, {L} layers; {mb / 1e6:.0f} MB of packed matrices per weight set")
    staged_prepare = eng.prepare_params
    results: dict[str, list] = {"staged": [], "decode thread": []}
    for _ in range(args.rounds):
        for mode in ("decode thread", "staged"):
            eng.prepare_params = staged_prepare if mode == "staged" else (lambda p: None)
            with Generator(eng, params[0]) as gen:
                handles = [gen.submit(list(range(3, 40)), SamplingParams(temperature=1.0, max_new_tokens=480, seed=i),
                                      stream=True) for i in range(16)]
                times: list[float] = []
                reader = threading.Thread(target=lambda ts=times, h=handles[0]: ts.extend(time.perf_counter() for _ in h))
                reader.start()
                time.sleep(4.0)
                blocked, windows = [], []
                for k in range(1, args.updates + 1):
                    time.sleep(1.5)
                    t0 = time.perf_counter()
                    gen.update_params(params[k], version=k, wait=True, timeout=300)
                    blocked.append(time.perf_counter() - t0)
                    windows.append((t0, time.perf_counter() + 1.5))
                reader.join(600)
                for h in handles:
                    h.result(600)
            gaps, ends = np.diff(times), np.asarray(times[1:])
            stalls = [float(gaps[(ends >= a) & (ends <= b)].max()) for a, b in windows]
            results[mode].append((blocked, float(np.median(gaps)), stalls))
            print(f"{mode:>13}: update_params blocked {', '.join(f'{b:.2f}' for b in blocked)} s; step gap median "
                  f"{np.median(gaps) * 1e3:.0f} ms; largest gap around each update "
                  f"{', '.join(f'{s * 1e3:.0f}' for s in stalls)} ms", flush=True)
    for mode, runs in results.items():
        stalls = [s for r in runs for s in r[2]]
        print(f"{mode:>13}: largest gap around an update, median over {len(stalls)} updates: "
              f"{np.median(stalls) * 1e3:.0f} ms (step median {np.median([r[1] for r in runs]) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
