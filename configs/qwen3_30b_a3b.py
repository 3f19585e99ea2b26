"""Qwen3-30B-A3B (mixture of experts: 128 experts, top 8; 30.5 B parameters, 3.3 B active) math RL on ONE node
of 8 H100, with LoRA on the attention projections.

Recipe: ``jaxrl_async.config.recipes.qwen3_math_rl`` (AReaL's math-RL hyper-parameters; its docstring tabulates them)
with the LoRA settings of ``configs/qwen3_8b_lora.py`` (rank 32, alpha 32, lr 1e-4, weight decay 0, frozen
base in bfloat16, adapters unmerged in the generator) restricted to q, k, v, o (26.7 M adapter parameters;
``model.lora.targets`` with gate/up/down would also adapt each of the 128 experts, PEFT's fused-expert form:
1285 M adapter parameters at rank 32, 48x more; NOTES.md, LoRA).

Why LoRA on one node: full-weight training keeps fp32 weights, AdamW moments and fp32 gradients, 16 bytes per
parameter = 455 GiB for 30.5 B, and the generator needs the bf16 weights (57 GiB) plus one incoming push: more
than the node's 8 x 72 GiB budget under any generator/trainer split, and the trainer's FSDP shards must divide
hidden 2048 and 128 experts (4 or 8 trainer devices). Full-weight training needs more devices: see
``configs/qwen3_30b_a3b_v5p.py`` (TPU v5p-64). With LoRA the trainer holds the bf16 base (57 GiB over FSDP 4)
and 26.7 M adapter parameters; a push carries only the adapters.

Layout ``h100x8-tp2``: generator devices 0-3 (2 replicas x tensor 2: each holds half of every expert's width),
trainer 4-7 (FSDP 4). Plan compiled for H100 (``[aot-gpu]`` extra; benchmarks/RESULTS.md): generator peak 53.8
of 72 GiB (bf16 weights 28.5, KV pool 24.0 for 256 slots), trainer 26.7 GiB (bf16 base 14.3, step temporaries
12.2); the same recipe with full weights needs 162 GiB per trainer device::

    python -m jaxrl_async.plan --config configs/qwen3_30b_a3b.py --compile-for target
"""
import dataclasses

from jaxrl_async.config import LoraSection
from jaxrl_async.config.recipes import qwen3_math_rl

LORA = LoraSection(rank=32, alpha=32.0, targets=("q", "k", "v", "o"), base_dtype="bfloat16", decode="unmerged")


def get_config():
    cfg = qwen3_math_rl("qwen3-30b-a3b", layout="h100x8-tp2", max_concurrent_decodes=256, tokens_per_micro=32768)
    return dataclasses.replace(cfg, name=cfg.name + "_lora", model=dataclasses.replace(cfg.model, lora=LORA),
                               trainer=dataclasses.replace(cfg.trainer, lr=1e-4, weight_decay=0.0))
