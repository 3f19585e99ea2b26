"""Packed minibatches with images (Qwen2.5-VL): their vision inputs and the trainer's log-probs.

A trajectory carries its prompt's images as a `data.images.ImageInputs` (the encoded files + grids + processor
settings; the n samples of a prompt share one object). When a sequence of a minibatch has images, `pack` adds to
the `PackedBatch` (`packing.pack_images`):

* ``mrope_positions`` [n_micro, rows, row_len, 3]: every placed sequence's M-RoPE positions
  (`qwen2_5_vl.sequence_layout`, restarting at each sequence like the 1-D ones; text-only sequences count up
  on all three rows, padding 0);
* ``image_index`` [n_micro, rows, row_len]: the row of its micro-batch's image features that each image
  placeholder takes (-1 on every other token);
* ``vision`` (`VisionBatch`, leading axis n_micro): per micro-batch the pixel patches of its *distinct* image
  sets (the samples of one prompt placed in the same micro-batch share one copy and one vision-tower pass; sets
  are identified by content, `ImageInputs.digest`) concatenated in order of first use, each patch with one of
  its ``temporal_patch_size`` copies only (an image repeats its frame; the device broadcasts it back: half the
  bytes; checked, so a video's differing frames are an error), zero-padded to the bucketed count
  `PackingConfig.patches_for(max over micro-batches)`, and their `vision.vision_layout` arrays
  padded consistently: padding patches sit after the real ones in the window order (``order`` / ``unorder``
  identity on the tail) with frame and window id -1, so they attend only among themselves and never reach a
  real feature or placeholder.

A sequence is never split across rows (first-fit-decreasing places whole sequences), so an image's placeholders
stay together in one row and one micro-batch; `packing.pack_images` asserts it. Pixels are decoded once per
`ImageInputs` object (its cache) and copied once into the minibatch's host array, which `Trainer.put_batch`
sends to the device once per minibatch (the proximal recompute and the update use the same device batch).

Device side (`vl_sequence_logprobs`): the vision tower over the micro-batch's patches, the features gathered into
the placeholders' embeddings (`image_index`), the decoder with the M-RoPE positions. The trainer runs it for
micro-batches of minibatches with images; text-only minibatches keep the text path (`transformer.sequence_logprobs`
with 1-D positions), whose programs are unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["VisionBatch", "vl_sequence_logprobs"]

@dataclasses.dataclass
class VisionBatch:
    """Per micro-batch vision inputs (leading axis n_micro; P = the bucketed patch count)."""

    pixel_values: np.ndarray  # float32 [n_micro, P, C*Ps*Ps]: one of the Tp equal temporal copies of each patch
    order: np.ndarray  # int32 [n_micro, P]: window order (vision.VisionLayout), padding = identity tail
    unorder: np.ndarray  # int32 [n_micro, P / m^2]
    hw: np.ndarray  # int32 [n_micro, P, 2]: 2D rotary coordinates (padding 0)
    frame_ids: np.ndarray  # int32 [n_micro, P] (padding -1)
    window_ids: np.ndarray  # int32 [n_micro, P] (padding -1)

    def layout(self) -> dict[str, Any]:
        """The `vision.vision_tower` layout of one micro-batch (call on a sliced VisionBatch)."""
        return {"order": self.order, "unorder": self.unorder, "hw": self.hw, "frame_ids": self.frame_ids,
                "window_ids": self.window_ids}

    def arrays(self) -> dict[str, Any]:
        """The fields by name (no copy)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays().values())


def _register():
    import jax

    jax.tree_util.register_dataclass(VisionBatch, data_fields=[f.name for f in dataclasses.fields(VisionBatch)],
                                     meta_fields=[])


_register()


def vl_sequence_logprobs(params: Any, cfg: Any, mb: Any, temperature: float = 1.0, chunk: int = 2048,
                         freeze_vision: bool = False) -> tuple[Any, Any]:
    """(log-probs, entropies) [rows, row_len] of one micro-batch of a minibatch with images (a `PackedBatch`
    sliced on its micro-batch axis), aligned with the tokens as `transformer.sequence_logprobs`: the vision tower
    over its patches (features under stop_gradient when `freeze_vision`), the features gathered into the image
    placeholders' embeddings, the decoder with the M-RoPE positions."""
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models import transformer
    from jaxrl_async.models.qwen2_5_vl import image_features

    v = cfg.vision
    px = mb.vision.pixel_values  # [P, C*Ps*Ps]: the processor's [P, C*Tp*Ps*Ps] without its repeated frames
    n = px.shape[0]
    px = jnp.broadcast_to(px.reshape(n, v.in_channels, 1, v.patch_size ** 2),
                          (n, v.in_channels, v.temporal_patch_size, v.patch_size ** 2)).reshape(n, v.patch_dim)
    idx = mb.image_index

    # the tower runs on every micro-batch of a minibatch with images, a text-only one too (its patches are all
    # padding): a `lax.cond` skipping it cost ~15 GiB of train-step temporaries per device in the Qwen2.5-VL-7B
    # H100 plan (the differentiated cond keeps the tower's residuals as its outputs), far more than the pass
    feats = image_features(params, cfg, px, mb.vision.layout())
    if freeze_vision:
        feats = jax.lax.stop_gradient(feats)
    dt = jnp.dtype(cfg.text.dtype)
    x = jnp.take(params["embed"], mb.tokens, axis=0).astype(dt)
    x = jnp.where((idx >= 0)[..., None], feats.astype(dt)[jnp.maximum(idx, 0)], x)
    positions = jnp.moveaxis(mb.mrope_positions, -1, 0)  # [3, rows, row_len]
    return transformer.sequence_logprobs(params, cfg.text, mb.tokens, mb.segment_ids, positions, temperature, chunk,
                                         embeds=x)
