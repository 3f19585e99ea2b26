"""Token sampling with exact behaviour log-probs (pure, jittable, per-row parameters).

Every row b of a batch of logits [B, V] carries its own sampling parameters (temperature
T_b, top_k_b, top_p_b) and its own random stream, so mixing requests in one decode batch
never changes any row's result and never recompiles (parameters are arrays, not statics).

Definitions, for one row with float32 logits l in R^V:

* scaled logits   z = l / T          (T > 0);   z = l   (T == 0, greedy)
* behaviour log-prob of the returned token x:  log_softmax(z)[x]  over the FULL vocabulary,
  before any top-k / top-p truncation: the quantity the trainer recomputes with
  `transformer.sequence_logprobs(..., temperature=T)` (T = 1 for greedy rows).
* truncation (HF / vLLM order): sort z descending, p = softmax(z_sorted);
    top-k keeps ranks r < k (k = 0: all);
    top-p keeps ranks r whose exclusive cumulative mass of the *top-k-renormalised*
    distribution is < top_p (rank 0 always kept; top_p >= 1: all).
  The kept set is a prefix of the sorted order; with theta = the smallest kept z, the
  sampling support is {v : z_v >= theta} (tokens tied with theta are all kept).
* sampling: x = argmax_v (z_v + g_v) over the support, g_v ~ Gumbel(0, 1) i.i.d. drawn from
  key = fold_in(fold_in(PRNGKey(seed), sample_index), position)   (`request_key`),
  i.e. a draw from softmax(z) restricted to and renormalised on the support. Greedy rows
  return argmax(l) (first index on ties, like torch.argmax).

Truncation without a full-vocabulary sort: when some row of the batch truncates (`lax.cond`),
the M = `TOPK_PREFILTER` largest scaled logits of every row come from `lax.top_k` and theta is
computed on that sorted prefix (softmax normalised by the full-vocabulary logsumexp). A row is
*resolved* by the prefix when its kept set provably ends inside it: 0 < top_k <= M, or top_k off
and the prefix's cumulative mass already reaches top_p. Only if some truncating row is not resolved
(a flat distribution under top-p, or top_k > M) does a second `lax.cond` sort the full vocabulary,
and even then a resolved row keeps its prefix theta, so every row's result depends only on its own
logits and parameters, never on the batch composition. A row without truncation gets theta =
-inf (the full support) in every branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_SEED = 2**32  # seeds are uint32: PRNGKey(s) for 0 <= s < 2**32


def request_key(seed: jax.Array, sample_index: jax.Array, position: jax.Array) -> jax.Array:
    """Raw PRNG key of the token at absolute `position` of sample `sample_index` of a request.

    fold_in(fold_in(PRNGKey(seed), sample_index), position); scalars (vmap for batches).
    """
    key = jax.random.PRNGKey(jnp.asarray(seed, jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(key, sample_index), position)


# The Gumbel noise of a batch, [B, V]: the numbers jax.random draws (`request_key`, then `jax.random.gumbel(key, (V,))`),
# computed as plain uint32 arithmetic. jax lowers its threefry hash on CPU as a 5-trip while loop (every trip a
# dozen thunks and copies of its [B, V] carries): three such loops per decode step, ~550 of the ~850 thunks a step of
# a one-layer model ran (issue 28). The unrolled hash below is the same function (jax's own non-CPU lowering,
# `_threefry2x32_lowering(use_rolled_loops=False)`), so the stream is unchanged, bit for bit
# (tests/generator/test_sampling.py); where jax's settings pick another stream it falls back to jax.random.
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block cipher (20 rounds) on uint32 arrays (broadcast together), unrolled."""
    u32 = jnp.uint32
    k1, k2, x1, x2 = (jnp.asarray(a, u32) for a in (k1, k2, x1, x2))
    ks = (k1, k2, k1 ^ k2 ^ u32(0x1BD11BDA))
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = jax.lax.shift_left(x[1], u32(r)) | jax.lax.shift_right_logical(x[1], u32(32 - r))
            x[1] = x[0] ^ x[1]
        x[0] = x[0] + ks[(i + 1) % 3]
        x[1] = x[1] + ks[(i + 2) % 3] + u32(i + 1)
    return x[0], x[1]


def _lean_stream() -> bool:
    """jax's settings draw the stream `gumbel_noise` reproduces (the defaults: threefry2x32, partitionable bits,
    low-range Gumbel)."""
    cfg = jax.config
    return (str(getattr(cfg, "jax_default_prng_impl", "")) == "threefry2x32"
            and bool(getattr(cfg, "jax_threefry_partitionable", False))
            and not bool(getattr(cfg, "jax_high_dynamic_range_gumbel", True)))


