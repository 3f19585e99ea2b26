"""Qwen2.5-VL (issue 29, the model): fp32 parity with transformers' ``Qwen2_5_VLForConditionalGeneration`` on a tiny
random checkpoint (`testing.make_tiny_vl_model`), with ``pixel_values`` / ``image_grid_thw`` fed directly: the
M-RoPE positions and rope deltas, the vision tower's window layout and features, the logits on text-only prompts,
one image, images of several sizes and aspect ratios (windowed ones among them), several images per prompt and a
padded batch; the HF export loads in transformers and reproduces the logits."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_async.models import load_hf, qwen2_5_vl, save_hf, vision
from jaxrl_async.models.safetensors_io import SafetensorsReader
from jaxrl_async.testing import TINY_VL_TOKENS, make_tiny_vl_model

IMG, VS, VE = TINY_VL_TOKENS["image_token_id"], TINY_VL_TOKENS["vision_start_token_id"], TINY_VL_TOKENS["vision_end_token_id"]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    cfg, params = load_hf(d)
    return d, hf, cfg, params


def _prompt(rng, grids, m=2, text=(5, 4)):
    """text, <vs> placeholders <ve>, text, ... for each image grid (t, h, w), then text."""
    ids = list(rng.integers(3, 240, text[0]))
    for t, h, w in grids:
        ids += [VS] + [IMG] * (t * h * w // (m * m)) + [VE] + list(rng.integers(3, 240, text[1]))
    return ids


def _pixels(rng, grids, patch_dim=96):
    n = sum(t * h * w for t, h, w in grids)
    return rng.standard_normal((n, patch_dim)).astype(np.float32)


def _hf_logits(hf, ids, pixels=None, grids=None, mask=None):
    ids_t = torch.tensor(np.asarray(ids))
    kw = dict(input_ids=ids_t, mm_token_type_ids=(ids_t == IMG).int())
    if pixels is not None:
        kw.update(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(np.asarray(grids)))
    if mask is not None:
        kw["attention_mask"] = torch.tensor(np.asarray(mask))
    with torch.no_grad():
        return hf(**kw).logits.float().numpy()


def _check_logits(hf, cfg, params, ids, grids=(), mask=None, rng=None):
    ids = np.asarray(ids)
    pixels = _pixels(rng, grids) if grids else None
    ref = _hf_logits(hf, ids, pixels, list(grids) or None, mask)
    ours = np.asarray(qwen2_5_vl.apply(params, cfg, ids, pixels, list(grids) or None, mask))
    valid = np.ones(ids.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    diff = float(np.abs(ours - ref)[valid].max())
    assert diff <= TOL, diff
    return diff


def test_config_round_trip(tiny):
    d, _, cfg, _ = tiny
    assert isinstance(cfg, qwen2_5_vl.VLConfig)
    assert cfg.text.model_type == "qwen2" and cfg.text.qkv_bias and cfg.text.mrope_section == (2, 3, 3)
    assert cfg.vision.fullatt_block_indexes == (1,) and cfg.vision.window_size == 16
    assert qwen2_5_vl.VLConfig.from_hf(cfg.to_hf()) == cfg
    # the exported config.json builds the same transformers config
    hf_cfg = transformers.Qwen2_5_VLConfig(**cfg.to_hf())
    ref = transformers.AutoConfig.from_pretrained(d)
    assert hf_cfg.vision_config.to_dict()["fullatt_block_indexes"] == list(ref.vision_config.fullatt_block_indexes)
    assert hf_cfg.text_config.rope_parameters["mrope_section"] == [2, 3, 3]


def test_rope_index_matches_hf(tiny):
    _, hf, cfg, _ = tiny
    rng = np.random.default_rng(0)
    rows_grids = [[(1, 4, 6)], [(1, 6, 4), (1, 2, 2), (1, 8, 10)], [], [(2, 4, 4)]]
    rows = [_prompt(rng, g) for g in rows_grids]
    T = max(len(r) for r in rows) + 3
    ids = np.zeros((len(rows), T), np.int64)
    mask = np.zeros((len(rows), T), np.int64)
    for b, r in enumerate(rows):  # left padding on even rows, right padding on odd rows (HF handles both)
        lo = T - len(r) if b % 2 == 0 else 0
        ids[b, lo:lo + len(r)], mask[b, lo:lo + len(r)] = r, 1
    grids = [g for gs in rows_grids for g in gs]
    ids_t = torch.tensor(ids)
    ref_pos, ref_delta = hf.model.get_rope_index(ids_t, mm_token_type_ids=(ids_t == IMG).int(),
                                                 image_grid_thw=torch.tensor(grids), attention_mask=torch.tensor(mask))
    pos, delta = qwen2_5_vl.rope_index(cfg, ids, grids, mask)
    np.testing.assert_array_equal(pos, ref_pos.numpy())
    np.testing.assert_array_equal(delta, ref_delta.numpy().reshape(-1))
    assert delta[2] == 0 and (delta[[0, 1, 3]] < 0).all()
    # the grids must match the placeholders
    with pytest.raises(ValueError, match="placeholder"):
        qwen2_5_vl.prepare_inputs(cfg, ids, grids[:-1], mask)


def test_decode_positions_follow_rope_deltas(tiny):
    """Tokens generated after a prompt with images sit at index + rope_delta on all three rows (what the
    generator's 1D decode positions use): the positions of the prompt + continuation agree."""
    _, hf, cfg, params = tiny
    rng = np.random.default_rng(8)
    grids = [(1, 8, 12), (1, 4, 4)]
    prompt = _prompt(rng, grids)
    cont = list(rng.integers(3, 240, 4))
    _, delta = qwen2_5_vl.rope_index(cfg, np.asarray([prompt]), grids)
    pos, delta2 = qwen2_5_vl.rope_index(cfg, np.asarray([prompt + cont]), grids)
    T = len(prompt)
    np.testing.assert_array_equal(pos[:, 0, T:], np.broadcast_to(np.arange(T, T + 4) + delta[0], (3, 4)))
    assert delta2[0] == delta[0] < 0
    # and the logits of the continuation with 1D positions index + delta equal the M-RoPE forward's
    ids = np.asarray([prompt + cont])
    pixels = _pixels(rng, grids)
    prep = qwen2_5_vl.prepare_inputs(cfg, ids, grids)
    full = np.asarray(qwen2_5_vl.apply(params, cfg, ids, pixels, grids))
    mixed = np.where(np.arange(ids.shape[1]) < T, prep["positions"], np.arange(ids.shape[1]) + delta[0])
    one_d = np.asarray(jax.jit(qwen2_5_vl.logits, static_argnums=1)(params, cfg, jnp.asarray(ids), jnp.asarray(mixed),
                                                                         jnp.ones(ids.shape, jnp.int32), jnp.asarray(pixels),
                                                                         prep["layout"]))
    np.testing.assert_allclose(one_d, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("grids", [[(1, 8, 12)], [(1, 6, 10), (2, 4, 4), (1, 2, 14)], [(1, 16, 4)]])
def test_vision_layout_and_features_match_hf(tiny, grids):
    _, hf, cfg, params = tiny
    from transformers.vision_utils import get_vision_window_index

    v = cfg.vision
    lay = vision.vision_layout(v, grids)
    win_index, cu_win = get_vision_window_index(torch.tensor(grids), v.spatial_merge_size, v.window_size, v.patch_size)
    np.testing.assert_array_equal(lay.order[:: v.merge_unit] // v.merge_unit, win_index.numpy())
    bounds = np.flatnonzero(np.diff(lay.window_ids)) + 1
    np.testing.assert_array_equal(np.concatenate([[0], bounds, [len(lay.window_ids)]]), cu_win.numpy())
    assert len(np.unique(lay.window_ids)) > len(grids)  # window attention actually windows
    pixels = _pixels(np.random.default_rng(1), grids)
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.tensor(pixels), torch.tensor(grids)).pooler_output
    ref = torch.cat(ref).numpy()
    features = jax.jit(qwen2_5_vl.image_features, static_argnums=1)
    ours = np.asarray(features(params, cfg, jnp.asarray(pixels), lay.arrays()))
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOL
    # the windows matter: every block attending to whole frames gives other features
    full = dict(lay.arrays(), window_ids=lay.frame_ids)
    other = np.asarray(features(params, cfg, jnp.asarray(pixels), full))
    assert np.abs(other - ref).max() > 1e-2


def test_logits_text_only(tiny):
    _, hf, cfg, params = tiny
    ids = np.random.default_rng(2).integers(3, 240, (2, 11))
    _check_logits(hf, cfg, params, ids)


def test_logits_one_image(tiny):
    _, hf, cfg, params = tiny
    rng = np.random.default_rng(3)
    grids = [(1, 4, 4)]
    _check_logits(hf, cfg, params, [_prompt(rng, grids)], grids, rng=rng)


@pytest.mark.parametrize("grid", [(1, 8, 12), (1, 6, 10), (1, 2, 16), (1, 14, 4)])
def test_logits_image_sizes(tiny, grid):
    """Wide, tall, square-ish, windows cut short (6 x 10 patches = 3 x 5 merge units in windows of 2 x 2)."""
    _, hf, cfg, params = tiny
    rng = np.random.default_rng(4)
    _check_logits(hf, cfg, params, [_prompt(rng, [grid])], [grid], rng=rng)


def test_logits_several_images_per_prompt(tiny):
    _, hf, cfg, params = tiny
    rng = np.random.default_rng(5)
    grids = [(1, 4, 6), (1, 8, 8), (1, 2, 2)]
    _check_logits(hf, cfg, params, [_prompt(rng, grids, text=(3, 2))], grids, rng=rng)


def test_logits_padded_batch_with_images(tiny):
    """Two rows with their own images (one with two), the shorter right-padded; text-only third row."""
    _, hf, cfg, params = tiny
    rng = np.random.default_rng(6)
    rows_grids = [[(1, 6, 4)], [(1, 4, 4), (1, 4, 8)], []]
    rows = [_prompt(rng, g) for g in rows_grids]
    T = max(len(r) for r in rows)
    ids = np.zeros((len(rows), T), np.int64)
    mask = np.zeros((len(rows), T), np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)], mask[b, :len(r)] = r, 1
    _check_logits(hf, cfg, params, ids, [g for gs in rows_grids for g in gs], mask, rng=rng)


def test_export_loads_in_transformers(tiny, tmp_path):
    d, hf, cfg, params = tiny
    out = str(tmp_path / "export")
    save_hf(params, cfg, out)
    m, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32,
                                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert sorted(SafetensorsReader.from_dir(out).keys()) == sorted(SafetensorsReader.from_dir(d).keys())
    rng = np.random.default_rng(7)
    grids = [(1, 8, 12), (1, 4, 4)]
    ids = np.asarray([_prompt(rng, grids)])
    pixels = _pixels(rng, grids)
    ref = _hf_logits(m.eval(), ids, pixels, grids)
    ours = np.asarray(qwen2_5_vl.apply(params, cfg, ids, pixels, grids))
    assert np.abs(ours - ref).max() <= TOL
    cfg2, params2 = load_hf(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert os.path.exists(os.path.join(out, "generation_config.json"))


def test_params_tables_and_shardings(tiny):
    _, _, cfg, params = tiny
    from jax.sharding import Mesh

    from jaxrl_async.models.shardings import model_shardings

    axes, shapes = qwen2_5_vl.logical_axes(cfg), qwen2_5_vl.param_shapes(cfg)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    for ax, sd, p in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(shapes), jax.tree.leaves(params)):
        assert len(ax) == len(sd.shape) and tuple(p.shape) == tuple(sd.shape)
    assert jax.tree.structure(shapes) == jax.tree.structure(params)
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    for rules in ("trainer", "generator"):
        sh = model_shardings(cfg, mesh, rules)
        assert jax.tree.structure(sh) == jax.tree.structure(params)
    fresh = jax.eval_shape(lambda k: qwen2_5_vl.init_params(cfg, k), jax.random.PRNGKey(0))
    assert jax.tree.structure(fresh) == jax.tree.structure(params)
    assert [a.shape for a in jax.tree.leaves(fresh)] == [a.shape for a in jax.tree.leaves(params)]
