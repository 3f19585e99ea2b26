"""The Qwen2.5-VL vision tower as pure functions (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``).

Pipeline (N patches of all images together, in the processor's order: per image, frame-major, then the
spatial-merge blocks row-major, the m x m patches of a block contiguous):

1. patch embedding: the Conv3d over (temporal_patch_size, patch_size, patch_size) patches with stride = kernel is a
   matmul of the flattened patches ``pixel_values`` [N, C*Tp*P*P] (the processor's layout) with ``patch_embed``;
2. window reordering: the merge units (m*m consecutive patches) are permuted so that every window of
   ``window_size // m // patch_size`` merge units (per side) is contiguous (``window_index``, as HF's
   ``get_vision_window_index``); the rotary tables are permuted alike;
3. ``depth`` pre-norm blocks: RMSNorm -> multi-head attention (fused qkv with bias, 2D rotary embedding over the
   (h, w) patch coordinates, no causal mask) -> + ; RMSNorm -> SwiGLU MLP with biases -> + . The blocks at
   ``fullatt_block_indexes`` attend within a whole frame of an image, the others within a window: both are
   varlen non-causal attention over the packed patches with segment ids (HF's cu_seqlens), computed by the
   implementation ``attention`` names (`VISION_ATTENTION_IMPLS`): ``xla``, the reference, a dense [N, N]
   block-diagonal mask and [Hv, N, N] float32 scores per block; ``blockwise``, the pure-JAX flash kernel of
   ``kernels/flash.py`` without the causal bound (``causal=False``): key blocks outside a query block's windows
   / frames are skipped in forward and backward (custom VJP), blocks of one window (<= 64 patches for the
   released configs) in the windowed blocks and of 512 patches in the full-attention ones, so memory is
   O(N * block) and a windowed block costs O(N * 3 windows); ``auto`` = ``blockwise`` from
   `VISION_BLOCKWISE_MIN_PATCHES` patches, ``xla`` below (on every platform);
4. the patch merger: RMSNorm, the m*m patches of a merge unit concatenated -> Linear -> GELU -> Linear to the
   language model's hidden size; the merge units put back in the processor's order.

The host-side layout (``vision_layout``: window index, segment ids, rotary positions) depends on the grid sizes
only; the device function (``vision_tower``) is traced once per total patch count and layout.

Parameters (one table, `param_table`: shapes, logical axes for the sharding rules, initialisers), blocks stacked
on a leading ``layers`` axis as the text decoder's: Dv vision hidden, Hv heads, Ev = Dv / Hv, Fv MLP width,
Lv depth, Pin = C*Tp*P*P, U = m*m*Dv, D the language model's hidden size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.kernels.attention import blockwise_attention, grouped_attention
from jaxrl_async.models.remat import remat as remat_fn
from jaxrl_async.models.transformer import ParamSpec, apply_rope, rms_norm

Params = dict[str, Any]
VISION_EPS = 1e-6  # the vision tower's RMSNorm epsilon (fixed in transformers)
#: the vision tower's attention implementations (``vision_tower(attention=...)``; module docstring)
VISION_ATTENTION_IMPLS = ("auto", "xla", "blockwise")
#: ``auto`` switches from the dense reference to ``blockwise`` at this many patches per batch of images
VISION_BLOCKWISE_MIN_PATCHES = 1024
#: query/key block of the full-attention (whole-frame) blocks in ``blockwise``
FULL_ATTENTION_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a Qwen2.5-VL checkpoint (``vision_config`` of its config.json)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 2
    rope_theta: float = 10000.0

    def __post_init__(self):
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        for f in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                  "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"VisionConfig.{f}: must be a positive int, got {v!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"VisionConfig.num_heads: head dim {self.hidden_size}/{self.num_heads} must be a "
                             f"multiple of 4 (2D rotary embedding)")
        if self.window_size < self.spatial_merge_size * self.patch_size:
            raise ValueError(f"VisionConfig.window_size: {self.window_size} is under one merge unit "
                             f"({self.spatial_merge_size} x {self.patch_size} pixels)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (C * Tp * P * P)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def window_patches(self) -> int:
        """The most patches one attention window holds (64 for the released configs: 4 x 4 merge units of
        2 x 2 patches); windows cut short at an image's edge hold fewer."""
        return max(1, self.window_size // self.spatial_merge_size // self.patch_size) ** 2 * self.merge_unit

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "VisionConfig":
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            from jaxrl_async.models.config import UnsupportedModelError

            raise UnsupportedModelError(f"vision_config.hidden_act {act!r} is not supported (silu only)")
        rope = dict(hf.get("rope_parameters") or {})
        kw = {f.name: hf[f.name] for f in dataclasses.fields(cls) if f.name in hf and f.name != "rope_theta"}
        return cls(**kw, rope_theta=float(rope.get("rope_theta", 10000.0)))

    def to_hf(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope_theta"}
        out["fullatt_block_indexes"] = list(self.fullatt_block_indexes)
        out.update(model_type="qwen2_5_vl_vision", hidden_act="silu",
                   rope_parameters={"rope_theta": self.rope_theta, "rope_type": "axial"})
        return out


def param_table(v: VisionConfig, out_dim: int) -> dict[str, Any]:
    """The vision tower's rows (``out_dim``: the language model's hidden size). Logical axes are the text
    decoder's names, so the trainer and generator rule sets shard the tower as they shard the decoder (heads and
    MLP width over ``tensor``, ``embed`` over ``fsdp`` in training); the fused q/k/v index and the patch values
    are unnamed (replicated)."""
    L, D, H, E, F, U = v.depth, v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size, v.merge_unit * v.hidden_size
    return {
        "patch_embed": ParamSpec((v.patch_dim, D), (None, "embed"), "normal"),
        "blocks": {
            "norm1": ParamSpec((L, D), ("layers", "norm"), "ones"),
            "qkv": ParamSpec((L, D, 3, H, E), ("layers", "embed", None, "heads", "head_dim"), "normal"),
            "qkv_bias": ParamSpec((L, 3, H, E), ("layers", None, "heads", "head_dim"), "zeros"),
            "o": ParamSpec((L, H, E, D), ("layers", "heads", "head_dim", "embed"), "normal"),
            "o_bias": ParamSpec((L, D), ("layers", "norm"), "zeros"),
            "norm2": ParamSpec((L, D), ("layers", "norm"), "ones"),
            "gate": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
            "gate_bias": ParamSpec((L, F), ("layers", "mlp"), "zeros"),
            "up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
            "up_bias": ParamSpec((L, F), ("layers", "mlp"), "zeros"),
            "down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal"),
            "down_bias": ParamSpec((L, D), ("layers", "norm"), "zeros"),
        },
        "merger": {
            "norm": ParamSpec((D,), ("norm",), "ones"),
            "fc1": ParamSpec((U, U), ("embed", "mlp"), "normal"),
            "fc1_bias": ParamSpec((U,), ("mlp",), "zeros"),
            "fc2": ParamSpec((U, out_dim), ("mlp", "embed"), "normal"),
            "fc2_bias": ParamSpec((out_dim,), ("norm",), "zeros"),
        },
    }


# ---------------------------------------------------------------------------------------
# Host-side layout (numpy; depends on the grid sizes only)
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """Per-patch index arrays of one batch of images, in the window order (numpy; `vision_layout`)."""

    order: np.ndarray  # [N] int32: the patch (processor order) at each window-order position
    unorder: np.ndarray  # [N / m^2] int32: the merge unit (window order) of each output token (processor order)
    hw: np.ndarray  # [N, 2] int32: (h, w) patch coordinates, window order (2D rotary embedding)
    frame_ids: np.ndarray  # [N] int32: frame of an image each patch belongs to (full-attention blocks)
    window_ids: np.ndarray  # [N] int32: window each patch belongs to (windowed blocks)

    def arrays(self) -> dict[str, np.ndarray]:
        return dataclasses.asdict(self)


def _grid_list(grid_thw) -> list[tuple[int, int, int]]:
    g = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return [tuple(int(x) for x in row) for row in g]


def num_patches(grid_thw) -> int:
    return sum(t * h * w for t, h, w in _grid_list(grid_thw))


def vision_layout(v: VisionConfig, grid_thw) -> VisionLayout:
    """The window reordering, attention segments and rotary coordinates of images with grids ``grid_thw``
    [n, 3] (t, h, w in patches). Same windows as transformers' ``get_vision_window_index`` (a window is
    ``window_size // m // patch_size`` merge units per side, the last row/column of windows cut short), same
    (h, w) coordinates as ``get_vision_position_ids`` and one full-attention segment per frame (its cu_seqlens)."""
    m, mu = v.spatial_merge_size, v.merge_unit
    ws = v.window_size // m // v.patch_size
    order_units, hw, frames, windows = [], [], [], []
    unit0 = frame0 = window0 = 0
    for t, h, w in _grid_list(grid_thw):
        if h % m or w % m:
            raise ValueError(f"image grid {(t, h, w)}: h and w must be multiples of spatial_merge_size {m}")
        gh, gw = h // m, w // m
        # (h, w) of each patch in the processor's order: merge blocks row-major, m x m patches within a block
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        hh, ww = (a.reshape(gh, m, gw, m).transpose(0, 2, 1, 3).reshape(-1) for a in (hh, ww))
        coords = np.tile(np.stack([hh, ww], -1), (t, 1))  # [t*h*w, 2]
        # windows of ws x ws merge units, row-major over windows, row-major within a window
        nwh, nww = -(-gh // ws), -(-gw // ws)
        uh, uw = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        win = (uh // ws) * nww + (uw // ws)  # window of each merge unit (row-major units)
        key = win * (ws * ws) + (uh % ws) * ws + (uw % ws)
        per_frame = np.argsort(key.reshape(-1), kind="stable")  # units of a frame in window order
        counts = np.bincount(win.reshape(-1), minlength=nwh * nww)
        for f in range(t):
            units = unit0 + f * gh * gw + per_frame
            order_units.append(units)
            hw.append(coords.reshape(t * gh * gw, mu, 2)[units - unit0])
            frames.append(np.full(gh * gw * mu, frame0 + f))
            wid = np.repeat(np.arange(window0, window0 + len(counts)), counts)  # every window holds >= 1 unit
            windows.append(np.repeat(wid, mu))
            window0 += len(counts)
        unit0 += t * gh * gw
        frame0 += t
    if not order_units:
        raise ValueError("vision_layout: no images")
    units = np.concatenate(order_units).astype(np.int64)
    order = (units[:, None] * mu + np.arange(mu)).reshape(-1)
    return VisionLayout(order=order.astype(np.int32), unorder=np.argsort(units).astype(np.int32),
                        hw=np.concatenate(hw).reshape(-1, 2).astype(np.int32),
                        frame_ids=np.concatenate(frames).astype(np.int32),
                        window_ids=np.concatenate(windows).astype(np.int32))


# ---------------------------------------------------------------------------------------
# Device functions
# ---------------------------------------------------------------------------------------
def rope_cos_sin(v: VisionConfig, hw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """2D rotary tables [N, Ev] from (h, w) coordinates [N, 2]: Ev/4 frequencies theta^(-4i/Ev) turned by h, the
    same by w, the pair repeated twice (transformers' ``Qwen2_5_VLVisionRotaryEmbedding``), float32."""
    half = v.head_dim // 2
    inv = 1.0 / (np.float32(v.rope_theta) ** (np.arange(0, half, 2, dtype=np.int64).astype(np.float32) / half))
    freqs = hw.astype(jnp.float32)[..., None] * jnp.asarray(inv.astype(np.float32))  # [N, 2, Ev/4]
    freqs = freqs.reshape(hw.shape[0], -1)  # h frequencies then w frequencies
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def resolve_vision_attention(impl: str, num_patches: int) -> str:
    """The implementation ``impl`` (`VISION_ATTENTION_IMPLS`) stands for at ``num_patches`` patches."""
    if impl not in VISION_ATTENTION_IMPLS:
        raise ValueError(f"vision attention must be one of {VISION_ATTENTION_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return "blockwise" if num_patches >= VISION_BLOCKWISE_MIN_PATCHES else "xla"


def dense_attend(mask: jax.Array, v: VisionConfig):
    """The reference attention: ``mask`` [N, N] who may attend to whom -> ``attend(q, k, val)`` [N, Hv, Ev]."""
    return lambda q, k, val: grouped_attention(q[None], k[None], val[None], mask[None], v.head_dim ** -0.5)[0]


def segment_attend(segment_ids: jax.Array, block: int, v: VisionConfig):
    """Non-causal blockwise attention within the runs of ``segment_ids`` [N] (contiguous, any int values)."""
    seg = (segment_ids - segment_ids.min() + 1)[None].astype(jnp.int32)  # >= 1: 0 is the kernel's padding
    return lambda q, k, val: blockwise_attention(q[None], k[None], val[None], seg, v.head_dim ** -0.5, block, block,
                                                 causal=False)[0]


def vision_block(p: Params, x: jax.Array, cos, sin, mask, v: VisionConfig) -> jax.Array:
    """One vision block over the packed patches x [N, Dv] (window order); ``mask``: [N, N] who may attend to whom
    (the dense reference), or an ``attend(q, k, val)`` function (`dense_attend`, `segment_attend`)."""
    dt = x.dtype
    attend = mask if callable(mask) else dense_attend(mask, v)
    h = rms_norm(x, p["norm1"], VISION_EPS)
    qkv = jnp.einsum("nd,dshe->snhe", h, p["qkv"].astype(dt)) + p["qkv_bias"].astype(dt)[:, None]
    q, k, val = apply_rope(qkv[0], cos, sin), apply_rope(qkv[1], cos, sin), qkv[2]
    a = attend(q, k, val)
    x = x + jnp.einsum("nhe,hed->nd", a, p["o"].astype(dt)) + p["o_bias"].astype(dt)
    h = rms_norm(x, p["norm2"], VISION_EPS)
    g = h @ p["gate"].astype(dt) + p["gate_bias"].astype(dt)
    u = h @ p["up"].astype(dt) + p["up_bias"].astype(dt)
    return x + (jax.nn.silu(g) * u) @ p["down"].astype(dt) + p["down_bias"].astype(dt)


def vision_tower(params: Params, v: VisionConfig, pixel_values: jax.Array, layout: Mapping[str, Any],
                 dtype: Any = jnp.float32, *, attention: str = "auto", remat: str = "none") -> jax.Array:
    """Image features [N / m^2, D] (processor order, image after image) of the flattened patches
    ``pixel_values`` [N, C*Tp*P*P]; ``layout``: `vision_layout(...)`.arrays() (arrays, possibly traced).
    ``attention``: `VISION_ATTENTION_IMPLS` (module docstring; ``xla`` is the dense reference); ``remat``: a
    ``ModelConfig.remat`` policy name for the scanned blocks (training: keep one block's activations)."""
    order, hw = jnp.asarray(layout["order"]), jnp.asarray(layout["hw"])
    x = (pixel_values.astype(dtype) @ params["patch_embed"].astype(dtype))[order]
    cos, sin = rope_cos_sin(v, hw)
    frame_ids, window_ids = jnp.asarray(layout["frame_ids"]), jnp.asarray(layout["window_ids"])
    is_full = jnp.asarray(np.isin(np.arange(v.depth), v.fullatt_block_indexes))
    impl = resolve_vision_attention(attention, x.shape[0])
    if impl == "xla":
        same = lambda ids: ids[:, None] == ids[None, :]  # noqa: E731
        full_mask, window_mask = same(frame_ids), same(window_ids)

        def block(p, x, full):
            return vision_block(p, x, cos, sin, jnp.where(full, full_mask, window_mask), v)
    else:
        full_attend = segment_attend(frame_ids, FULL_ATTENTION_BLOCK, v)
        window_attend = segment_attend(window_ids, v.window_patches, v)

        def block(p, x, full):  # one block body; only the attention's segments and block size differ
            attend = lambda q, k, val: jax.lax.cond(full, full_attend, window_attend, q, k, val)  # noqa: E731
            return vision_block(p, x, cos, sin, attend, v)

    block = remat_fn(block, remat)

    def body(x, xs):
        p, full = xs
        return block(p, x, full), None

    x, _ = jax.lax.scan(body, x, (params["blocks"], is_full))
    mp = params["merger"]
    h = rms_norm(x, mp["norm"], VISION_EPS).reshape(-1, v.merge_unit * v.hidden_size)
    h = jax.nn.gelu(h @ mp["fc1"].astype(dtype) + mp["fc1_bias"].astype(dtype), approximate=False)
    out = h @ mp["fc2"].astype(dtype) + mp["fc2_bias"].astype(dtype)
    return out[jnp.asarray(layout["unorder"])]
