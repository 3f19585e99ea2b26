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
* sampling: x = the inverse CDF of softmax(z) restricted to and renormalised on the support, at
  u = jax.random.uniform(key, ()) with
  key = fold_in(fold_in(PRNGKey(seed), sample_index), position)   (`request_key`):
  x = the first token (vocabulary order) whose inclusive cumulative mass exceeds u times the
  support's mass (`inverse_cdf`). One uniform per row: the [B, V] Gumbel noise of the Gumbel-max
  draw this replaced (one threefry hash and two logs per vocabulary entry, about half of the
  sampler's time; without it a one-layer model's decode step is 1.12-1.21x cheaper, issue 28) is
  gone. Greedy rows return argmax(l) (first index on ties, like torch.argmax).

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


# The sampler's random numbers: one uniform per row, the number jax.random draws (`request_key`, then
# `jax.random.uniform(key, ())`), computed as plain uint32 arithmetic. jax lowers its threefry hash on CPU as a 5-trip
# while loop (every trip a dozen thunks and copies of its carries); the unrolled hash below is the same function
# (jax's own non-CPU lowering, `_threefry2x32_lowering(use_rolled_loops=False)`), so the numbers are unchanged, bit
# for bit (tests/generator/test_sampling.py); where jax's settings pick another stream it falls back to jax.random.
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
    """jax's settings draw the stream `uniform_from_keys` reproduces (the defaults: threefry2x32, partitionable
    bits)."""
    cfg = jax.config
    return (str(getattr(cfg, "jax_default_prng_impl", "")) == "threefry2x32"
            and bool(getattr(cfg, "jax_threefry_partitionable", False)))


def row_keys(seed: jax.Array, sample_index: jax.Array, position: jax.Array):
    """The request keys of a batch (`request_key` per row): with the lean stream a pair of [B] uint32 arrays, else
    jax's [B, 2] raw keys (`uniform_from_keys` takes either)."""
    if not _lean_stream():
        return jax.vmap(request_key)(seed, sample_index, position)
    u32 = jnp.uint32
    zero = jnp.zeros_like(seed, u32)
    # PRNGKey(seed) = (seed >> 32, seed) = (0, seed) for uint32 seeds; fold_in(key, d) = threefry(key, (0, d))
    k1, k2 = threefry2x32(zero, seed.astype(u32), zero, sample_index.astype(u32))
    return threefry2x32(k1, k2, zero, position.astype(u32))


def uniform_from_keys(keys) -> jax.Array:
    """[B] float32 in [0, 1): row b = jax.random.uniform(key b, ()), bitwise (unrolled threefry; see above)."""
    if not isinstance(keys, tuple):
        return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    u32 = jnp.uint32
    k1, k2 = keys
    zero = jnp.zeros_like(k1)
    # random_bits(key, 32, ()) with partitionable threefry: b1 ^ b2 of threefry(key, (0, 0)); uniform's mantissa
    # trick: the top 23 bits as a float in [1, 2), minus 1
    b1, b2 = threefry2x32(k1, k2, zero, zero)
    bits = jax.lax.shift_right_logical(b1 ^ b2, u32(32 - 23)) | u32(0x3F800000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1.0)


def uniform_noise(seed: jax.Array, sample_index: jax.Array, position: jax.Array) -> jax.Array:
    """[B] float32: row b = jax.random.uniform(request_key(seed[b], sample_index[b], position[b]), ()), bitwise."""
    return uniform_from_keys(row_keys(seed, sample_index, position))


CDF_BLOCK = 128  # vocabulary entries per block of the two-level inverse CDF


