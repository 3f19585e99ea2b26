"""Policy losses for asynchronous RL post-training (decoupled PPO, GSPO, CISPO, M2PO).

Everything here is a small pure JAX function over per-token ``[B, T]`` arrays and is
``jax.jit``-able: configuration objects are frozen (hashable) dataclasses used as static
arguments, and no Python control flow depends on array values.

Notation (per token t of sequence i)::

    m_t   loss mask (original, as passed in)           ℓθ_t  log π_θ   (``logprobs``, differentiated)
    A_t   advantage                                     ℓp_t  log π_prox (``proximal_logprobs``)
    w_t   behaviour importance weight                   ℓb_t  log π_behav (``behaviour_logprobs``)

Pipeline of :func:`policy_loss` (AReaL ``ppo_actor_loss_fn`` semantics, see
``../shared/reference/areal-semantics.md`` (beside the checkout) §4.1-4.4):

1. M2PO (``m2_threshold``): m¹ = m ∧ keep_M2PO (:func:`m2po_mask`).
2. Behaviour weight (``behaviour_weight``): ρ_t = exp(ℓp_t − ℓb_t) → (w_t, m′_t)
   (:func:`behaviour_weights`), computed with m¹ as the valid set.
3. Ratio r_t = exp(ℓθ_t − ℓp_t) (token level) or the GSPO sequence ratio
   s_i = exp(mean_{t∈i, m′} (ℓθ_t − ℓp_t)) with the sequence-mean advantage (sequence level).
4. Per-token loss l_t: PPO ``max(−A r, −A clip(r, 1−ε, 1+ε_h))`` (+ dual clip) or CISPO
   ``−sg(clip(r, 1−ε, 1+ε_h))·A·ℓθ``.
5. Aggregate Σ m′_t w_t l_t with a denominator built from the ORIGINAL mask m, so that
   masking (M2PO, behaviour rejection) reduces the gradient instead of renormalising it.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxrl_async.rl.advantages import kl_estimate

__all__ = [
    "BehaviourWeightConfig",
    "PolicyLossConfig",
    "policy_loss",
    "behaviour_weights",
    "m2po_mask",
    "aggregation_count",
    "combine_stats",
    "kl_penalty",
]

_BW_ACTIONS = ("mask", "truncate", "off")
_LEVELS = ("token", "sequence")
_METRICS = ("ratio", "k1", "k2", "k3")
_AGGS = ("mean", "sum", "max")
_POLICY_LOSSES = ("ppo", "cispo")
_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


# ---------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BehaviourWeightConfig:
    """Off-policy correction by the behaviour importance weight ρ_t = π_prox/π_behav.

    Fields (AReaL ``RejectionSamplingConfig``; ``truncate`` = AReaL ``clamp``, TIS):

    * ``action``: ``"mask"`` (reject tokens/sequences whose metric is outside
      [lower, upper]: m′ = 0, w = 0), ``"truncate"`` (w ← clip(w, lower or 0, upper)),
      ``"off"`` (w ≡ 1, no rejection; AReaL ``rejection_sampling: null``).
    * ``level``: ``"token"`` or ``"sequence"`` (decision per sequence, applied to all its tokens).
    * ``metric`` on log ρ: ``ratio`` → ρ; ``k1`` → log ρ; ``k2`` → ½(log ρ)²;
      ``k3`` → ρ⁻¹ − 1 + log ρ.
    * ``agg`` (sequence level only): ``mean`` | ``sum`` | ``max`` over the sequence's valid
      tokens. For ``ratio`` the aggregation is done on log ρ and exponentiated
      (``mean`` → geometric mean), for k1/k2/k3 on the metric values.
    * ``lower`` (None: no lower bound; truncate uses 0), ``upper`` (default 5.0).

    Validation: ratio needs upper > 1 and lower > 0 (if set); truncate only with metric
    ratio; k2/k3 need upper > 0; lower < upper.
    """

    action: Literal["mask", "truncate", "off"] = "mask"
    level: Literal["token", "sequence"] = "token"
    metric: Literal["ratio", "k1", "k2", "k3"] = "ratio"
    agg: Literal["mean", "sum", "max"] = "mean"
    lower: float | None = None
    upper: float | None = 5.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        p = "behaviour_weight"
        _choice(f"{p}.action", self.action, _BW_ACTIONS)
        _choice(f"{p}.level", self.level, _LEVELS)
        _choice(f"{p}.metric", self.metric, _METRICS)
        _choice(f"{p}.agg", self.agg, _AGGS)
        if self.action == "off":
            return
        if self.upper is None:
            raise ValueError(f"{p}.upper must be set when {p}.action={self.action!r}")
        if self.action == "truncate" and self.metric != "ratio":
            raise ValueError(
                f"{p}.action='truncate' is only defined for {p}.metric='ratio', got {self.metric!r}")
        if self.metric == "ratio":
            if not self.upper > 1.0:
                raise ValueError(f"{p}.upper must be > 1 for metric 'ratio', got {self.upper}")
            if self.lower is not None and not self.lower > 0.0:
                raise ValueError(f"{p}.lower must be > 0 for metric 'ratio', got {self.lower}")
        if self.metric in ("k2", "k3") and not self.upper > 0.0:
            raise ValueError(f"{p}.upper must be > 0 for metric {self.metric!r}, got {self.upper}")
        if self.lower is not None and not self.lower < self.upper:
            raise ValueError(f"{p}.lower ({self.lower}) must be < {p}.upper ({self.upper})")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Policy-loss configuration (frozen, hashable: usable as a ``jax.jit`` static argument).

    * ``policy_loss``: ``"ppo"`` (decoupled PPO / GSPO) or ``"cispo"``.
    * ``eps_clip`` ε (0.2), ``eps_clip_higher`` ε_h (None → ε): ratio clip range [1−ε, 1+ε_h].
      For CISPO the same range clips the IS weight; MiniMax-M1's "no lower bound" is
      ``eps_clip=1.0`` (lower bound 0).
    * ``c_clip``: dual-clip constant c > 1 (PPO only) or None.
    * ``importance_sampling_level``: ``"token"`` (PPO) or ``"sequence"`` (GSPO; PPO only).
    * ``behaviour_weight``: :class:`BehaviourWeightConfig` (default token mask at 5).
    * ``m2_threshold``: M2PO second-moment threshold τ > 0, or None (off).
    * ``aggregation``: ``"token_mean"`` | ``"seq_mean_token_mean"`` | ``"constant"``;
      ``constant_normaliser`` C > 0 for ``"constant"`` (Dr.GRPO).
    """

    policy_loss: Literal["ppo", "cispo"] = "ppo"
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    c_clip: float | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    behaviour_weight: BehaviourWeightConfig = dataclasses.field(default_factory=BehaviourWeightConfig)
    m2_threshold: float | None = None
    aggregation: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    constant_normaliser: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def eps_high(self) -> float:
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher

    def validate(self) -> None:
        _choice("policy_loss", self.policy_loss, _POLICY_LOSSES)
        _choice("importance_sampling_level", self.importance_sampling_level, _LEVELS)
        _choice("aggregation", self.aggregation, _AGGREGATIONS)
        if not self.eps_clip >= 0.0:
            raise ValueError(f"eps_clip must be >= 0, got {self.eps_clip}")
        if self.eps_clip_higher is not None and not self.eps_clip_higher >= 0.0:
            raise ValueError(f"eps_clip_higher must be >= 0 or None, got {self.eps_clip_higher}")
        if self.c_clip is not None:
            if not self.c_clip > 1.0:
                raise ValueError(f"c_clip must be > 1 or None, got {self.c_clip}")
            if self.policy_loss != "ppo":
                raise ValueError(f"c_clip (dual clip) is only defined for policy_loss='ppo', "
                                 f"got policy_loss={self.policy_loss!r}")
        if self.policy_loss == "cispo" and self.importance_sampling_level != "token":
            raise ValueError("importance_sampling_level must be 'token' for policy_loss='cispo'")
        if self.m2_threshold is not None and not self.m2_threshold > 0.0:
            raise ValueError(f"m2_threshold must be > 0 or None, got {self.m2_threshold}")
        if self.aggregation == "constant" and not self.constant_normaliser > 0.0:
            raise ValueError(f"constant_normaliser must be > 0, got {self.constant_normaliser}")
        if not isinstance(self.behaviour_weight, BehaviourWeightConfig):
            raise ValueError("behaviour_weight must be a BehaviourWeightConfig, got "
                             f"{type(self.behaviour_weight).__name__}")
        self.behaviour_weight.validate()


