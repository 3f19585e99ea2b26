"""The grouped matmul of mixture-of-experts layers and its one switch (``ModelConfig.moe_kernel``): rows sorted by
group (expert) times one weight per group, ``[M, K] x [X, K, F] -> [M, F]`` with per-group row counts.

* ``ragged``: ``jax.lax.ragged_dot`` (the reference; CPU default);
* ``tiled``: a loop over tiles of rows of one group each (GPU default: XLA:GPU lowers ``ragged_dot`` densely);
* ``megablox``: the Pallas TPU kernel (``jax.experimental.pallas.ops.tpu.megablox``; TPU default, interpret mode
  elsewhere, for tests).

Each is tested against ``ragged_dot`` in values and gradients (``tests/models/test_moe.py``,
``test_moe_kernels.py``). Imports nothing from ``models/``.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxrl_async.kernels.platform import at_precision, kernel_platform

logger = logging.getLogger(__name__)

#: ``ModelConfig.moe_kernel`` values: ``auto`` picks by platform (``grouped_matmul_impl``)
MOE_KERNELS = ("auto", "ragged", "tiled", "megablox")

#: rows per tile of the tiled grouped matmul (GPU)
GROUP_TILE = 256


_LOGGED: set = set()


def grouped_matmul_impl(kernel: str = "auto") -> str:
    """The grouped matmul of ``kernel`` (``ModelConfig.moe_kernel``); ``auto`` picks by the platform of the
    active mesh, else the default backend: ``megablox`` on TPU (the Pallas TPU grouped-matmul kernel,
    ``jax.experimental.pallas.ops.tpu.megablox``: gmm forward, gmm + tgmm backward), ``tiled`` on GPUs
    (XLA:GPU lowers ``ragged_dot`` densely: a deviceless H100 compile of one [65536 x 2048] x
    [128 x 2048 x 768] ragged_dot needs 32 GiB of temporaries, every row against every expert), ``ragged``
    (``jax.lax.ragged_dot``) elsewhere. ``megablox`` off TPU runs the kernel in Pallas interpret mode (tests).
    The choice is logged once per (kernel, platform)."""
    platform = kernel_platform()
    impl = kernel
    if kernel == "auto":
        impl = "tiled" if platform in ("gpu", "cuda") else "megablox" if platform == "tpu" else "ragged"
    if (kernel, platform) not in _LOGGED:
        _LOGGED.add((kernel, platform))
        logger.info("MoE grouped matmul: %s (moe_kernel=%s, platform %s)%s", impl, kernel, platform,
                    " in Pallas interpret mode" if impl == "megablox" and platform != "tpu" else "")
    return impl


def tiled_grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, out_dtype,
                         tile: int = GROUP_TILE) -> jax.Array:
    """``ragged_dot(rows, w, group_sizes)`` as a loop over tiles of ``tile`` rows that each belong to ONE group:
    every group is padded to a multiple of the tile in a buffer of at most M + X (tile - 1) rows (a static
    bound), each tile multiplies its rows by its group's weight (one [tile, K] x [K, F] matmul, the weight cast
    per tile from its stored dtype, so its gradient accumulates there), and the rows are gathered back.
    rows [M, K] sorted by group, w [X, K, F], group_sizes [X] (sum M) -> [M, F] in ``out_dtype``."""
    M, K = rows.shape
    X, _, F = w.shape
    tile = max(1, min(tile, M))
    padded = (group_sizes + tile - 1) // tile * tile
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    row_start = jnp.cumsum(group_sizes) - group_sizes
    group_of_row = jnp.repeat(jnp.arange(X, dtype=jnp.int32), group_sizes, total_repeat_length=M)
    dest = pad_start[group_of_row] + jnp.arange(M, dtype=jnp.int32) - row_start[group_of_row]
    n_tiles = -(-(M + X * (tile - 1)) // tile)
    buf = jnp.zeros((n_tiles * tile, K), rows.dtype).at[dest].set(rows)
    tile_group = jnp.minimum(jnp.searchsorted(pad_end, jnp.arange(n_tiles) * tile, side="right"), X - 1)

    def one(t):
        xt = jax.lax.dynamic_slice_in_dim(buf, t * tile, tile, axis=0)
        wt = jax.lax.dynamic_index_in_dim(w, tile_group[t], axis=0, keepdims=False).astype(rows.dtype)
        return jnp.dot(xt, wt, preferred_element_type=jnp.float32).astype(out_dtype)

    out = jax.lax.map(one, jnp.arange(n_tiles, dtype=jnp.int32)).reshape(n_tiles * tile, F)
    return jnp.take(out, dest, axis=0)


def _tile(dim: int, cap: int) -> int:
    """A tile of ``dim``: the whole dimension up to ``cap``, else the largest of cap, cap/2, ..., 128 dividing
    it (else ``cap``: the kernel masks an irregular last tile)."""
    if dim <= cap:
        return dim
    t = cap
    while t >= 128:
        if dim % t == 0:
            return t
        t //= 2
    return cap


def megablox_grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array,
                            tiling: tuple[int, int, int] = (512, 1024, 1024)) -> jax.Array:
    """``ragged_dot(rows, w, group_sizes)`` with the Pallas TPU kernel (megablox ``gmm``, custom VJP: ``gmm``
    for the rows' gradient, ``tgmm`` for the weights'). Rows are padded to a multiple of the row tile (the
    padding belongs to no group and is cut off). rows [M, K], w [X, K, F] -> float32 [M, F]."""
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    M, K = rows.shape
    F = w.shape[-1]
    tm = min(tiling[0], -(-M // 128) * 128)
    Mp = -(-M // tm) * tm
    lhs = jnp.pad(rows, ((0, Mp - M), (0, 0))) if Mp != M else rows
    tiles, interpret = (tm, _tile(K, tiling[1]), _tile(F, tiling[2])), kernel_platform() != "tpu"
    # Mosaic takes bf16 operands only at the default precision (a caller's "highest" would ask for an fp32
    # contraction of bf16 vectors and fail to compile); fp32 operands get a full fp32 matmul
    precision = "highest" if rows.dtype == jnp.float32 else "default"
    gmm = at_precision(lambda x, y, g: megablox.gmm(x, y, g, jnp.float32, tiles, None, None, False, interpret),
                        precision)
    return gmm(lhs, w.astype(rows.dtype), group_sizes.astype(jnp.int32))[:M]


def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, impl: str | None = None) -> jax.Array:
    """[M, K] rows sorted by group x w [X, K, F] -> float32 [M, F] (see ``grouped_matmul_impl``)."""
    impl = impl or grouped_matmul_impl()
    if impl == "tiled":
        return tiled_grouped_matmul(rows, w, group_sizes, jnp.float32)
    if impl == "megablox":
        return megablox_grouped_matmul(rows, w, group_sizes)
    return jax.lax.ragged_dot(rows, w.astype(rows.dtype), group_sizes, preferred_element_type=jnp.float32)
