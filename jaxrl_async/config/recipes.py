"""Shared run recipes for the published-size configs (``configs/qwen3_*.py``).

:func:`qwen3_math_rl` is the math RL recipe (GSM8K / MATH-style prompts, math-verify reward, GRPO
group normalisation, decoupled PPO) with AReaL's published hyper-parameters; each config file
picks a model size and a hardware layout (``jaxrl_async.config.layouts``) and sizes the two
memory-driven knobs (decode slots, trainer micro-batch tokens) so that ``python -m
jaxrl_async.plan.planner`` says the layout fits.

Sources (AReaL repository at commit 00d07c04 unless noted; ``../shared/reference/areal-semantics.md`` (beside the checkout)):

* [boba] ``examples/math/boba_grpo.yaml``, AReaL's math RL recipe (R1-Distill-Qwen-1.5B):
  n_samples 16, max_head_offpolicyness 4, batch 32 prompts, ppo_n_minibatches 4, Adam lr 1e-5
  constant, weight decay 0.01, betas (0.9, 0.999), eps 1e-8, gradient clipping 1.0,
  reward_scaling 10 / reward_bias -0.5, kl_ctl 0, recompute_logprob + use_decoupled_loss,
  behav_imp_weight_cap 5, reward_norm group mean/std, adv_norm batch mean/std, temperature 1.0,
  gradient_checkpointing, bf16, max_tokens_per_mb 16384.
* [gsm8k] ``examples/math/gsm8k_grpo.yaml``: max_new_tokens 1024, prompt max_length 1024 (the
  GSM8K/MATH-length recipe; boba's 8192 new tokens is the long-CoT variant).
* [paper] the AReaL paper (arXiv 2505.24298), experimental setup as summarised in
  areal-semantics.md section 8: PPO clip eps 0.2, 16 samples per prompt, 4 PPO minibatches, no KL,
  no critic, 75 % of the GPUs for generation.

Choices and where they come from:

| setting | value | source |
|---|---|---|
| rollout.n_samples | 16 | [boba], [paper] |
| rollout.max_head_offpolicyness (eta) | 4 | [boba] ([paper]: 8 for math, 4 for code) |
| rollout.sampling | temperature 1.0, top_p 1, top_k 0, max_new_tokens 1024 | [boba] / [gsm8k] |
| data.max_prompt_len | 1024 | [gsm8k] train_dataset.max_length |
| data.prompt_suffix | "Please put your final answer within \\boxed{}." | AReaL's gsm8k/math datasets |
| rollout.reward | ``math`` (math-verify, binary) | AReaL MathVerifyWorker |
| trainer.batch_size | 32 prompt groups (512 sequences) | [boba] train_dataset.batch_size |
| trainer.ppo_n_minibatches | 4 | [boba], [paper] |
| trainer.proximal | recompute (decoupled loss) | [boba] recompute_logprob, use_decoupled_loss |
| trainer.lr, schedule | 1e-5, constant | [boba] ([paper]: 2e-5; use ``trainer.lr=1e-6`` for a cautious start) |
| trainer.weight_decay, b1, b2, eps | 0.01, 0.9, 0.999, 1e-8 | [boba] |
| trainer.max_grad_norm | 1.0 | [boba] gradient_clipping |
| trainer.loss | PPO, eps_clip 0.2, token mask at behaviour ratio 5, token mean | [paper] eps; [boba] cap 5 |
| trainer.advantage | grpo (group mean/std), batch adv norm, reward (r - 0.5) x 10 (binary -> +-5), kl 0 | [boba] |
| model.remat | full | [boba] gradient_checkpointing |
| model.dtype / param_dtype | bfloat16 compute, float32 master weights + Adam | [boba] dtype bf16 (master fp32 is ours) |
| trainer.packing.tokens_per_micro | per data shard: 16384 (<= 8B), 8192 (14B), 4096 (32B) | [boba] max_tokens_per_mb; plan |

``model.path`` is None: the architecture fields are the published Qwen3 numbers
(``models.config.PRESETS``) so the run can be planned without weights; for training set
``model.path=/path/to/Qwen3-XB`` (a Hugging Face directory with config.json + safetensors, read
from local disk, never downloaded) and ``data.train_path`` / ``data.eval_path`` (JSONL or Parquet in
``data.format``). The default ``data.train_path`` is the packaged 40-row GSM8K sample, only so that
the config validates out of the box.
"""

from __future__ import annotations

import os

from jaxrl_async.config import (
    CheckpointSection, DataConfig, EngineConfig, EvalConfig, ModelConfigSection, PackingConfig, RolloutConfig,
    RunConfig, SamplingConfig, TrainerConfig,
)
from jaxrl_async.rl.advantages import AdvantageConfig
from jaxrl_async.rl.losses import BehaviourWeightConfig, PolicyLossConfig

__all__ = ["qwen3_model_section", "qwen3_math_rl", "qwen3_math_rl_long", "SAMPLE_TRAIN_PATH", "MAX_PROMPT_LEN",
           "MAX_NEW_TOKENS", "LONG_MAX_NEW_TOKENS", "LONG_MAX_PROMPT_LEN"]

SAMPLE_TRAIN_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "samples", "gsm8k_sample.jsonl")
BOXED_INSTRUCTION = "\nPlease put your final answer within \\boxed{}."
MAX_PROMPT_LEN = 1024
MAX_NEW_TOKENS = 1024