# ---------------------------------------------------------------------------------------
# Segment helpers (sequence membership for packed rows)
# ---------------------------------------------------------------------------------------
def _resolve_segments(shape, seq_ids, num_seqs):
    """Returns (seq_ids [B,T] int32, num_seqs). Rows are sequences when ``seq_ids`` is None."""
    if seq_ids is None:
        b, t = shape
        if num_seqs is not None and num_seqs != b:
            raise ValueError(f"num_seqs ({num_seqs}) must equal the batch size ({b}) when seq_ids is None")
        return jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], shape), b
    if num_seqs is None:
        raise ValueError("num_seqs (a static python int) is required when seq_ids is given")
    if not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs must be a positive python int, got {num_seqs!r}")
    seq_ids = jnp.asarray(seq_ids)
    if seq_ids.shape != tuple(shape):
        raise ValueError(f"seq_ids shape {seq_ids.shape} != token array shape {tuple(shape)}")
    return seq_ids.astype(jnp.int32), num_seqs


def _segsum(x, seq_ids, num_seqs):
    """Σ over tokens of each sequence; ids outside [0, num_seqs) (e.g. −1 padding) are dropped."""
    return jax.ops.segment_sum(x.reshape(-1), seq_ids.reshape(-1), num_segments=num_seqs)


