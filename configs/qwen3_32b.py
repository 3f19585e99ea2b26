"""Qwen3-32B math RL on layout ``v5p-64``.

Architecture (Qwen/Qwen3-32B config.json, ``models.config.PRESETS["qwen3-32b"]``): hidden 5120, 64
layers, 64 query / 8 kv heads, head_dim 128, intermediate 25600, vocab 151936, untied embeddings,
rope_theta 1e6, rms_norm_eps 1e-6, q/k RMSNorm; ``model.path=None`` plans it without weights.

Recipe: ``jaxrl_async.config.recipes.qwen3_math_rl``: AReaL's published math-RL hyper-parameters (16
samples per prompt, eta 4, 32 x 16 sequences per step in 4 PPO minibatches, decoupled PPO, Adam lr
1e-5, bf16 compute with fp32 master weights, full remat); its docstring tabulates every setting
with its source (AReaL boba_grpo.yaml, gsm8k_grpo.yaml, the AReaL paper).

Layout ``v5p-64``: a TPU v5p-64 slice (32 chips of 95 GB; one process per host, not implemented
yet: the layout is for planning); chips 0-15 generate (4 replicas x tensor 4), chips 16-31 train
(FSDP 16: fp32 weights + Adam 22.9 GiB per chip). ``--layout h100x64`` (8 nodes of H100) is the GPU
alternative. Sizing (``jaxrl_async.plan.planner``): 128 decode slots (32 per replica; KV pool 16 GiB per
chip), trainer micro-batches of 65536 tokens (4096 per FSDP shard; trainer peak 57.5 of 85.5 GiB;
8192 per shard also fits v5p, 71.6 GiB, but not ``h100x64``, whose 8 data shards then take 16384
tokens each: 81.3 of 72 GiB).

Weights and data come from local paths; nothing downloads::

    python -m jaxrl_async.main --config configs/qwen3_32b.py model.path=/models/Qwen3-32B \\
        data.train_path=/data/math/train.jsonl data.eval_path=/data/math/test.jsonl data.format=math
    python -m jaxrl_async.plan --config configs/qwen3_32b.py   # memory plan on 32 simulated devices
"""
from jaxrl_async.config.recipes import qwen3_math_rl


def get_config():
    return qwen3_math_rl("qwen3-32b", layout="v5p-64", max_concurrent_decodes=128, tokens_per_micro=65536)
