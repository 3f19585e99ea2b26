"""Qwen3-32B math RL at reasoning lengths on a TPU v5p-64 slice: DOES NOT FIT YET (the trainer shard).

Recipe ``recipes.qwen3_math_rl_long`` (prompts <= 4,096, <= 27,648 generated tokens, 32k-token trainer rows,
full remat, splash attention). The plan compiled for ``v5:2x4x4`` (benchmarks/RESULTS.md) fits the generator
(78.8 of 85.5 GiB, KV pool 40,960 pages) but not the trainer: 107.6 GiB per chip, of which 80.9 GiB are the
train step's temporaries for ONE 32k-token row (64 layers x 5120 hidden), with 22.9 GiB of fp32 weights and
Adam state. More FSDP shards only shrink the 22.9 GiB; a row of this length needs context (sequence)
parallelism for its activations, which jaxrl_async does not have yet (NOTES.md, open problems). The config
is kept as the target of that work: ``python -m jaxrl_async.plan --config configs/qwen3_32b_long_v5p.py``.
"""
from jaxrl_async.recipes import qwen3_math_rl_long


def get_config():
    return qwen3_math_rl_long("qwen3-32b", layout="v5p-64", max_concurrent_decodes=256, num_pages=40960,
                              tokens_per_micro=16 * 32768)
