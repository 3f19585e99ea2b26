"""Vision-language prefill of `PagedEngine` (Qwen2.5-VL, `models/qwen2_5_vl.py`).

A prefill row of a VL engine (prompts packed into [1, bucket] as for text, or one long sequence in chunks) runs:

1. the vision tower once over the images of the row's requests (`tower_fn`: every image once, whatever the number
   of samples; the patch count padded to a power of two >= `MIN_PATCH_BUCKET`, the padding patches a segment of
   their own, so the real features are those of the unpadded tower), giving the features [bucket, D] of the row's
   image placeholders in order;
2. the decoder over the token embeddings with those features written at the placeholders (``feat_index`` [1, T]:
   the feature row of each token, -1 for text) and M-RoPE positions [3, 1, T], each prompt its own
   (`sequence_positions`), through the text engine's `prefill_fn` / `prefill_chunk_fn` (the same KV and logits
   bookkeeping, only positions and input embeddings given).

A sequence's positions: transformers' ``get_rope_index`` over the prompt (`qwen2_5_vl.sequence_rope_index`); the
tokens after the prompt's last image placeholder count up from it, i.e. sit at index + rope_delta, which is what
decoding uses (``rope_delta`` per slot, `engine_steps.decode_step_fn`). A re-prefill (a preempted continuation,
recompute_kv after a weight update) of prompt + generated tokens therefore rebuilds the same positions; a generated
token that happens to be the image placeholder id is text there, as in transformers' decoding (the features go to
the first ``images.num_tokens`` placeholders only). Text prompts on a VL engine: no features, positions 0.. on the
three rows, delta 0.

Compilations: the tower once per (patch bucket, row bucket) pair used; the VL prefill once per row bucket and the
chunked one once per chunked buffer length, as the text programs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.generator.engine_steps import prefill_chunk_fn, prefill_fn
from jaxrl_async.models import qwen2_5_vl, vision
from jaxrl_async.models.qwen2_5_vl import VLConfig

MIN_PATCH_BUCKET = 64  # smallest padded patch count of one tower call (powers of two above)


@dataclasses.dataclass
class VLSequence:
    """Host-side inputs of one sequence: M-RoPE positions [3, n], its rope delta, the feature row of each token
    within the sequence's own features (-1: text) and its images (None: a text sequence)."""

    positions: np.ndarray
    delta: int
    feat_index: np.ndarray
    images: Any = None

    @property
    def num_features(self) -> int:
        return 0 if self.images is None else int(self.images.num_tokens)


def sequence_positions(cfg: VLConfig, tokens: np.ndarray, images: Any = None) -> VLSequence:
    """`VLSequence` of ``tokens`` (a prompt, or a prompt + generated tokens) with the prompt's ``images``
    (`data.images.ImageInputs` or None). ValueError when the tokens hold fewer image placeholders than the images
    need or a run of placeholders does not match the grids."""
    pos, delta, feat = qwen2_5_vl.sequence_layout(cfg, tokens, None if images is None else images.grid_thw)
    return VLSequence(pos, delta, feat, images if (feat >= 0).any() else None)


def vl_sequences(cfg: VLConfig | None, reqs: list) -> list[VLSequence] | None:
    """The `VLSequence` of each (tokens, `PrefillRequest`) of a prefill batch; None for a text engine (``cfg``
    None), which refuses requests with images."""
    if cfg is None:
        if any(r.images is not None for _, r in reqs):
            raise ValueError("prefill: a request with images needs a vision-language model (this engine's is "
                             "text-only)")
        return None
    return [sequence_positions(cfg, t, r.images) for t, r in reqs]


def check_placeholders(cfg: VLConfig, prompt, images: Any) -> None:
    """A prompt's image placeholders must be exactly its images' tokens (ValueError otherwise)."""
    n_tok = int((np.asarray(prompt) == cfg.image_token_id).sum())
    n_img = 0 if images is None else int(images.num_tokens)
    if n_tok != n_img:
        raise ValueError(f"{n_tok} image placeholder tokens ({cfg.image_token_id}) in the prompt but its images "
                         f"make {n_img} (grids {None if images is None else images.grid_thw.tolist()})")
    if images is not None:
        sequence_positions(cfg, prompt, images)  # the runs of placeholders match the grids


