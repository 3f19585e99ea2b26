"""The dropless MoE layer (float32 router, top-k, tokens sorted by expert, grouped matmuls, scatter-add back) vs a
dense SwiGLU layer with the same active parameters (width k x moe_intermediate_size), on the same tokens, fp32.

    python benchmarks/bench_moe.py --tokens 2048 --hidden 1024 --moe-inter 384 --experts 32 --top-k 4 --repeats 7

Times (median of ``--repeats`` after a warm-up call, the two layers interleaved) of the jitted forward and of
forward + backward (gradients of the inputs and of every weight, router included) for each grouped-matmul
implementation in ``--impls`` (``ragged``: ``jax.lax.ragged_dot``, the CPU default; ``tiled``: the GPU path;
``megablox`` runs in Pallas interpret mode off TPU: meaningless for speed, not offered). Prints a Markdown table
and the MoE / dense time ratios; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-inter", type=int, default=384)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--impls", default="ragged,tiled")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    impls = [s for s in args.impls.split(",") if s]
    if any(i not in ("ragged", "tiled") for i in impls):
        p.error(f"--impls: ragged and/or tiled, got {args.impls!r}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_async.models.moe import grouped_swiglu, routing

    N, D, Fm, X, k = args.tokens, args.hidden, args.moe_inter, args.experts, args.top_k
    F = k * Fm  # the dense layer's width: the same active parameters per token (router aside)
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32)  # noqa: E731
    x = arr(N, D)
    moe_w = dict(router=arr(D, X), gate=arr(X, D, Fm), up=arr(X, D, Fm), down=arr(X, Fm, D))
    dense_w = dict(gate=arr(D, F), up=arr(D, F), down=arr(F, D))

    def moe(w, x, impl):
        ids, weights, _ = routing(x, w["router"], k, True)
        return grouped_swiglu(x, ids, weights, w["gate"], w["up"], w["down"], impl)

    def dense(w, x, impl=None):
        return (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]

    def fwd_bwd(layer):
        return jax.grad(lambda w, x, impl: (layer(w, x, impl) ** 2).sum(), argnums=(0, 1))

    fns = {}
    for impl in impls:
        fns[f"moe_{impl}/forward"] = (jax.jit(lambda w, x, impl=impl: moe(w, x, impl)), moe_w)
        fns[f"moe_{impl}/forward+backward"] = (jax.jit(lambda w, x, impl=impl: fwd_bwd(moe)(w, x, impl)), moe_w)
    fns["dense/forward"] = (jax.jit(lambda w, x: dense(w, x)), dense_w)
    fns["dense/forward+backward"] = (jax.jit(lambda w, x: fwd_bwd(dense)(w, x, None)), dense_w)
    for f, w in fns.values():  # compile and warm up
        jax.block_until_ready(f(w, x))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.repeats):  # interleaved: load changes hit every variant alike
        for name, (f, w) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(w, x))
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    active_moe = D * X + 3 * k * D * Fm
    print(f"tokens {N}, hidden {D}, {X} experts x width {Fm}, top-{k}; dense width {F}; active parameters per "
          f"token: MoE {active_moe} (router {D * X}), dense {3 * D * F}; fp32, {jax.devices()[0].platform}, "
          f"median of {args.repeats}")
    print("| layer | pass | median s | MoE / dense |")
    print("|---|---|---:|---:|")
    rows = []
    for name, s in med.items():
        layer, pas = name.split("/")
        ratio = s / med[f"dense/{pas}"]
        rows.append(dict(layer=layer, pass_=pas, seconds=s, ratio_to_dense=ratio))
        print(f"| {layer} | {pas} | {s:.4f} | {ratio:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), rows=rows), fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