def _gather(per_seq, seq_ids, fill=0):
    """Broadcast a per-sequence value back to tokens (out-of-range ids get ``fill``)."""
    return jnp.take(per_seq, seq_ids, mode="fill", fill_value=fill)


# ---------------------------------------------------------------------------------------
# M2PO
# ---------------------------------------------------------------------------------------
def m2po_mask(behaviour_logprobs, proximal_logprobs, loss_mask, threshold: float):
    """M2PO second-moment masking (Zheng et al. 2025; AReaL ``_apply_m2po_masking``).

    Over the valid tokens (``loss_mask``) of the whole array, δ²_t = (ℓb_t − ℓp_t)² is sorted
    descending: s_0 ≥ s_1 ≥ … ≥ s_{n−1}. The number of masked tokens is
    k* = min{k : (1/(n−k)) Σ_{j≥k} s_j < τ}, or n − 1 if no such k (at least one token is
    kept). The k* largest-δ² tokens are masked (ties broken by flat position). Non-finite δ²
    counts as +∞ (masked first). Implemented with a stable sort and a reverse cumulative sum.

    Returns a bool ``[B, T]`` keep mask (⊆ loss_mask).
    """
    mask = jnp.asarray(loss_mask).astype(bool)
    f = jnp.promote_types(jnp.result_type(proximal_logprobs), jnp.float32)
    d = jnp.asarray(behaviour_logprobs, f) - jnp.asarray(proximal_logprobs, f)
    d2 = d * d
    d2 = jnp.where(jnp.isfinite(d2), d2, jnp.inf).reshape(-1)
    valid = mask.reshape(-1)
    size = d2.shape[0]
    key = jnp.where(valid, d2, -jnp.inf)
    order = jnp.argsort(-key, stable=True)  # valid tokens first, largest δ² first
    valid_sorted = valid[order]
    vals_sorted = jnp.where(valid_sorted, d2[order], 0.0)
    n = jnp.sum(valid)
    suffix = jnp.cumsum(vals_sorted[::-1])[::-1]  # Σ_{j≥k} s_j (padding contributes 0)
    k = jnp.arange(size)
    avg = suffix / jnp.maximum(n - k, 1).astype(f)
    below = (avg < threshold) & (k < n)
    k_star = jnp.where(jnp.any(below), jnp.argmax(below), jnp.maximum(n - 1, 0))
    keep_sorted = (k >= k_star) & (k < n)
    keep = jnp.zeros((size,), bool).at[order].set(keep_sorted)
    return keep.reshape(mask.shape) & mask


