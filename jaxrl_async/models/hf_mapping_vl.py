"""Hugging Face <-> jaxrl_async names of Qwen2.5-VL (`models/qwen2_5_vl.py`), in the style of `hf_mapping.py`.

The checkpoint layout ``Qwen2_5_VLForConditionalGeneration.save_pretrained`` writes (transformers 5 maps its
modules ``model.language_model.*`` / ``model.visual.*`` back to the original names): the language model under
``model.*`` and ``lm_head.weight`` exactly as a Qwen2 checkpoint (the rows of `hf_mapping.mapping` for the text
config), the vision tower under ``visual.*``. Vision rows, with Dv vision hidden, Hv heads, Ev head dim, Fv MLP
width, Pin = C*Tp*P*P, U = m*m*Dv, D the language model's hidden size (``{i}``: block i = slice i of
``vision/blocks/*``):

| ours                              | HF                                        | transform (HF -> ours)             |
|-----------------------------------|-------------------------------------------|------------------------------------|
| vision/patch_embed [Pin, Dv]      | visual.patch_embed.proj.weight            | Conv3d [Dv, C, Tp, P, P] -> flat, T|
| vision/blocks/norm1, norm2 [Dv]   | visual.blocks.{i}.norm{1,2}.weight        | identity                           |
| vision/blocks/qkv [Dv, 3, Hv, Ev] | visual.blocks.{i}.attn.qkv.weight         | [3*Dv, Dv] -> T -> reshape         |
| vision/blocks/qkv_bias [3, Hv, Ev]| visual.blocks.{i}.attn.qkv.bias           | reshape                            |
| vision/blocks/o [Hv, Ev, Dv]      | visual.blocks.{i}.attn.proj.weight        | [Dv, Hv*Ev] -> T -> reshape        |
| vision/blocks/o_bias [Dv]         | visual.blocks.{i}.attn.proj.bias          | identity                           |
| vision/blocks/gate, up [Dv, Fv]   | visual.blocks.{i}.mlp.{gate,up}_proj.weight | T                                |
| vision/blocks/down [Fv, Dv]       | visual.blocks.{i}.mlp.down_proj.weight    | T                                  |
| vision/blocks/*_bias              | visual.blocks.{i}.mlp.*_proj.bias         | identity                           |
| vision/merger/norm [Dv]           | visual.merger.ln_q.weight                 | identity                           |
| vision/merger/fc1 [U, U]          | visual.merger.mlp.0.weight                | T                                  |
| vision/merger/fc2 [U, D]          | visual.merger.mlp.2.weight                | T                                  |
| vision/merger/fc{1,2}_bias        | visual.merger.mlp.{0,2}.bias              | identity                           |
"""

from __future__ import annotations

from typing import Any

from jaxrl_async.models import hf_mapping
from jaxrl_async.models.hf_mapping import Row


def _ident(x, cfg):
    return x


def _t(x, cfg):
    return x.T


def _patch_in(x, cfg):
    return x.reshape(x.shape[0], -1).T


def _patch_hf(x, cfg):
    v = cfg.vision
    return x.T.reshape(v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)


def _qkv_in(x, cfg):
    v = cfg.vision
    return x.T.reshape(v.hidden_size, 3, v.num_heads, v.head_dim)


def _qkv_hf(x, cfg):
    return x.reshape(x.shape[0], -1).T


def _qkv_bias_in(x, cfg):
    return x.reshape(3, cfg.vision.num_heads, cfg.vision.head_dim)


def _flat(x, cfg):
    return x.reshape(-1)


def _o_in(x, cfg):
    v = cfg.vision
    return x.T.reshape(v.num_heads, v.head_dim, v.hidden_size)


def _o_hf(x, cfg):
    return x.reshape(-1, x.shape[-1]).T


def _on_text(row: Row) -> Row:
    """A text row of `hf_mapping` whose transforms read the text config of a VLConfig."""
    return Row(row.ours, row.hf, lambda x, cfg, f=row.to_ours: f(x, cfg.text),
               lambda x, cfg, f=row.to_hf: f(x, cfg.text))


def vision_rows() -> list[Row]:
    B, V = "visual.blocks.{i}.", ("vision", "blocks")
    rows = [
        Row(("vision", "patch_embed"), "visual.patch_embed.proj.weight", _patch_in, _patch_hf),
        Row((*V, "norm1"), B + "norm1.weight", _ident, _ident),
        Row((*V, "norm2"), B + "norm2.weight", _ident, _ident),
        Row((*V, "qkv"), B + "attn.qkv.weight", _qkv_in, _qkv_hf),
        Row((*V, "qkv_bias"), B + "attn.qkv.bias", _qkv_bias_in, _flat),
        Row((*V, "o"), B + "attn.proj.weight", _o_in, _o_hf),
        Row((*V, "o_bias"), B + "attn.proj.bias", _ident, _ident),
    ]
    for name in ("gate", "up", "down"):
        rows += [Row((*V, name), B + f"mlp.{name}_proj.weight", _t, _t),
                 Row((*V, f"{name}_bias"), B + f"mlp.{name}_proj.bias", _ident, _ident)]
    M = ("vision", "merger")
    rows += [
        Row((*M, "norm"), "visual.merger.ln_q.weight", _ident, _ident),
        Row((*M, "fc1"), "visual.merger.mlp.0.weight", _t, _t),
        Row((*M, "fc1_bias"), "visual.merger.mlp.0.bias", _ident, _ident),
        Row((*M, "fc2"), "visual.merger.mlp.2.weight", _t, _t),
        Row((*M, "fc2_bias"), "visual.merger.mlp.2.bias", _ident, _ident),
    ]
    return rows


def mapping(cfg: Any) -> list[Row]:
    """Every row of a Qwen2.5-VL checkpoint (``cfg``: `qwen2_5_vl.VLConfig`)."""
    return [_on_text(r) for r in hf_mapping.mapping(cfg.text)] + vision_rows()


def layer_stacks(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Stacked groups by the first element of a row's path -> the HF layer (block) index of each slice."""
    return {**cfg.text.layer_stacks(), "vision": tuple(range(cfg.vision.depth))}
