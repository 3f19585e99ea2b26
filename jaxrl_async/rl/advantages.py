"""Reward shaping and advantage estimation (AReaL §4.5-4.7 semantics).

Precision / placement choice: advantages are computed once per training step on the host
over a small batch, so the host functions here are plain numpy in **float64** (AReaL
computes its normalisations in float64 too) and return float64 arrays;
:func:`compute_advantages` returns float32 arrays ready to be put on device. The two
functions that may be needed inside ``jax.jit`` — :func:`kl_estimate` and
:func:`loglinear_proximal_logprobs` — are array-generic: they use ``jax.numpy`` when any
input is a ``jax.Array`` (or a tracer) and numpy otherwise.

Batch layout: a batch of G prompt groups with n samples each is G·n consecutive rows
(group g = rows [g·n, (g+1)·n)). Token arrays are right-padded ``[G·n, T]`` with a loss
mask that is already aligned with the log-prob positions (1 where the position's log-prob
scores a generated token); no shifting is done here.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "NormSpec",
    "PRESETS",
    "AdvantageConfig",
    "AdvantageOutput",
    "transform_rewards",
    "overlong_penalty",
    "normalize",
    "group_slices",
    "preset_advantages",
    "grpo_advantages",
    "dr_grpo_advantages",
    "liteppo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "kl_estimate",
    "kl_token_rewards",
    "gae",
    "group_has_signal",
    "loglinear_proximal_logprobs",
    "compute_advantages",
]

_LEVELS = ("batch", "group", None)


# ---------------------------------------------------------------------------------------
# Reward transforms
# ---------------------------------------------------------------------------------------
def transform_rewards(rewards, bias: float = 0.0, scale: float = 1.0, clip: float | None = 20.0):
    """R ← clip((R + b)·s, −c, c) (AReaL ``reward_bias``/``reward_scaling``/``reward_clip``).

    ``clip=None`` disables clipping. float64.
    """
    r = (np.asarray(rewards, np.float64) + bias) * scale
    if clip is not None:
        if not clip > 0:
            raise ValueError(f"reward clip must be > 0 or None, got {clip}")
        r = np.clip(r, -clip, clip)
    return r


def overlong_penalty(response_lengths, max_new_tokens: int, overlong_tokens: int, penalty_factor: float):
    """DAPO soft overlong penalty (AReaL ``overlong_reward_penalty``), per sequence (≤ 0):

        p_i = min( −(L_i − (L_max − L_ov)) / L_ov · φ, 0 )

    i.e. 0 up to L_max − L_ov tokens, then linear down to −φ at L_max (no lower clip beyond).
    """
    if not overlong_tokens > 0:
        raise ValueError(f"overlong_tokens must be > 0, got {overlong_tokens}")
    if not 0 < overlong_tokens <= max_new_tokens:
        raise ValueError(f"overlong_tokens ({overlong_tokens}) must be <= max_new_tokens ({max_new_tokens})")
    L = np.asarray(response_lengths, np.float64)
    return np.minimum(-(L - (max_new_tokens - overlong_tokens)) / overlong_tokens * penalty_factor, 0.0)


# ---------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------
def _mean(x, m, leave_one_out):
    """Masked mean over all elements of x (AReaL ``Normalization._compute_mean``)."""
    n = m.sum()
    s = (x * m).sum()
    if leave_one_out:
        if n <= 1:
            return np.zeros_like(x)
        loo = (s - x * m) / np.maximum(n - m, 1.0)
        return np.where(m > 0, loo, s / n)
    if n == 0:
        return np.zeros_like(x)
    return np.full_like(x, s / n)


def _std(x, m, mu, unbiased):
    n = m.sum()
    ss = (((x - mu) * m) ** 2).sum()
    if unbiased:
        return 1.0 if n <= 1 else float(np.sqrt(ss / (n - 1)))
    return 1.0 if n == 0 else float(np.sqrt(ss / n))


def group_slices(batch: int, group_size) -> list[slice]:
    """Row slices of consecutive groups: ``group_size`` an int n (B must be a multiple of n) or a
    sequence of positive sizes summing to B (groups of unequal size, e.g. partial groups)."""
    if isinstance(group_size, (int, np.integer)):
        if group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if batch % group_size:
            raise ValueError(f"batch size {batch} is not a multiple of group_size {group_size}")
        sizes = [int(group_size)] * (batch // int(group_size))
    else:
        try:
            sizes = [int(n) for n in group_size]
        except TypeError:
            raise ValueError(f"group_size must be a positive int or a sequence of them, got {group_size!r}") from None
        if any(n < 1 for n in sizes) or sum(sizes) != batch:
            raise ValueError(f"group sizes {sizes} must be positive and sum to the batch size {batch}")
    bounds = np.cumsum([0] + sizes)
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def normalize(x, mask=None, *, mean_level: Literal["batch", "group"] | None = "batch",
              std_level: Literal["batch", "group"] | None = "batch", leave_one_out: bool = False,
              unbiased: bool = True, eps: float = 1e-5, group_size: int | Sequence[int] = 1):
    """AReaL ``Normalization`` (§4.5), float64, x of shape [B] or [B, T], mask same shape.

    Groups are consecutive blocks of ``group_size`` rows. With N = Σ m over the level:

    * mean: μ = Σ m x / N (0 if N = 0); leave-one-out: μ_j = (Σ m x − m_j x_j)/max(N − m_j, 1)
      on masked-in elements (the plain mean elsewhere), μ = 0 if N ≤ 1 (so group_size 1 ⇒ 0);
      ``mean_level=None`` ⇒ μ = 0.
    * std (around the already chosen μ, per element): σ = sqrt(Σ m (x − μ)² / (N − 1)) if
      unbiased else / N; N ≤ 1 (unbiased) or N = 0 ⇒ σ = 1; group level with group_size 1 and
      unbiased ⇒ σ = 1. ``std_level=None`` ⇒ σ = 1 and eps = 0.
    * y = m·(x − μ)/(σ + eps). An all-masked input is returned unchanged.

    ``group_size`` is an int n (groups of n consecutive rows) or a sequence of group sizes that
    sums to B (consecutive groups of those sizes: a batch with partial groups).
    """
    if mean_level not in _LEVELS:
        raise ValueError(f"mean_level must be one of {list(_LEVELS)}, got {mean_level!r}")
    if std_level not in _LEVELS:
        raise ValueError(f"std_level must be one of {list(_LEVELS)}, got {std_level!r}")
    x = np.asarray(x, np.float64)
    if x.ndim not in (1, 2):
        raise ValueError(f"x must be [B] or [B, T], got shape {x.shape}")
    m = np.ones_like(x) if mask is None else np.asarray(mask).astype(np.float64)
    if m.shape != x.shape:
        raise ValueError(f"mask shape {m.shape} != x shape {x.shape}")
    if mask is not None and m.sum() == 0:
        return x.copy()
    B = x.shape[0]
    groups = group_slices(B, group_size) if "group" in (mean_level, std_level) else []

    if mean_level == "batch":
        mu = _mean(x, m, leave_one_out)
    elif mean_level == "group":
        mu = np.zeros_like(x)
        for s in groups:
            mu[s] = 0.0 if (s.stop - s.start == 1 and leave_one_out) else _mean(x[s], m[s], leave_one_out)
    else:
        mu = np.zeros_like(x)

    if std_level == "batch":
        sigma = np.full_like(x, _std(x, m, mu, unbiased))
    elif std_level == "group":
        sigma = np.ones_like(x)
        for s in groups:
            sigma[s] = 1.0 if (s.stop - s.start == 1 and unbiased) else _std(x[s], m[s], mu[s], unbiased)
    else:
        sigma, eps = np.ones_like(x), 0.0
    return m * (x - mu) / (sigma + eps)


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """A normalisation recipe (AReaL ``NormConfig`` minus ``group_size``)."""

    mean_level: Literal["batch", "group"] | None = "batch"
    std_level: Literal["batch", "group"] | None = "batch"
    leave_one_out: bool = False
    unbiased: bool = True
    eps: float = 1e-5


#: Reward normalisation of each advantage preset (AReaL gsm8k_*.yaml, §4.5 table). The
#: token-level advantage normalisation (batch mean & std with the loss mask) is applied
#: afterwards by :func:`compute_advantages` when ``AdvantageConfig.adv_norm`` is on
#: (all presets of the table use it). None = no reward normalisation.
PRESETS: dict[str, NormSpec | None] = {
    "grpo": NormSpec("group", "group"),
    "dr_grpo": NormSpec("group", None),
    "liteppo": NormSpec("group", "batch"),
    "rloo": NormSpec("group", None, leave_one_out=True),
    "reinforce_pp": None,
    "reinforce_baseline": NormSpec("group", None),
    "ppo": None,
    "none": None,
}


def preset_advantages(rewards, preset: str, group_size: int | Sequence[int], *, eps: float = 1e-5):
    """Per-sequence advantages of a preset = its reward normalisation of ``rewards`` [G·n].

    grpo: (R − mean_g)/(std_g + eps); dr_grpo / reinforce_baseline: R − mean_g;
    liteppo: (R − mean_g)/(std_batch(R − mean_g) + eps); rloo: R − mean_{g∖j};
    reinforce_pp / ppo / none: R (REINFORCE++ relies on the batch advantage normalisation).
    std is unbiased (AReaL default since v0.3.4).
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    spec = PRESETS[preset]
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be [G*n], got shape {r.shape}")
    if spec is None:
        return r.copy()
    return normalize(r, None, mean_level=spec.mean_level, std_level=spec.std_level,
                     leave_one_out=spec.leave_one_out, unbiased=spec.unbiased, eps=eps,
                     group_size=group_size)