def qwen3_model_section(size: str, **overrides) -> ModelConfigSection:
    """``model`` section with the published architecture of ``size`` (e.g. ``"qwen3-8b"``)."""
    from jaxrl_async.models.config import preset

    p = preset(size)
    kw = dict(model_type=p.model_type, vocab_size=p.vocab_size, hidden_size=p.hidden_size,
              intermediate_size=p.intermediate_size, num_layers=p.num_layers, num_heads=p.num_heads,
              num_kv_heads=p.num_kv_heads, head_dim=p.head_dim, max_position_embeddings=p.max_position_embeddings,
              tie_word_embeddings=p.tie_word_embeddings, rope_theta=p.rope_theta, dtype="bfloat16",
              param_dtype="float32", remat="full", scan_layers=True)
    if p.num_experts:
        kw.update(num_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok,
                  moe_intermediate_size=p.moe_intermediate_size, norm_topk_prob=p.norm_topk_prob)
    kw.update(overrides)
    return ModelConfigSection(**kw)


def qwen3_math_rl(size: str, *, layout: str, max_concurrent_decodes: int, tokens_per_micro: int,
                  name: str | None = None, page_size: int = 16, logprob_chunk: int = 2048) -> RunConfig:
    """The math RL recipe of the module docstring for Qwen3 ``size`` on ``layout``.

    ``max_concurrent_decodes``: decode slots of the generator engine (all its data replicas
    together; a multiple of the layout's data axis so the decode batch splits evenly).
    ``tokens_per_micro``: trainer micro-batch token budget (all data shards together).
    """
    from jaxrl_async.config.layouts import mesh_config

    max_seq = MAX_PROMPT_LEN + MAX_NEW_TOKENS
    return RunConfig(
        name=name or size.replace("-", "_").replace(".", "_") + "_math_rl",
        seed=1,  # AReaL yamls: seed 1
        model=qwen3_model_section(size),
        data=DataConfig(task="dataset", train_path=SAMPLE_TRAIN_PATH, eval_path=None, format="gsm8k",
                        max_prompt_len=MAX_PROMPT_LEN, apply_chat_template=True, prompt_suffix=BOXED_INSTRUCTION,
                        tokenizer_kind="bpe"),
        rollout=RolloutConfig(
            mode="async", max_head_offpolicyness=4, n_samples=16, kv_update_policy="recompute_kv",
            sampling=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS),
            engine=EngineConfig(max_concurrent_decodes=max_concurrent_decodes, max_sequence_length=max_seq,
                                max_prefill_length=MAX_PROMPT_LEN, page_size=page_size, cache_memory_fraction=0.9),
            reward="math", reward_workers=8, group_timeout_s=1800.0),
        trainer=TrainerConfig(
            batch_size=32, total_steps=1000, ppo_n_minibatches=4, proximal="recompute", lr=1e-5, schedule="constant",
            warmup_steps=0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, max_grad_norm=1.0,
            logprob_chunk=logprob_chunk,
            loss=PolicyLossConfig(policy_loss="ppo", eps_clip=0.2, behaviour_weight=BehaviourWeightConfig(
                action="mask", level="token", metric="ratio", upper=5.0), aggregation="token_mean"),
            advantage=AdvantageConfig(preset="grpo", reward_bias=-0.5, reward_scale=10.0, adv_norm=True, kl_coef=0.0),
            packing=PackingConfig(tokens_per_micro=tokens_per_micro, row_len_buckets=(256, 512, 1024, max_seq))),
        mesh=mesh_config(layout),
        eval=EvalConfig(every_steps=50, at_start=True, temperature=0.0),
        checkpoint=CheckpointSection(every_seconds=3600.0, keep_last=2, export_hf=True),  # AReaL recover freq 3600 s
    )


#: AReaL's long-CoT lengths (boba recipes: up to 27,648 generated tokens in a 32k context)
LONG_MAX_NEW_TOKENS = 27648
LONG_MAX_PROMPT_LEN = 4096


def qwen3_math_rl_long(size: str, *, layout: str, max_concurrent_decodes: int, num_pages: int,
                       tokens_per_micro: int, remat: str = "full", name: str | None = None) -> RunConfig:
    """:func:`qwen3_math_rl` at reasoning lengths: prompts up to 4,096 tokens, up to 27,648 generated, rows of
    32,768 tokens (one row per trainer data shard per micro-batch at ``tokens_per_micro`` = 32,768 x shards).

    The generator's KV pool is sized by ``num_pages`` (pages of 16 tokens, allocated on demand: decode slots do
    not reserve full-length sequences; the orchestrator preempts when the pool runs out; the pages split over
    the generator's data replicas, so each replica holds num_pages / data of them) instead of slots x
    full length, which at 32k tokens would be 8-16x the memory. Attention is ``auto`` (splash on TPU, the
    Pallas-Triton kernel on GPU): at these lengths the T x T scores of ``xla`` alone exceed a device.
    """
    import dataclasses

    base = qwen3_math_rl(size, layout=layout, max_concurrent_decodes=max_concurrent_decodes,
                         tokens_per_micro=tokens_per_micro,
                         name=name or size.replace("-", "_").replace(".", "_") + "_math_rl_long")
    max_seq = LONG_MAX_PROMPT_LEN + LONG_MAX_NEW_TOKENS  # 31,744 <= Qwen3's 40,960 positions
    ro = base.rollout
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, remat=remat, attention="auto"),
        data=dataclasses.replace(base.data, max_prompt_len=LONG_MAX_PROMPT_LEN),
        rollout=dataclasses.replace(
            ro, sampling=dataclasses.replace(ro.sampling, max_new_tokens=LONG_MAX_NEW_TOKENS),
            engine=dataclasses.replace(ro.engine, max_sequence_length=max_seq, max_prefill_length=LONG_MAX_PROMPT_LEN,
                                       num_pages=num_pages)),
        trainer=dataclasses.replace(base.trainer, packing=dataclasses.replace(
            base.trainer.packing, tokens_per_micro=tokens_per_micro,
            row_len_buckets=(1024, 2048, 4096, 8192, 16384, 32768))),
    )

