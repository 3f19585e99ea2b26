"""Paged KV cache, the generator's side: pool layout, host-side page allocators, automatic sizing.

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

Decode attention: the pool's spec and the attention over it are kernels (``kernels/paged.py``: the reference
`paged_decode_attend` and the portable default `blocked_decode_attend`; ``kernels/paged_attention.py``: the
accelerator kernels, the pool layouts they need and the one switch); this module re-exports the portable ones.

Automatic sizing (`auto_num_pages`)
-----------------------------------
Per device: budget = fraction * (limit - max(in_use, param_bytes) - incoming) - workspace, where
``limit``/``in_use`` come from ``device.memory_stats()`` ("bytes_limit"/"bytes_in_use", the
minimum over the generator mesh's devices), ``param_bytes`` is the per-device size of the
parameters under the generator shardings, ``incoming`` the same again when the engine receives
weight pushes (``reserve_weight_push``: the new weights arrive while the old ones still serve, as
the planner counts them) and ``workspace`` an estimate of the transient prefill/decode buffers. Backends without
memory stats (CPU) size from what the host can give: limit = the host's available RAM (``MemAvailable``: what
the loaded weights, the trainer's state and everything else already hold is not in it) / the number of devices
the pool spreads over, in_use = 0 (the parameters' device copy is counted by ``param_bytes``). No fixed cap: a
real-size checkpoint on a laptop gets what the laptop has. The page count is clamped to
[max_pages_per_seq, S * max_pages_per_seq] (more pages than a full per-slot reservation can
never be used); fewer than one full sequence raises :class:`KVSizingError`, as does an explicit pool that does
not fit the same budget (``check_num_pages``). Callers turn it into one line naming their own flags or config
fields (``generator.factory.build_engine``).
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
from jaxrl_async.generator.engine_api import OutOfPagesError
from jaxrl_async.kernels.paged import (  # noqa: F401  (the pool's spec and attention, used through this module)
    POOL_AXES, KVCacheSpec, blocked_decode_attend, chunk_prefill_attend, live_blocks, paged_decode_attend, pages_for,
    prefill_attend, write_prefix,
)
from jaxrl_async.sharding.rules import logical_to_spec, spec_axes_size


class KVSizingError(MemoryError):
    """The pool does not fit: ``fit_pages`` pages fit the budget (``detail`` says how it was counted),
    ``pages_per_sequence`` make one sequence of ``max_sequence_length`` tokens."""

    def __init__(self, detail: str, fit_pages: int, pages_per_sequence: int, max_seq: int):
        super().__init__(f"KV cache: {detail}; {fit_pages} pages fit, one sequence of max_sequence_length={max_seq} "
                         f"needs {pages_per_sequence}")
        self.detail, self.fit_pages, self.pages_per_sequence = detail, int(fit_pages), int(pages_per_sequence)
        self.weights_do_not_fit = detail.startswith("the weights alone do not fit")


def kv_head_shards(spec_or_heads: KVCacheSpec | int, mesh: Mesh, rules: Any = "generator") -> int:
    """How many ways the kv-head axis of the pool is split on `mesh`."""
    heads = spec_or_heads.num_kv_heads if isinstance(spec_or_heads, KVCacheSpec) else int(spec_or_heads)
    return spec_axes_size(mesh, logical_to_spec(("cache_kv_heads",), (heads,), rules, mesh)[0])


# ---------------------------------------------------------------------------------------
# Automatic sizing
# ---------------------------------------------------------------------------------------
def device_memory(devices: Sequence[jax.Device]) -> tuple[int, int, str]:
    """(bytes_limit, bytes_in_use, source) for the most constrained device of `devices`.

    Uses `device.memory_stats()`; where unavailable (CPU): the host's available RAM / len(devices), in_use = 0.
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
    return host_available_bytes() // max(1, len(devices)), 0, "host RAM"


