"""Qwen3-30B-A3B (128 experts, top 8; 30.5 B parameters, 3.3 B active) full-weight math RL on a TPU v5p-64 slice
(32 chips: 16 generate, 16 train).

Recipe: ``jaxrl_async.config.recipes.qwen3_math_rl`` (AReaL's math-RL hyper-parameters: fp32 master weights and AdamW,
bf16 compute, full remat). Layout ``v5p-64``: generator chips 0-15 (4 replicas x tensor 4: bf16 weights and
a push in flight, a quarter of every expert's width each), trainer chips 16-31 (FSDP 16: fp32 weights,
AdamW moments and fp32 gradients, 16 bytes per parameter = 28 GiB per chip). MoE grouped matmul: ``auto`` =
the megablox Pallas kernel on TPU (``models/moe.py``). Plan compiled for ``v5:2x4x4`` (libtpu, ``[aot-tpu]``
extra; benchmarks/RESULTS.md): trainer peak 58.7 of 85.5 GiB per chip (step temporaries 33.8 GiB; 52.0 with
``model.moe_kernel=ragged``), generator 45.2 GiB::

    python -m jaxrl_async.plan --config configs/qwen3_30b_a3b_v5p.py --compile-for target
"""
from jaxrl_async.config.recipes import qwen3_math_rl


def get_config():
    return qwen3_math_rl("qwen3-30b-a3b", layout="v5p-64", max_concurrent_decodes=256, tokens_per_micro=65536)
