"""Qwen3-8B math RL at reasoning lengths on one node of 8 H100, with context parallelism (``h100x8-tp2-cp2``).

AReaL's long-CoT lengths (``recipes.qwen3_math_rl_long``; see ``configs/qwen3_8b_long.py`` for the H200 node).
On 8 H100 with the trainer as FSDP 4 (layout ``h100x8-tp2``, one 32k row per GPU) the trainer shard misses
the budget (78.7 of 72 GiB, 51.9 GiB of them the step's temporaries for one row). Layout ``h100x8-tp2-cp2``
splits every trainer row over 2 GPUs (fsdp 2 x context 2; weights and Adam state still over all 4): 2 rows per
micro-batch. Compiled plan (``python -m jaxrl_async.plan --config configs/qwen3_8b_long_h100.py
--compile-for target`` with the ``[aot-gpu]`` extra): see benchmarks/RESULTS.md.
"""
from jaxrl_async.config.recipes import qwen3_math_rl_long


def get_config():
    return qwen3_math_rl_long("qwen3-8b", layout="h100x8-tp2-cp2", max_concurrent_decodes=64, num_pages=2 * 32768,
                              tokens_per_micro=2 * 32768)
