"""The loop tests' tiny run as a config file for ``python -m jaxrl_async.main --config`` (subprocess tests).

Same model/data/engine as ``test_rl_loop.tiny_run_config`` (a 1-layer Qwen3 on arithmetic prompts, a
reward GRPO climbs fast), on ``mesh.cpu_devices = 4`` simulated CPU devices: the generator on device 0,
the trainer on devices 1-2 (fsdp = 2, so every push reshards). Override anything on the command line.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loop_targets (reward functions)

from jaxrl_async.config import (  # noqa: E402
    ArithmeticConfig, CheckpointSection, DataConfig, EngineConfig, EvalConfig, LoggingConfig, MeshAxesConfig,
    MeshConfig, ModelConfigSection, PackingConfig, RolloutConfig, RunConfig, SamplingConfig, TrainerConfig,
)
from jaxrl_async.rl.advantages import AdvantageConfig  # noqa: E402


def get_config() -> RunConfig:
    return RunConfig(
        name="tiny_loop", seed=0,
        model=ModelConfigSection(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                 head_dim=16, max_position_embeddings=128),
        data=DataConfig(arithmetic=ArithmeticConfig(num_train=200, num_eval=8), max_prompt_len=32),
        rollout=RolloutConfig(
            mode="async", max_head_offpolicyness=2, n_samples=4, reward="loop_targets:has_digit", reward_workers=2,
            group_timeout_s=120.0, sampling=SamplingConfig(temperature=1.0, max_new_tokens=12),
            engine=EngineConfig(max_concurrent_decodes=16, max_sequence_length=48, max_prefill_length=32,
                                page_size=8, num_pages=256)),
        trainer=TrainerConfig(batch_size=4, total_steps=8, lr=1e-2, weight_decay=0.0,
                              advantage=AdvantageConfig(preset="grpo", adv_norm=False),
                              packing=PackingConfig(tokens_per_micro=1024, row_len_buckets=(64,))),
        mesh=MeshConfig(generator=MeshAxesConfig(shape=(1, 1), axis_names=("data", "tensor"), devices=(0,)),
                        trainer=MeshAxesConfig(shape=(2,), axis_names=("fsdp",), devices=(1, 2)), cpu_devices=4),
        eval=EvalConfig(every_steps=0, at_start=False, at_end=False),
        checkpoint=CheckpointSection(every_steps=1, keep_last=2, save_at_end=True, export_hf=False, resume="auto"),
        logging=LoggingConfig(tensorboard=False, progress=False, print_config=False),
    )
