"""The VL planner's memory arithmetic (`plan/vl.py`) and the Qwen2.5-VL-7B preset, on CPU in seconds (no compile):
the preset is Qwen/Qwen2.5-VL-7B-Instruct's config.json field by field and 8.29 B parameters; the image budget's
grid; the vision tower's bytes per device under the trainer's FSDP and the generator's tensor rules against a hand
calculation from the architecture; pixel bytes of the minibatches; the VL configs parse, validate (as runs once a
tokenizer directory is named) and carry the preset's architecture; the decoder's run config; a text policy is
refused with one line."""
import os

import jax
import numpy as np
import pytest

from jaxrl_async.config import load_config_file, validate
from jaxrl_async.models.vl_presets import vision_num_params, vl_num_params, vl_preset
from jaxrl_async.plan.planner import PlanError
from jaxrl_async.plan.vl import (
    ImageBudget, decoder_run_config, micro_batch_patches, prefill_patches, reduced_run_depth, vision_batch_bytes,
    vision_bytes, vl_memory, vl_model_config,
)
from jaxrl_async.sharding.mesh import make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [os.path.join(ROOT, "configs", f) for f in ("qwen2_5_vl_7b.py", "qwen2_5_vl_7b_v5p.py")]


def test_qwen2_5_vl_7b_preset_is_the_published_architecture():
    c = vl_preset("qwen2.5-vl-7b")
    t, v = c.text, c.vision
    # Qwen/Qwen2.5-VL-7B-Instruct config.json
    assert (t.model_type, t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size,
            t.vocab_size, t.rope_theta, t.mrope_section, t.tie_word_embeddings, t.qkv_bias, t.rms_norm_eps,
            t.max_position_embeddings) == ("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, 1e6, (16, 24, 24), False,
                                           True, 1e-6, 128000)
    assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.out_hidden_size, v.fullatt_block_indexes,
            v.window_size, v.patch_size, v.spatial_merge_size, v.temporal_patch_size, v.in_channels) == (
        32, 1280, 16, 3420, 3584, (7, 15, 23, 31), 112, 14, 2, 2, 3)
    assert (c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id) == (
        151655, 151656, 151652, 151653)
    # 8.29 B (the model card); text = ModelConfig.num_params; vision by hand from the architecture
    assert vl_num_params(c) == 8_292_166_656
    assert t.num_params() == 7_615_616_512
    D, F, U, P = v.hidden_size, v.intermediate_size, 4 * v.hidden_size, 3 * 2 * 14 * 14
    block = 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + 2 * (D * F + F) + (F * D + D)
    merger = D + (U * U + U) + (U * 3584 + 3584)
    assert vision_num_params(v) == P * D + v.depth * block + merger == 676_550_144
    with pytest.raises(ValueError, match="unknown VL model preset"):
        vl_preset("qwen9-vl")


def test_image_budget():
    b = ImageBudget()
    assert b.grid(2) == (1, 64, 80) and b.patches_per_prompt(2) == 5120 and b.image_tokens_per_prompt() == 1280
    assert ImageBudget(2, 256).grid(2) == (1, 32, 32) and ImageBudget(2, 256).patches_per_prompt(2) == 2048
    assert ImageBudget(1, 7).grid(2) == (1, 2, 14)  # a prime: one row of merge units
    with pytest.raises(PlanError, match="ImageBudget.tokens_per_image"):
        ImageBudget(1, 0)


def _hand_vision_bytes(v, bytes_per, shard_embed: int = 1, shard_heads_mlp: int = 1) -> int:
    """Per-device bytes: rows with an ``embed`` axis divided by ``shard_embed`` (trainer FSDP), rows with a
    ``heads`` / ``mlp`` axis by ``shard_heads_mlp`` (generator tensor) -- the rule sets of sharding/rules.py."""
    D, F, H, E, L, U, P, O = (v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim, v.depth, 4 * v.hidden_size,
                              v.patch_dim, v.out_hidden_size)
    e, t = shard_embed, shard_heads_mlp
    n = P * D / e  # patch_embed (None, embed)
    n += L * (2 * D + D + D)  # norm1, norm2, o_bias, down_bias: (layers, norm) replicated
    n += L * D * 3 * H * E / (e * t) + L * 3 * H * E / t  # qkv (embed, heads), qkv_bias (heads)
    n += L * H * E * D / (t * e)  # o (heads, embed)
    n += L * (2 * D * F / (e * t) + 2 * F / t + F * D / (t * e))  # gate, up, down + gate/up biases (mlp)
    n += D + U * U / (e * t) + U / t + U * O / (t * e) + O  # merger: norm, fc1 (embed, mlp), fc1_bias, fc2, bias
    return int(round(n * bytes_per))


