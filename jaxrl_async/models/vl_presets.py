"""Published Qwen2.5-VL architectures (``qwen2_5_vl.VLConfig``) and their parameter counts, for planning on paper
(no weights are downloaded; ``models.config.PRESETS`` holds the text-only ones).

``qwen2.5-vl-7b``: the config.json of ``Qwen/Qwen2.5-VL-7B-Instruct``: text (qwen2) hidden 3584, 28 layers, 28
query / 4 kv heads (head_dim 128), intermediate 18944, vocab 152064, rope_theta 1e6 with ``mrope_section``
[16, 24, 24], rms_norm_eps 1e-6, max_position_embeddings 128000, untied embeddings, q/k/v biases; vision depth 32,
hidden 1280, 16 heads, intermediate 3420, out_hidden 3584, full attention at blocks [7, 15, 23, 31], 112 px
windows of 14 px patches, 2 x 2 spatial merge, temporal patch 2; image / video / vision start / end tokens
151655 / 151656 / 151652 / 151653, bos 151643, eos 151645. 8,292,166,656 parameters (7,615,616,512 text +
676,550,144 vision), the ~8.29 B the model card gives.
"""

from __future__ import annotations

import math

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.qwen2_5_vl import VLConfig, param_table
from jaxrl_async.models.vision import VisionConfig, param_table as vision_table


def _text_7b() -> ModelConfig:
    return ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=128000, qkv_bias=True, qk_norm=False, bos_token_id=151643, eos_token_id=151645,
        dtype="bfloat16", param_dtype="float32", mrope_section=(16, 24, 24))


VL_PRESETS: dict[str, VLConfig] = {
    "qwen2.5-vl-7b": VLConfig(
        text=_text_7b(),
        vision=VisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                            out_hidden_size=3584, fullatt_block_indexes=(7, 15, 23, 31), tokens_per_second=2)),
}


def vl_preset(name: str, **policy) -> VLConfig:
    """A published VL architecture by name; ``policy``: numerical fields of the text model (dtype, remat, ...)."""
    try:
        cfg = VL_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown VL model preset {name!r}; known: {', '.join(VL_PRESETS)}") from None
    return cfg.replace(**policy) if policy else cfg


def _count(table) -> int:
    import jax

    from jaxrl_async.models.transformer import ParamSpec

    return sum(math.prod(s.shape) for s in jax.tree.leaves(table, is_leaf=lambda x: isinstance(x, ParamSpec)))


def vision_num_params(v: VisionConfig, out_dim: int | None = None) -> int:
    """Parameters of the vision tower (patch embedding, blocks, merger), from its parameter table."""
    return _count(vision_table(v, v.out_hidden_size if out_dim is None else out_dim))


def vl_num_params(cfg: VLConfig) -> int:
    """Parameters of a Qwen2.5-VL model: the text decoder + the vision tower (= the leaves of `param_table`)."""
    return _count(param_table(cfg))
