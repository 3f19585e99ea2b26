"""Portable paged-KV attention: the pool's static shape (``KVCacheSpec``), writing a prefix into pages, the
decode attention over a slot's pages (``paged_decode_attend``: the reference, a gathered contiguous view with a
length mask; ``blocked_decode_attend``: only the blocks up to the longest active slot, on the ``page_heads`` pool
layout) and the prefill attention that fills the cache (``prefill_attend``, ``chunk_prefill_attend``).

Pool layout: one pool per k and v, ``[L, P, page_size, K, E]`` (L layers, P pages, K kv heads, E head dim), logical
axes ``POOL_AXES``; token t of slot s lives at ``pool[:, page_table[s, t // page_size], t % page_size]``; page
``P`` (one past the end) is the null page (writes dropped, reads masked). The accelerator kernels and the pool
layouts they need are switched in ``paged_attention.py``; the host-side allocators and the pool's sizing are the
generator's (``generator/kv_cache.py``). Imports nothing from ``models/``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.kernels.flash import grouped_attention

POOL_AXES = ("layers", "cache_pages", "cache_page", "cache_kv_heads", "head_dim")


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

    Why this layout: a gathered block [S, bp, K, page, E] keeps each page's (page, E) keys contiguous with the
    head dim last, so viewing it as [S, K, bp * page, E] (the dots' batch dims slot and kv head leading, the
    block's tokens as one free dim) moves whole rows (a bitcast when K == 1), and each slot's query heads meet
    the block in one [G, E] x [E, bp * page] dot instead of bp small per-page dots of a query broadcast over
    the pages (issue 28: fewer, larger dots; ~10% of the one-layer step). On the ``split`` layout ([L, P, page,
    K, E]) XLA:CPU transposed every gathered block element by element before its dots, which cost more than
    the dots (measured in NOTES). The page ids are clamped on the [S, bp] table once (null entries:
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
        qg = q[:, 0].reshape(S, K, G, E)
        tok_in_block = jnp.arange(n)  # token t of a block: page t // page_size, offset t % page_size
        batch = ((0, 1), (0, 1))  # slot, kv head

        def body(b, carry):
            m, l, acc = carry  # [S, K, G] x 2, [S, K, G, E]
            pages = jax.lax.dynamic_slice_in_dim(pt, b * bp, bp, axis=1)  # [S, bp]
            # [S, bp, K, page, E] -> [S, K, bp * page, E]: whole (page, E) rows move (free when K == 1)
            kb, vb = (jnp.swapaxes(pool.at[layer_idx, pages].get(mode="promise_in_bounds"), 1, 2).reshape(
                S, K, n, E).astype(q.dtype) for pool in (k_pool, v_pool))
            s = jax.lax.dot_general(qg, kb, (((3,), (3,)), batch), preferred_element_type=jnp.float32) * scale
            live = (b * n + tok_in_block)[None] <= positions[:, None]  # [S, n]
            s = jnp.where(live[:, None, None, :], s, neg)  # [S, K, G, n]
            m_new = jnp.maximum(m, jnp.max(s, axis=3))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=3)
            pv = jax.lax.dot_general(p.astype(vb.dtype), vb, (((3,), (2,)), batch),
                                     preferred_element_type=jnp.float32)  # [S, K, G, E]
            return m_new, l, acc * corr[..., None] + pv

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