def test_vision_bytes_per_device_match_a_hand_calculation():
    vl = vl_preset("qwen2.5-vl-7b")
    devs = jax.devices()[:4]
    fsdp = make_mesh({"fsdp": 4}, ("fsdp",), devices=devs)
    tensor = make_mesh({"data": 2, "tensor": 2}, ("data", "tensor"), devices=devs)
    assert vision_bytes(vl, fsdp, "trainer", "float32") == _hand_vision_bytes(vl.vision, 4, shard_embed=4)
    assert vision_bytes(vl, tensor, "generator", "bfloat16") == _hand_vision_bytes(vl.vision, 2, shard_heads_mlp=2)
    one = make_mesh({"fsdp": 1}, ("fsdp",), devices=devs[:1])
    assert vision_bytes(vl, one, "trainer", "float32") == 4 * vision_num_params(vl.vision)


def test_vl_memory_adds_vision_state_and_pixels():
    from jaxrl_async.trainer.packing import PackingConfig

    vl = vl_preset("qwen2.5-vl-7b")
    devs = jax.devices()[:8]
    trn = make_mesh({"fsdp": 4}, ("fsdp",), devices=devs[4:])
    gen = make_mesh({"data": 2, "tensor": 2}, ("data", "tensor"), devices=devs[:4])
    m = vl_memory(vl, trn, gen)
    assert m["trainer_vision_optimizer_bytes"] == 2 * m["trainer_vision_params_bytes"]
    assert m["trainer_vision_push_staging_bytes"] == _hand_vision_bytes(vl.vision, 2, shard_embed=4)
    assert m["generator_vision_params_bytes"] == m["generator_vision_incoming_bytes"]
    # the vision tower is ~8 % of the model: fp32 + Adam per trainer device ~ 12 x 677 M / 4 bytes
    assert 1.9e9 < m["trainer_vision_params_bytes"] * 3 < 2.1e9
    assert np.isclose(m["generator_vision_params_bytes"], 2 * vision_num_params(vl.vision) / 2, rtol=0.01)
    # a micro-batch of 8 rows (8 sequences of 8 prompts x 16 samples): 8 image sets of 5120 patches, bucketed to
    # the power of two 65536; 4 sequences of one prompt: one set
    b, pk = ImageBudget(), PackingConfig()
    assert micro_batch_patches(b, vl, sequences_per_micro=8, prompts_per_minibatch=8, packing=pk) == (8, 65536)
    assert micro_batch_patches(b, vl, sequences_per_micro=32, prompts_per_minibatch=2, packing=pk) == (2, 16384)
    assert micro_batch_patches(b, vl, sequences_per_micro=4, prompts_per_minibatch=1, packing=pk) == (1, 8192)
    # float32 pixels (588 values a patch: one of its 2 temporal copies) + int32 layout (order, 2 coordinates,
    # frame, window; 1/4 for unorder)
    assert vision_batch_bytes(vl, 16, 65536) == 16 * (65536 * 588 * 4 + 65536 * 5 * 4 + 16384 * 4)
    # a prefill row of 2048 tokens holds one 1280-token image prompt: the tower over 8192 padded patches
    assert prefill_patches(b, vl, 2048) == (1, 8192) and prefill_patches(ImageBudget(1, 256), vl, 2048) == (8, 8192)


