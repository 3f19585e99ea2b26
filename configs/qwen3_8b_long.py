"""Qwen3-8B math RL at reasoning lengths on one node of 8 H200 (layout ``h200x8``).

AReaL's long-CoT lengths (``recipes.qwen3_math_rl_long``): prompts up to 4,096 tokens, up to 27,648 generated
tokens (31,744 in all), 16 samples per prompt, trainer rows of 32,768 tokens (one row per FSDP shard per
micro-batch), full remat, ``model.attention=auto`` (the Pallas-Triton flash kernel on GPU). Sized from plans
compiled for the target (``python -m jaxrl_async.plan --config configs/qwen3_8b_long.py`` with the
``[aot-gpu]`` extra; benchmarks/RESULTS.md): trainer peak 103.7 of 126.9 GiB per device (train step
temporaries 50.0 GiB), generator 96.0 GiB (KV pool 65,536 pages of 16 tokens = 1.05 M tokens per replica,
allocated on demand; 96 decode slots).

On 8 H100 see ``configs/qwen3_8b_long_h100.py`` (context parallelism, 53.5 of 72 GiB per trainer GPU); with
the layer gradients sharded per layer the plain FSDP 4 layout fits too (``--layout h100x8-tp2``, 60.0 GiB).
"""
from jaxrl_async.config.recipes import qwen3_math_rl_long


def get_config():
    return qwen3_math_rl_long("qwen3-8b", layout="h200x8", max_concurrent_decodes=96, num_pages=3 * 65536,
                              tokens_per_micro=2 * 32768)
