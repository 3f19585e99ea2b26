"""Qwen3-8B math RL on layout ``h100x8-tp2``.

Architecture (Qwen/Qwen3-8B config.json, ``models.config.PRESETS["qwen3-8b"]``): hidden 4096, 36
layers, 32 query / 8 kv heads, head_dim 128, intermediate 12288, vocab 151936, untied embeddings
(separate lm_head), rope_theta 1e6, rms_norm_eps 1e-6, q/k RMSNorm; ``model.path=None`` plans it
without weights.

Recipe: ``jaxrl_async.config.recipes.qwen3_math_rl``: AReaL's published math-RL hyper-parameters (16
samples per prompt, eta 4, 32 x 16 sequences per step in 4 PPO minibatches, decoupled PPO, Adam lr
1e-5, bf16 compute with fp32 master weights, full remat); its docstring tabulates every setting
with its source (AReaL boba_grpo.yaml, gsm8k_grpo.yaml, the AReaL paper).

Layout ``h100x8-tp2``: one node of 8 H100 split 4+4 as AReaL's single-node examples
(gsm8k_grpo.yaml ``d4+d4``): devices 0-3 generate (2 replicas x tensor 2: bf16 weights 7.6 GiB and
half the kv heads per device), devices 4-7 train (FSDP 4: fp32 weights + Adam 22.9 GiB per
device). The 3:1 split does not fit 8B on 80 GB: 2 trainer devices would hold 45.8 GiB of state
plus 15 GiB of gradients each. Sizing (``jaxrl_async.plan.planner``): 128 decode slots (64 per replica, KV
pool 18 GiB per device), trainer micro-batches of 65536 tokens (16384 per FSDP shard, AReaL boba
max_tokens_per_mb; plan: trainer peak 69.2 of 72 GiB, float32 temporaries as an upper bound).

Weights and data come from local paths; nothing downloads::

    python -m jaxrl_async.main --config configs/qwen3_8b.py model.path=/models/Qwen3-8B \\
        data.train_path=/data/math/train.jsonl data.eval_path=/data/math/test.jsonl data.format=math
    python -m jaxrl_async.plan --config configs/qwen3_8b.py   # memory plan on 8 simulated devices
"""
from jaxrl_async.config.recipes import qwen3_math_rl


def get_config():
    return qwen3_math_rl("qwen3-8b", layout="h100x8-tp2", max_concurrent_decodes=128, tokens_per_micro=65536)
