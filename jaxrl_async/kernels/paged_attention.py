"""Decode attention over the paged KV pool: the implementations and the pool layout each one reads.

================  ==============================================  ==========================================
attention         pool arrays (layout)                            reads per decode step
================  ==============================================  ==========================================
``gather``        k_pool, v_pool [L, P, page, K, E] (``split``)   every slot's pages up to max_sequence_length
                                                                  (the reference; `paged.paged_decode_attend`)
``blocked``       k_pool, v_pool [L, P, K, page, E]               blocks of pages up to the longest *active*
                  (``page_heads``: a gathered block is laid out   slot, gathered into copies for XLA's dots
                  as its two dots read it)                        (`paged.blocked_decode_attend`; portable)
``cpu_paged``     k_pool, v_pool [L, P, K, page, E]               each active slot's own pages, in place: a C++
                  (``page_heads``, as ``blocked``)                XLA FFI kernel (`cpu_kernels`; CPU default,
                                                                  ``blocked`` where it cannot be built)
``tpu_ragged``    kv_pool [L, P, page, 2K, E] (``combined``:      each slot's own pages, Pallas/Mosaic
                  k at even, v at odd heads, the kernel's         `ragged_paged_attention` (TPU default)
                  format)
``gpu_paged``     k_pool, v_pool [K, L, P, page, E]               each slot's own pages, Pallas-Triton
                  (``heads_first``, the kernel's format)          `paged_attention` (GPU default)
================  ==============================================  ==========================================

The kernels see the pool of all layers as one page array (a free reshape to ``[L*P, ...]``) and layer
l's pages as ``page_table + l * P``, so no per-layer slice of the pool is ever copied; per-slot
lengths are ``pos + 1`` for active slots and 1 for free or finished ones (their output is discarded).
On a mesh every path runs per shard (``jax.shard_map``): slots over ``data`` where the decode batch is
split, kv heads over ``tensor`` where the pool's are, and, when the slots split over ``data``, the pool's
pages too: each decode replica owns a range of pages (local page ids, its own allocator in
`generator.kv_cache.ReplicaAllocators`), so per-device KV bytes = pool / data and no page crosses devices. The
portable paths run anywhere; a kernel path traced for another platform runs in Pallas interpret mode
(``gpu_paged``, for tests) or is refused.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_async.kernels.platform import kernel_platform
from jaxrl_async.kernels import cpu_kernels, paged
from jaxrl_async.sharding.rules import logical_to_spec

DECODE_ATTENTION = ("gather", "blocked", "cpu_paged", "tpu_ragged", "gpu_paged")
LAYOUT_OF = {"gather": "split", "blocked": "page_heads", "cpu_paged": "page_heads", "tpu_ragged": "combined",
             "gpu_paged": "heads_first"}
_SPLIT_AXES = paged.POOL_AXES  # layers, cache_pages, cache_page, cache_kv_heads, head_dim
_HEADS_FIRST_AXES = ("cache_kv_heads", "layers", "cache_pages", "cache_page", "head_dim")


def resolve(attention: str, platform: str) -> str:
    """The decode attention for a platform: "auto" -> tpu_ragged on TPU, gpu_paged on GPU, cpu_paged on CPU
    (blocked where that kernel cannot be built: `cpu_kernels.available`, its reason logged), blocked elsewhere.
    "cpu_paged" asked for where it cannot run is refused."""
    if attention == "auto":
        if platform == "cpu":
            return "cpu_paged" if cpu_kernels.available() else "blocked"
        return {"tpu": "tpu_ragged", "gpu": "gpu_paged", "cuda": "gpu_paged"}.get(platform, "blocked")
    if attention not in DECODE_ATTENTION:
        raise ValueError(f"decode attention must be 'auto' or one of {DECODE_ATTENTION}, got {attention!r}")
    if attention == "cpu_paged":
        if platform != "cpu":
            raise ValueError(f"decode attention 'cpu_paged' runs on CPU only (platform {platform!r})")
        if not cpu_kernels.available():
            raise ValueError(f"decode attention 'cpu_paged' is not available here: {cpu_kernels.unavailable_reason()}")
    return attention


# ---------------------------------------------------------------------------------------
# Pool layouts
# ---------------------------------------------------------------------------------------
class PoolLayout:
    """Shapes, shardings and writes of the pool arrays of one layout (``split``, ``page_heads``, ``combined``,
    ``heads_first``).

    The decode state carries the pool as ``tuple(arrays[k] for k in layout.keys)``.
    """

    def __init__(self, name: str):
        if name not in ("split", "page_heads", "combined", "heads_first"):
            raise ValueError(f"unknown pool layout {name!r}")
        self.name = name
        self.keys = ("kv_pool",) if name == "combined" else ("k_pool", "v_pool")
        self.head_axis = {"heads_first": 0, "page_heads": 2}.get(name, 3)
        self.pages_dim = 2 if name == "heads_first" else 1

    def shapes(self, spec: paged.KVCacheSpec) -> dict[str, tuple[int, ...]]:
        L, Pn, page, K, E = spec.pool_shape
        shape = {"split": (L, Pn, page, K, E), "page_heads": (L, Pn, K, page, E), "combined": (L, Pn, page, 2 * K, E),
                 "heads_first": (K, L, Pn, page, E)}[self.name]
        return dict.fromkeys(self.keys, shape)

    def spec(self, pages_axis: str | None, kv_axis: Any) -> P:
        """PartitionSpec of the pool arrays: pages over `pages_axis` (one range per decode replica), kv heads over
        `kv_axis` (combined: the 2K axis split like K keeps each (k, v) pair on one shard)."""
        dims: list[Any] = [None] * 5
        dims[self.pages_dim], dims[self.head_axis] = pages_axis, kv_axis
        return P(*dims)

    def shardings(self, spec: paged.KVCacheSpec, mesh: Mesh, rules: Any = "generator",
                  pages_axis: str | None = None) -> dict[str, NamedSharding]:
        """The pool's shardings: kv heads by the rules (split iff K divides), pages over `pages_axis` (the engine
        passes its decode replicas' axis when the slots split over it, see `PagedEngine`)."""
        kv_ax = logical_to_spec(_SPLIT_AXES, spec.pool_shape, rules, mesh)[3]
        return dict.fromkeys(self.keys, NamedSharding(mesh, self.spec(pages_axis, kv_ax)))

    def zeros(self, spec: paged.KVCacheSpec) -> dict[str, jax.Array]:
        return {k: jnp.zeros(s, spec.dtype) for k, s in self.shapes(spec).items()}

    def num_pages(self, pools: dict[str, jax.Array]) -> int:
        a = pools[self.keys[0]]
        return a.shape[2] if self.name == "heads_first" else a.shape[1]

    def write_prefix(self, pools: dict[str, jax.Array], k: jax.Array, v: jax.Array, dest_pages: jax.Array,
                     offsets: jax.Array) -> dict[str, jax.Array]:
        """Prompt k/v [L, T, K, E] to (dest_pages[t], offsets[t]) of every layer (null page: dropped)."""
        if self.name == "split":
            return {"k_pool": paged.write_prefix(pools["k_pool"], k, dest_pages, offsets),
                    "v_pool": paged.write_prefix(pools["v_pool"], v, dest_pages, offsets)}
        if self.name == "combined":
            pool = pools["kv_pool"]
            return {"kv_pool": pool.at[:, dest_pages, offsets].set(interleave(k, v).astype(pool.dtype), mode="drop")}
        if self.name == "page_heads":  # the indexed (page, offset) pairs come first: values [T, L, K, E]
            return {key: pools[key].at[:, dest_pages, :, offsets].set(jnp.swapaxes(x, 0, 1).astype(pools[key].dtype),
                                                                      mode="drop")
                    for key, x in (("k_pool", k), ("v_pool", v))}
        out = {}
        for key, x in (("k_pool", k), ("v_pool", v)):
            pool = pools[key]
            out[key] = pool.at[:, :, dest_pages, offsets].set(jnp.moveaxis(x, 2, 0).astype(pool.dtype), mode="drop")
        return out

    def write_token(self, pools: tuple, layer_idx, pages: jax.Array, offsets: jax.Array, k: jax.Array,
                    v: jax.Array) -> tuple:
        """One decode token per slot, k/v [S, K, E], at (pages[s], offsets[s]) of layer `layer_idx`."""
        if self.name == "split":
            kp, vp = pools
            return (kp.at[layer_idx, pages, offsets].set(k.astype(kp.dtype), mode="drop"),
                    vp.at[layer_idx, pages, offsets].set(v.astype(vp.dtype), mode="drop"))
        if self.name == "combined":
            (pool,) = pools
            return (pool.at[layer_idx, pages, offsets].set(interleave(k, v).astype(pool.dtype), mode="drop"),)
        if self.name == "page_heads":
            kp, vp = pools
            return (kp.at[layer_idx, pages, :, offsets].set(k.astype(kp.dtype), mode="drop"),
                    vp.at[layer_idx, pages, :, offsets].set(v.astype(vp.dtype), mode="drop"))
        kp, vp = pools
        return (kp.at[:, layer_idx, pages, offsets].set(jnp.swapaxes(k, 0, 1).astype(kp.dtype), mode="drop"),
                vp.at[:, layer_idx, pages, offsets].set(jnp.swapaxes(v, 0, 1).astype(vp.dtype), mode="drop"))


def interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """[..., K, E] k and v -> [..., 2K, E] with k_h at 2h and v_h at 2h + 1 (the ragged kernel's format)."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def layout_for(attention: str) -> PoolLayout:
    return PoolLayout(LAYOUT_OF[attention])


# ---------------------------------------------------------------------------------------
# attend functions (the `forward` hook) for one decode token per slot
# ---------------------------------------------------------------------------------------
def decode_attend(attention: str, page_table: jax.Array, positions: jax.Array, active: jax.Array,
                  write_pages: jax.Array, page_size: int, scale: float, *, block_pages: int = 8,
                  kernel_options: dict | None = None, pages_axis: str | None = None):
    """`attend(q [S,1,H,E], k/v [S,1,K,E], layer_idx, pools)` of `attention` (state = the layout's pool tuple).

    Page ids (`page_table`, `write_pages`) index the pool shard of the slot's replica: with `pages_axis`
    (the pool's pages split over that mesh axis, one range per decode replica, as the slots are) every shard
    writes and reads only its own pages inside one `shard_map`, so no page crosses devices; the blocked loop's
    trip count is then each replica's own longest active slot. Without an active mesh the local function runs
    directly (one device, or a caller outside the engine)."""
    opts = dict(kernel_options or {})
    layout = layout_for(attention)

    def local(q, k, v, layer_idx, pools, pt, pos, act, wp):
        if attention == "gather":
            return paged.paged_decode_attend(pt, pos, wp, page_size, scale)(q, k, v, layer_idx, pools)
        if attention == "blocked":
            nblk = paged.live_blocks(pos, act, block_pages * page_size)
            return paged.blocked_decode_attend(pt, pos, wp, page_size, scale, nblk, block_pages)(
                q, k, v, layer_idx, pools)
        pools = layout.write_token(pools, layer_idx, wp, pos % page_size, k[:, 0], v[:, 0])
        if attention == "cpu_paged":  # free slots read nothing (length 0: zeros, discarded)
            out = cpu_kernels.paged_decode(q[:, 0], *pools, jnp.where(act, pos + 1, 0), pt, layer_idx, scale)
            return out[:, None], pools
        kv_lens = jnp.where(act, pos + 1, 1).astype(jnp.int32)
        if attention == "tpu_ragged":
            (pool,) = pools
            L, Pn = pool.shape[:2]
            flat = (pool.reshape(L * Pn, *pool.shape[2:]),)
            fn = _tpu_local
        else:
            kp, _ = pools
            L, Pn = kp.shape[1:3]
            flat = tuple(a.reshape(a.shape[0], L * Pn, *a.shape[3:]) for a in pools)
            fn = _gpu_local
        pages = jnp.minimum(pt, Pn - 1) + layer_idx * Pn  # null entries past a slot's length: unread
        out = fn(q[:, 0], kv_lens, pages, *flat, scale=float(scale), **opts)
        return out[:, None], pools

    def attend(q, k, v, layer_idx, state):
        from jaxrl_async.sharding.activations import active_activation_rules

        args = (page_table, positions, active, write_pages)
        mesh_rules = active_activation_rules()
        if mesh_rules is None:
            if pages_axis is not None:
                raise ValueError("decode attention with the pool split over pages needs the engine's mesh active")
            return local(q, k, v, layer_idx, state, *args)
        mesh, rules = mesh_rules
        S = q.shape[0]
        slot_ax = logical_to_spec(("batch",), (S,), rules, mesh)[0]
        if pages_axis is not None and slot_ax != pages_axis:
            raise ValueError(f"the pool's pages split over {pages_axis!r} but the decode slots over {slot_ax!r}")
        heads = state[0].shape[layout.head_axis] // (2 if layout.name == "combined" else 1)
        kv_ax = logical_to_spec(("cache_kv_heads",), (heads,), rules, mesh)[0]
        pool_spec = layout.spec(pages_axis, kv_ax)
        x_spec = P(slot_ax, None, kv_ax, None)  # q (query heads grouped by kv head) and k/v
        fn = jax.shard_map(
            lambda q_, k_, v_, l_, pools_, *a: local(q_, k_, v_, l_, pools_, *a), mesh=mesh,
            in_specs=(x_spec, x_spec, x_spec, P(), (pool_spec,) * len(state), P(slot_ax, None), P(slot_ax),
                      P(slot_ax), P(slot_ax)),
            out_specs=(x_spec, (pool_spec,) * len(state)), check_vma=False)
        out, pools = fn(q, k, v, jnp.asarray(layer_idx, jnp.int32), tuple(state), *args)
        return out, pools

    return attend


def write_prefix_on_replica(layout: PoolLayout, pools: dict[str, jax.Array], k: jax.Array, v: jax.Array,
                            dest_pages: jax.Array, offsets: jax.Array, replica: jax.Array, *, mesh: Mesh | None,
                            pages_axis: str | None, kv_axis: str | None) -> dict[str, jax.Array]:
    """`layout.write_prefix` of a prompt's k/v [L, T, K, E] into the pool shard of decode replica `replica`.

    `dest_pages` are that replica's local page ids. With `pages_axis` the write runs inside a `shard_map`:
    every shard of the pool sees the prompt (replicated over the pages axis), and the shards of other
    replicas write nothing (their destinations become the null page); without it, a plain write."""
    if pages_axis is None or mesh is None:
        return layout.write_prefix(pools, k, v, dest_pages, offsets)
    keys = layout.keys
    pool_spec = layout.spec(pages_axis, kv_axis)
    kv_spec = P(None, None, kv_axis, None)

    def local(pools_, k_, v_, dest, off, rep):
        null = layout.num_pages(dict(zip(keys, pools_)))
        mine = jax.lax.axis_index(pages_axis) == rep
        out = layout.write_prefix(dict(zip(keys, pools_)), k_, v_, jnp.where(mine, dest, null), off)
        return tuple(out[key] for key in keys)

    fn = jax.shard_map(local, mesh=mesh, in_specs=((pool_spec,) * len(keys), kv_spec, kv_spec, P(), P(), P()),
                       out_specs=(pool_spec,) * len(keys), check_vma=False)
    return dict(zip(keys, fn(tuple(pools[key] for key in keys), k, v, dest_pages, offsets, replica)))


def _tpu_local(q, kv_lens, pages, kv_pages, *, scale: float, pages_per_block: int | None = None,
               queries_per_block: int | None = None, vmem_limit_bytes: int | None = None, kernel=None):
    """q [S, H, E], kv_pages [L*P, page, 2K, E] -> [S, H, E] with `ragged_paged_attention` (one query per slot)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    S, maxp = pages.shape
    cu_q_lens = jnp.arange(S + 1, dtype=jnp.int32)
    num_seqs = jnp.full((1,), S, jnp.int32)
    if kernel is None:
        if kernel_platform() != "tpu":
            raise ValueError("decode attention 'tpu_ragged' runs on TPU only (use 'blocked' elsewhere)")
        kernel = functools.partial(
            rpa.ragged_paged_attention, vmem_limit_bytes=vmem_limit_bytes,
            # explicit block sizes: the tuned-size table queries jax.devices(), absent when compiling deviceless
            num_kv_pages_per_block=min(pages_per_block or 8, maxp), num_queries_per_block=queries_per_block or 8)
    with jax.default_matmul_precision(_kernel_precision(q.dtype)):
        out = kernel(q, kv_pages, kv_lens, pages.astype(jnp.int32), cu_q_lens, num_seqs, sm_scale=scale)
    return out.astype(q.dtype)


def _gpu_local(q, kv_lens, pages, k_pages, v_pages, *, scale: float, pages_per_block: int | None = None,
               k_splits: int | None = None, block_h: int = 16, interpret: bool | None = None):
    """q [S, H, E], k/v_pages [K, L*P, page, E] -> [S, H, E] with the Pallas-Triton `paged_attention`.

    The kernel has no softmax scale: q is scaled first. Its page table needs pages_per_sequence % (k_splits
    x pages_per_compute_block) == 0: padded with page 0, never read (the kernel stops at each length)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpa

    if interpret is None:
        interpret = kernel_platform() not in ("gpu", "cuda")
    page = k_pages.shape[2]
    maxp = pages.shape[1]
    ppcb = min(pages_per_block or max(1, 64 // page), maxp)
    splits = k_splits or max(1, min(16, maxp // ppcb))
    padded = math.ceil(maxp / (ppcb * splits)) * ppcb * splits
    if padded > maxp:
        pages = jnp.pad(pages, ((0, 0), (0, padded - maxp)))
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
    with jax.default_matmul_precision(_kernel_precision(q.dtype)):
        out = gpa.paged_attention(qs, k_pages, v_pages, pages.astype(jnp.int32), kv_lens, block_h=block_h,
                                  pages_per_compute_block=ppcb, k_splits=splits, interpret=interpret)
    return out.astype(q.dtype)


def _kernel_precision(dtype) -> str:
    """Matmul precision inside the kernels: float32 pools at full precision, others at the native one (Mosaic
    rejects a float32-precision matmul of bf16 operands, which a caller's "highest" default would ask for)."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else "default"
