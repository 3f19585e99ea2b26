"""Collectives and memory of the MoE train step compiled deviceless for H100: FSDP vs expert parallelism by GSPMD.

    JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/moe_collectives.py --layers 2 --vocab 8192

Model: Qwen3-30B-A3B's dimensions (hidden 2048, 128 experts x width 768, top 8) cut to ``--layers`` layers and a
``--vocab`` vocabulary; one micro-batch of 4 x 2048 tokens; bf16 compute, fp32 master weights, full remat; the
trainer's step (``Trainer._step_fn``) on 4 H100 (``jaxrl_async.aot``, the CUDA plugin's deviceless compile; the
MoE grouped matmul is ``tiled`` there). Meshes: fsdp 4 (the trainer today), and fsdp x expert with the
trainer's ``batch`` rule extended to the ``expert`` axis for this experiment only (``expert`` is not an
allowed trainer mesh axis: tokens would otherwise be replicated over it). Per mesh: the executable's argument
and temporary bytes per device, the number of each collective in the HLO and the bytes they produce (each op
counted once, loop bodies included once: a static volume, not per step). Needs the ``[aot-gpu]`` extra.
"""

from __future__ import annotations

import argparse
import collections
import re


def collectives(hlo: str) -> tuple[dict, dict]:
    kinds, volume = collections.Counter(), collections.Counter()
    for line in hlo.split("\n"):
        m = re.match(r"\s*%\S+ = (.*?) (all-gather|all-to-all|reduce-scatter|all-reduce|collective-permute)(-start)?\(",
                     line)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxrl_async import aot
    from jaxrl_async.models.config import preset
    from jaxrl_async.plan import _abstract_batch, _abstract_state
    from jaxrl_async.sharding import make_mesh, rules
    from jaxrl_async.trainer.train_step import Trainer, TrainerConfig

    if not aot.gpu_available():
        p.error("needs the CUDA plugin (extra [aot-gpu])")
    cfg = preset("qwen3-30b-a3b").replace(num_layers=args.layers, vocab_size=args.vocab, remat="full")
    base = rules.RULE_SETS["trainer"]
    ep = tuple((k, ("data", "fsdp", "expert")) if k == "batch" else (k, v) for k, v in base)
    GiB = 2 ** 30
    print("| mesh | arguments GiB | temporaries GiB | collectives (count) | produced GiB by kind |")
    print("|---|---:|---:|---|---|")
    for shape, names in (((4,), ("fsdp",)), ((2, 2), ("fsdp", "expert")), ((1, 4), ("fsdp", "expert"))):
        rules.RULE_SETS["trainer"] = ep if "expert" in names else base
        try:
            mesh = make_mesh(shape, names, devices=aot.h100_devices(4))
            tr = Trainer(cfg, TrainerConfig(), mesh=mesh)
            state, batch = _abstract_state(tr), _abstract_batch((1, 4, 2048), tr.batch_sharding)
            scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=tr.replicated)  # noqa: E731
            c = tr._step_fn(5).lower(state, batch, scalar(jnp.float32), scalar(jnp.int32)).compile(
                compiler_options=aot.compiler_options(mesh.devices.flat))
        finally:
            rules.RULE_SETS["trainer"] = base
        kinds, volume = collectives(c.as_text())
        ma = c.memory_analysis()
        print(f"| {' x '.join(f'{n} {s}' for n, s in zip(names, shape))} | {ma.argument_size_in_bytes / GiB:.2f} | "
              f"{ma.temp_size_in_bytes / GiB:.2f} | {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} | "
              f"{', '.join(f'{k} {v / GiB:.2f}' for k, v in sorted(volume.items()))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
