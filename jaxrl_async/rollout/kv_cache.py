"""Paged KV cache: pool layout, host-side page allocator, paged attention, automatic sizing.

Layout
------
One pool per k and v, ``[L, P, page_size, K, E]`` (L layers, P pages, K kv heads, E head
dim) in the compute dtype, kv heads sharded over ``tensor`` where divisible (logical axes
``layers, cache_pages, cache_page, cache_kv_heads, head_dim``). Each decode slot s owns a row
of the page table ``[S, max_pages_per_seq]``: token at absolute position t of slot s lives
at ``pool[:, page_table[s, t // page_size], t % page_size]``. Pages are allocated on demand as
a sequence grows and returned on release, so a slot only holds ceil(len / page_size) pages
instead of a max-length reservation.

The page id ``P`` (one past the end) is the *null page*: writes to it are dropped
(`mode="drop"`) and reads are clamped (their scores are masked), so free or finished slots and
prompt padding never touch live pages.

Sharing: the n samples of one prefill share the prompt's *full* pages (reference counted);
the partially filled last prompt page is copied per sample (copy on write at insert), since
each sample appends its own tokens to it. Decode never writes below the prompt length, so a
shared page is immutable while referenced.

Decode attention: `paged_decode_attend` (the reference) gathers each slot's pages into a contiguous
``[S, max_pages * page_size, K, E]`` view per layer and applies a length mask; `blocked_decode_attend`
reads only the blocks up to the longest active slot (the portable default, on the ``page_heads`` pool layout). The
accelerator kernels
and the pool layouts they need are in `paged_attention.py`.

Automatic sizing (`auto_num_pages`)
-----------------------------------
Per device: budget = fraction * (limit - max(in_use, param_bytes) - incoming) - workspace, where
``limit``/``in_use`` come from ``device.memory_stats()`` ("bytes_limit"/"bytes_in_use", the
minimum over the generator mesh's devices), ``param_bytes`` is the per-device size of the
parameters under the generator shardings, ``incoming`` the same again when the engine receives
weight pushes (``reserve_weight_push``: the new weights arrive while the old ones still serve, as
the planner counts them) and ``workspace`` an estimate of the transient prefill/decode buffers. Backends without
memory stats (CPU) use the host fallback
limit = min(available host RAM / 4 / num_devices, 1 GiB). The page count is clamped to
[max_pages_per_seq, S * max_pages_per_seq] (more pages than a full per-slot reservation can
never be used; fewer than one full sequence is an error).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import grouped_attention
from jaxrl_async.rollout.engine_api import OutOfPagesError
from jaxrl_async.sharding.rules import logical_to_spec, spec_axes_size

POOL_AXES = ("layers", "cache_pages", "cache_page", "cache_kv_heads", "head_dim")
CPU_FALLBACK_CAP_BYTES = 1 << 30
CPU_FALLBACK_RAM_FRACTION = 0.25


def pages_for(num_tokens: int, page_size: int) -> int:
    """ceil(num_tokens / page_size)."""
    return -(-int(num_tokens) // page_size)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Static shape of the paged pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    max_pages_per_seq: int
    dtype: str = "float32"

    def __post_init__(self):
        for f in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages", "max_pages_per_seq"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"KVCacheSpec.{f} must be a positive int, got {v!r}")

    @property
    def pool_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def null_page(self) -> int:
        return self.num_pages

    def page_bytes(self, kv_head_shards: int = 1) -> int:
        """Bytes of one page (k and v, all layers) on one device: 2 * L * page * K/shards * E * itemsize."""
        k_local = self.num_kv_heads // kv_head_shards
        return 2 * self.num_layers * self.page_size * k_local * self.head_dim * jnp.dtype(self.dtype).itemsize


def kv_head_shards(spec_or_heads: KVCacheSpec | int, mesh: Mesh, rules: Any = "generator") -> int:
    """How many ways the kv-head axis of the pool is split on `mesh`."""
    heads = spec_or_heads.num_kv_heads if isinstance(spec_or_heads, KVCacheSpec) else int(spec_or_heads)
    return spec_axes_size(mesh, logical_to_spec(("cache_kv_heads",), (heads,), rules, mesh)[0])


# ---------------------------------------------------------------------------------------
# Automatic sizing
# ---------------------------------------------------------------------------------------
def device_memory(devices: Sequence[jax.Device]) -> tuple[int, int, str]:
    """(bytes_limit, bytes_in_use, source) for the most constrained device of `devices`.

    Uses `device.memory_stats()`; where unavailable (CPU) falls back to
    min(available host RAM * 0.25 / len(devices), 1 GiB) with in_use = 0.
    """
    limits, used = [], []
    for d in devices:
        stats = None
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = None
        if not stats or "bytes_limit" not in stats:
            break
        limits.append(int(stats["bytes_limit"]))
        used.append(int(stats.get("bytes_in_use", 0)))
    else:
        if limits:
            i = int(np.argmin(np.asarray(limits) - np.asarray(used)))
            return limits[i], used[i], "memory_stats"
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 8 << 30
    limit = min(int(avail * CPU_FALLBACK_RAM_FRACTION / max(1, len(devices))), CPU_FALLBACK_CAP_BYTES)
    return limit, 0, "host_fallback"


def param_bytes_per_device(cfg: ModelConfig, shardings: Any) -> int:
    """Bytes of the parameters held by one device under `shardings` (tree of NamedSharding)."""
    from jaxrl_async.models.transformer import param_shapes

    shapes = jax.tree.leaves(param_shapes(cfg))
    shards = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    total = 0
    for sd, sh in zip(shapes, shards):
        total += math.prod(sh.shard_shape(sd.shape)) * jnp.dtype(sd.dtype).itemsize
    return total


def workspace_bytes(cfg: ModelConfig, max_slots: int, max_prefill: int, max_seq: int, kv_shards: int = 1) -> int:
    """Transient memory of the largest step (x2 safety): max of prefill and decode estimates.

    prefill: kv buffer 2*L*T*K*E*b + f32 scores H*T*T*4 + activations T*(D+F)*4*4
    decode:  gathered pages 2*S*N*K*E*b + f32 scores S*H*N*4 + logits S*V*4*3 (N = max_seq)
    """
    b = jnp.dtype(cfg.dtype).itemsize
    L, H, K, E = cfg.num_layers, cfg.num_heads, max(1, cfg.num_kv_heads // kv_shards), cfg.head_dim
    T, S, N = max_prefill, max_slots, max_seq
    pre = 2 * L * T * K * E * b + H * T * T * 4 + T * (cfg.hidden_size + cfg.intermediate_size) * 16 + cfg.vocab_size * 16
    dec = 2 * S * N * K * E * b + S * H * N * 4 + S * cfg.vocab_size * 12 + S * (cfg.hidden_size + cfg.intermediate_size) * 16
    return 2 * max(pre, dec)


@dataclasses.dataclass(frozen=True)
class SizingReport:
    num_pages: int
    source: str  # "memory_stats" | "host_fallback" | "explicit"
    bytes_limit: int
    bytes_in_use: int
    param_bytes: int
    workspace_bytes: int
    page_bytes: int
    incoming_weight_bytes: int = 0  # room kept for a weight push's arriving copy


def _incoming_push_bytes(cfg: ModelConfig, shardings: Any, pbytes: int) -> int:
    """Bytes a weight push brings per device: all parameters, or with unmerged LoRA adapters (the engine's
    params hold them) only the adapters (``weight_sync.LoraPush``: the base stays)."""
    if cfg.lora is None:
        return pbytes
    from jaxrl_async.models import lora

    return param_bytes_per_device(cfg, shardings) - param_bytes_per_device(
        cfg.replace(lora=None), lora.split(shardings)[1])


def auto_num_pages(spec_wo_pages: dict, cfg: ModelConfig, mesh: Mesh, param_shardings: Any, *, max_slots: int,
                   max_prefill: int, max_seq: int, fraction: float,
                   reserve_weight_push: bool = False, replicas: int = 1) -> SizingReport:
    """Number of pages that fit the generator mesh (formula in the module doc). With `replicas` > 1 (the pool's
    pages split over the generator's `data` axis, one range per replica) each device holds 1/replicas of the
    pool: the page count is `replicas` x what fits one device, a multiple of `replicas`."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cache_memory_fraction must be in (0, 1], got {fraction}")
    probe = KVCacheSpec(num_pages=1, **spec_wo_pages)
    shards = kv_head_shards(probe, mesh)
    page_b = probe.page_bytes(shards)
    limit, in_use, source = device_memory(list(mesh.devices.flat))
    pbytes = param_bytes_per_device(cfg, param_shardings)
    ws = workspace_bytes(cfg, max_slots // replicas, max_prefill, max_seq, shards)
    incoming = _incoming_push_bytes(cfg, param_shardings, pbytes) if reserve_weight_push else 0
    budget = fraction * (limit - max(in_use, pbytes) - incoming) - ws
    n = int(budget // page_b) if budget > 0 else 0
    need_one = probe.max_pages_per_seq
    if n < need_one:
        raise MemoryError(
            f"KV cache: {max(budget, 0) / 2**20:.1f} MiB left per device (limit {limit / 2**20:.0f} MiB from {source}, "
            f"params {pbytes / 2**20:.1f} MiB, incoming weights {incoming / 2**20:.1f} MiB, workspace "
            f"{ws / 2**20:.1f} MiB, fraction {fraction}) hold {n} pages of "
            f"{page_b} B, fewer than the {need_one} pages of one max_sequence_length={max_seq} sequence")
    n = min(n, (max_slots // replicas) * probe.max_pages_per_seq) * replicas
    return SizingReport(n, source, limit, in_use, pbytes, ws, page_b, incoming)


# ---------------------------------------------------------------------------------------
# Host-side page allocator
# ---------------------------------------------------------------------------------------
class PageAllocator:
    """Free list + reference counts of the pool's pages, per-slot page lists, shared prefixes.

    Pages are ints in [0, num_pages). `slot_pages[s]` lists slot s's pages in sequence order.
    A page referenced by k slots has refcount k and returns to the free list when it drops
    to 0. `prefix_pages[pid]` remembers the full prompt pages of a live prefill so later
    samples of it can share them; the entry disappears when its pages are freed.
    """

    def __init__(self, num_pages: int, num_slots: int):
        self.num_pages = int(num_pages)
        self.refcount = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # stack: pops low ids first
        self.slot_pages: list[list[int]] = [[] for _ in range(num_slots)]
        self.prefix_pages: dict[int, tuple[int, ...]] = {}
        self._page_prefix: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, slots: Sequence[int] = ()) -> list[int]:
        """n fresh pages with refcount 1; OutOfPagesError (nothing changed) if fewer are free."""
        if n > len(self._free):
            err = OutOfPagesError(f"KV cache: {n} pages needed, {len(self._free)} free of {self.num_pages}")
            err.slots = tuple(slots)
            err.pages_needed = n
            err.pages_free = len(self._free)
            raise err
        out = [self._free.pop() for _ in range(n)]
        self.refcount[out] = 1
        return out

    def share(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"PageAllocator.share: page {p} is free")
            self.refcount[p] += 1

    def release_pages(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"PageAllocator.release_pages: page {p} is already free")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)
                pid = self._page_prefix.pop(p, None)
                if pid is not None:
                    self.prefix_pages.pop(pid, None)

    def register_prefix(self, prefix_id: int, pages: Sequence[int]) -> None:
        self.prefix_pages[prefix_id] = tuple(pages)
        for p in pages:
            self._page_prefix[p] = prefix_id

    def release_slot(self, slot: int) -> None:
        self.release_pages(self.slot_pages[slot])
        self.slot_pages[slot] = []

    def check(self) -> None:
        """Invariant: every page is either free (refcount 0) or referenced exactly refcount times."""
        counts = np.zeros(self.num_pages, np.int32)
        for pages in self.slot_pages:
            for p in pages:
                counts[p] += 1
        if not np.array_equal(counts, self.refcount):
            raise AssertionError(f"PageAllocator: refcounts {self.refcount} != slot references {counts}")
        free = sorted(self._free)
        if free != sorted(np.flatnonzero(counts == 0).tolist()) or len(set(free)) != len(free):
            raise AssertionError("PageAllocator: free list does not match unreferenced pages")


class ReplicaAllocators:
    """One `PageAllocator` per decode replica (the pool's pages split over the generator's `data` axis).

    Slot s belongs to replica ``s // (num_slots / replicas)`` (the decode batch is split over `data` in
    contiguous blocks) and takes its pages from that replica's allocator, whose ids are *local* to the
    replica's shard of the pool (``[0, pages_per_replica)``; the page table holds local ids and the null page is
    ``pages_per_replica``). Shared prompt pages are per replica: the samples of a prefill on two replicas each
    get their own copy. With one replica this is a plain `PageAllocator`.
    """

    def __init__(self, num_pages: int, num_slots: int, replicas: int = 1):
        if replicas < 1 or num_pages % replicas or num_slots % replicas:
            raise ValueError(f"ReplicaAllocators: {num_pages} pages and {num_slots} slots must split over "
                             f"{replicas} replicas")
        self.replicas = int(replicas)
        self.pages_per_replica = num_pages // replicas
        self.slots_per_replica = num_slots // replicas
        self.allocs = [PageAllocator(self.pages_per_replica, num_slots) for _ in range(replicas)]

    def replica(self, slot: int) -> int:
        return int(slot) // self.slots_per_replica

    def of(self, slot: int) -> PageAllocator:
        return self.allocs[self.replica(slot)]

    @property
    def slot_pages(self) -> list[list[int]]:
        """Every slot's page list (local ids of its replica), in slot order; the lists are the allocators' own."""
        return [self.of(s).slot_pages[s] for s in range(self.slots_per_replica * self.replicas)]

    @property
    def prefix_pages(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """(replica, prefix id) -> shared prompt pages, over all replicas."""
        return {(r, pid): pages for r, a in enumerate(self.allocs) for pid, pages in a.prefix_pages.items()}

    @property
    def num_free(self) -> int:
        """Free pages of all replicas together."""
        return sum(a.num_free for a in self.allocs)

    @property
    def max_free(self) -> int:
        """Free pages of the emptiest replica: the most one new sequence can get."""
        return max(a.num_free for a in self.allocs)

    def free_of(self, slot: int) -> int:
        return self.of(slot).num_free

    def release_slot(self, slot: int) -> None:
        self.of(slot).release_slot(slot)

    def check(self) -> None:
        for r, a in enumerate(self.allocs):
            foreign = [s for s, pages in enumerate(a.slot_pages) if pages and self.replica(s) != r]
            if foreign:
                raise AssertionError(f"ReplicaAllocators: replica {r} holds pages of other replicas' slots {foreign}")
            a.check()


# ---------------------------------------------------------------------------------------
# Pure device functions
# ---------------------------------------------------------------------------------------
def write_prefix(pool: jax.Array, kv: jax.Array, dest_pages: jax.Array, offsets: jax.Array | int) -> jax.Array:
    """pool[:, dest_pages[t], offsets[t]] = kv[:, t] for every t (null-page writes dropped).

    pool [L, P, page, K, E], kv [L, T, K, E], dest_pages [T] int32, offsets [T] int32 (the token's place in
    its page); an int `offsets` is the page size of a prompt starting at t = 0 (offsets = t % page_size).
    """
    if isinstance(offsets, int):
        offsets = jnp.arange(kv.shape[1], dtype=jnp.int32) % offsets
    return pool.at[:, dest_pages, offsets].set(kv.astype(pool.dtype), mode="drop")


def paged_decode_attend(page_table: jax.Array, positions: jax.Array, write_pages: jax.Array, page_size: int,
                        scale: float):
    """`attend` for one decode token per slot over the paged pool carried as `state`.

    state = (k_pool, v_pool) [L, P, page, K, E]; q [S, 1, H, E], k/v [S, 1, K, E].
    Writes k/v at (write_pages[s], positions[s] % page) of layer `layer_idx` (null page =
    dropped), then attends over the slot's pages gathered to [S, N, K, E], N = pages *
    page, with mask j <= positions[s].
    """
    S, maxp = page_table.shape
    N = maxp * page_size
    mask = (jnp.arange(N)[None, :] <= positions[:, None])[:, None, :]  # [S, 1, N]
    offsets = positions % page_size

    def attend(q, k, v, layer_idx, state):
        k_pool, v_pool = state
        k_pool = k_pool.at[layer_idx, write_pages, offsets].set(k[:, 0].astype(k_pool.dtype), mode="drop")
        v_pool = v_pool.at[layer_idx, write_pages, offsets].set(v[:, 0].astype(v_pool.dtype), mode="drop")
        kg = k_pool.at[layer_idx, page_table].get(mode="clip").reshape(S, N, *k_pool.shape[3:])
        vg = v_pool.at[layer_idx, page_table].get(mode="clip").reshape(S, N, *v_pool.shape[3:])
        out = grouped_attention(q, kg.astype(q.dtype), vg.astype(q.dtype), mask, scale)
        return out, (k_pool, v_pool)

    return attend


def live_blocks(positions: jax.Array, active: jax.Array, block_tokens: int) -> jax.Array:
    """Number of `block_tokens`-token blocks that cover every active slot's tokens 0..positions[s]
    (at least 1): the trip count of `blocked_decode_attend`'s loop, a traced int32 scalar."""
    longest = jnp.max(jnp.where(active, positions + 1, 1))
    return jnp.maximum(-(-longest // block_tokens), 1).astype(jnp.int32)


def blocked_decode_attend(page_table: jax.Array, positions: jax.Array, write_pages: jax.Array, page_size: int,
                          scale: float, num_blocks: jax.Array, block_pages: int):
    """`attend` for one decode token per slot that reads only the pages holding live tokens.

    Same contract as `paged_decode_attend` (same write, same result) on the ``page_heads`` pool layout:
    state = (k_pool, v_pool) [L, P, K, page, E] (`paged_attention.PoolLayout`). The keys are read in blocks
    of `block_pages` pages straight from the pool (a gather of [S, block_pages] page ids per block) inside a
    `fori_loop` whose trip count `num_blocks` is *traced* (`live_blocks`: the longest active slot's length in
    blocks). The loop keeps an online softmax (running max / sum / weighted values in float32), so per-step
    KV traffic is slots x the longest live length instead of slots x max_sequence_length, and the step
    compiles once whatever the lengths. Pages past block `num_blocks` are never read. Scores and the softmax
    statistics are float32 as in `grouped_attention`; with float32 pools the result equals the gather path up
    to summation order (<= 1e-6).

    Why this layout: a gathered block [S, bp, K, page, E] already has the dots' batch dimensions (slot,
    page, kv head) leading and the contracted one last, so both matmuls read it as gathered. On the ``split``
    layout ([L, P, page, K, E]) XLA:CPU transposed every gathered block before its dots, which cost more
    than the dots (measured in NOTES). The page ids are clamped on the [S, bp] table once (null entries:
    the last page, finite and masked), so the gather itself does no bounds checks.
    """
    S, maxp = page_table.shape
    bp = max(1, min(int(block_pages), maxp))
    nblk = -(-maxp // bp)
    n = bp * page_size
    offsets = positions % page_size
    neg = jnp.float32(-1e30)

    def attend(q, k, v, layer_idx, state):
        k_pool, v_pool = state
        k_pool = k_pool.at[layer_idx, write_pages, :, offsets].set(k[:, 0].astype(k_pool.dtype), mode="drop")
        v_pool = v_pool.at[layer_idx, write_pages, :, offsets].set(v[:, 0].astype(v_pool.dtype), mode="drop")
        Pn = k_pool.shape[1]
        pad_to = nblk * bp
        pt = page_table if pad_to == maxp else jnp.pad(page_table, ((0, 0), (0, pad_to - maxp)),
                                                       constant_values=Pn)  # null pages
        pt = jnp.minimum(pt, Pn - 1)  # in bounds: the gathers need no checks (entries past a length are masked)
        H, E = q.shape[2], q.shape[3]
        K = k_pool.shape[2]
        G = H // K
        qb = jnp.broadcast_to(q[:, 0].reshape(S, 1, K, G, E), (S, bp, K, G, E))
        tok_in_block = (jnp.arange(bp)[:, None] * page_size + jnp.arange(page_size)[None, :])  # [bp, page]
        batch = ((0, 1, 2), (0, 1, 2))  # slot, page of the block, kv head

        def body(b, carry):
            m, l, acc = carry  # [S, K, G] x 2, [S, K, G, E]
            pages = jax.lax.dynamic_slice_in_dim(pt, b * bp, bp, axis=1)  # [S, bp]
            kb = k_pool.at[layer_idx, pages].get(mode="promise_in_bounds").astype(q.dtype)  # [S, bp, K, page, E]
            vb = v_pool.at[layer_idx, pages].get(mode="promise_in_bounds").astype(q.dtype)
            s = jax.lax.dot_general(qb, kb, (((4,), (4,)), batch), preferred_element_type=jnp.float32) * scale
            live = (b * n + tok_in_block)[None] <= positions[:, None, None]  # [S, bp, page]
            s = jnp.where(live[:, :, None, None, :], s, neg)  # [S, bp, K, G, page]
            m_new = jnp.maximum(m, jnp.max(s, axis=(1, 4)))
            p = jnp.exp(s - m_new[:, None, :, :, None])
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=(1, 4))
            pv = jax.lax.dot_general(p.astype(vb.dtype), vb, (((4,), (3,)), batch),
                                     preferred_element_type=jnp.float32)  # [S, bp, K, G, E]
            return m_new, l, acc * corr[..., None] + jnp.sum(pv, axis=1)

        init = (jnp.full((S, K, G), neg, jnp.float32), jnp.zeros((S, K, G), jnp.float32),
                jnp.zeros((S, K, G, E), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
        out = (acc / l[..., None]).astype(q.dtype).reshape(S, 1, H, E)
        return out, (k_pool, v_pool)

    return attend


def prefill_attend(valid: jax.Array, scale: float, impl: str = "xla", block: int = 512):
    """`attend` for one padded row [1, T] of prompts: causal attention within each prompt, k/v of every
    layer stored in `state` = (k_buf, v_buf) [L, T, K, E]. valid [1, T]: bool (one prompt, True on its
    tokens) or int segment ids (packed prompts, 0 = padding). ``impl``: the model's attention
    implementation (``ModelConfig.attention``, ``kernels/attention.py``)."""
    from jaxrl_async.kernels.attention import segment_attention

    inner = segment_attention(valid.astype(jnp.int32), scale, impl, block)

    def attend(q, k, v, layer_idx, state):
        k_buf, v_buf = state
        k_buf = jax.lax.dynamic_update_index_in_dim(k_buf, k[0].astype(k_buf.dtype), layer_idx, 0)
        v_buf = jax.lax.dynamic_update_index_in_dim(v_buf, v[0].astype(v_buf.dtype), layer_idx, 0)
        return inner(q, k, v, layer_idx, None)[0], (k_buf, v_buf)

    return attend


def chunk_prefill_attend(start: jax.Array, length: jax.Array, scale: float, block: int):
    """`attend` for one chunk of C query tokens at absolute positions start..start+C-1 of a sequence
    whose earlier tokens' k/v are already in `state` = (k_buf, v_buf) [L, T, K, E] (T a multiple of
    `block`, the chunk size). Writes the chunk's k/v at [start, start + C) of its layer, then attends
    causally (key j <= query position, j < length) over the key blocks 0..(start + C) / block with an
    online softmax: no [C, T] score matrix, and no block past the chunk's end is read."""

    def attend(q, k, v, layer_idx, state):
        k_buf, v_buf = state
        upd = lambda buf, x: jax.lax.dynamic_update_slice(  # noqa: E731
            buf, x.astype(buf.dtype)[None], (layer_idx, start, 0, 0))
        k_buf, v_buf = upd(k_buf, k[0]), upd(v_buf, v[0])
        C, H, E = q.shape[1], q.shape[2], q.shape[3]
        K = k_buf.shape[2]
        G = H // K
        qg = q[0].reshape(C, K, G, E)
        q_pos = start + jnp.arange(C)
        neg = jnp.float32(-1e30)

        def body(b, carry):
            m, l, acc = carry
            kb = jax.lax.dynamic_slice(k_buf, (layer_idx, b * block, 0, 0), (1, block, K, E))[0].astype(q.dtype)
            vb = jax.lax.dynamic_slice(v_buf, (layer_idx, b * block, 0, 0), (1, block, K, E))[0].astype(q.dtype)
            s = jnp.einsum("ckge,nke->kgcn", qg, kb, preferred_element_type=jnp.float32) * scale
            key_pos = b * block + jnp.arange(block)
            ok = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < length)
            s = jnp.where(ok[None, None], s, neg)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("kgcn,nke->kgce", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

        init = (jnp.full((K, G, C), neg, jnp.float32), jnp.zeros((K, G, C), jnp.float32),
                jnp.zeros((K, G, C, E), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, start // block + 1, body, init)
        out = (acc / l[..., None]).astype(q.dtype)  # [K, G, C, E]
        return jnp.moveaxis(out, 2, 0).reshape(1, C, H, E), (k_buf, v_buf)

    return attend