def grpo_advantages(rewards, group_size: int, eps: float = 1e-5):
    """GRPO: A_i = (R_i − mean_g R)/(std_g R + eps) (unbiased std)."""
    return preset_advantages(rewards, "grpo", group_size, eps=eps)


def dr_grpo_advantages(rewards, group_size: int):
    """Dr.GRPO: A_i = R_i − mean_g R (no std)."""
    return preset_advantages(rewards, "dr_grpo", group_size)


def liteppo_advantages(rewards, group_size: int, eps: float = 1e-5):
    """LitePPO: group-mean centring, then division by the batch std of the residuals."""
    return preset_advantages(rewards, "liteppo", group_size, eps=eps)


def rloo_advantages(rewards, group_size: int):
    """RLOO: A_i = R_i − (Σ_{j∈g} R_j − R_i)/(n − 1) (0 baseline when n = 1)."""
    return preset_advantages(rewards, "rloo", group_size)


def reinforce_pp_advantages(rewards, loss_mask, eps: float = 1e-5):
    """REINFORCE++ (γ = λ = 1, no KL): token advantages R_i on the sequence's loss tokens,
    batch-normalised over all loss tokens (token-weighted mean and unbiased std)."""
    m = np.asarray(loss_mask).astype(np.float64)
    a = np.asarray(rewards, np.float64)[:, None] * m
    return normalize(a, m, mean_level="batch", std_level="batch", eps=eps)