# ---------------------------------------------------------------------------------------
# Behaviour importance weight
# ---------------------------------------------------------------------------------------
def _metric(log_rho, metric: str):
    if metric == "ratio":
        return jnp.exp(log_rho)
    if metric == "k1":
        return log_rho
    if metric == "k2":
        return 0.5 * log_rho * log_rho
    return jnp.exp(-log_rho) - 1.0 + log_rho  # k3


def _in_bounds(x, cfg: BehaviourWeightConfig):
    ok = x <= cfg.upper
    if cfg.lower is not None:
        ok = ok & (x >= cfg.lower)
    return ok


def behaviour_weights(proximal_logprobs, behaviour_logprobs, loss_mask, cfg: BehaviourWeightConfig,
                      *, seq_ids=None, num_seqs=None):
    """Behaviour importance weight and rejection mask.

    log ρ_t = ℓp_t − ℓb_t is computed in float32 (or the wider input dtype), both inputs
    stop-gradiented. A non-finite log ρ_t is replaced by 0 for the arithmetic (AReaL), and
    additionally — stricter than AReaL — makes its token (token level) or its whole sequence
    (sequence level) out of bounds under ``action="mask"``, because its true weight is unknown.

    * token level: metric_t = metric(log ρ_t); mask → m′ = m·[lower ≤ metric_t ≤ upper],
      w = ρ; truncate → w = clip(ρ, lower or 0, upper), m′ = m.
    * sequence level, metric ratio: w_t = exp(mean_{t∈i, m} log ρ_t) (geometric mean, uniform
      over the sequence); decision statistic exp(agg_{t∈i, m} log ρ_t).
      metric k1/k2/k3: w_t = ρ_t, decision statistic agg_{t∈i, m} metric_t.
      ``max`` ignores masked tokens; a sequence without valid tokens is in bounds.
      mask → out-of-bounds sequences are removed; truncate → their tokens get
      w = clip(w, lower or 0, upper).
    * off: w = 1, m′ = m.
    * finally w ← w·m′.

    Returns ``(w, keep, filtered, log_rho)``: w float ``[B,T]``; keep = m′ (bool); filtered
    (bool) = valid tokens that were rejected (mask) or whose weight was changed (truncate);
    log_rho = the sanitised log ρ (for statistics).
    """
    mask = jnp.asarray(loss_mask).astype(bool)
    f = jnp.promote_types(jnp.result_type(proximal_logprobs), jnp.float32)
    raw = (jax.lax.stop_gradient(jnp.asarray(proximal_logprobs, f))
           - jax.lax.stop_gradient(jnp.asarray(behaviour_logprobs, f)))
    finite = jnp.isfinite(raw)
    log_rho = jnp.where(finite, raw, 0.0)
    rho = jnp.exp(log_rho)
    if cfg.action == "off":
        return jnp.where(mask, 1.0, 0.0).astype(f), mask, jnp.zeros_like(mask), log_rho

    lo = 0.0 if cfg.lower is None else cfg.lower
    if cfg.level == "token":
        w = rho
        if cfg.action == "mask":
            in_b = _in_bounds(_metric(log_rho, cfg.metric), cfg) & finite
            keep = mask & in_b
            filtered = mask & ~in_b
        else:
            w = jnp.clip(rho, lo, cfg.upper)
            keep = mask
            filtered = mask & (w != rho)
    else:
        sid, ns = _resolve_segments(mask.shape, seq_ids, num_seqs)
        mf = mask.astype(f)
        cnt = _segsum(mf, sid, ns)
        vals = log_rho if cfg.metric == "ratio" else _metric(log_rho, cfg.metric)
        s_sum = _segsum(jnp.where(mask, vals, 0.0), sid, ns)
        if cfg.agg == "sum":
            agg = s_sum
        elif cfg.agg == "mean":
            agg = s_sum / jnp.maximum(cnt, 1.0)
        else:
            s_max = jax.ops.segment_max(jnp.where(mask, vals, -jnp.inf).reshape(-1), sid.reshape(-1),
                                        num_segments=ns)
            agg = jnp.where(cnt > 0, s_max, 0.0)
        stat = jnp.exp(agg) if cfg.metric == "ratio" else agg
        seq_in = _in_bounds(stat, cfg)
        if cfg.action == "mask":
            n_bad = _segsum((mask & ~finite).astype(f), sid, ns)
            seq_in = seq_in & (n_bad == 0)
        in_b = _gather(seq_in, sid, fill=True)
        if cfg.metric == "ratio":
            w = _gather(jnp.exp(_segsum(jnp.where(mask, log_rho, 0.0), sid, ns) / jnp.maximum(cnt, 1.0)),
                        sid, fill=1.0)
        else:
            w = rho
        if cfg.action == "mask":
            keep = mask & in_b
            filtered = mask & ~in_b
        else:
            w_t = jnp.where(in_b, w, jnp.clip(w, lo, cfg.upper))
            filtered = mask & (w_t != w)
            w = w_t
            keep = mask
    return jnp.where(keep, w, 0.0).astype(f), keep, filtered, log_rho


