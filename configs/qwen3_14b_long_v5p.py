"""Qwen3-14B math RL at reasoning lengths on a TPU v5p-64 slice (32 chips: 16 generate, 16 train with FSDP).

Recipe ``recipes.qwen3_math_rl_long`` (prompts <= 4,096, <= 27,648 generated tokens, 32k-token trainer rows,
full remat, splash attention). Plan compiled for ``v5:2x4x4`` (benchmarks/RESULTS.md): trainer peak 58.5 of
85.5 GiB per chip (step temporaries 46.4 GiB), generator 59.7 GiB (KV pool 65,536 pages = 1.05 M tokens per
replica, 256 slots).
"""
from jaxrl_async.config.recipes import qwen3_math_rl_long


def get_config():
    return qwen3_math_rl_long("qwen3-14b", layout="v5p-64", max_concurrent_decodes=256, num_pages=4 * 65536,
                              tokens_per_micro=16 * 32768)