# ---------------------------------------------------------------------------------------
# KL to reference
# ---------------------------------------------------------------------------------------
def _xp(*arrays):
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def kl_estimate(logp, ref_logp, kind: Literal["k1", "k2", "k3"] = "k1", clamp: float | None = 10.0):
    """Per-token KL(π‖π_ref) estimators (Schulman), d = ℓ − ℓ_ref:

    k1 = d;  k2 = ½ d²;  k3 = e^{−d} − 1 + d;  then clipped to [−clamp, clamp] (None: off).
    jax arrays in → jax out (differentiable, jit-able); numpy in → float64 numpy out.
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"kl kind must be one of ['k1', 'k2', 'k3'], got {kind!r}")
    xp = _xp(logp, ref_logp)
    if xp is np:
        logp, ref_logp = np.asarray(logp, np.float64), np.asarray(ref_logp, np.float64)
    d = logp - ref_logp
    if kind == "k1":
        k = d
    elif kind == "k2":
        k = 0.5 * d * d
    else:
        k = xp.exp(-d) - 1.0 + d
    if clamp is not None:
        k = xp.clip(k, -clamp, clamp)
    return k


def kl_token_rewards(logp, ref_logp, loss_mask, coef: float, kind: str = "k1", clamp: float | None = 10.0):
    """KL folded into token rewards: r_t = −β · KL_est(ℓ_t, ℓref_t) · m_t (float64)."""
    m = np.asarray(loss_mask).astype(np.float64)
    k = np.asarray(kl_estimate(np.asarray(logp, np.float64), np.asarray(ref_logp, np.float64), kind, clamp))
    return np.where(m > 0, -coef * k, 0.0)


# ---------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------
def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0, bootstrap=None):
    """Generalised advantage estimation over right-padded token arrays ``[B, T]``.

    Backward over t = T−1 … 0 with running (A, V_next), initialised to (0, bootstrap_i)
    (bootstrap default 0: terminated sequences). Positions with m_t = 0 (prompt, padding,
    tool output) are skipped: they carry A and V_next through unchanged and output A_t = 0.

        δ_t = r_t + γ V_next − V_t;   A_t = δ_t + γλ A_next;   returns_t = A_t + V_t.

    ``values=None`` means V ≡ 0. Returns (advantages, returns), float64, 0 where m = 0.
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [B, T], got shape {r.shape}")
    v = np.zeros_like(r) if values is None else np.asarray(values, np.float64)
    m = np.asarray(mask).astype(bool)
    if v.shape != r.shape or m.shape != r.shape:
        raise ValueError(f"rewards {r.shape}, values {v.shape} and mask {m.shape} must have equal shapes")
    B, T = r.shape
    next_v = np.zeros(B) if bootstrap is None else np.asarray(bootstrap, np.float64).reshape(B).copy()
    run = np.zeros(B)
    adv = np.zeros_like(r)
    for t in range(T - 1, -1, -1):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        new = delta + gamma * lam * run
        run = np.where(mt, new, run)
        next_v = np.where(mt, v[:, t], next_v)
        adv[:, t] = np.where(mt, new, 0.0)
    return adv, np.where(m, adv + v, 0.0)