# ---------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------
def aggregation_count(loss_mask, cfg: PolicyLossConfig, *, seq_ids=None, num_seqs=None):
    """This micro-batch's contribution to the global ``normaliser`` of :func:`policy_loss`.

    ``token_mean`` and ``constant``: Σ m (number of loss tokens); ``seq_mean_token_mean``:
    number of sequences with at least one loss token. Sum it over all micro-batches and
    data-parallel shards of the minibatch and pass the total as ``normaliser``
    (``constant`` ignores the normaliser, its denominator is ``cfg.constant_normaliser``).
    A sequence must not be split across micro-batches (sequence-level statistics, GSPO
    and ``seq_mean_token_mean`` see only the tokens of the call they are in).
    """
    mask = jnp.asarray(loss_mask).astype(bool)
    if cfg.aggregation == "seq_mean_token_mean":
        sid, ns = _resolve_segments(mask.shape, seq_ids, num_seqs)
        return jnp.sum(_segsum(mask.astype(jnp.float32), sid, ns) > 0).astype(jnp.float32)
    return jnp.sum(mask).astype(jnp.float32)


def policy_loss(logprobs, proximal_logprobs, behaviour_logprobs, advantages, loss_mask,
                cfg: PolicyLossConfig, *, seq_ids=None, num_seqs: int | None = None,
                normaliser=None, entropy=None):
    """Decoupled PPO / GSPO / CISPO policy loss with behaviour weighting and M2PO.

    Args:
      logprobs: ℓθ ``[B, T]`` (the only differentiated input).
      proximal_logprobs: ℓp ``[B, T]`` (stop-gradiented; with one minibatch per step this
        equals ℓθ in value, so r ≡ 1).
      behaviour_logprobs: ℓb ``[B, T]`` from the generator (stop-gradiented).
      advantages: A ``[B, T]`` (stop-gradiented).
      loss_mask: m ``[B, T]`` bool or 0/1.
      cfg: :class:`PolicyLossConfig` (static).
      seq_ids: optional int ``[B, T]`` global sequence index in [0, num_seqs) of each token
        (packed rows); padding may use −1. None: each row is one sequence.
      num_seqs: static python int, required with ``seq_ids``.
      normaliser: global denominator (sum of :func:`aggregation_count` over all
        micro-batches and DP shards of the minibatch). None: the local count, clamped ≥ 1.
        Ignored for ``aggregation="constant"``.
      entropy: optional ``[B, T]`` token entropies (statistics only).

    Per-token loss l_t (r from the importance-sampling level, ε_h = eps_clip_higher or ε):

      PPO:   l_t = max(−A_t r_t, −A_t clip(r_t, 1−ε, 1+ε_h));
             dual clip (c): l_t ← min(l_t, c·|A_t|) (binds only for A_t < 0).
      GSPO:  r_t = s_i = exp( Σ_{t∈i} m′_t(ℓθ_t − ℓp_t) / max(Σ_{t∈i} m′_t, 1) ),
             A_t ← Ā_i = Σ_{t∈i} m′_t A_t / max(Σ_{t∈i} m′_t, 1).
      CISPO: l_t = −sg(clip(r_t, 1−ε, 1+ε_h)) · A_t · ℓθ_t   (MiniMax-M1 eq. 4, AReaL
             ``cispo_loss_fn``): ∇l_t = −clip(r_t)·A_t·∇ℓθ_t for every token, clipped or not.
             The loss VALUE is a surrogate (depends on ℓθ); only its gradient is meaningful.

    Aggregation (m = original mask, m′ = mask after M2PO and behaviour rejection, w = weight):

      token_mean:          L = Σ_t m′_t w_t l_t / N,       N = normaliser or max(Σ_t m_t, 1)
      seq_mean_token_mean: L = Σ_i [Σ_{t∈i} m′_t w_t l_t / max(Σ_{t∈i} m_t, 1)] / S,
                           S = normaliser or max(#{i : Σ_{t∈i} m_t > 0}, 1)
      constant:            L = Σ_t m′_t w_t l_t / C         (C = cfg.constant_normaliser)

    Returns ``(loss, stats)``. Stats are stop-gradiented scalars following one convention
    so micro-batches combine exactly (:func:`combine_stats`):

      * ``n_tokens`` = Σ m, ``n_seqs`` = #sequences with a loss token (additive);
      * ``X_sum`` additive sums over valid (m) tokens and ``X = X_sum / max(n_tokens, 1)``;
      * ``X_max`` combine by max; ``loss`` additive (when all micro-batches use the
        global normaliser, the sum of their losses is the minibatch loss).

      Keys: ``clip_frac`` (m′ tokens whose loss is clipped; CISPO: whose weight left the band),
      ``dual_clip_frac`` (m′ tokens where the dual clip binds), ``behave_mask_frac`` (valid
      tokens rejected by the behaviour mask, or truncated under ``truncate``),
      ``m2po_mask_frac``, ``behave_weight`` (mean applied w, 0 where rejected),
      ``behave_weight_max``, ``behave_ratio_max`` (max raw ρ), ``ratio`` (mean r),
      ``approx_kl`` (k1: mean ℓθ − ℓp), ``approx_kl_k3`` (mean e^{ℓp−ℓθ} − 1 + ℓθ − ℓp),
      ``behave_approx_kl`` (k1: mean ℓp − ℓb), ``behave_approx_kl_k3`` (mean ρ⁻¹ − 1 + log ρ),
      ``loss_token_sum`` (Σ m′ w l), and ``entropy`` if given.
    """
    cfg.validate()
    lp = jnp.asarray(logprobs)
    if lp.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {lp.shape}")
    for name, arr in (("proximal_logprobs", proximal_logprobs), ("behaviour_logprobs", behaviour_logprobs),
                      ("advantages", advantages), ("loss_mask", loss_mask)):
        if jnp.shape(arr) != lp.shape:
            raise ValueError(f"{name} shape {jnp.shape(arr)} != logprobs shape {lp.shape}")
    if entropy is not None and jnp.shape(entropy) != lp.shape:
        raise ValueError(f"entropy shape {jnp.shape(entropy)} != logprobs shape {lp.shape}")
    f = jnp.promote_types(lp.dtype, jnp.float32)
    lp = lp.astype(f)
    prox = jax.lax.stop_gradient(jnp.asarray(proximal_logprobs, f))
    behav = jax.lax.stop_gradient(jnp.asarray(behaviour_logprobs, f))
    m0 = jnp.asarray(loss_mask).astype(bool)
    adv = jnp.where(m0, jax.lax.stop_gradient(jnp.asarray(advantages, f)), 0.0)
    sid, ns = _resolve_segments(lp.shape, seq_ids, num_seqs)

    # 1. M2PO, 2. behaviour weight.
    m1 = m0 if cfg.m2_threshold is None else m2po_mask(behav, prox, m0, cfg.m2_threshold)
    w, mp, filtered, log_rho = behaviour_weights(prox, behav, m1, cfg.behaviour_weight,
                                                 seq_ids=sid, num_seqs=ns)
    w = w.astype(f)

    # 3. Ratio (masked tokens use log-ratio 0 so that NaN/inf padding never reaches exp or grads).
    log_r = jnp.where(m0, lp - prox, 0.0)
    if cfg.importance_sampling_level == "sequence":
        cnt_p = jnp.maximum(_segsum(mp.astype(f), sid, ns), 1.0)
        seq_log_r = _segsum(jnp.where(mp, log_r, 0.0), sid, ns) / cnt_p
        ratio = _gather(jnp.exp(seq_log_r), sid, fill=1.0)
        adv = _gather(_segsum(jnp.where(mp, adv, 0.0), sid, ns) / cnt_p, sid)
    else:
        ratio = jnp.exp(log_r)

    # 4. Per-token loss.
    lo, hi = 1.0 - cfg.eps_clip, 1.0 + cfg.eps_high
    clipped = jnp.clip(ratio, lo, hi)
    if cfg.policy_loss == "ppo":
        l1 = -adv * ratio
        l2 = -adv * clipped
        tok_loss = jnp.maximum(l1, l2)
        clip_ind = l1 < l2
        if cfg.c_clip is not None:
            l3 = cfg.c_clip * jnp.abs(adv)
            dual_ind = l3 < tok_loss
            tok_loss = jnp.minimum(tok_loss, l3)
        else:
            dual_ind = jnp.zeros_like(m0)
    else:  # cispo
        lp_valid = jnp.where(m0, lp, 0.0)
        tok_loss = -jax.lax.stop_gradient(clipped) * adv * lp_valid
        clip_ind = clipped != ratio
        dual_ind = jnp.zeros_like(m0)
    weighted = jnp.where(mp, tok_loss * w, 0.0)

    # 5. Aggregation.
    n_tokens = jnp.sum(m0).astype(f)
    cnt0 = _segsum(m0.astype(f), sid, ns)
    n_seqs = jnp.sum(cnt0 > 0).astype(f)
    total = jnp.sum(weighted)
    if cfg.aggregation == "token_mean":
        denom = jnp.maximum(n_tokens, 1.0) if normaliser is None else jnp.asarray(normaliser, f)
        loss = total / denom
    elif cfg.aggregation == "seq_mean_token_mean":
        per_seq = _segsum(weighted, sid, ns) / jnp.maximum(cnt0, 1.0)
        denom = jnp.maximum(n_seqs, 1.0) if normaliser is None else jnp.asarray(normaliser, f)
        loss = jnp.sum(per_seq) / denom
    else:
        loss = total / cfg.constant_normaliser

    # Statistics.
    sg = jax.lax.stop_gradient

    def msum(x, where=m0):
        return jnp.sum(jnp.where(where, sg(x), 0.0)).astype(f)

    def mmax(x):
        return jnp.max(jnp.where(m0, sg(x), -jnp.inf), initial=-jnp.inf).astype(f)

    kl = sg(log_r)
    stats = {
        "loss": sg(loss),
        "n_tokens": n_tokens,
        "n_seqs": n_seqs,
        "loss_token_sum": sg(total),
        "clip_frac_sum": msum(clip_ind.astype(f), mp),
        "dual_clip_frac_sum": msum(dual_ind.astype(f), mp),
        "behave_mask_frac_sum": msum(filtered.astype(f)),
        "m2po_mask_frac_sum": msum((m0 & ~m1).astype(f)),
        "behave_weight_sum": msum(w),
        "ratio_sum": msum(ratio),
        "approx_kl_sum": msum(kl),
        "approx_kl_k3_sum": msum(jnp.exp(-kl) - 1.0 + kl),
        "behave_approx_kl_sum": msum(log_rho),
        "behave_approx_kl_k3_sum": msum(jnp.exp(-log_rho) - 1.0 + log_rho),
        "behave_weight_max": jnp.maximum(mmax(w), 0.0),
        "behave_ratio_max": jnp.maximum(mmax(jnp.exp(log_rho)), 0.0),
    }
    if entropy is not None:
        stats["entropy_sum"] = msum(jnp.asarray(entropy, f))
    return loss, _with_means(stats)


