"""Qwen3-8B math RL at reasoning lengths on a TPU v5p-64 slice (32 chips: 16 generate, 16 train with FSDP).

Lengths and recipe as ``configs/qwen3_8b_long.py`` (``recipes.qwen3_math_rl_long``); ``model.attention=auto``
is the splash kernel on TPU. Plan compiled for ``v5:2x4x4`` (libtpu, ``[aot-tpu]`` extra;
benchmarks/RESULTS.md): trainer peak 38.6 of 85.5 GiB per chip (one 32k row per chip per micro-batch, step
temporaries 31.9 GiB), generator 66.7 GiB (KV pool 98,304 pages = 1.57 M tokens per replica, 256 slots).
"""
from jaxrl_async.config.recipes import qwen3_math_rl_long


def get_config():
    return qwen3_math_rl_long("qwen3-8b", layout="v5p-64", max_concurrent_decodes=256, num_pages=4 * 98304,
                              tokens_per_micro=16 * 32768)