# ---------------------------------------------------------------------------------------
# Dynamic sampling and proximal approximation
# ---------------------------------------------------------------------------------------
def group_has_signal(rewards, group_size: int | None = None, atol: float = 0.0):
    """DAPO dynamic-sampling predicate: a group is kept iff its rewards are not all equal
    (max − min > atol). ``group_size=None``: ``rewards`` is one group → python bool;
    otherwise ``rewards`` is [G·n] → bool array [G]."""
    r = np.asarray(rewards, np.float64)
    if group_size is None:
        return bool(r.size > 0 and (r.max() - r.min()) > atol)
    if group_size < 1 or r.ndim != 1 or r.size % group_size:
        raise ValueError(f"rewards of shape {r.shape} cannot be split into groups of {group_size}")
    g = r.reshape(-1, group_size)
    return (g.max(axis=1) - g.min(axis=1)) > atol


def loglinear_proximal_logprobs(behaviour_logprobs, theta_logprobs, versions, current_version):
    """Log-linear approximation of the proximal log-probs (AReaL ``prox_logp_method=loglinear``).

    With v_b the version that generated each token and v_θ = ``current_version``
    (π_prox = π_{v_θ − 1}):

        α_t = clip((v_θ − 1 − v_b)/(v_θ − v_b), 0, 1)  if v_θ > v_b and v_b ≥ 0, else 0
        ℓp_t ≈ ℓb_t + α_t (sg(ℓθ_t) − ℓb_t)

    (v_b = −1 marks prompt tokens). jax in → jax out (jit-able); numpy in → float64 numpy.
    """
    xp = _xp(behaviour_logprobs, theta_logprobs, versions)
    if xp is np:
        lb = np.asarray(behaviour_logprobs, np.float64)
        lt = np.asarray(theta_logprobs, np.float64)
        vb = np.asarray(versions, np.float64)
        f = np.float64
    else:
        lb = jnp.asarray(behaviour_logprobs)
        f = jnp.promote_types(lb.dtype, jnp.float32)
        lb = lb.astype(f)
        lt = jax.lax.stop_gradient(jnp.asarray(theta_logprobs, f))
        vb = jnp.asarray(versions).astype(f)
    vt = xp.asarray(current_version).astype(f)
    gap = vt - vb
    ok = (gap > 0) & (vb >= 0)
    alpha = xp.where(ok, xp.clip((gap - 1.0) / xp.where(ok, gap, 1.0), 0.0, 1.0), 0.0)
    return lb + alpha * (lt - lb)


