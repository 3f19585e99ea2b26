"""The embedded default run: `python -m jaxrl_async.main` with no `--config` (also `configs/tiny_cpu.py`).

Made for a laptop CPU (2 cores, no network, no GPU) and about three minutes (184 s measured on a
2-core CPU shared with other jobs): the run builds a local tokenizer, a synthetic arithmetic task
with `\\boxed{}` answers (train and held-out splits, disjoint by construction), a tiny
Qwen3-architecture policy, a short supervised warm start on the gold completions, and then
asynchronous GRPO with the decoupled PPO loss (η = 2) on two simulated CPU devices (one generator,
one trainer). It evaluates greedy accuracy on the held-out split, checkpoints every 5 RL steps and
every 30 s (SIGTERM/SIGINT at any moment save and exit 0; the same command resumes), and ends with
an Orbax checkpoint, a Hugging Face export (`runs/tiny_cpu/hf`), `metrics.jsonl`, TensorBoard
scalars and `curves.png`.

Measured results are in `benchmarks/RESULTS.md` ("Embedded default").
"""

from jaxrl_async.config import (
    ArithmeticConfig, CheckpointSection, DataConfig, EngineConfig, EvalConfig, MeshConfig,
    ModelConfigSection, PackingConfig, RolloutConfig, RunConfig, SamplingConfig, SFTConfig, TrainerConfig,
)
from jaxrl_async.rl.advantages import AdvantageConfig
from jaxrl_async.rl.losses import PolicyLossConfig


def get_config() -> RunConfig:
    return RunConfig(
        name="tiny_cpu",
        seed=0,
        model=ModelConfigSection(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2,
                                 head_dim=16, max_position_embeddings=256),
        data=DataConfig(task="arithmetic", arithmetic=ArithmeticConfig(
            min_digits=1, max_digits=2, operators=("+", "-"), min_operands=2, max_operands=2,
            num_train=10000, num_eval=200, styles=("direct", "columns"), style_weights=(0.5, 0.5)),
            max_prompt_len=64),
        rollout=RolloutConfig(
            mode="async", max_head_offpolicyness=2, n_samples=8,
            sampling=SamplingConfig(temperature=1.0, max_new_tokens=64),
            engine=EngineConfig(max_concurrent_decodes=64, max_sequence_length=128, max_prefill_length=64,
                                page_size=16),
            reward="math", reward_workers=2, group_timeout_s=300.0),
        trainer=TrainerConfig(
            batch_size=8, total_steps=150, lr=1e-4, weight_decay=0.0, max_grad_norm=1.0,
            loss=PolicyLossConfig(eps_clip=0.2), advantage=AdvantageConfig(preset="grpo", adv_norm=False),
            packing=PackingConfig(tokens_per_micro=8192, row_len_buckets=(64, 128)),
            sft=SFTConfig(steps=1000, batch_size=32, lr=3e-3, warmup_steps=10)),
        mesh=MeshConfig(cpu_devices=2),  # 2 simulated CPU devices: 1 generator, 1 trainer (AReaL's 3/4 split rounds to 1)
        eval=EvalConfig(every_steps=25, temperature=0.0),
        # every 5 RL steps (a few seconds; async: the step blocks ~10 ms) and every 30 s of the warm start: a
        # kill loses little; SIGTERM/SIGINT save at once; the same command resumes
        checkpoint=CheckpointSection(every_steps=5, every_seconds=30.0, keep_last=3, save_at_end=True, export_hf=True,
                                     resume="auto"),
    )
