"""Qwen2.5-VL-7B visual RL on one node of 8 H100 (layout ``h100x8-tp2``): the plan of issue 29 item 6.

Architecture (``model.model_type=qwen2_5_vl``; = ``models.vl_presets.VL_PRESETS["qwen2.5-vl-7b"]``, the config.json
of Qwen/Qwen2.5-VL-7B-Instruct): text (qwen2, q/k/v biases) hidden 3584, 28 layers, 28 / 4 heads of 128,
intermediate 18944, vocab 152064, rope_theta 1e6 with M-RoPE sections [16, 24, 24], untied embeddings; vision depth
32, hidden 1280, 16 heads, intermediate 3420, full attention at blocks [7, 15, 23, 31], 112 px windows of 14 px
patches, 2 x 2 merge, temporal patch 2; 8.29 B parameters.

Image budget (``IMAGE_BUDGET``, read by the VL planner): one image of up to 1280 visual tokens per prompt (the
model card's recommended ``max_pixels = 1280 * 28 * 28``, also ``data.image_max_pixels``: a 64 x 80 patch grid =
5120 patches in the vision tower); prompts up to 2048 tokens (the image's 1280 included) and 2048 new tokens
(veRL's geo3k GRPO example for this model: responses of 2048). Recipe otherwise ``recipes.qwen3_math_rl`` (AReaL's:
16 samples, 32 prompts x 4 minibatches, decoupled PPO, lr 1e-5, bf16 compute, fp32 master weights, full remat).
Layout ``h100x8-tp2`` as ``configs/qwen3_8b.py`` (4 GPUs generate: 2 replicas x tensor 2; 4 train: FSDP 4).

    python -m jaxrl_async.cli.plan_vl --config configs/qwen2_5_vl_7b.py --compile-for target
    python -m jaxrl_async.main --config configs/qwen2_5_vl_7b.py model.path=/models/Qwen2.5-VL-7B-Instruct \\
        data.train_path=/data/geo3k/train.parquet data.format=generic   # (a run: the checkpoint's tokenizer)
"""
import dataclasses

from jaxrl_async.config.recipes import qwen3_math_rl

IMAGE_BUDGET = {"images_per_prompt": 1, "tokens_per_image": 1280}
MAX_PROMPT_LEN = 2048
MAX_NEW_TOKENS = 2048


def vl_run_config(layout: str, *, max_concurrent_decodes: int, tokens_per_micro: int, name: str):
    from jaxrl_async.config.sections import ModelConfigSection, VisionSection
    from jaxrl_async.models.vl_presets import vl_preset

    p = vl_preset("qwen2.5-vl-7b")
    t, v = p.text, p.vision
    base = qwen3_math_rl("qwen3-8b", layout=layout, max_concurrent_decodes=max_concurrent_decodes,
                         tokens_per_micro=tokens_per_micro, name=name)
    model = ModelConfigSection(
        model_type="qwen2_5_vl", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=t.tie_word_embeddings, rope_theta=t.rope_theta, mrope_section=t.mrope_section,
        vision=VisionSection(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                             num_heads=v.num_heads, patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
                             temporal_patch_size=v.temporal_patch_size, window_size=v.window_size,
                             fullatt_block_indexes=v.fullatt_block_indexes),
        dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True)
    max_seq = MAX_PROMPT_LEN + MAX_NEW_TOKENS
    ro = base.rollout
    rollout = dataclasses.replace(
        ro, sampling=dataclasses.replace(ro.sampling, max_new_tokens=MAX_NEW_TOKENS),
        engine=dataclasses.replace(ro.engine, max_sequence_length=max_seq, max_prefill_length=MAX_PROMPT_LEN))
    # patch buckets at multiples of one budget image (5120 patches) instead of powers of two: a micro-batch with the
    # images of 8 prompts holds 40960 patches, not 65536 (the trainer replicates each micro-batch's float32 pixels)
    patches = 4 * IMAGE_BUDGET["tokens_per_image"] * IMAGE_BUDGET["images_per_prompt"]
    trainer = dataclasses.replace(base.trainer, packing=dataclasses.replace(
        base.trainer.packing, row_len_buckets=(512, 1024, 2048, max_seq),
        patch_buckets=(patches // 4, patches // 2, patches, 2 * patches, 4 * patches, 8 * patches)))
    # tokenizer_kind: without model.path (planning, a random-init smoke run) the run builds its own tokenizer, which
    # needs the vision tokens; a real run takes the checkpoint's
    data = dataclasses.replace(base.data, max_prompt_len=MAX_PROMPT_LEN, tokenizer_kind="arithmetic_vl",
                               image_max_pixels=IMAGE_BUDGET["tokens_per_image"] * 28 * 28)
    return dataclasses.replace(base, model=model, rollout=rollout, trainer=trainer, data=data)


def get_config():
    return vl_run_config("h100x8-tp2", max_concurrent_decodes=128, tokens_per_micro=32768, name="qwen2_5_vl_7b_rl")
