"""Qwen3-8B math RL at reasoning lengths on one node of 8 H200 (layout ``h200x8``).

AReaL's long-CoT lengths (``recipes.qwen3_math_rl_long``): prompts up to 4,096 tokens, up to 27,648 generated
tokens (31,744 in all), 16 samples per prompt, trainer rows of 32,768 tokens (one row per FSDP shard per
micro-batch), full remat, ``model.attention=auto`` (the Pallas-Triton flash kernel on GPU). Sized from plans
compiled for the target (``python -m jaxrl_async.plan --config configs/qwen3_8b_long.py`` with the
``[aot-gpu]`` extra; benchmarks/RESULTS.md): trainer peak 116.6 of 126.9 GiB per device (train step
temporaries 62.9 GiB), generator 99.2 GiB (KV pool 65,536 pages of 16 tokens = 1.05 M tokens per replica,
allocated on demand; 96 decode slots).

On 8 H100 (``--layout h100x8-tp2``, trainer fsdp 4, one 32k row per device) the trainer shard does not fit
at these lengths: 78.7 GiB of a 72 GiB budget (train step temporaries 51.9 GiB): use H200s, a TPU slice
(``configs/qwen3_8b_long_v5p.py``), or more trainer devices.
"""
from jaxrl_async.recipes import qwen3_math_rl_long


def get_config():
    return qwen3_math_rl_long("qwen3-8b", layout="h200x8", max_concurrent_decodes=96, num_pages=65536,
                              tokens_per_micro=2 * 32768)
