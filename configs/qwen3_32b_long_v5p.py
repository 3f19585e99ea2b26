"""Qwen3-32B math RL at reasoning lengths on a TPU v5p-64 slice, with context parallelism (layout ``v5p-64-cp4``).

Recipe ``recipes.qwen3_math_rl_long`` (prompts <= 4,096, <= 27,648 generated tokens, 32k-token trainer rows,
full remat, splash attention). Without context parallelism (layout ``v5p-64``: trainer FSDP 16, one 32k row per
chip) the trainer needs 107.6 GiB per chip, of which 80.9 GiB are the temporaries of ONE 32k-token row (64
layers x 5120 hidden): more FSDP shards cannot help. Layout ``v5p-64-cp4`` splits every row over 4 chips
(trainer mesh fsdp 4 x context 4; weights and Adam state sharded over all 16): 4 rows per micro-batch, each
chip holding a quarter of one. Compiled plan (``python -m jaxrl_async.plan --config configs/qwen3_32b_long_v5p.py
--compile-for target`` with the ``[aot-tpu]`` extra): see benchmarks/RESULTS.md.
"""
from jaxrl_async.config.recipes import qwen3_math_rl_long


def get_config():
    return qwen3_math_rl_long("qwen3-32b", layout="v5p-64-cp4", max_concurrent_decodes=256, num_pages=4 * 40960,
                              tokens_per_micro=4 * 32768)
