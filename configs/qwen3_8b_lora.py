"""Qwen3-8B math RL with LoRA on ONE H100 (or H200): generator and trainer time-share the device.

The recipe is ``jaxrl_async.config.recipes.qwen3_math_rl`` (AReaL's math-RL hyper-parameters, see its docstring)
with LoRA (``model.lora``, ``jaxrl_async/models/lora.py``) instead of full-weight training:

* rank 32, alpha 32 (scale 1) on every projection (q, k, v, o, gate, up, down): 87.3 M adapter parameters
  (1.1 % of 8.2 B); A initialised like PEFT, B = 0.
* the frozen base is stored in bfloat16 in the trainer (``model.lora.base_dtype``): 15.3 GiB, no gradient,
  no Adam state; adapters and their AdamW moments in float32 (1.0 GiB together).
* lr 1e-4 (10x the full-weight 1e-5: LoRA's optimal learning rate is about an order of magnitude higher;
  Schulman et al., "LoRA Without Regret", Thinking Machines 2025), weight decay 0.
* the generator holds its own bf16 copy of the base (loaded once) and applies the adapters unmerged; a
  weight push carries only the adapters (175 MB in bf16 instead of 16.4 GB).
* one device cannot hold AReaL's 4 x 16k-token trainer micro-batches next to the generator: micro-batches of
  16384 tokens, 64 decode slots.

Plan (memory on the target, trainer and generator compiled for it; figures in benchmarks/RESULTS.md)::

    python -m jaxrl_async.plan --config configs/qwen3_8b_lora.py --target h100 --devices 1 --compile-for target
    python -m jaxrl_async.plan --config configs/qwen3_8b_lora.py --target h200 --devices 1

Train (local weights and data; nothing downloads)::

    python -m jaxrl_async.main --config configs/qwen3_8b_lora.py model.path=/models/Qwen3-8B \\
        data.train_path=/data/math/train.jsonl data.eval_path=/data/math/test.jsonl data.format=math
"""
import dataclasses

from jaxrl_async.config import LoraSection, MeshAxesConfig, MeshConfig
from jaxrl_async.config.recipes import qwen3_math_rl

LORA = LoraSection(rank=32, alpha=32.0, base_dtype="bfloat16", decode="unmerged")


def lora_recipe(cfg, *, lr: float = 1e-4):
    """``cfg`` (a ``qwen3_math_rl`` config) with the LoRA settings of the module docstring."""
    return dataclasses.replace(cfg, name=cfg.name + "_lora", model=dataclasses.replace(cfg.model, lora=LORA),
                               trainer=dataclasses.replace(cfg.trainer, lr=lr, weight_decay=0.0))


def get_config():
    cfg = qwen3_math_rl("qwen3-8b", layout="h100x8", max_concurrent_decodes=64, tokens_per_micro=16384)
    one = MeshConfig(generator=MeshAxesConfig(shape=(1, 1), axis_names=("data", "tensor")),
                     trainer=MeshAxesConfig(shape=(1,), axis_names=("fsdp",)), colocate=True)
    return lora_recipe(dataclasses.replace(cfg, mesh=one))