def patch_bucket(n: int) -> int:
    return max(MIN_PATCH_BUCKET, 1 << max(n - 1, 0).bit_length())


def padded_layout(cfg: VLConfig, grids: list, nb: int) -> dict[str, np.ndarray]:
    """`vision.vision_layout` of ``grids`` padded to ``nb`` patches: the padding patches keep their place in both
    orders and form a segment of their own (frame and window id -1), so no real patch attends to them."""
    lay = vision.vision_layout(cfg.vision, grids).arrays()
    n, mu = len(lay["order"]), cfg.vision.merge_unit
    extra = nb - n
    return {"order": np.concatenate([lay["order"], np.arange(n, nb, dtype=np.int32)]),
            "unorder": np.concatenate([lay["unorder"], np.arange(n // mu, nb // mu, dtype=np.int32)]),
            "hw": np.concatenate([lay["hw"], np.zeros((extra, 2), np.int32)]),
            "frame_ids": np.concatenate([lay["frame_ids"], np.full(extra, -1, np.int32)]),
            "window_ids": np.concatenate([lay["window_ids"], np.full(extra, -1, np.int32)])}


# ---------------------------------------------------------------------------------------
# Device functions
# ---------------------------------------------------------------------------------------
def tower_fn(params, pixel_values, layout, *, cfg: VLConfig, rows: int):
    """Features [rows, D] of the padded patches (the real ones first, in order; zeros past the padded count)."""
    feats = qwen2_5_vl.image_features(params, cfg, pixel_values, layout)
    if feats.shape[0] >= rows:
        return feats[:rows]
    return jnp.concatenate([feats, jnp.zeros((rows - feats.shape[0], feats.shape[1]), feats.dtype)])


def _embeds(params, cfg: VLConfig, tokens, features, feat_index):
    dt = jnp.dtype(cfg.text.dtype)
    x = jnp.take(params["embed"], tokens, axis=0).astype(dt)
    f = jnp.take(features, jnp.maximum(feat_index, 0), axis=0).astype(dt)
    return jnp.where((feat_index >= 0)[..., None], f, x)


def vl_prefill_fn(params, tokens, length, positions, features, feat_index, *, cfg: VLConfig):
    """`engine_steps.prefill_fn` of a packed row with M-RoPE ``positions`` [3, 1, T] and ``features`` [T, D] at
    the tokens of ``feat_index`` [1, T] >= 0."""
    return prefill_fn(params, tokens, length, cfg=cfg.text, positions=positions,
                      embeds=_embeds(params, cfg, tokens, features, feat_index))


def vl_prefill_chunk_fn(params, k_buf, v_buf, tokens, start, length, positions, features, feat_index, *,
                        cfg: VLConfig):
    """`engine_steps.prefill_chunk_fn` of one chunk [1, C] (positions [3, 1, C], feat_index [1, C] into the
    sequence's ``features``)."""
    return prefill_chunk_fn(params, k_buf, v_buf, tokens, start, length, cfg=cfg.text, positions=positions,
                            embeds=_embeds(params, cfg, tokens, features, feat_index))


# ---------------------------------------------------------------------------------------
# The engine's VL prefill programs
# ---------------------------------------------------------------------------------------
class VisionPrefill:
    """The jitted VL prefill programs of one engine (``traced``: the engine's activation-rule wrapper;
    ``kv_sharding``: its prompt-KV sharding)."""

    def __init__(self, cfg: VLConfig, traced: Callable, kv_sharding: Any, replicated: Any):
        self.cfg = cfg
        self._kv_sh, self._rep = kv_sharding, replicated
        self._towers: dict[tuple[int, int], Any] = {}  # (patch bucket, rows) -> jitted tower
        self._prefill = jax.jit(traced(functools.partial(vl_prefill_fn, cfg=cfg)),
                                out_shardings=(kv_sharding, kv_sharding, replicated))
        self._chunk = jax.jit(traced(functools.partial(vl_prefill_chunk_fn, cfg=cfg)), donate_argnums=(1, 2),
                              out_shardings=(kv_sharding, kv_sharding, replicated))
        self._zeros: dict[int, jax.Array] = {}
        self.tower_calls = 0

    def compile_counts(self) -> dict[str, int]:
        return {"vision_tower": sum(f._cache_size() for f in self._towers.values()),
                "prefill_vl": self._prefill._cache_size(), "prefill_chunk_vl": self._chunk._cache_size()}

    def prefill_job(self, params_a, tokens_a, lengths_a, bucket: int) -> tuple:
        """(program, abstract arguments) of the packed-row prefill of ``bucket`` tokens (`PagedEngine.warmup`'s
        ahead-of-time compiles; the features arrive on the replicated sharding, the host arrays uncommitted)."""
        sds = jax.ShapeDtypeStruct
        feats = sds((bucket, self.cfg.text.hidden_size), jnp.dtype(self.cfg.text.dtype), sharding=self._rep)
        return self._prefill, (params_a, tokens_a, lengths_a, sds((3, 1, bucket), np.int32), feats,
                               sds((1, bucket), np.int32))

    def features(self, params, seqs: list[VLSequence], rows: int) -> tuple[jax.Array, np.ndarray]:
        """(features [rows, D] of the images of ``seqs``, in order; each sequence's first feature row)."""
        offs = np.cumsum([0] + [s.num_features for s in seqs])[:-1]
        with_images = [s for s in seqs if s.images is not None]
        if not with_images:
            z = self._zeros.get(rows)
            if z is None:
                z = self._zeros[rows] = jax.device_put(  # placed as the tower's output (one prefill program)
                    jnp.zeros((rows, self.cfg.text.hidden_size), jnp.dtype(self.cfg.text.dtype)), self._rep)
            return z, offs
        grids = [tuple(int(x) for x in g) for s in with_images for g in np.asarray(s.images.grid_thw).reshape(-1, 3)]
        pixels = np.concatenate([s.images.pixel_values() for s in with_images])
        nb = patch_bucket(len(pixels))
        pv = np.zeros((nb, pixels.shape[1]), np.float32)
        pv[:len(pixels)] = pixels
        fn = self._towers.get((nb, rows))
        if fn is None:
            fn = self._towers[(nb, rows)] = jax.jit(functools.partial(tower_fn, cfg=self.cfg, rows=rows),
                                                    out_shardings=self._rep)
        self.tower_calls += 1
        return fn(params, pv, padded_layout(self.cfg, grids, nb)), offs

    @staticmethod
    def _row_arrays(seqs: list[VLSequence], offs: np.ndarray, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.zeros((3, 1, bucket), np.int32)
        feat = np.full((1, bucket), -1, np.int32)
        at = 0
        for s, o in zip(seqs, offs):
            n = s.positions.shape[1]
            pos[:, 0, at:at + n] = s.positions
            feat[0, at:at + n] = np.where(s.feat_index >= 0, s.feat_index + o, -1)
            at += n
        return pos, feat

    def prefill_row(self, params, padded: np.ndarray, lengths: np.ndarray, seqs: list[VLSequence]):
        """The packed row ``padded`` [1, bucket] of the sequences ``seqs``: (k, v, logits [N, V])."""
        bucket = padded.shape[1]
        feats, offs = self.features(params, seqs, bucket)
        pos, feat = self._row_arrays(seqs, offs, bucket)
        return self._prefill(params, padded, lengths, pos, feats, feat)

    def prefill_chunked(self, params, padded: np.ndarray, total: int, seq: VLSequence, chunk: int, kv_zeros):
        """A sequence past the largest bucket, in chunks of ``chunk`` tokens: (k, v, logits [V])."""
        bucket = padded.shape[1]
        feats, offs = self.features(params, [seq], bucket)
        pos, feat = self._row_arrays([seq], offs, bucket)
        k, v = kv_zeros(bucket)
        for start in range(0, bucket, chunk):
            sl = slice(start, start + chunk)
            k, v, logits = self._chunk(params, k, v, padded[:, sl], np.int32(start), np.int32(total), pos[:, :, sl],
                                       feats, feat[:, sl])
        return k, v, logits