def _with_means(stats):
    n = jnp.maximum(stats["n_tokens"], 1.0)
    out = dict(stats)
    for k, v in stats.items():
        if k.endswith("_sum") and k != "loss_token_sum":
            out[k[:-4]] = v / n
    return out


def combine_stats(stats_list: Sequence[Mapping[str, jax.Array]]) -> dict:
    """Exactly combine the stats of several micro-batches / shards of one minibatch.

    ``*_sum``, ``n_tokens``, ``n_seqs`` and ``loss`` are added, ``*_max`` are maxed, and
    every mean ``X`` is recomputed as ``X_sum / max(n_tokens, 1)``.
    """
    if not stats_list:
        raise ValueError("combine_stats needs at least one stats dict")
    keys = [k for k in stats_list[0] if k.endswith("_sum") or k.endswith("_max")
            or k in ("n_tokens", "n_seqs", "loss")]
    out = {}
    for k in keys:
        vals = [jnp.asarray(s[k]) for s in stats_list]
        out[k] = jnp.max(jnp.stack(vals)) if k.endswith("_max") else jnp.sum(jnp.stack(vals))
    return _with_means(out)


def kl_penalty(logprobs, ref_logprobs, loss_mask, *, kind: Literal["k1", "k2", "k3"] = "k3",
               clamp: float | None = None, normaliser=None):
    """KL-to-reference as a loss term (GRPO-style): Σ_t m_t KL_est(ℓθ_t, ℓref_t) / N.

    KL_est is :func:`jaxrl_async.rl.advantages.kl_estimate` (k1 = ℓθ − ℓref, k2 = ½(ℓθ − ℓref)²,
    k3 = e^{ℓref−ℓθ} − 1 − (ℓref − ℓθ)); ``ref_logprobs`` is stop-gradiented; N = normaliser
    or max(Σ m, 1). Multiply by the KL coefficient and add to :func:`policy_loss`.
    """
    m = jnp.asarray(loss_mask).astype(bool)
    lp = jnp.asarray(logprobs)
    f = jnp.promote_types(lp.dtype, jnp.float32)
    lp = jnp.where(m, lp.astype(f), 0.0)
    ref = jnp.where(m, jax.lax.stop_gradient(jnp.asarray(ref_logprobs, f)), 0.0)
    k = kl_estimate(lp, ref, kind=kind, clamp=clamp)
    denom = jnp.maximum(jnp.sum(m), 1).astype(f) if normaliser is None else jnp.asarray(normaliser, f)
    return jnp.sum(jnp.where(m, k, 0.0)) / denom
