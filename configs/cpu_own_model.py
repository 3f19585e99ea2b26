"""Math RL of your own Hugging Face model on a laptop CPU (GSM8K-format data, the published recipe's prompt and
reward at laptop sizes):

    python -m jaxrl_async.main --config configs/cpu_own_model.py model.path=DIR data.train_path=train.jsonl \\
        data.eval_path=test.jsonl [trainer.total_steps=N] [--dry-run]

float32 (bfloat16 matmuls are several times slower on a CPU), two simulated devices (one generator, one trainer),
2 prompts x 2 samples per step, prompts up to 256 tokens and up to 256 generated, no SFT warm start (a pretrained
model starts from its own weights). `--dry-run` prints what the run needs on this machine (memory per role, a
rough time per step). Expect minutes per step for a 0.6B model on 2 cores.
"""
import dataclasses

from jaxrl_async.config import (
    CheckpointSection, DataConfig, EngineConfig, EvalConfig, MeshConfig, PackingConfig, RolloutConfig, RunConfig,
    SamplingConfig, SFTConfig, TrainerConfig,
)
from jaxrl_async.config.recipes import BOXED_INSTRUCTION, SAMPLE_TRAIN_PATH
from jaxrl_async.rl.advantages import AdvantageConfig
from jaxrl_async.rl.losses import PolicyLossConfig

MAX_PROMPT, MAX_NEW = 256, 256


def get_config() -> RunConfig:
    base = RunConfig()
    return RunConfig(
        name="cpu_own_model",
        seed=1,
        model=dataclasses.replace(base.model, dtype="float32", param_dtype="float32"),
        data=DataConfig(task="dataset", format="gsm8k", train_path=SAMPLE_TRAIN_PATH, eval_path=None,
                        max_prompt_len=MAX_PROMPT, apply_chat_template=True, prompt_suffix=BOXED_INSTRUCTION),
        rollout=RolloutConfig(
            mode="async", max_head_offpolicyness=2, n_samples=2,
            sampling=SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW),
            engine=EngineConfig(max_concurrent_decodes=4, max_sequence_length=MAX_PROMPT + MAX_NEW,
                                max_prefill_length=MAX_PROMPT),
            reward="math", reward_workers=1, group_timeout_s=3600.0),
        trainer=TrainerConfig(
            batch_size=2, total_steps=20, lr=1e-6, weight_decay=0.01, max_grad_norm=1.0,
            loss=PolicyLossConfig(eps_clip=0.2), advantage=AdvantageConfig(preset="grpo"),
            packing=PackingConfig(tokens_per_micro=2048, row_len_buckets=(128, 256, MAX_PROMPT + MAX_NEW)),
            sft=SFTConfig(steps=0)),
        mesh=MeshConfig(cpu_devices=2),
        eval=EvalConfig(every_steps=10, max_items=16, temperature=0.0),
        checkpoint=CheckpointSection(every_steps=1, keep_last=2, export_hf=True),
    )
