"""Qwen3-14B math RL on layout ``h100x32``.

Architecture (Qwen/Qwen3-14B config.json, ``models.config.PRESETS["qwen3-14b"]``): hidden 5120, 40
layers, 40 query / 8 kv heads, head_dim 128, intermediate 17408, vocab 151936, untied embeddings,
rope_theta 1e6, rms_norm_eps 1e-6, q/k RMSNorm; ``model.path=None`` plans it without weights.

Recipe: ``jaxrl_async.config.recipes.qwen3_math_rl``: AReaL's published math-RL hyper-parameters (16
samples per prompt, eta 4, 32 x 16 sequences per step in 4 PPO minibatches, decoupled PPO, Adam lr
1e-5, bf16 compute with fp32 master weights, full remat); its docstring tabulates every setting
with its source (AReaL boba_grpo.yaml, gsm8k_grpo.yaml, the AReaL paper).

Layout ``h100x32``: 4 nodes of 8 H100 (needs one process per host: multi-process execution is
not implemented yet, the layout is for planning); devices 0-23 generate (12 replicas x tensor 2),
devices 24-31 train (FSDP 8, one node), AReaL's 3:1 split. Sizing (``jaxrl_async.plan.planner``): 192
decode slots (16 per replica; KV pool 30 GiB per device), trainer micro-batches of 65536 tokens
(8192 per FSDP shard; 16384 per shard does not fit: trainer peak 74.4 of 72 GiB).

Weights and data come from local paths; nothing downloads::

    python -m jaxrl_async.main --config configs/qwen3_14b.py model.path=/models/Qwen3-14B \\
        data.train_path=/data/math/train.jsonl data.eval_path=/data/math/test.jsonl data.format=math
    python -m jaxrl_async.plan --config configs/qwen3_14b.py   # memory plan on 32 simulated devices
"""
from jaxrl_async.config.recipes import qwen3_math_rl


def get_config():
    return qwen3_math_rl("qwen3-14b", layout="h100x32", max_concurrent_decodes=192, tokens_per_micro=65536)