@pytest.mark.parametrize("path", CONFIGS)
def test_vl_configs_parse_validate_and_carry_the_preset(path, tmp_path):
    import dataclasses

    from jaxrl_async.config.layouts import LAYOUTS

    cfg = load_config_file(path)
    n = LAYOUTS[cfg.mesh.layout].num_devices
    # a VL run names its checkpoint (or tokenizer) directory: the run's tokenizer has the vision tokens
    validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tokenizer_path=str(tmp_path))), n)
    vl, preset = vl_model_config(cfg), vl_preset("qwen2.5-vl-7b")
    assert vl.vision == preset.vision
    assert vl.text.replace(eos_token_id=None, bos_token_id=None, pad_token_id=None) == preset.text.replace(
        eos_token_id=None, bos_token_id=None, pad_token_id=None, remat="full")
    assert vl_num_params(vl) == 8_292_166_656
    assert cfg.data.max_prompt_len >= ImageBudget().image_tokens_per_prompt()
    assert cfg.rollout.engine.max_prefill_length == cfg.data.max_prompt_len
    assert cfg.data.image_max_pixels == 1280 * 28 * 28
    assert cfg.trainer.packing.patches_for(8 * 5120) == 40960  # buckets at multiples of one budget image
    dec = decoder_run_config(cfg, vl)  # the decoder's plan: a text run of the same decoder, 1-D RoPE
    validate(dec, n)
    text = dec.model.model_config(vocab_size=dec.model.vocab_size)
    assert text.model_type == "qwen2" and not text.mrope_section and text.num_params() == preset.text.num_params()
    small = reduced_run_depth(cfg, 2, 2)
    assert small.model.num_layers == 2 and small.model.vision.depth == 2
    assert small.model.vision.fullatt_block_indexes == (1,)  # none of 7/15/23/31 is below 2: the last block


def test_a_text_policy_is_refused():
    cfg = load_config_file(os.path.join(ROOT, "configs", "qwen3_8b.py"))
    with pytest.raises(PlanError, match="needs a Qwen2.5-VL policy"):
        vl_model_config(cfg)


@pytest.mark.slow
def test_make_vl_plan_on_cpu_for_the_visual_task():
    """The whole VL plan end to end on the CPU (the small visual-arithmetic policy): the decoder's plan plus the VL
    train step and prefill compiled; the VL peaks add the vision state and pixels to the decoder's resident bytes."""
    from jaxrl_async.plan.planner import load_plan_config
    from jaxrl_async.plan.vl import format_vl_plan, make_vl_plan

    cfg = load_plan_config(os.path.join(ROOT, "configs", "visual_arithmetic.py"), None, ["model.vocab_size=300"])
    r = make_vl_plan(cfg, ImageBudget(2, 12), num_devices=2, target="h100", compile_for="cpu")
    v, t = r["vl"], r["trainer"]
    assert r["model"]["type"] == "qwen2" and v["image_budget"]["patches_per_prompt"] == 2 * 12 * 4
    assert v["train_step"]["compute_dtype"] == "float32" and v["train_step_transient_bytes"] > 0
    assert v["prefill_transient_bytes"] > 0 and v["fits"]
    ib = v["image_budget"]
    # the minibatches with images hold the text fields + the replicated vision inputs of every micro-batch
    k = cfg.trainer.ppo_n_minibatches
    vis = vision_batch_bytes(vl_model_config(cfg), ib["n_micro"], ib["patches_per_micro"]) * k
    assert vis < v["trainer_batches_bytes"] <= vis + 2 * t["batches_bytes"]
    resident = (t["params_bytes"] + t["optimizer_state_bytes"] + v["trainer_batches_bytes"] + t["push_staging_bytes"]
                + v["trainer_vision_params_bytes"] + v["trainer_vision_optimizer_bytes"]
                + v["trainer_vision_push_staging_bytes"])
    assert v["trainer_peak_bytes"] >= resident + v["train_step_transient_bytes"]
    assert v["tower_transient_bytes"] > 0 and ib["prefill_patches"] >= 2 * 12 * 4
    assert "VL verdict: FITS" in format_vl_plan(r)


def test_the_plan_command_hands_a_vl_config_to_plan_vl(monkeypatch):
    """`python -m jaxrl_async.plan --config configs/qwen2_5_vl_7b.py ...` plans it as a VL run (cli/plan_vl.py, with
    its own flags) instead of refusing the VL flags or planning the decoder alone."""
    from jaxrl_async.cli import plan, plan_vl

    seen = []
    monkeypatch.setattr(plan_vl, "main", lambda argv: seen.append(list(argv)) or 0)
    argv = ["--config", os.path.join(ROOT, "configs", "qwen2_5_vl_7b.py"), "--image-tokens", "256", "--layers", "1"]
    assert plan.main(argv) == 0 and seen == [argv]
    seen.clear()
    # a text config refuses a VL flag in one line (exit 2)
    assert plan.main(["--config", os.path.join(ROOT, "configs", "qwen3_8b.py"), "--image-tokens", "256"]) == 2
    assert not seen
