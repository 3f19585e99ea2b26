"""The embedded default's arithmetic task shown as images, learned by a vision-language policy (issue 29).

Everything is the embedded default (``jaxrl_async/config/default.py``: local tokenizer, SFT warm start on the gold
completions, async GRPO with eta = 2 on two simulated CPU devices) except: the policy is a random-init
Qwen2.5-VL-shaped model (``model.model_type=qwen2_5_vl``: the qwen2 decoder with M-RoPE and a small vision tower,
4-pixel patches, 2 x 2 merging, window attention with one full-attention block), and the prompts are the problems
drawn as 48 x 16 images (``data.task=visual_arithmetic``: the prompt's text only asks "What is the value shown?",
so the answer has to be read from the picture). The tokenizer is the arithmetic one plus Qwen2.5-VL's vision
tokens and chat template (``data.tokenizer_kind=arithmetic_vl``), and the warm start is 2000 steps on a mixture of two
teachers that both read the problem from the picture: ``steps`` (the expression transcribed, then the whole sum at
once: ``37+58 = 95``) and ``columns`` (the digits read column by column, units first, with the carry). The policy
learns to read and knows both; greedy decoding mostly transcribes and sums in one shot, and RL discovers that the
column work pays, as in the embedded text default. Measured (benchmarks/RESULTS.md, "The visual arithmetic task"):
held-out 0.290 after the warm start -> 0.640 after 150 RL steps (seed 0; seed 1: 0.430 -> 0.775).

    python -m jaxrl_async.main --config configs/visual_arithmetic.py
"""
import dataclasses

from jaxrl_async.config import VisionSection
from jaxrl_async.config.default import get_config as default_config


def get_config():
    cfg = default_config()
    return dataclasses.replace(
        cfg, name="visual_arithmetic",
        model=dataclasses.replace(cfg.model, model_type="qwen2_5_vl", max_position_embeddings=256,
                                  vision=VisionSection(depth=2, hidden_size=64, intermediate_size=128, num_heads=4)),
        data=dataclasses.replace(cfg.data, task="visual_arithmetic", tokenizer_kind="arithmetic_vl", max_prompt_len=64,
                                 arithmetic=dataclasses.replace(cfg.data.arithmetic, styles=("steps", "columns"),
                                                                style_weights=(0.5, 0.5))),
        # both teachers read the picture (the text default's terse teacher does not: with the direct/columns mixture
        # the policy had not learned to read after 3000 steps, held-out 0.025); columns-only demonstrations read
        # (0.615 after 1500 steps, 0.900 after 3000) but leave RL only reading errors to fix (flat)
        trainer=dataclasses.replace(cfg.trainer, sft=dataclasses.replace(cfg.trainer.sft, steps=2000)))