def row_keys(seed: jax.Array, sample_index: jax.Array, position: jax.Array):
    """The request keys of a batch (`request_key` per row): with the lean stream a pair of [B] uint32 arrays, else
    jax's [B, 2] raw keys (`gumbel_from_keys` takes either)."""
    if not _lean_stream():
        return jax.vmap(request_key)(seed, sample_index, position)
    u32 = jnp.uint32
    zero = jnp.zeros_like(seed, u32)
    # PRNGKey(seed) = (seed >> 32, seed) = (0, seed) for uint32 seeds; fold_in(key, d) = threefry(key, (0, d))
    k1, k2 = threefry2x32(zero, seed.astype(u32), zero, sample_index.astype(u32))
    return threefry2x32(k1, k2, zero, position.astype(u32))


def gumbel_from_keys(keys, vocab: int) -> jax.Array:
    """[B, V] float32: row b = jax.random.gumbel(key b, (V,)), bitwise (unrolled threefry; see above)."""
    if not isinstance(keys, tuple):
        return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
    u32 = jnp.uint32
    k1, k2 = keys
    # random_bits(key, 32, (V,)) with partitionable threefry: b1 ^ b2 of threefry(key, (0, iota))
    iota = jax.lax.broadcasted_iota(u32, (1, vocab), 1)
    b1, b2 = threefry2x32(k1[:, None], k2[:, None], jnp.zeros((1, vocab), u32), iota)
    bits = b1 ^ b2
    # jax.random.uniform(minval=tiny, maxval=1) then -log(-log(u)), the same operations in the same order
    f32 = jnp.float32
    tiny = f32(jnp.finfo(f32).tiny)
    floats = jax.lax.bitcast_convert_type(jax.lax.shift_right_logical(bits, u32(32 - 23)) | u32(0x3F800000),
                                          f32) - f32(1.0)
    u = jax.lax.max(tiny, floats * (f32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def gumbel_noise(seed: jax.Array, sample_index: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """[B, V] float32: row b = jax.random.gumbel(request_key(seed[b], sample_index[b], position[b]), (V,)),
    bitwise."""
    return gumbel_from_keys(row_keys(seed, sample_index, position), vocab)


def scale_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """z = logits / T per row (T > 0), logits unchanged where T == 0. logits [B, V], T [B]."""
    t = temperature[:, None].astype(jnp.float32)
    return jnp.where(t > 0, logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0), logits.astype(jnp.float32))


def behaviour_logprobs(logits: jax.Array, temperature: jax.Array, tokens: jax.Array) -> jax.Array:
    """log_softmax(scale_logits(logits, T))[b, tokens[b]] over the full vocabulary, [B] float32."""
    z = scale_logits(logits, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    return jnp.take_along_axis(z, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0] - lse


def top_logprobs(logits: jax.Array, temperature: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k (static) largest entries of log_softmax(scale_logits(logits, T)) per row, the distribution whose entry
    at the sampled token is its behaviour log-prob (`behaviour_logprobs`: the same z and logsumexp, so the top-1
    entry of a greedy row is that log-prob bitwise): (log-probs [B, k] float32 descending, token ids [B, k] int32;
    equal values in id order, as `first_argmax`). Over the full vocabulary, before top-k / top-p truncation."""
    z = scale_logits(logits, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    vals, ids = jax.lax.top_k(z, k)
    return vals - lse[:, None], ids.astype(jnp.int32)


def truncation_threshold(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """theta [B]: the smallest scaled logit kept by top-k then top-p (see module doc).

    z [B, V] scaled logits, top_k [B] int (0 = off), top_p [B] float (>= 1 = off).
    """
    V = z.shape[-1]
    z_sorted = -jnp.sort(-z, axis=-1)  # descending
    rank = jnp.arange(V)[None, :]
    keep_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    p = jax.nn.softmax(z_sorted, axis=-1)
    p_k = jnp.where(keep_k, p, 0.0)
    p_k = p_k / jnp.sum(p_k, axis=-1, keepdims=True)
    exclusive = jnp.cumsum(p_k, axis=-1) - p_k
    keep_p = (top_p[:, None] >= 1.0) | (exclusive < top_p[:, None])
    keep = keep_k & keep_p
    keep = keep.at[:, 0].set(True)
    n_keep = jnp.sum(keep, axis=-1)  # the kept set is a prefix of the sorted order
    return jnp.take_along_axis(z_sorted, (n_keep - 1)[:, None], axis=-1)[:, 0]


TOPK_PREFILTER = 64  # M: sorted candidates taken with lax.top_k before any full-vocabulary sort


def threshold_from_sorted(z_sorted: jax.Array, lse: jax.Array, top_k: jax.Array,
                          top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(theta [B], resolved [B] bool) from the M largest scaled logits in descending order (M <= V).

    lse [B] = logsumexp of the full row, so p = exp(z - lse) are the full-vocabulary probabilities of
    the prefix; top-k renormalises over the top_k ranks (mass 1 when top-k is off). `resolved`: the kept
    set ends inside the prefix, so theta equals the full-vocabulary sort's (always true when M == V).
    """
    M = z_sorted.shape[-1]
    rank = jnp.arange(M)[None, :]
    keep_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    p_k = jnp.where(keep_k, jnp.exp(z_sorted - lse[:, None]), 0.0)
    mass = jnp.where(top_k > 0, jnp.sum(p_k, axis=-1), 1.0)
    p_k = p_k / mass[:, None]
    inclusive = jnp.cumsum(p_k, axis=-1)
    keep_p = (top_p[:, None] >= 1.0) | (inclusive - p_k < top_p[:, None])
    keep = (keep_k & keep_p).at[:, 0].set(True)
    n_keep = jnp.sum(keep, axis=-1)  # the kept set is a prefix of the sorted order
    theta = jnp.take_along_axis(z_sorted, (n_keep - 1)[:, None], axis=-1)[:, 0]
    ends_by_k = (top_k > 0) & (top_k <= M)
    ends_by_p = (top_k <= 0) & (top_p < 1.0) & (inclusive[:, -1] >= top_p)  # top_k > M: mass unknown
    return theta, ends_by_k | ends_by_p


def prefilter_threshold(z: jax.Array, top_k: jax.Array, top_p: jax.Array,
                        prefilter: int = TOPK_PREFILTER) -> tuple[jax.Array, jax.Array]:
    """`threshold_from_sorted` on the `prefilter` largest logits of each row (`lax.top_k`, no sort of V)."""
    lse = jax.nn.logsumexp(z, axis=-1)
    M = min(int(prefilter), z.shape[-1])
    theta, resolved = threshold_from_sorted(jax.lax.top_k(z, M)[0], lse, top_k, top_p)
    return theta, resolved | (M == z.shape[-1])


def needs_truncation(temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B] bool: the row samples (T > 0) with top-k or top-p active."""
    return (temperature > 0) & ((top_k > 0) | (top_p < 1.0))


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seed: jax.Array,
           sample_index: jax.Array, position: jax.Array,
           prefilter: int = TOPK_PREFILTER, truncation: bool = True) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; returns (tokens [B] int32, behaviour log-probs [B] float32).

    logits [B, V] (any float dtype, used in float32); temperature [B] float (0 = greedy);
    top_k [B] int (0 = off); top_p [B] float in (0, 1]; seed [B] uint32; sample_index [B]
    int; position [B] int = absolute position of the token being sampled.

    truncation=False (static) leaves the top-k/top-p machinery out of the program: for batches whose rows all
    sample without truncation (`needs_truncation` false everywhere; the caller guarantees it), where it gives
    the same tokens as truncation=True (such rows have theta = -inf in every branch) and compiles in about
    half the time (measured on XLA:CPU).
    """
    logits = logits.astype(jnp.float32)
    temperature = temperature.astype(jnp.float32)
    top_k = top_k.astype(jnp.int32)
    top_p = top_p.astype(jnp.float32)
    z = scale_logits(logits, temperature)
    trunc = needs_truncation(temperature, top_k, top_p)

    def truncated():
        theta, resolved = prefilter_threshold(z, top_k, top_p, prefilter)
        unsettled = trunc & ~resolved

        def full_sort_rows():  # one row at a time, and only the rows the prefix cannot settle
            def row(args):
                z_r, k_r, p_r, need, th = args
                return jax.lax.cond(need, lambda: truncation_threshold(z_r[None], k_r[None], p_r[None])[0],
                                    lambda: th)
            return jax.lax.map(row, (z, top_k, top_p, unsettled, theta))

        theta = jax.lax.cond(jnp.any(unsettled), full_sort_rows, lambda: theta)
        return jnp.where(trunc, theta, -jnp.inf)

    # the row keys are computed here, outside the branch: an operand of the cond is materialised once, where
    # inside it XLA fused the two [B] key hashes into the [B, V] noise fusion (per element in the HLO; LLVM
    # hoisted them out of the inner loop, so no measured change in time: issue 28 NOTES)
    keys = row_keys(seed, sample_index, position)

    def sampled():
        no_theta = jnp.full(z.shape[:1], -jnp.inf, jnp.float32)
        theta = jax.lax.cond(jnp.any(trunc), truncated, lambda: no_theta) if truncation else no_theta
        gumbel = gumbel_from_keys(keys, z.shape[-1])
        # one argmax for the whole batch: sampled rows over their support + noise, greedy rows over the logits
        return first_argmax(jnp.where((temperature > 0)[:, None],
                                      jnp.where(z >= theta[:, None], z, -jnp.inf) + gumbel, logits))

    tokens = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: first_argmax(logits)).astype(jnp.int32)
    return tokens, behaviour_logprobs(logits, temperature, tokens)


def first_argmax(x: jax.Array) -> jax.Array:
    """argmax over the last axis, first index on ties (= jnp.argmax for non-NaN rows), as two plain
    reductions: XLA:CPU's variadic-reduce argmax is ~20x slower on [64, 16k] rows."""
    m = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1)


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """[B] bool: tokens[b] is one of stop_ids[b, :] (padded with -1)."""
    return jnp.any((tokens[:, None] == stop_ids) & (stop_ids >= 0), axis=-1)
