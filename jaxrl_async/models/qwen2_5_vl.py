"""Qwen2.5-VL (transformers' ``Qwen2_5_VLForConditionalGeneration``) as pure functions.

The model is the vision tower (`models/vision.py`) in front of the existing decoder (`models/transformer.py`):
Qwen2.5-VL's language model is the Qwen2 architecture (q/k/v biases, no q/k norm) with multimodal rotary
positions (M-RoPE, ``ModelConfig.mrope_section``). A forward:

1. the image features [M, D] of all images of the batch (`image_features`: the vision tower over the flattened
   patches ``pixel_values`` [N, C*Tp*P*P] with the grids ``image_grid_thw`` [n, 3], M = N / m^2);
2. the token embeddings with the features scattered, in order, into the positions of ``image_token_id`` (the
   processor expands one image into t*h*w/m^2 such placeholders; `embed_inputs`);
3. the decoder with positions [3, B, T] (temporal, height, width: `rope_index`, transformers' ``get_rope_index``):
   text tokens count up on all three rows; the tokens of an image take (start + frame, start + row, start + col)
   of the merged grid, and the text after it resumes at start + max(h, w) / m. Generation continues after the
   prompt at position index + ``rope_delta`` (the same on the three rows, i.e. ordinary 1D RoPE).

Parameters: the decoder's tree (``embed``, ``layers``, ``final_norm``, ``lm_head``: the text model's functions take
it as is) plus ``vision`` (`vision.param_table`). `param_table` / `logical_axes` / `param_shapes` / `init_params`
mirror `transformer.py`'s; the HF names are in `hf_mapping_vl.py`, import and export in `hf_io.py`.

Host-side (numpy) preparation, `prepare_inputs`: the M-RoPE positions (they depend on the token ids and grid
sizes, as in transformers) and the vision layout (window order, attention segments). The device functions
(`forward`, `logits`) take their results as arrays, so a jitted step retraces only on new shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.kernels.attention import AttendFn
from jaxrl_async.models import transformer, vision
from jaxrl_async.models.config import ModelConfig, UnsupportedModelError
from jaxrl_async.models.vision import VisionConfig

Params = dict[str, Any]
MODEL_TYPE = "qwen2_5_vl"
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


@dataclasses.dataclass(frozen=True)
class VLConfig:
    """A Qwen2.5-VL checkpoint: the text decoder (a qwen2 `ModelConfig` with ``mrope_section``), the vision tower
    and the special token ids. Frozen and hashable (a static argument of jitted functions)."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    model_type: str = MODEL_TYPE

    def __post_init__(self):
        if not self.text.mrope_section:
            raise ValueError("VLConfig.text: a Qwen2.5-VL language model needs mrope_section (M-RoPE)")
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"VLConfig.vision.out_hidden_size {self.vision.out_hidden_size} != the language model's "
                             f"hidden_size {self.text.hidden_size}")

    # the text model's fields that HF import/export and the callers read
    tie_word_embeddings = property(lambda self: self.text.tie_word_embeddings)
    num_layers = property(lambda self: self.text.num_layers)
    vocab_size = property(lambda self: self.text.vocab_size)
    dtype = property(lambda self: self.text.dtype)
    param_dtype = property(lambda self: self.text.param_dtype)
    bos_token_id = property(lambda self: self.text.bos_token_id)
    eos_token_id = property(lambda self: self.text.eos_token_id)
    eos_token_ids = property(lambda self: self.text.eos_token_ids)
    pad_token_id = property(lambda self: self.text.pad_token_id)

    def __getattr__(self, name: str) -> Any:
        """Every other field of the text model's `ModelConfig` (``num_heads``, ``head_dim``, ``lora``, ``attention``,
        ...), read-only: the run's code that sizes, shards and schedules the decoder reads a VL config as it reads a
        text one (only the forward passes know about the vision tower)."""
        if name.startswith("__") or name == "text":
            raise AttributeError(name)
        return getattr(self.text, name)

    def replace(self, **kw) -> "VLConfig":
        """Fields of VLConfig, or of the text model (numerical policy: dtype, param_dtype, remat, ...)."""
        own = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(self)}}
        if kw:
            own["text"] = own.get("text", self.text).replace(**kw)
        return dataclasses.replace(self, **own)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | str | os.PathLike, **policy) -> "VLConfig":
        """From a Qwen2.5-VL config.json (dict, path or model directory): the transformers 5 layout
        (``text_config`` / ``vision_config``) or the older one (text fields at the top level)."""
        source = "config"
        if not isinstance(hf, Mapping):
            path = os.fspath(hf)
            path = os.path.join(path, "config.json") if os.path.isdir(path) else path
            source = path
            with open(path) as fh:
                hf = json.load(fh)
        hf = dict(hf)
        if hf.get("model_type") != MODEL_TYPE:
            raise UnsupportedModelError(f"{source}: model_type {hf.get('model_type')!r} is not {MODEL_TYPE!r}")
        text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k != "vision_config"})
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        section = rope.pop("mrope_section", None)
        if section is None:
            raise ValueError(f"{source}: text rope_parameters has no mrope_section")
        if rope.get("rope_type", rope.get("type")) in ("mrope", None):
            rope["rope_type"] = "default"
        rope.pop("type", None)
        rope.setdefault("rope_theta", text.get("rope_theta", 1_000_000.0))
        text.update(model_type="qwen2", rope_parameters=rope, rope_scaling=None,
                    tie_word_embeddings=hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        tcfg = ModelConfig.from_hf(text, **policy).replace(mrope_section=tuple(section))
        ids = {k: int(hf[k]) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                        "vision_end_token_id") if k in hf}
        return cls(text=tcfg, vision=VisionConfig.from_hf(hf.get("vision_config") or {}), **ids)

    def to_hf(self) -> dict[str, Any]:
        """The config.json of ``Qwen2_5_VLForConditionalGeneration`` (transformers 5 layout)."""
        text = self.text.to_hf()
        text.pop("architectures")
        text.update(model_type="qwen2_5_vl_text", use_sliding_window=False)
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(self.text.mrope_section)}
        return {
            "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text,
            "vision_config": self.vision.to_hf(), "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id, "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id, "tie_word_embeddings": self.text.tie_word_embeddings,
            "dtype": self.text.param_dtype,
        }


