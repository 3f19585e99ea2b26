"""Qwen3-1.7B math RL on layout ``h100x8``.

Architecture (Qwen/Qwen3-1.7B config.json, ``models.config.PRESETS["qwen3-1.7b"]``): hidden 2048, 28
layers, 16 query / 8 kv heads, head_dim 128, intermediate 6144, vocab 151936, tied embeddings,
rope_theta 1e6, rms_norm_eps 1e-6, q/k RMSNorm; ``model.path=None`` plans it without weights.

Recipe: ``jaxrl_async.config.recipes.qwen3_math_rl``: AReaL's published math-RL hyper-parameters (16
samples per prompt, eta 4, 32 x 16 sequences per step in 4 PPO minibatches, decoupled PPO, Adam lr
1e-5, bf16 compute with fp32 master weights, full remat); its docstring tabulates every setting
with its source (AReaL boba_grpo.yaml, gsm8k_grpo.yaml, the AReaL paper).

Layout ``h100x8``: one node of 8 H100; devices 0-5 generate (6 data-parallel decode replicas,
AReaL's 3:1 split), devices 6-7 train (FSDP 2). Sizing, from ``python -m jaxrl_async.plan --config
configs/qwen3_1_7b.py`` (8 simulated CPU devices, 20 s on 2 cores): 192 decode slots (32 per replica) at 2048
tokens, a 42 GiB pool split over the 6 ``data`` replicas: 7.00 GiB of KV per generator device (same layers / kv
heads as 0.6B; generator peak 15.5 of 72 GiB), trainer micro-batches of 32768 tokens (16384 per FSDP shard, AReaL
boba max_tokens_per_mb; trainer peak 26.5 GiB; CPU float32 compiles: an upper bound).

Weights and data come from local paths; nothing downloads::

    python -m jaxrl_async.main --config configs/qwen3_1_7b.py model.path=/models/Qwen3-1.7B \\
        data.train_path=/data/math/train.jsonl data.eval_path=/data/math/test.jsonl data.format=math
    python -m jaxrl_async.plan --config configs/qwen3_1_7b.py   # memory plan on 8 simulated devices
"""
from jaxrl_async.config.recipes import qwen3_math_rl


def get_config():
    return qwen3_math_rl("qwen3-1.7b", layout="h100x8", max_concurrent_decodes=192, tokens_per_micro=32768)