# ---------------------------------------------------------------------------------------
# Full pipeline
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Advantage pipeline configuration (AReaL ``PPOActorConfig`` reward/advantage fields).

    * ``preset``: key of :data:`PRESETS` (reward normalisation).
    * ``reward_bias`` b, ``reward_scale`` s, ``reward_clip`` c (None: off).
    * ``overlong_penalty``; ``overlong_tokens``, ``overlong_penalty_factor``, ``max_new_tokens``.
    * ``mask_no_eos_with_zero``: truncated sequences get scalar reward 0 at their last token.
    * ``adv_norm``: token-level batch mean & std normalisation of the final advantages with
      the loss mask (token weighted); ``norm_eps``.
    * ``kl_coef`` β, ``kl_estimator`` (k1/k2/k3), ``kl_clamp``: KL-in-reward.
    * ``gamma``, ``lam``: GAE.
    """

    preset: str = "grpo"
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: float | None = 20.0
    overlong_penalty: bool = False
    overlong_tokens: int | None = None
    overlong_penalty_factor: float | None = None
    max_new_tokens: int | None = None
    mask_no_eos_with_zero: bool = False
    adv_norm: bool = True
    norm_eps: float = 1e-5
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    kl_clamp: float | None = 10.0
    gamma: float = 1.0
    lam: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.reward_clip is not None and not self.reward_clip > 0:
            raise ValueError(f"reward_clip must be > 0 or None, got {self.reward_clip}")
        if self.overlong_penalty:
            for name in ("overlong_tokens", "overlong_penalty_factor", "max_new_tokens"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name} must be set when overlong_penalty is on")
            if not 0 < self.overlong_tokens <= self.max_new_tokens:
                raise ValueError(f"overlong_tokens must be in (0, max_new_tokens], got {self.overlong_tokens}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator must be one of ['k1', 'k2', 'k3'], got {self.kl_estimator!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if not self.norm_eps >= 0:
            raise ValueError(f"norm_eps must be >= 0, got {self.norm_eps}")


@dataclasses.dataclass(frozen=True)
class AdvantageOutput:
    advantages: np.ndarray  # [B, T] float32, 0 where loss_mask = 0
    returns: np.ndarray  # [B, T] float32 (A + V)
    seq_rewards: np.ndarray  # [B] float64, after penalty, transform and reward normalisation
    token_rewards: np.ndarray  # [B, T] float64, KL rewards + sequence reward at the last token


def compute_advantages(rewards, loss_mask, cfg: AdvantageConfig, *, group_size: int | Sequence[int],
                       response_lengths=None, logprobs=None, ref_logprobs=None, values=None,
                       truncated=None) -> AdvantageOutput:
    """Scalar rewards of a batch of groups → token advantages (AReaL ``_compute_advantages``).

    Args: rewards [B = G·n]; loss_mask [B, T] (aligned with log-prob positions);
    group_size n, or the sizes of the consecutive groups (partial groups). Call it once on the
    WHOLE training batch: the batch-level statistics (LitePPO's std, ``adv_norm``) are over all
    its groups (AReaL normalises the consumed batch, §4.5-4.6); response_lengths [B] (default Σ_t loss_mask);
    logprobs / ref_logprobs
    [B, T] (required when kl_coef > 0; logprobs = behaviour log-probs in decoupled mode);
    values [B, T] critic values (default 0); truncated [B] bool (no EOS).

    1. R_i += overlong_penalty(L_i) (if on);  2. R_i ← clip((R_i + b)·s, −c, c);
    3. R ← preset reward normalisation (over [B], no mask);
    4. token rewards r_t = −β KL_est(ℓ_t, ℓref_t) m_t, plus R_i at the sequence's last loss
       token (0 instead if mask_no_eos_with_zero and truncated_i);
    5. (A, returns) = gae(r, V, m, γ, λ);  6. A ← normalize(A, m, batch, batch) if adv_norm.
    With γ = λ = 1, V = 0, β = 0 every loss token of sequence i gets A = R_i before step 6.
    """
    cfg.validate()
    R = np.asarray(rewards, np.float64)
    m = np.asarray(loss_mask).astype(bool)
    if R.ndim != 1 or m.ndim != 2 or m.shape[0] != R.shape[0]:
        raise ValueError(f"rewards must be [B] and loss_mask [B, T]; got {R.shape} and {m.shape}")
    B, T = m.shape
    if cfg.overlong_penalty:
        L = m.sum(axis=1) if response_lengths is None else np.asarray(response_lengths)
        if L.shape != (B,):
            raise ValueError(f"response_lengths must be [B={B}], got {L.shape}")
        R = R + overlong_penalty(L, cfg.max_new_tokens, cfg.overlong_tokens, cfg.overlong_penalty_factor)
    R = transform_rewards(R, cfg.reward_bias, cfg.reward_scale, cfg.reward_clip)
    R = preset_advantages(R, cfg.preset, group_size, eps=cfg.norm_eps)

    tok = np.zeros((B, T))
    if cfg.kl_coef > 0:
        if logprobs is None or ref_logprobs is None:
            raise ValueError("logprobs and ref_logprobs are required when kl_coef > 0")
        tok = kl_token_rewards(logprobs, ref_logprobs, m, cfg.kl_coef, cfg.kl_estimator, cfg.kl_clamp)
    has = m.any(axis=1)
    last = T - 1 - np.argmax(m[:, ::-1], axis=1)
    final = R.copy()
    if cfg.mask_no_eos_with_zero and truncated is not None:
        final = np.where(np.asarray(truncated).astype(bool).reshape(B), 0.0, final)
    rows = np.nonzero(has)[0]
    tok[rows, last[rows]] += final[rows]

    adv, ret = gae(tok, values, m, cfg.gamma, cfg.lam)
    if cfg.adv_norm:
        adv = normalize(adv, m, mean_level="batch", std_level="batch", eps=cfg.norm_eps)
    return AdvantageOutput(adv.astype(np.float32), ret.astype(np.float32), R, tok)
