"""The portable attention implementations (no Pallas): the ``xla`` reference (full float32 scores and a
materialised mask) and ``blockwise``, pure-JAX flash attention with a FlashAttention-2 custom VJP. The
switch between them and the kernels is ``kernels.attention``; its docstring states the function they all
compute."""


from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DEFAULT_BLOCK = 512

_NEG_INF = -1e30


# ---------------------------------------------------------------------------------------
# Reference (XLA): full scores
# ---------------------------------------------------------------------------------------
def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention.

    q [B, T, H, E], k/v [B, S, K, E], mask [B, T, S] (True = may attend) -> [B, T, H, E].
    Scores and softmax in float32; probabilities cast back to the compute dtype.
    """
    B, T, H, E = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, E)
    s = jnp.einsum("btkge,bske->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None, :, :], s, _NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bske->btkge", p, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return o.reshape(B, T, H, E)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids (0 = padding) -> [B, T, T] causal mask with no attention across segments."""
    T = segment_ids.shape[-1]
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    valid = (segment_ids != 0)[:, None, :]
    return causal[None] & same & valid


def xla_attention(q, k, v, segment_ids, scale):
    return grouped_attention(q, k, v, segment_mask(segment_ids), scale)


# ---------------------------------------------------------------------------------------
# Blockwise (flash) attention in pure JAX
# ---------------------------------------------------------------------------------------
def run_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids -> [B, T] int32: the index of the first token of each token's run (its
    sequence), ``T`` for padding (segment 0), which has no visible key."""
    B, T = segment_ids.shape
    pos = jnp.arange(T, dtype=jnp.int32)
    boundary = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(boundary, pos, 0), axis=1)
    return jnp.where(segment_ids != 0, start, jnp.int32(T))


def run_ends(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids -> [B, T] int32: the index of the last token of each token's run, -1 for padding
    (the non-causal bound of ``blockwise_attention(causal=False)``)."""
    T = segment_ids.shape[1]
    rev = segment_ids[:, ::-1]
    return jnp.where(segment_ids != 0, T - 1 - run_starts(rev)[:, ::-1], jnp.int32(-1))


