"""The host's mirror of the decode slots and the page mapping that follows it (split out of ``engine.py``).

A decode step writes token ``pos`` of every live slot into page ``pos // page_size`` of its sequence; when that page
is not mapped yet, the host takes one from the slot's replica allocator before the step and hands the device
``new_pages[s]`` (-1: nothing to map). The host knows every limit except stop tokens (sampled on the device), so a
replica short of pages first drops the slots the device already stopped, then raises ``OutOfPagesError`` with
nothing changed. A K-step dispatch maps ahead every page its K steps start (K <= page_size: at most one per slot).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxrl_async.generator import kv_cache

__all__ = ["HostSlots", "advance", "allocate_pages", "need_ahead", "need_now"]


@dataclasses.dataclass
class HostSlots:
    """Host mirror of the slots (what page allocation needs) and the page allocator."""

    alloc: kv_cache.ReplicaAllocators  # one page allocator per decode replica
    live: np.ndarray  # [S] bool: inserted, not released
    done: np.ndarray  # [S] bool: known finished (max_new / length on host, stop ids after a refresh)
    pos: np.ndarray  # [S] int: position of the last sampled token
    num_generated: np.ndarray  # [S] int
    max_new: np.ndarray  # [S] int
    num_pages: np.ndarray  # [S] int: pages held
    trunc: np.ndarray  # [S] bool: the slot samples with top-k / top-p (the decode step needs the full sampler)

    @classmethod
    def empty(cls, num_pages: int, num_slots: int, replicas: int = 1) -> "HostSlots":
        z = lambda dt: np.zeros(num_slots, dt)  # noqa: E731
        return cls(kv_cache.ReplicaAllocators(num_pages, num_slots, replicas), z(bool), z(bool), z(np.int64),
                   z(np.int64), z(np.int64), z(np.int64), z(bool))


def need_now(h: HostSlots, page_size: int) -> np.ndarray:
    """[S] bool: active slots whose next write starts a page they do not hold."""
    return h.live & ~h.done & (h.pos // page_size >= h.num_pages)


def need_ahead(h: HostSlots, k: int, page_size: int, max_seq: int) -> np.ndarray:
    """[S] bool: active slots whose next k writes (fewer where max_new_tokens or the sequence limit ends them
    sooner) start a page they do not hold (k <= page_size: at most one)."""
    steps = np.minimum(k, np.minimum(h.max_new - h.num_generated, max_seq - 1 - h.pos))
    return h.live & ~h.done & (steps >= 1) & ((h.pos + np.maximum(steps, 1) - 1) // page_size >= h.num_pages)


def allocate_pages(h: HostSlots, need: np.ndarray,
                   device_done: Callable[[], np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One page from its replica's pages for every slot in ``need`` (a replica short of pages first drops the slots
    the device already stopped, ``device_done()`` -> [S] bool, then raises ``OutOfPagesError`` before changing
    anything): (new_pages, new_index) [S], the page and the page-table index it goes to (-1 / 0 elsewhere)."""
    S, replicas = h.live.shape[0], len(h.alloc.allocs)
    per = S // replicas
    counts = need.reshape(replicas, per).sum(axis=1)
    if device_done is not None and any(c > a.num_free for c, a in zip(counts, h.alloc.allocs)):
        h.done |= np.asarray(device_done()) & h.live  # stop ids are only known on the device
        need = need & ~h.done
    slots = np.flatnonzero(need)
    for r, a in enumerate(h.alloc.allocs):
        rs = slots[slots // per == r].tolist()
        if len(rs) > a.num_free:
            a.allocate(len(rs), rs)  # raises OutOfPagesError (.slots: that replica's), nothing changed
    new_pages = np.full(S, -1, np.int32)
    new_index = np.zeros(S, np.int32)
    for r, a in enumerate(h.alloc.allocs):  # a replica's pages in one call, handed out in slot order
        rs = slots[slots // per == r]
        if len(rs):
            pages = a.allocate(len(rs), rs.tolist())
            for s, p in zip(rs.tolist(), pages):
                a.slot_pages[s].append(p)
            new_pages[rs], new_index[rs] = pages, h.num_pages[rs]
    h.num_pages[slots] += 1
    return new_pages, new_index


def advance(h: HostSlots, steps: int, max_seq: int) -> None:
    """The host's view after ``steps`` decode steps: positions, counts, and the length limits it knows (stop tokens
    are read from the step results)."""
    # step by step, an active slot advances and is done once num_generated >= max_new or pos + 1 >= max_seq: it
    # advances to the first t >= 1 where t >= max_new - num_generated or t >= max_seq - 1 - pos, at most `steps`
    act = h.live & ~h.done
    until = np.maximum(np.minimum(h.max_new - h.num_generated, max_seq - 1 - h.pos), 1)
    moved = np.where(act, np.minimum(until, steps), 0)
    h.pos += moved
    h.num_generated += moved
    h.done |= act & (until <= steps)
