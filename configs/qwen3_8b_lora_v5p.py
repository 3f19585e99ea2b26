"""Qwen3-8B math RL with LoRA on a small TPU slice: v5p-8 (4 chips of 95 GB: 2 generate as 2 replicas,
2 train with FSDP 2). The LoRA settings are those of ``configs/qwen3_8b_lora.py`` (rank 32, alpha 32, all
projections, bf16 frozen base, unmerged decoding, lr 1e-4); AReaL's trainer micro-batches (16384 tokens
per FSDP shard) and 128 decode slots.

    python -m jaxrl_async.plan --config configs/qwen3_8b_lora_v5p.py --target v5p --devices 4 --compile-for target
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxrl_async.config import MeshAxesConfig, MeshConfig  # noqa: E402
from jaxrl_async.config.recipes import qwen3_math_rl  # noqa: E402
from qwen3_8b_lora import lora_recipe  # noqa: E402


def get_config():
    cfg = qwen3_math_rl("qwen3-8b", layout="h100x8", max_concurrent_decodes=128, tokens_per_micro=32768)
    mesh = MeshConfig(generator=MeshAxesConfig(shape=(2, 1), axis_names=("data", "tensor"), devices=(0, 1)),
                      trainer=MeshAxesConfig(shape=(2,), axis_names=("fsdp",), devices=(2, 3)))
    return lora_recipe(dataclasses.replace(cfg, mesh=mesh))