def host_available_bytes() -> int:
    """The RAM this host can still give (``MemAvailable`` of /proc/meminfo: free + reclaimable caches; elsewhere
    the free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def param_bytes_per_device(cfg: ModelConfig, shardings: Any) -> int:
    """Bytes of the parameters held by one device under `shardings` (tree of NamedSharding)."""
    from jaxrl_async.models import qwen2_5_vl
    from jaxrl_async.models.transformer import param_shapes

    shapes = jax.tree.leaves(qwen2_5_vl.param_shapes(cfg) if qwen2_5_vl.is_vl(cfg) else param_shapes(cfg))
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
    source: str  # "memory_stats" | "host RAM" | "explicit"
    bytes_limit: int
    bytes_in_use: int
    param_bytes: int
    workspace_bytes: int
    page_bytes: int
    incoming_weight_bytes: int = 0  # room kept for a weight push's arriving copy
    packed_weight_bytes: int = 0  # the engine's packed copy of its layer matrices (`packed_weights.py`; with a push's
    # staged copy where weight pushes are reserved for)


def _push_brings_base(cfg: ModelConfig) -> bool:
    """A weight push brings new base matrices: all parameters, unless the engine holds unmerged LoRA adapters
    (``weight_sync.LoraPush``: then only the adapters arrive and the base stays)."""
    return getattr(cfg, "lora", None) is None  # (a vision-language config has no adapters)


def _incoming_push_bytes(cfg: ModelConfig, shardings: Any, pbytes: int) -> int:
    """Bytes a weight push brings per device: all parameters, or with unmerged LoRA adapters (the engine's
    params hold them) only the adapters (``weight_sync.LoraPush``: the base stays)."""
    if _push_brings_base(cfg):
        return pbytes
    from jaxrl_async.models import lora

    return param_bytes_per_device(cfg, shardings) - param_bytes_per_device(
        cfg.replace(lora=None), lora.split(shardings)[1])


def pool_budget(spec_wo_pages: dict, cfg: ModelConfig, mesh: Mesh, param_shardings: Any, *, max_slots: int,
                max_prefill: int, max_seq: int, fraction: float, reserve_weight_push: bool = False,
                replicas: int = 1, extra_weight_bytes: int = 0) -> tuple[int, SizingReport, str]:
    """(pages that fit the generator mesh, the sizing report with that count, how it was counted); the formula
    is in the module doc. With `replicas` > 1 (the pool's pages split over the generator's `data` axis, one range
    per replica) each device holds 1/replicas of the pool: the count is `replicas` x what fits one device.
    `extra_weight_bytes`: more weight memory per device derived from the params' base matrices (the engine's packed
    copy of its layer matrices, `packed_weights.packed_bytes`); remade for each weight set, so with
    `reserve_weight_push` a push that brings new base matrices brings a second one while the old one serves."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cache_memory_fraction must be in (0, 1], got {fraction}")
    probe = KVCacheSpec(num_pages=1, **spec_wo_pages)
    shards = kv_head_shards(probe, mesh)
    page_b = probe.page_bytes(shards)
    limit, in_use, source = device_memory(list(mesh.devices.flat))
    pbytes = param_bytes_per_device(cfg, param_shardings)
    ws = workspace_bytes(getattr(cfg, "text", cfg), max_slots // replicas, max_prefill, max_seq, shards)
    incoming = _incoming_push_bytes(cfg, param_shardings, pbytes) if reserve_weight_push else 0
    extra = int(extra_weight_bytes) * (2 if reserve_weight_push and _push_brings_base(cfg) else 1)
    budget = fraction * (limit - max(in_use, pbytes) - incoming - extra) - ws
    n = (int(budget // page_b) if budget > 0 else 0) * replicas
    report_weights = limit - max(in_use, pbytes) - incoming - extra <= 0
    detail = (f"{max(budget, 0) / 2**20:.1f} MiB per device for the pool (limit {limit / 2**20:.0f} MiB from "
              f"{source}, weights {pbytes / 2**20:.1f} MiB, incoming weights {incoming / 2**20:.1f} MiB, "
              + (f"packed weights {extra / 2**20:.1f} MiB, " if extra else "")
              + f"workspace {ws / 2**20:.1f} MiB, fraction {fraction}), pages of {page_b} B")
    if report_weights:
        detail = "the weights alone do not fit: " + detail
    return n, SizingReport(n, source, limit, in_use, pbytes, ws, page_b, incoming, extra), detail


def auto_num_pages(spec_wo_pages: dict, cfg: ModelConfig, mesh: Mesh, param_shardings: Any, *, max_slots: int,
                   max_prefill: int, max_seq: int, fraction: float,
                   reserve_weight_push: bool = False, replicas: int = 1, extra_weight_bytes: int = 0) -> SizingReport:
    """Number of pages that fit the generator mesh (`pool_budget`), at most a full reservation for every slot, a
    multiple of `replicas`; fewer than one full sequence: `KVSizingError`."""
    n, report, detail = pool_budget(spec_wo_pages, cfg, mesh, param_shardings, max_slots=max_slots,
                                    max_prefill=max_prefill, max_seq=max_seq, fraction=fraction,
                                    reserve_weight_push=reserve_weight_push, replicas=replicas,
                                    extra_weight_bytes=extra_weight_bytes)
    need_one = spec_wo_pages["max_pages_per_seq"]
    if n < need_one * replicas:
        raise KVSizingError(detail, n, need_one, max_seq)
    n = min(n, max_slots * need_one)
    n -= n % replicas
    return dataclasses.replace(report, num_pages=n)


def check_num_pages(num_pages: int, spec_wo_pages: dict, cfg: ModelConfig, mesh: Mesh, param_shardings: Any, *,
                    max_slots: int, max_prefill: int, max_seq: int, reserve_weight_push: bool = False,
                    replicas: int = 1, extra_weight_bytes: int = 0) -> None:
    """An explicit pool of `num_pages` must fit the same budget (all of the free memory: fraction 1): else
    `KVSizingError` with the largest count that fits."""
    n, _, detail = pool_budget(spec_wo_pages, cfg, mesh, param_shardings, max_slots=max_slots,
                               max_prefill=max_prefill, max_seq=max_seq, fraction=1.0,
                               reserve_weight_push=reserve_weight_push, replicas=replicas,
                               extra_weight_bytes=extra_weight_bytes)
    if num_pages > n:
        raise KVSizingError(f"{num_pages} pages asked, {detail}", n - n % replicas, spec_wo_pages["max_pages_per_seq"],
                            max_seq)


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