def is_vl(cfg: Any) -> bool:
    return isinstance(cfg, VLConfig)


# ---------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------
def param_table(cfg: VLConfig) -> Params:
    """The decoder's rows (`transformer.param_table`) and the vision tower's under ``vision``."""
    return {**transformer.param_table(cfg.text), "vision": vision.param_table(cfg.vision, cfg.text.hidden_size)}


def _spec_map(fn, cfg: VLConfig) -> Params:
    return jax.tree.map(fn, param_table(cfg), is_leaf=lambda x: isinstance(x, transformer.ParamSpec))


def logical_axes(cfg: VLConfig) -> Params:
    return _spec_map(lambda s: s.axes, cfg)


def param_shapes(cfg: VLConfig) -> Params:
    dt = jnp.dtype(cfg.text.param_dtype)
    return _spec_map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), cfg)


def init_params(cfg: VLConfig, key: jax.Array, std: float = 0.02) -> Params:
    return transformer.init_from_table(param_table(cfg), key, cfg.text.param_dtype, std)


# ---------------------------------------------------------------------------------------
# M-RoPE positions (host side, numpy)
# ---------------------------------------------------------------------------------------
def _grid_rows(grid_thw) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    return [tuple(int(x) for x in r) for r in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)]


def sequence_rope_index(cfg: VLConfig, tokens, grids) -> tuple[np.ndarray, int]:
    """M-RoPE positions [3, n] of one sequence (no padding) and its rope delta (max position + 1 - n); ``grids``:
    an iterator over the (t, h, w) of the sequence's images, consumed in order. As transformers'
    ``get_rope_index`` (images: temporal spacing 1), and images placed back to back are each given their grid."""
    tokens = np.asarray(tokens).reshape(-1)
    m = cfg.vision.spatial_merge_size
    parts, pos = [], 0
    for is_image, run in itertools.groupby(tokens == cfg.image_token_id):
        n = len(list(run))
        if not is_image:
            parts.append(np.broadcast_to(np.arange(pos, pos + n), (3, n)))
            pos += n
            continue
        while n > 0:  # one or more images in this run of placeholders
            try:
                t, h, w = next(grids)
            except StopIteration:
                raise ValueError("more image placeholder tokens than image_grid_thw rows provide") from None
            gh, gw = h // m, w // m
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            parts.append(np.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(h, w) // m
            n -= t * gh * gw
        if n < 0:
            raise ValueError("a run of image placeholder tokens ends inside an image (fewer than its t*h*w/m^2)")
    out = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
    delta = int(out.max()) + 1 - len(tokens) if len(tokens) else 0
    return out.astype(np.int32), delta


def sequence_layout(cfg: VLConfig, tokens, grid_thw=None) -> tuple[np.ndarray, int, np.ndarray]:
    """(M-RoPE positions [3, n], rope delta, feature row of each token [n] (-1: text)) of one sequence whose
    *prompt* holds the images of ``grid_thw`` (None / empty: a text sequence): `sequence_rope_index` up to the last
    placeholder of the images, then every later token at index + delta, and the image features written into the
    first ``sum(t*h*w) / merge**2`` placeholders only. So a prompt + its generated tokens gets the positions the
    generator decoded them at (index + delta), and a generated token that happens to be the image placeholder id
    is text, as in transformers' decoding. The one definition the generator (prefill, re-prefill) and the trainer
    (packing) share. ValueError when the tokens hold fewer placeholders than the images need, or a run of them
    does not match the grids."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    n = len(tokens)
    grids = _grid_rows(grid_thw)
    m = sum(t * h * w for t, h, w in grids) // cfg.vision.merge_unit
    if m == 0:
        return np.broadcast_to(np.arange(n, dtype=np.int32), (3, n)).copy(), 0, np.full(n, -1, np.int32)
    is_img = tokens == cfg.image_token_id
    cum = np.cumsum(is_img)
    if n == 0 or cum[-1] < m:
        raise ValueError(f"{int(cum[-1]) if n else 0} image placeholder tokens but the images' grids give {m} "
                         "image features")
    cut = int(np.argmax(cum >= m)) + 1  # just past the last image's last placeholder
    head, delta = sequence_rope_index(cfg, tokens[:cut], iter(grids))
    tail = np.broadcast_to(np.arange(cut, n, dtype=np.int32) + delta, (3, n - cut))
    feat = np.where(is_img & (cum <= m), cum - 1, -1).astype(np.int32)
    return np.concatenate([head, tail], axis=1).astype(np.int32), int(delta), feat


def rope_index(cfg: VLConfig, tokens, image_grid_thw=None, attention_mask=None) -> tuple[np.ndarray, np.ndarray]:
    """Positions [3, B, T] (int32) and rope deltas [B] of a batch (``tokens`` [B, T]; ``attention_mask`` [B, T],
    0 = padding, which gets position 0), as transformers' ``get_rope_index``: the images of ``image_grid_thw`` are
    consumed row by row, in order. Text-only rows count 0, 1, ... on all three rows (delta 0)."""
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    mask = np.ones((B, T), bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    grids = iter(_grid_rows(image_grid_thw))
    out = np.zeros((3, B, T), np.int32)
    deltas = np.zeros((B,), np.int64)
    for b in range(B):
        pos, deltas[b] = sequence_rope_index(cfg, tokens[b][mask[b]], grids)
        out[:, b, mask[b]] = pos
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw has more images than the tokens have placeholders")
    return out, deltas


def prepare_inputs(cfg: VLConfig, tokens, image_grid_thw=None, attention_mask=None) -> dict[str, Any]:
    """Host-side inputs of `forward` / `logits`: ``positions`` [3, B, T], ``rope_deltas`` [B] and, with images,
    ``layout`` (`vision.vision_layout` arrays). Checks that the placeholders match the grids."""
    positions, deltas = rope_index(cfg, tokens, image_grid_thw, attention_mask)
    out: dict[str, Any] = {"positions": positions, "rope_deltas": deltas, "layout": None}
    grids = _grid_rows(image_grid_thw)
    n_tokens = int((np.asarray(tokens) == cfg.image_token_id).sum())
    n_feats = sum(t * h * w for t, h, w in grids) // cfg.vision.merge_unit
    if n_tokens != n_feats:
        raise ValueError(f"{n_tokens} image placeholder tokens but image_grid_thw gives {n_feats} image features")
    if grids:
        out["layout"] = vision.vision_layout(cfg.vision, grids).arrays()
    return out


# ---------------------------------------------------------------------------------------
# Device functions
# ---------------------------------------------------------------------------------------
def image_features(params: Params, cfg: VLConfig, pixel_values: jax.Array, layout: Mapping[str, Any], *,
                   attention: str = "auto") -> jax.Array:
    """[M, D] features of the flattened patches of all images (image after image), in the compute dtype.
    ``attention``: the vision tower's implementation (`vision.VISION_ATTENTION_IMPLS`; ``xla`` = the dense
    reference); its blocks are rematerialised as the decoder's layers (``cfg.text.remat``)."""
    return vision.vision_tower(params["vision"], cfg.vision, pixel_values, layout, jnp.dtype(cfg.text.dtype),
                               attention=attention, remat=cfg.text.remat)


