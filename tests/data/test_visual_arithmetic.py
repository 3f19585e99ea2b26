"""The visual arithmetic task (data/visual_arithmetic.py) and the run settings of a vision-language policy."""
import json
import os

import numpy as np
import pytest

from jaxrl_async.data.arithmetic import ArithmeticConfig, build_splits
from jaxrl_async.data.visual_arithmetic import (
    GLYPHS, VisualArithmeticConfig, render_expression, write_visual_arithmetic_dataset,
)


def test_render_draws_each_glyph_and_fails_loudly():
    cfg = VisualArithmeticConfig(width=48, height=16, scale=2, jitter=0)
    img = render_expression("8", cfg)
    assert img.shape == (16, 48, 3) and img.dtype == np.uint8
    ink = img[..., 0] > 0
    ys, xs = np.nonzero(ink)
    # "8" is 3x5 font pixels, 13 of them inked, each scale x scale
    assert (ys.max() - ys.min() + 1, xs.max() - xs.min() + 1) == (10, 6)
    assert ink.sum() == sum(r.count("#") for r in GLYPHS["8"]) * 4
    assert (img[..., 0] == img[..., 1]).all() and (img[..., 1] == img[..., 2]).all()
    # different expressions, different pixels; the same one, the same pixels
    assert not np.array_equal(render_expression("12+34", cfg), render_expression("12+35", cfg))
    assert np.array_equal(render_expression("12+34", cfg), render_expression("12+34", cfg))
    with pytest.raises(ValueError, match="no glyph"):
        render_expression("1/2", cfg)
    with pytest.raises(ValueError, match="pixels"):
        render_expression("12345+6789", cfg)


def test_dataset_rows_images_and_split(tmp_path):
    probs = ArithmeticConfig(num_train=30, num_eval=10)
    paths = write_visual_arithmetic_dataset(tmp_path, probs)
    train, held = build_splits(probs)
    rows = [json.loads(line) for line in open(paths["train"])]
    assert len(rows) == 30 and len([1 for _ in open(paths["eval"])]) == 10
    from PIL import Image

    for row, p in zip(rows, train):
        # the text says nothing about the expression: only the image does
        assert row["prompt"].startswith("<image>") and p.expression not in row["prompt"]
        assert row["answer"] == p.answer and row["completion"] == p.completion
        im = Image.open(os.path.join(tmp_path, row["images"][0]))
        assert im.size == (48, 16)
    # deterministic
    again = write_visual_arithmetic_dataset(tmp_path / "again", probs)
    a = open(os.path.join(tmp_path, rows[3]["images"][0]), "rb").read()
    b = open(os.path.join(tmp_path / "again", rows[3]["images"][0]), "rb").read()
    assert a == b and open(again["train"]).read() == open(paths["train"]).read()


def test_rows_load_as_image_prompts_with_the_run_settings(tmp_path):
    from transformers import AutoTokenizer

    from jaxrl_async.config import apply_overrides
    from jaxrl_async.config.default import get_config
    from jaxrl_async.data.images import VLPromptRecord, load_vl_prompt_dataset, vl_token_ids
    from jaxrl_async.data.recipe import run_recipe
    from jaxrl_async.data.tokenizer import build_tokenizer
    from jaxrl_async.loop.setup import image_processor, is_vl_run
    from jaxrl_async.models.qwen2_5_vl import VLConfig, prepare_inputs

    cfg = apply_overrides(get_config(), ["model.model_type=qwen2_5_vl", "data.task=visual_arithmetic",
                                         "data.tokenizer_kind=arithmetic_vl"])
    assert is_vl_run(cfg)
    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok", kind="arithmetic_vl"))
    ids = vl_token_ids(tok)
    m = cfg.model.model_config(len(tok), eos_token_id=tok.eos_token_id, vision_token_ids=ids)
    assert isinstance(m, VLConfig) and m.text.mrope_section == (2, 3, 3) and m.image_token_id == ids["image_token_id"]
    assert m.vision.out_hidden_size == m.text.hidden_size and m.text.qkv_bias
    ip = image_processor(cfg)
    assert (ip.patch_size, ip.merge_size, ip.min_pixels, ip.max_pixels) == (4, 2, 256, 81920)
    paths = write_visual_arithmetic_dataset(tmp_path / "data", ArithmeticConfig(num_train=8, num_eval=2))
    dc = run_recipe(cfg).prompt.dataset_config(paths["train"], apply_chat_template=True)
    ds = load_vl_prompt_dataset(dc, tok, ip)
    r = ds.records[0]
    assert isinstance(r, VLPromptRecord) and r.image_grid_thw.tolist() == [[1, 4, 12]]  # 16 x 48 px, 4-px patches
    assert list(r.prompt_ids).count(ids["image_token_id"]) == 12
    ii = r.image_inputs()
    assert ii is r.image_inputs() and ii.num_tokens == 12 and ii.pixel_values().shape == (48, 3 * 2 * 16)
    prepare_inputs(m, np.asarray([r.prompt_ids]), ii.grid_thw)  # placeholders = grids


@pytest.mark.parametrize("overrides,field", [
    (["data.task=visual_arithmetic"], "data.task"),
    (["model.model_type=qwen2_5_vl"], "data.tokenizer_kind"),
    (["model.model_type=qwen2_5_vl", "data.tokenizer_kind=arithmetic_vl", "data.image_min_pixels=0"],
     "data.image_min_pixels"),
    (["model.model_type=qwen2_5_vl", "data.tokenizer_kind=arithmetic_vl", "model.lora.rank=4"], "model.lora.rank"),
    (["model.model_type=qwen2_5_vl", "data.tokenizer_kind=arithmetic_vl", "rollout.workflow=openai_agent",
      "rollout.agent=online"], "rollout.workflow"),
])
def test_settings_of_a_vl_run_are_checked(overrides, field):
    from jaxrl_async.config import ConfigError, apply_overrides, validate
    from jaxrl_async.config.default import get_config

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(apply_overrides(get_config(), overrides), num_devices=2)