def _first_true(c: jax.Array) -> jax.Array:
    """The first index along the last axis where c holds (the axis length where none does)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, c.shape, c.ndim - 1)
    return jnp.min(jnp.where(c, iota, c.shape[-1]), axis=-1)


def _crossing(cum: jax.Array, mass: jax.Array, t: jax.Array) -> jax.Array:
    """The first index with cum > t among entries of positive mass; if rounding leaves none (t at the very top),
    the last entry of positive mass. cum [B, n] inclusive cumulative sums of mass [B, n] >= 0, t [B]."""
    i = _first_true((cum > t[:, None]) & (mass > 0))
    iota = jax.lax.broadcasted_iota(jnp.int32, mass.shape, 1)
    return jnp.where(i < mass.shape[-1], i, jnp.max(jnp.where(mass > 0, iota, -1), axis=-1))


def inverse_cdf(z: jax.Array, theta: jax.Array, u: jax.Array) -> jax.Array:
    """[B] int32: per row, the inverse CDF of softmax(z) on the support {v : z_v >= theta} at u in [0, 1).

    Two levels so no [B, V] prefix sum is formed: p = exp(z - max z) on the support, block sums over
    `CDF_BLOCK` entries and their prefix sums pick the block where u times the support's mass falls, then the
    prefix sums of that block's entries pick the token. A token of zero mass is never returned (`_crossing`);
    rounding of the fp32 sums moves a draw's boundaries by ~1e-7 of the mass, nothing else.
    """
    B, V = z.shape
    nb = -(-V // CDF_BLOCK)
    p = jnp.where(z >= theta[:, None], jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)), 0.0)
    if nb * CDF_BLOCK != V:
        p = jnp.pad(p, ((0, 0), (0, nb * CDF_BLOCK - V)))
    blocks = p.reshape(B, nb, CDF_BLOCK)
    sums = jnp.sum(blocks, axis=-1)
    cum = jnp.cumsum(sums, axis=-1)
    t = u * cum[:, -1]
    j = _crossing(cum, sums, t)
    below = jnp.where(j > 0, jnp.take_along_axis(cum, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    block = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]
    i = _crossing(jnp.cumsum(block, axis=-1), block, t - below)
    return j * CDF_BLOCK + i


def scale_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """z = logits * (1 / T) per row (T > 0), logits unchanged where T == 0. logits [B, V], T [B].

    A multiplication by the row's reciprocal, written out: XLA rewrites the division that way anyway, and the CPU
    sampler kernel (`cpu_kernels.sample_rows`) computes the same bits (theta, from these z, is compared with its)."""
    t = temperature[:, None].astype(jnp.float32)
    inv = jnp.where(t > 0, 1.0 / jnp.where(t > 0, t, 1.0), 1.0)
    return logits.astype(jnp.float32) * inv


def behaviour_logprobs(logits: jax.Array, temperature: jax.Array, tokens: jax.Array) -> jax.Array:
    """log_softmax(scale_logits(logits, T))[b, tokens[b]] over the full vocabulary, [B] float32."""
    z = scale_logits(logits, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    return jnp.take_along_axis(z, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0] - lse


def top_logprobs(logits: jax.Array, temperature: jax.Array, k: int,
                 lse: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The k (static) largest entries of log_softmax(scale_logits(logits, T)) per row, the distribution whose entry
    at the sampled token is its behaviour log-prob (`behaviour_logprobs`: the same z and logsumexp, so the top-1
    entry of a greedy row is that log-prob bitwise): (log-probs [B, k] float32 descending, token ids [B, k] int32;
    equal values in id order, as `first_argmax`). Over the full vocabulary, before top-k / top-p truncation.
    `lse` [B]: the normaliser the sampler used (`sample(..., with_lse=True)`), so that stays true of a `rows_fn`."""
    z = scale_logits(logits, temperature)
    lse = jax.nn.logsumexp(z, axis=-1) if lse is None else lse
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
           prefilter: int = TOPK_PREFILTER, truncation: bool = True, rows_fn=None,
           with_lse: bool = False) -> tuple[jax.Array, ...]:
    """Sample one token per row; returns (tokens [B] int32, behaviour log-probs [B] float32).

    logits [B, V] (any float dtype, used in float32); temperature [B] float (0 = greedy);
    top_k [B] int (0 = off); top_p [B] float in (0, 1]; seed [B] uint32; sample_index [B]
    int; position [B] int = absolute position of the token being sampled.

    truncation=False (static) leaves the top-k/top-p machinery out of the program: for batches whose rows all
    sample without truncation (`needs_truncation` false everywhere; the caller guarantees it), where it gives
    the same tokens as truncation=True (such rows have theta = -inf in every branch) and compiles in about
    half the time (measured on XLA:CPU).

    rows_fn (static): computes the draw and the normaliser logsumexp(z) of every row from (logits, temperature,
    theta, u) instead of `inverse_cdf` and the logsumexp of `behaviour_logprobs` (`kernels.cpu_kernels.sample_rows`:
    the same math in two passes per row; theta = -inf where a row does not truncate, u = 0 for greedy rows); the
    truncation threshold and the log-prob z[token] - lse are computed here either way. with_lse (static): also
    return the normaliser [B] (third), for `top_logprobs`.
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

    u = uniform_noise(seed, sample_index, position)

    def support_threshold():  # theta per row: -inf where a row does not truncate
        no_theta = jnp.full(z.shape[:1], -jnp.inf, jnp.float32)
        return jax.lax.cond(jnp.any(trunc), truncated, lambda: no_theta) if truncation else no_theta

    def sampled():
        # one inverse CDF for the whole batch: a greedy row's support is its maximal logits and its u is 0, so it
        # gets the first of them (= first_argmax(logits), as torch.argmax)
        greedy = temperature <= 0
        theta = jnp.where(greedy, jnp.max(z, axis=-1), support_threshold())
        return inverse_cdf(z, theta, jnp.where(greedy, 0.0, u))

    if rows_fn is not None:
        tokens, lse = rows_fn(logits, temperature, support_threshold(), jnp.where(temperature > 0, u, 0.0))
    else:
        tokens = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: first_argmax(logits))
        lse = jax.nn.logsumexp(z, axis=-1)
    tokens = tokens.astype(jnp.int32)
    logprobs = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - lse  # = behaviour_logprobs
    return (tokens, logprobs) + ((lse,) if with_lse else ())


def first_argmax(x: jax.Array) -> jax.Array:
    """argmax over the last axis, first index on ties (= jnp.argmax for non-NaN rows), as two plain
    reductions: XLA:CPU's variadic-reduce argmax is ~20x slower on [64, 16k] rows."""
    return _first_true(x == jnp.max(x, axis=-1, keepdims=True))


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """[B] bool: tokens[b] is one of stop_ids[b, :] (padded with -1)."""
    return jnp.any((tokens[:, None] == stop_ids) & (stop_ids >= 0), axis=-1)
