"""Collectives and memory of the MoE train step compiled deviceless for H100 or TPU v5p: FSDP vs expert
parallelism left to GSPMD vs the explicit shard_map exchange (``moe.expert_parallel_swiglu``).

    PYTHONPATH=. JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/moe_collectives.py --target h100
    PYTHONPATH=. JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/moe_collectives.py --target v5p

Model: Qwen3-30B-A3B's dimensions (hidden 2048, 128 experts x width 768, top 8) cut to ``--layers`` layers and a
``--vocab`` vocabulary; one micro-batch of 4 x 2048 tokens; bf16 compute, fp32 master weights, full remat; the
trainer's step (``Trainer._step_fn``) on 4 devices (``jaxrl_async.plan.aot``: the CUDA plugin's deviceless compile,
MoE grouped matmul ``tiled``; or libtpu's for ``v5:2x2x1``, ``megablox``). The trainer's ``batch`` rule splits
tokens over ``expert`` too. Rows: fsdp 4 (no expert axis); fsdp x expert with ``gspmd`` = the explicit exchange
switched off (``moe.expert_parallel_size`` forced to 1: GSPMD partitions the layer from the shardings alone)
and ``shard_map`` = the exchange (all-gather of the tokens within an expert group, local experts, reduce-scatter
back). Per row: the executable's argument and temporary bytes per device, the number of each collective in the
HLO and the bytes they produce (each op counted once, loop bodies included once: a static volume, not per step).
``--ragged-all-to-all``: also check whether ``jax.lax.ragged_all_to_all`` (MaxText's dropless EP exchange)
compiles for the target (and on XLA:CPU). Needs the ``[aot-gpu]`` / ``[aot-tpu]`` extra.
"""

from __future__ import annotations

import argparse
import collections
import re


def collectives(hlo: str) -> tuple[dict, dict]:
    kinds, volume = collections.Counter(), collections.Counter()
    for line in hlo.split("\n"):
        m = re.match(r"\s*%\S+ = (.*?) (all-gather|all-to-all|ragged-all-to-all|reduce-scatter|all-reduce|"
                     r"collective-permute)(-start)?\(", line)
        if not m:
            continue
        kinds[m.group(2)] += 1
        shapes = re.findall(r"(bf16|f32|s32)\[([\d,]*)\]", m.group(1))
        if m.group(3):  # async form: (operands, results)
            shapes = shapes[len(shapes) // 2:]
        for dt, s in shapes:
            n = 1
            for d in s.split(","):
                n *= int(d) if d else 1
            volume[m.group(2)] += n * (2 if dt == "bf16" else 4)
    return dict(kinds), dict(volume)


def ragged_all_to_all_compiles(devices) -> str:
    """Compile a dropless token exchange with ``jax.lax.ragged_all_to_all`` under shard_map on ``devices`` (4):
    'ok' or the error's first line."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxrl_async.plan import aot

    n = len(devices)
    mesh = Mesh(np.array(devices).reshape(n), ("expert",))
    rows, D = 8192, 2048

    def exchange(x, sizes):
        # every device sends sizes[j] rows to device j and receives into a static worst-case buffer
        send = sizes.reshape(n)
        in_off = jnp.cumsum(send) - send
        recv = jax.lax.all_to_all(send, "expert", 0, 0, tiled=True)
        out_off = jax.lax.all_to_all(jnp.cumsum(recv) - recv, "expert", 0, 0, tiled=True)
        out = jnp.zeros((rows * n, D), x.dtype)
        return jax.lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name="expert")

    fn = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(P("expert"), P("expert")), out_specs=P("expert")))
    args = (jax.ShapeDtypeStruct((rows * n, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("expert"))),
            jax.ShapeDtypeStruct((n * n,), jnp.int32, sharding=NamedSharding(mesh, P("expert"))))
    try:
        opts = aot.compiler_options(devices) if devices[0].platform != "cpu" else None
        fn.lower(*args).compile(compiler_options=opts)
        return "ok"
    except Exception as e:  # noqa: BLE001 -- reported, not raised
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--target", choices=("h100", "v5p"), default="h100")
    p.add_argument("--ragged-all-to-all", action="store_true")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxrl_async.plan import aot
    from jaxrl_async.models import moe
    from jaxrl_async.models.config import preset
    from jaxrl_async.plan.planner import _abstract_batch, _abstract_state
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig

    if args.target == "h100" and not aot.gpu_available():
        p.error("needs the CUDA plugin (extra [aot-gpu])")
    if args.target == "v5p" and not aot.tpu_available():
        p.error("needs libtpu (extra [aot-tpu])")
    devices = aot.h100_devices(4) if args.target == "h100" else aot.tpu_devices("v5:2x2x1")
    if args.ragged_all_to_all:
        print(f"ragged_all_to_all on {args.target}: {ragged_all_to_all_compiles(devices)}")
        print(f"ragged_all_to_all on XLA:CPU: {ragged_all_to_all_compiles(jax.devices('cpu')[:4])}"
              if len(jax.devices("cpu")) >= 4 else "XLA:CPU: needs 4 CPU devices (XLA_FLAGS)")
    cfg = preset("qwen3-30b-a3b").replace(num_layers=args.layers, vocab_size=args.vocab, remat="full")
    GiB = 2 ** 30
    print(f"target {args.target} ({devices[0].device_kind})")
    print("| mesh | expert MLP | arguments GiB | temporaries GiB | collectives (count) | produced GiB by kind |")
    print("|---|---|---:|---:|---|---|")
    real_ep_size = moe.expert_parallel_size
    for shape, names, how in (((4,), ("fsdp",), "fsdp"), ((2, 2), ("fsdp", "expert"), "gspmd"),
                              ((2, 2), ("fsdp", "expert"), "shard_map"), ((1, 4), ("fsdp", "expert"), "gspmd"),
                              ((1, 4), ("fsdp", "expert"), "shard_map")):
        if how == "gspmd":
            moe.expert_parallel_size = lambda *a: 1
        try:
            mesh = make_mesh(shape, names, devices=devices)
            tr = Trainer(cfg, TrainStepConfig(), mesh=mesh)
            state, batch = _abstract_state(tr), _abstract_batch((1, 4, 2048), tr.batch_sharding)
            scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=tr.replicated)  # noqa: B023, E731
            c = tr._step_fn(5).lower(state, batch, scalar(jnp.float32), scalar(jnp.int32)).compile(
                compiler_options=aot.compiler_options(mesh.devices.flat))
        except Exception as e:  # noqa: BLE001 -- one row per variant
            print(f"| {' x '.join(f'{n} {s}' for n, s in zip(names, shape))} | {how} | failed: "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:160]} | | | |")
            continue
        finally:
            moe.expert_parallel_size = real_ep_size
        kinds, volume = collectives(c.as_text())
        ma = c.memory_analysis()
        print(f"| {' x '.join(f'{n} {s}' for n, s in zip(names, shape))} | {how} | "
              f"{ma.argument_size_in_bytes / GiB:.2f} | {ma.temp_size_in_bytes / GiB:.2f} | "
              f"{', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} | "
              f"{', '.join(f'{k} {v / GiB:.2f}' for k, v in sorted(volume.items()))} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
