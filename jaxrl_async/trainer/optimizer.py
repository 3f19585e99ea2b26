"""Optimizer: optax AdamW with warmup + cosine/constant learning-rate schedules and global-norm clipping.

The schedule advances once per RL step, as AReaL's scheduler steps once per ``ppo_update``: with
``updates_per_step`` optimizer updates per step (``trainer.ppo_n_minibatches``), update ``u`` runs at
``s = u // updates_per_step``, and ``warmup_steps`` / ``total_steps`` count RL steps.

    lr(s) = lr * s / warmup_steps                                   for s < warmup_steps
    constant: lr(s) = lr                                            afterwards
    cosine:   lr(s) = lr * (m + (1 - m) * (1 + cos(pi * p)) / 2),   p = (s - w) / (total - w) clipped to [0, 1],
              m = min_lr_ratio

    update = AdamW(clip_by_global_norm(g, max_grad_norm)), decoupled weight decay
    (theta <- theta - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * theta)).

As AReaL's FSDP engine (torch AdamW over all parameters): weight decay applies to every
parameter by default; `decay_norms_and_biases=False` exempts RMSNorm weights and biases.
The optimizer works on the fp32 master weights; the compute dtype lives in the ModelConfig.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

__all__ = ["OptimizerConfig", "learning_rate_schedule", "make_optimizer"]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 0
    total_steps: int | None = None  # required by "cosine"
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_norms_and_biases: bool = True
    max_grad_norm: float | None = 1.0  # None / <= 0 disables clipping
    updates_per_step: int = 1  # optimizer updates per schedule step (RL: ppo_n_minibatches)

    def __post_init__(self):
        def bad(field, msg):
            raise ValueError(f"OptimizerConfig.{field}: {msg}")

        if not (self.lr >= 0 and math.isfinite(self.lr)):
            bad("lr", f"must be a finite non-negative float, got {self.lr}")
        if self.schedule not in ("constant", "cosine"):
            bad("schedule", f"must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.warmup_steps < 0:
            bad("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.schedule == "cosine":
            if self.total_steps is None or self.total_steps <= self.warmup_steps:
                bad("total_steps", f"cosine needs total_steps > warmup_steps, got {self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            bad("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            bad("weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.updates_per_step < 1:
            bad("updates_per_step", f"must be >= 1, got {self.updates_per_step}")


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """The schedule of the module docstring as an optax schedule (optimizer update count -> lr)."""
    w = cfg.warmup_steps

    def schedule(count):
        s = (jnp.asarray(count, jnp.int32) // cfg.updates_per_step).astype(jnp.float32)
        warm = cfg.lr * s / max(w, 1) if w > 0 else cfg.lr
        if cfg.schedule == "constant":
            after = jnp.asarray(cfg.lr, jnp.float32)
        else:
            p = jnp.clip((s - w) / (cfg.total_steps - w), 0.0, 1.0)
            after = cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * p)))
        return jnp.where(s < w, warm, after) if w > 0 else after

    return schedule


def _decay_mask(params):
    def keep(path, _):
        name = str(getattr(path[-1], "key", path[-1])).rstrip("0123456789")  # the vision tower's norm1 / norm2
        return not (name.endswith("norm") or name.endswith("bias"))

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm -> AdamW with the configured schedule."""
    mask = None if cfg.decay_norms_and_biases else _decay_mask
    parts = []
    if cfg.max_grad_norm is not None and cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=mask))
    return optax.chain(*parts)