def _block_ranges(q_start: jax.Array, qpos: jax.Array, nk: int, bq: int, bk: int,
                  q_end: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per query block i, the key blocks [lo_i, hi_i] that can hold a visible key for some row.

    ``q_start`` [B, Tq]: the run start (key index) of each query (``run_starts``; padding: past the end);
    ``qpos`` [Tq / bq]: the key position of each query block's first query (``i * bq`` in self-attention;
    chunk or stripe starts under context parallelism). hi_i: the causal bound (the block of the block's
    last query), clipped to the last key block. lo_i: the block of the earliest run start among the block's queries
    over all rows (segments
    are contiguous runs, so no key before it is visible). A block of padding only gets lo > hi (no work).
    Non-causal (``q_end`` [B, Tq], the run end of each query, -1 for padding): hi_i is the block of the latest
    run end among the block's queries instead of the causal bound.
    """
    Tq = q_start.shape[1]
    nq = Tq // bq
    lo = (q_start.min(axis=0).reshape(nq, bq).min(axis=1) // bk).astype(jnp.int32)
    if q_end is None:
        hi = jnp.minimum((qpos + bq - 1) // bk, nk - 1)
    else:
        hi = jnp.minimum(q_end.max(axis=0).reshape(nq, bq).max(axis=1) // bk, nk - 1)
    return lo, hi.astype(jnp.int32)


def _block_mask(seg_q, seg_k, q0, k0, bq, bk, causal: bool = True):
    """[B, bq, bk] visibility of keys k0.. for queries at key positions q0.. (causal unless ``causal=False``,
    same segment, key not padding)."""
    same = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k != 0)[:, None, :]
    if not causal:
        return same
    causal_mask = (q0 + jnp.arange(bq))[:, None] >= (k0 + jnp.arange(bk))[None, :]
    return causal_mask[None] & same


def _key_block(k, v, seg_k, seg_q, qpos0, j, bq: int, bk: int, causal: bool = True):
    """Key block j: (k block, v block, [B, 1, 1, bq, bk] visibility for the query block at key position
    ``qpos0``)."""
    k0 = j * bk

    def sl(x):
        return jax.lax.dynamic_slice_in_dim(x, k0, bk, axis=1)

    return sl(k), sl(v), _block_mask(seg_q, sl(seg_k), qpos0, k0, bq, bk, causal)[:, None, None]


def _scores(qb, kb, scale):
    """q block [B, bq, K, G, E], k block [B, bk, K, E] -> float32 scores [B, K, G, bq, bk]."""
    return jnp.einsum("bqkge,bske->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale


def _flash_forward(q, k, v, seg_q, seg_k, q_start, qpos, q_end, scale, bq, bk):
    """(out [B, Tq, K, G, E] in q.dtype, lse [B, K, G, Tq] float32). Query block i sits at key positions
    ``qpos[i]`` onwards; ``q_end`` None = causal, else the queries' run ends (non-causal)."""
    B, Tq, K, G, E = q.shape
    nq = Tq // bq
    causal = q_end is None
    lo, hi = _block_ranges(q_start, qpos, k.shape[1] // bk, bq, bk, q_end)

    def q_block(i):
        q0 = i * bq
        qb = jax.lax.dynamic_slice_in_dim(q, q0, bq, axis=1)
        sq = jax.lax.dynamic_slice_in_dim(seg_q, q0, bq, axis=1)

        def step(j, carry):
            m, l, acc = carry
            kb, vb, mask = _key_block(k, v, seg_k, sq, qpos[i], j, bq, bk, causal)
            s = jnp.where(mask, _scores(qb, kb, scale), _NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(axis=-1)
            pv = jnp.einsum("bkgqs,bske->bqkge", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
            acc = acc * jnp.moveaxis(alpha, -1, 1)[..., None] + pv
            return m_new, l, acc

        init = (jnp.full((B, K, G, bq), _NEG_INF, jnp.float32), jnp.zeros((B, K, G, bq), jnp.float32),
                jnp.zeros((B, bq, K, G, E), jnp.float32))
        m, l, acc = jax.lax.fori_loop(lo[i], hi[i] + 1, step, init)
        safe = jnp.where(l > 0, l, 1.0)
        out = (acc / jnp.moveaxis(safe, -1, 1)[..., None]).astype(q.dtype)
        lse = jnp.where(l > 0, m + jnp.log(safe), jnp.inf)  # inf: exp(s - lse) = 0 on padding rows
        return out, lse

    out, lse = jax.lax.map(q_block, jnp.arange(nq))  # [nq, B, bq, K, G, E], [nq, B, K, G, bq]
    out = jnp.moveaxis(out, 0, 1).reshape(B, Tq, K, G, E)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, G, Tq)
    return out, lse


def _flash_backward(q, k, v, seg_q, seg_k, q_start, qpos, q_end, out, lse, dout, scale, bq, bk):
    B, Tq, K, G, E = q.shape
    nq = Tq // bq
    causal = q_end is None
    lo, hi = _block_ranges(q_start, qpos, k.shape[1] // bk, bq, bk, q_end)
    # D_t = sum_e dO * O (FlashAttention-2), float32 [B, K, G, Tq]
    delta = jnp.einsum("btkge,btkge->bkgt", dout.astype(jnp.float32), out.astype(jnp.float32))

    def q_block(i, carry):
        dq, dk, dv = carry
        q0 = i * bq
        qb = jax.lax.dynamic_slice_in_dim(q, q0, bq, axis=1)
        dob = jax.lax.dynamic_slice_in_dim(dout, q0, bq, axis=1)
        sq = jax.lax.dynamic_slice_in_dim(seg_q, q0, bq, axis=1)
        lse_b = jax.lax.dynamic_slice_in_dim(lse, q0, bq, axis=3)
        d_b = jax.lax.dynamic_slice_in_dim(delta, q0, bq, axis=3)

        def step(j, inner):
            dq_b, dk, dv = inner
            k0 = j * bk
            kb, vb, mask = _key_block(k, v, seg_k, sq, qpos[i], j, bq, bk, causal)
            s = _scores(qb, kb, scale)
            p = jnp.where(mask, jnp.exp(s - lse_b[..., None]), 0.0)  # [B, K, G, bq, bk] float32
            dv_j = jnp.einsum("bkgqs,bqkge->bske", p.astype(dout.dtype), dob, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkge,bske->bkgqs", dob, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - d_b[..., None]) * scale
            dq_b = dq_b + jnp.einsum("bkgqs,bske->bqkge", ds.astype(k.dtype), kb, preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("bkgqs,bqkge->bske", ds.astype(q.dtype), qb, preferred_element_type=jnp.float32)
            dk = jax.lax.dynamic_update_slice_in_dim(dk, jax.lax.dynamic_slice_in_dim(dk, k0, bk, 1) + dk_j, k0, 1)
            dv = jax.lax.dynamic_update_slice_in_dim(dv, jax.lax.dynamic_slice_in_dim(dv, k0, bk, 1) + dv_j, k0, 1)
            return dq_b, dk, dv

        dq_b = jnp.zeros((B, bq, K, G, E), jnp.float32)
        dq_b, dk, dv = jax.lax.fori_loop(lo[i], hi[i] + 1, step, (dq_b, dk, dv))
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_b, q0, 1), dk, dv

    init = (jnp.zeros((B, Tq, K, G, E), jnp.float32), jnp.zeros(k.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, nq, q_block, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _flash(q, k, v, seg_q, seg_k, q_start, qpos, q_end, scale, bq, bk):
    return _flash_forward(q, k, v, seg_q, seg_k, q_start, qpos, q_end, scale, bq, bk)[0]


def _flash_fwd(q, k, v, seg_q, seg_k, q_start, qpos, q_end, scale, bq, bk):
    out, lse = _flash_forward(q, k, v, seg_q, seg_k, q_start, qpos, q_end, scale, bq, bk)
    return out, (q, k, v, seg_q, seg_k, q_start, qpos, q_end, out, lse)


def _flash_bwd(scale, bq, bk, res, dout):
    q, k, v, seg_q, seg_k, q_start, qpos, q_end, out, lse = res
    dq, dk, dv = _flash_backward(q, k, v, seg_q, seg_k, q_start, qpos, q_end, out, lse, dout, scale, bq, bk)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_len(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    if x.shape[axis] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float,
                        block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK, causal: bool = True) -> jax.Array:
    """Flash attention in pure JAX: q [B, T, H, E], k/v [B, T, K, E], segment_ids [B, T] -> [B, T, H, E].

    Rows are padded (segment 0) to a multiple of the block sizes; a block larger than T shrinks to T.
    Differentiable (custom VJP, no T x T buffer in either direction). ``causal=False``: every token attends
    its whole segment (a vision tower's windows and frames); key blocks outside the query block's segments
    are skipped in both directions, so segments of w tokens cost O(T * (w + block)).
    """
    B, T, H, E = q.shape
    if k.shape[1] != T or v.shape[1] != T or segment_ids.shape != (B, T):
        raise ValueError(f"blockwise_attention: self-attention shapes q {q.shape}, k {k.shape}, v {v.shape}, "
                         f"segment_ids {segment_ids.shape}")
    segment_ids = segment_ids.astype(jnp.int32)
    if not causal:
        return _non_causal(q, k, v, segment_ids, scale, block_q, block_k)
    return blockwise_attention_chunk(q, k, v, segment_ids, segment_ids, run_starts(segment_ids), 0, scale,
                                     block_q, block_k)


def blockwise_attention_chunk(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array,
                              q_start: jax.Array, q_offset, scale: float, block_q: int = DEFAULT_BLOCK,
                              block_k: int = DEFAULT_BLOCK) -> jax.Array:
    """``blockwise_attention`` of a chunk of queries against the whole row's keys (context parallelism):
    q [B, Tq, H, E] at key positions ``q_offset + i``, k/v [B, Tk, K, E], seg_q [B, Tq] / seg_k [B, Tk]
    segment ids, ``q_start`` [B, Tq] the queries' run starts (``run_starts`` of the whole row at the
    chunk). Self-attention is ``q_offset = 0``, ``Tq = Tk``. Queries and keys are padded (segment 0) to
    block multiples at their ends; ``q_offset`` may be traced (``lax.axis_index`` under ``shard_map``).
    """
    return blockwise_attention_stripes([(q, seg_q, q_start, q_offset)], k, v, seg_k, scale, block_q, block_k)[0]


def blockwise_attention_stripes(stripes, k: jax.Array, v: jax.Array, seg_k: jax.Array, scale: float,
                                block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK) -> list[jax.Array]:
    """Several chunks of queries ("stripes", each a contiguous run of key positions) against the whole row
    in ONE block loop: ``stripes`` = [(q [B, n, H, E], seg_q [B, n], q_start [B, n], first key position
    (may be traced)), ...] of equal n -> their outputs. Each stripe is padded to a block multiple and every
    query block carries its own key position, so the causal bound and block skipping are exact per stripe
    (the load-balanced context-parallel layout: stripes d and 2C-1-d of a row on device d)."""
    B, n, H, E = stripes[0][0].shape
    Tk, K = k.shape[1], k.shape[2]
    bq, bk = min(int(block_q), n), min(int(block_k), Tk)
    npad, Tkp = -(-n // bq) * bq, -(-Tk // bk) * bk
    qs, sqs, starts, pos = [], [], [], []
    for q, seg_q, q_start, first in stripes:
        qs.append(_pad_len(q, npad))
        sqs.append(_pad_len(seg_q.astype(jnp.int32), npad))
        starts.append(jnp.pad(q_start.astype(jnp.int32), [(0, 0), (0, npad - n)], constant_values=Tkp))
        pos.append(jnp.asarray(first, jnp.int32) + jnp.arange(npad // bq, dtype=jnp.int32) * bq)
    k, v, seg_k = _pad_len(k, Tkp), _pad_len(v, Tkp), _pad_len(seg_k.astype(jnp.int32), Tkp)
    q = jnp.concatenate(qs, axis=1)
    out = _flash(q.reshape(B, q.shape[1], K, H // K, E), k, v, jnp.concatenate(sqs, axis=1), seg_k,
                 jnp.concatenate(starts, axis=1), jnp.concatenate(pos), None, float(scale), bq, bk)
    out = out.reshape(B, q.shape[1], H, E)
    return [out[:, m * npad: m * npad + n] for m in range(len(stripes))]


def _non_causal(q, k, v, segment_ids, scale, block_q, block_k):
    """``blockwise_attention(causal=False)`` (self-attention, segments are contiguous runs)."""
    B, T, H, E = q.shape
    K = k.shape[2]
    bq, bk = min(int(block_q), T), min(int(block_k), T)
    Tqp, Tkp = -(-T // bq) * bq, -(-T // bk) * bk
    seg_q, seg_k = _pad_len(segment_ids, Tqp), _pad_len(segment_ids, Tkp)
    q_start = jnp.pad(run_starts(segment_ids), [(0, 0), (0, Tqp - T)], constant_values=Tkp)
    q_end = jnp.pad(run_ends(segment_ids), [(0, 0), (0, Tqp - T)], constant_values=-1)
    qp = _pad_len(q, Tqp).reshape(B, Tqp, K, H // K, E)
    pos = jnp.arange(Tqp // bq, dtype=jnp.int32) * bq
    out = _flash(qp, _pad_len(k, Tkp), _pad_len(v, Tkp), seg_q, seg_k, q_start, pos, q_end, float(scale), bq, bk)
    return out.reshape(B, Tqp, H, E)[:, :T]
