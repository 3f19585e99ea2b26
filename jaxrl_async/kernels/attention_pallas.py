"""Accelerator attention kernels behind ``model.attention`` (``splash`` on TPU, ``gpu_flash`` on NVIDIA GPUs).

Both are JAX's own Pallas kernels, wrapped to compute exactly the reference function of
``kernels/flash.py`` (causal within a segment, nothing across segments, GQA):

* ``splash``: ``jax.experimental.pallas.ops.tpu.splash_attention`` (a causal ``MultiHeadMask`` plus
  ``SegmentIds``; GQA natively: K/V keep their K heads). Fully masked blocks are skipped by the kernel's
  mask info.
* ``gpu_flash``: ``jax.experimental.pallas.ops.gpu.attention.mha`` (Pallas-Triton flash attention with
  ``segment_ids`` and ``causal=True``). The kernel is multi-head only, so K/V are repeated to H heads
  (inside the shard: K x G per device, not a global copy).

On a mesh (the trainer's, under ``sharding.activations.activation_rules``) the kernel runs under
``jax.shard_map`` with the activations' own shardings: batch over the data axes, heads over ``tensor``;
the sequence axis is not sharded here (rows split over ``context``: ``context_parallel_attention``). When the kv
heads are not split
like the query heads (e.g. 2 kv heads on tensor = 4), K/V are repeated to H heads first so that every
shard holds the kv heads of its query heads.

Rows are padded (segment 0) to a multiple of the block. Padding queries (segment 0) attend other
padding in these kernels (the reference averages V there, ``blockwise`` gives 0): no loss reads them.
On the CPU the kernels run in Pallas interpret mode (slow; for tests against the reference).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_async.kernels.platform import at_precision, kernel_platform
from jaxrl_async.sharding.activations import active_activation_rules
from jaxrl_async.sharding.rules import spec_axes_size

Q_AXES = ("batch", "length", "activation_heads", "head_dim")
KV_AXES = ("batch", "length", "activation_kv_heads", "head_dim")
SEG_AXES = ("batch", "length")


def _pad_rows(q, k, v, segment_ids, multiple: int):
    T = q.shape[1]
    Tp = -(-T // multiple) * multiple
    if Tp == T:
        return q, k, v, segment_ids, T
    pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
    return (jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad),
            jnp.pad(segment_ids, [(0, 0), (0, Tp - T)]), T)


def _on_mesh(local: Callable, q, k, v, segment_ids):
    """``local(q, k, v, seg)`` on every shard of the active mesh (or directly without one)."""
    active = active_activation_rules()
    if active is None:
        return local(q, k, v, segment_ids)
    from jaxrl_async.sharding.rules import logical_to_spec

    mesh, rules = active
    q_spec = logical_to_spec(Q_AXES, q.shape, rules, mesh)
    kv_spec = logical_to_spec(KV_AXES, k.shape, rules, mesh)
    seg_spec = logical_to_spec(SEG_AXES, segment_ids.shape, rules, mesh)
    if q_spec[1] is not None:
        raise ValueError(f"attention kernels need the sequence axis unsharded, got {q_spec}")
    if kv_spec[2] != q_spec[2]:  # kv heads not split like the query heads: give every shard its own
        G = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        kv_spec = P(kv_spec[0], None, q_spec[2], None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                       check_vma=False)
    return fn(q, k, v, segment_ids)


# ---------------------------------------------------------------------------------------
# TPU: splash attention
# ---------------------------------------------------------------------------------------
def _splash_local(q, k, v, seg, *, scale: float, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    B, T, H, E = q.shape
    b = min(block, T)
    mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(H)])
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    # splash has no softmax scale: scale q (exactly what the reference's scores do: (q k) * scale)
    qt = jnp.swapaxes(q, 1, 2) * jnp.asarray(scale, q.dtype)
    # Mosaic takes bf16 operands only at the default precision (a global "highest" would make it ask for
    # an fp32 contraction of bf16 vectors and fail to compile); fp32 operands get a full fp32 matmul
    precision = "highest" if q.dtype == jnp.float32 else "default"
    run = at_precision(lambda q_, k_, v_, s_: jax.vmap(kernel)(q_, k_, v_, segment_ids=sk.SegmentIds(q=s_, kv=s_)),
                        precision)
    out = run(qt, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), seg)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def splash_attention(q, k, v, segment_ids, scale: float, block: int = 512, *, interpret: bool | None = None):
    """q [B, T, H, E], k/v [B, T, K, E], segment_ids [B, T] -> [B, T, H, E] with the TPU splash kernel."""
    if interpret is None:
        interpret = kernel_platform() != "tpu"
    # the kernel's blocks are multiples of the 128 TPU lanes; short rows are padded up to one block
    lanes = 128
    b = max(lanes, min(block, -(-q.shape[1] // lanes) * lanes) // lanes * lanes)
    q, k, v, seg, T = _pad_rows(q, k, v, segment_ids.astype(jnp.int32), b)
    local = functools.partial(_splash_local, scale=float(scale), block=b, interpret=interpret)
    return _on_mesh(local, q, k, v, seg)[:, :T]


# ---------------------------------------------------------------------------------------
# NVIDIA GPU: Pallas-Triton flash attention
# ---------------------------------------------------------------------------------------
def _gpu_local(q, k, v, seg, *, scale: float, block: int, interpret: bool):
    from jax.experimental.pallas.ops.gpu import attention as ga

    G = q.shape[2] // k.shape[2]
    if G > 1:
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    b = min(block, q.shape[1])
    bwd = min(b, 64)
    sizes = ga.BlockSizes(block_q=b, block_k=b, block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
    return ga.mha(q, k, v, seg, sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret)


def gpu_flash_attention(q, k, v, segment_ids, scale: float, block: int = 128, *, interpret: bool | None = None):
    """q [B, T, H, E], k/v [B, T, K, E], segment_ids [B, T] -> [B, T, H, E] with the Pallas-Triton kernel."""
    if interpret is None:
        interpret = kernel_platform() not in ("gpu", "cuda")
    b = min(block, q.shape[1])
    q, k, v, seg, T = _pad_rows(q, k, v, segment_ids.astype(jnp.int32), b)
    local = functools.partial(_gpu_local, scale=float(scale), block=b, interpret=interpret)
    return _on_mesh(local, q, k, v, seg)[:, :T]


# ---------------------------------------------------------------------------------------
# Context (sequence) parallelism
# ---------------------------------------------------------------------------------------
CONTEXT_AXIS = "context"


def context_shards(seq_len: int) -> int:
    """How many ``context`` shards split a row of ``seq_len`` tokens under the active activation rules
    (1: no context parallelism: no rules, no ``context`` axis, or a length it does not divide)."""
    active = active_activation_rules()
    if active is None:
        return 1
    from jaxrl_async.sharding.rules import logical_to_spec

    mesh, rules = active
    spec = logical_to_spec(("length",), (seq_len,), rules, mesh)[0]
    if spec is None:
        return 1
    if spec != CONTEXT_AXIS:
        raise ValueError(f"the sequence axis may only be sharded over {CONTEXT_AXIS!r}, got {spec!r}")
    return mesh.shape[CONTEXT_AXIS]


def _balanced_pair(d: int, C: int) -> tuple[int, int]:
    """(even stripe, odd stripe) that device d computes under load balancing: stripes d and 2C-1-d."""
    a, b = d, 2 * C - 1 - d
    return (a, b) if a % 2 == 0 else (b, a)


def context_parallel_attention(impl: str, q, k, v, segment_ids, scale: float, block: int = 512,
                               load_balance: bool = True):
    """Attention of rows split over the ``context`` mesh axis (the activations' ``length`` under the
    trainer rules): every device holds T/C consecutive queries of its rows and all-gathers the rows'
    keys, values and segment ids over ``context`` (per layer, inside ``shard_map``; the backward pass of
    the all-gather is a reduce-scatter of dK/dV). Memory per device: the chunk's activations plus one
    layer's full-row K/V, instead of whole rows.

    ``impl``: ``splash`` runs the TPU kernel with the full-row causal mask split into C query shards (its
    mask info enters the ``shard_map`` sharded over ``context``, as MaxText does); anything else runs
    ``blockwise`` on the chunk (queries offset by the chunk start; ``gpu_flash``'s Triton kernel has no
    query offset, so GPUs use ``blockwise`` here).

    Load balance (``blockwise``, ``load_balance``): with contiguous chunks the last shard has the most causal
    work (stripe j of 2C sees j + 1/2 stripes of keys: 2C - 1/2 + 2C - 3/2 for the last shard against 1 for
    the first). The chunk's two halves are exchanged (``ppermute``) so that device d computes stripes d and
    2C-1-d (2C stripes of work on every device), and the outputs sent back: the activations keep their
    contiguous layout, only queries and attention outputs move. ``splash`` keeps contiguous chunks (its mask
    info is split by query blocks of the natural order).
    """
    from jaxrl_async.kernels.flash import blockwise_attention_chunk, blockwise_attention_stripes, run_starts
    from jaxrl_async.sharding.rules import logical_to_spec

    mesh, rules = active_activation_rules()
    B, T, H, E = q.shape
    C = mesh.shape[CONTEXT_AXIS]
    Tl = T // C
    segment_ids = segment_ids.astype(jnp.int32)
    q_spec = logical_to_spec(Q_AXES, q.shape, rules, mesh)
    kv_spec = logical_to_spec(KV_AXES, k.shape, rules, mesh)
    seg_spec = logical_to_spec(SEG_AXES, segment_ids.shape, rules, mesh)
    if q_spec[1] != CONTEXT_AXIS or seg_spec[1] != CONTEXT_AXIS:
        raise ValueError(f"context parallel attention: the sequence axis must be sharded over {CONTEXT_AXIS!r}, "
                         f"got q {q_spec}, segment ids {seg_spec}")
    if kv_spec[2] != q_spec[2]:  # kv heads not split like the query heads: give every shard its own
        G = H // k.shape[2]
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        kv_spec = P(kv_spec[0], CONTEXT_AXIS, q_spec[2], None)

    def gather(x):
        return jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)

    lanes = 128
    b = max(lanes, min(block, Tl) // lanes * lanes)
    if impl == "splash" and Tl % b == 0:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

        interpret = kernel_platform() != "tpu"
        h_local = H // spec_axes_size(mesh, q_spec[2])
        mask = sm.MultiHeadMask([sm.CausalMask((T, T), shard_count=C) for _ in range(h_local)])
        sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
        kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=C, interpret=interpret)
        kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(None, CONTEXT_AXIS)))
        precision = "highest" if q.dtype == jnp.float32 else "default"

        def run(kern, q_, k_, v_, sq, sk_):
            return jax.vmap(lambda a, b_, c, d, e: kern(a, b_, c, segment_ids=sk.SegmentIds(q=d, kv=e)))(
                q_, k_, v_, sq, sk_)

        run = at_precision(run, precision)

        def local(kern, q, k, v, seg):
            qt = jnp.swapaxes(q, 1, 2) * jnp.asarray(scale, q.dtype)
            out = run(kern, qt, jnp.swapaxes(gather(k), 1, 2), jnp.swapaxes(gather(v), 1, 2), seg, gather(seg))
            return jnp.swapaxes(out, 1, 2).astype(q.dtype)

        fn = jax.shard_map(local, mesh=mesh, in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, seg_spec),
                           out_specs=q_spec, check_vma=False)
        return fn(kernel, q, k, v, segment_ids)
    if impl == "splash":
        _log_fallback(f"splash needs chunks of whole {b}-token blocks (chunk {Tl})")

    Ts = Tl // 2
    balance = load_balance and Tl % 2 == 0 and C > 1

    def chunk(qc, k_full, v_full, seg_full, starts, first, n):
        """Attention of n queries at key positions first.. (a traced offset) to the whole row."""
        sq = jax.lax.dynamic_slice_in_dim(seg_full, first, n, axis=1)
        qs = jax.lax.dynamic_slice_in_dim(starts, first, n, axis=1)
        return blockwise_attention_chunk(qc, k_full, v_full, sq, seg_full, qs, first, scale, block, block)

    def local(q, k, v, seg):
        i = jax.lax.axis_index(CONTEXT_AXIS)
        seg_full, k_full, v_full = gather(seg), gather(k), gather(v)
        starts = run_starts(seg_full)
        if not balance:
            return chunk(q, k_full, v_full, seg_full, starts, i * Tl, Tl)
        # load balance: the row is 2C stripes of Ts queries; device i holds stripes 2i, 2i+1 and computes
        # stripes i and 2C-1-i (one even, one odd), so every device does the same causal work
        even, odd = zip(*[_balanced_pair(d, C) for d in range(C)])  # stripes device d computes
        to_even = [(src, even.index(2 * src)) for src in range(C)]  # first half = stripe 2 src
        to_odd = [(src, odd.index(2 * src + 1)) for src in range(C)]  # second half = stripe 2 src + 1
        q_even = jax.lax.ppermute(q[:, :Ts], CONTEXT_AXIS, to_even)
        q_odd = jax.lax.ppermute(q[:, Ts:], CONTEXT_AXIS, to_odd)
        stripes = []
        for qc, ids in ((q_even, even), (q_odd, odd)):
            first = jnp.asarray(ids, jnp.int32)[i] * Ts
            stripes.append((qc, jax.lax.dynamic_slice_in_dim(seg_full, first, Ts, axis=1),
                            jax.lax.dynamic_slice_in_dim(starts, first, Ts, axis=1), first))
        out_even, out_odd = blockwise_attention_stripes(stripes, k_full, v_full, seg_full, scale, block, block)
        back = lambda perm: [(b, a) for a, b in perm]  # noqa: E731
        return jnp.concatenate([jax.lax.ppermute(out_even, CONTEXT_AXIS, back(to_even)),
                                jax.lax.ppermute(out_odd, CONTEXT_AXIS, back(to_odd))], axis=1)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                       check_vma=False)
    return fn(q, k, v, segment_ids)


@functools.lru_cache(maxsize=None)
def _log_fallback(why: str) -> None:
    import logging

    logging.getLogger("jaxrl_async").warning("context parallel attention: blockwise instead of splash: %s", why)