def embed_inputs(params: Params, cfg: VLConfig, tokens: jax.Array, features: jax.Array | None) -> jax.Array:
    """Token embeddings [B, T, D] with ``features`` [M, D] written, in order (row-major over the batch), into the
    positions of ``image_token_id`` (transformers' ``masked_scatter``)."""
    dt = jnp.dtype(cfg.text.dtype)
    x = jnp.take(params["embed"], tokens, axis=0).astype(dt)
    if features is None or features.shape[0] == 0:
        return x
    B, T, D = x.shape
    is_img = (tokens == cfg.image_token_id).reshape(-1)
    idx = jnp.clip(jnp.cumsum(is_img) - 1, 0, features.shape[0] - 1)
    flat = jnp.where(is_img[:, None], features.astype(dt)[idx], x.reshape(B * T, D))
    return flat.reshape(B, T, D)


def forward(params: Params, cfg: VLConfig, tokens: jax.Array, positions: jax.Array, attend: AttendFn,
            pixel_values: jax.Array | None = None, layout: Mapping[str, Any] | None = None,
            state: Any = None) -> tuple[jax.Array, Any]:
    """(hidden [B, T, D], state): the vision tower over ``pixel_values`` (with its ``layout``), the features
    scattered into the image placeholders, the decoder with M-RoPE ``positions`` [3, B, T] (or [B, T])."""
    feats = None if pixel_values is None else image_features(params, cfg, pixel_values, layout)
    embeds = embed_inputs(params, cfg, tokens, feats)
    return transformer.forward(params, cfg.text, tokens, positions, attend, state, embeds=embeds)


def logits(params: Params, cfg: VLConfig, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array,
           pixel_values: jax.Array | None = None, layout: Mapping[str, Any] | None = None) -> jax.Array:
    """float32 logits [B, T, V] of padded (``segment_ids`` 0) or single-sequence rows."""
    hidden, _ = forward(params, cfg, tokens, positions, transformer.model_attention(cfg.text, segment_ids),
                        pixel_values, layout)
    return transformer.logits_from_hidden(params, hidden)


def apply(params: Params, cfg: VLConfig, tokens, pixel_values=None, image_grid_thw=None,
          attention_mask=None) -> jax.Array:
    """Convenience: `prepare_inputs` on the host, then `logits` (jitted) -> [B, T, V] float32."""
    tokens = np.asarray(tokens)
    prep = prepare_inputs(cfg, tokens, image_grid_thw, attention_mask)
    seg = np.ones(tokens.shape, np.int32) if attention_mask is None else np.asarray(attention_mask, np.int32)
    pv = None if pixel_values is None else jnp.asarray(np.asarray(pixel_values))
    return _logits_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(prep["positions"]), jnp.asarray(seg), pv,
                       prep["layout"])


_logits_jit = jax.jit(logits, static_argnums=(1,))
