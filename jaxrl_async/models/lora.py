"""LoRA adapters (Hu et al. 2021) on the decoder's projections.

For a target projection with base weight W (our layout: input axes first, output axes last),

    y = x W + (alpha / rank) * (x A) B,     A: [in..., r],  B: [r, out...]

A is initialised like PEFT's default (``init_lora_weights=True``: Kaiming-uniform with a = sqrt(5),
i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in))) and B = 0, so a fresh adapter leaves the model unchanged
(bit-identical logits). Adapters live in the same parameter tree as the base weights, as stacked
per-layer leaves ``layers/{target}_lora_a`` and ``layers/{target}_lora_b``; their shapes, logical
axes and initialisers are rows of ``transformer.param_table`` (the single source of truth; fresh adapters:
``transformer.init_adapters``), which
adds them when ``ModelConfig.lora`` is set. The rank dimension has no logical name (replicated on
every mesh): r is small and sharding it would only add collectives.

Training (``trainer/train_step.py``) differentiates and optimises only the adapter leaves
(``split``); the base is frozen and may be stored in bfloat16 (``LoraSpec.base_dtype``). The
generator either applies the adapters unmerged (the same layer code) or receives them merged into a
generator-side copy of the base (``merge``); see NOTES.md (LoRA).

Mixture-of-experts layers (``moe.py``) take gate/up/down adapters per expert, parametrised as PEFT adapts
transformers' fused expert parameters (``target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"]``): ONE A shared by gate and up per expert, ``moe_gate_up_lora_a`` [L, X, D, r], and
``moe_gate_up_lora_b`` [L, X, r, n, F] with one slice per adapted half (n = 1 or 2: gate, up in that order),
and ``moe_down_lora_a`` [L, X, F, r] / ``moe_down_lora_b`` [L, X, r, D]. Expert x's update of gate is
``scale * A[x] B[x, :, gate]``, so the PEFT export is a relayout (no rank change: PEFT's fused gate_up adapter
has exactly this form). Logical axes carry ``expert``: they shard like the expert weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LoraSpec", "TARGETS", "split", "join", "merge", "adapter_keys", "init_adapter", "delta",
           "expert_adapters"]

# target name -> (einsum subscripts of the base weight, number of leading input axes)
# q [D, H, E], k/v [D, K, E], o [H, E, D], gate/up [D, F], down [F, D] (transformer.param_table)
TARGETS: dict[str, tuple[str, int]] = {
    "q": ("dhe", 1), "k": ("dke", 1), "v": ("dke", 1), "o": ("hed", 2),
    "gate": ("df", 1), "up": ("df", 1), "down": ("fd", 1),
}
# Hugging Face module paths of the targets (PEFT's `target_modules` names and adapter tensor names)
HF_MODULES: dict[str, str] = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
# mixture-of-experts adapters (`moe.py`): target -> (adapter group, its HF fused expert parameter)
MOE_GROUPS: dict[str, str] = {"gate": "moe_gate_up", "up": "moe_gate_up", "down": "moe_down"}
MOE_HF_PARAMS: dict[str, str] = {"moe_gate_up": "mlp.experts.gate_up_proj", "moe_down": "mlp.experts.down_proj"}
BASE_DTYPES = ("float32", "bfloat16")
DECODE = ("unmerged", "merged")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank r, alpha (scale = alpha / r), target projections by name, dropout (on the adapters' input during
    training steps, as PEFT's lora_dropout; off in every other forward),
    base_dtype (storage dtype of the frozen base weights in the trainer; adapters are float32), decode
    (the generator's strategy: "unmerged" low-rank matmuls, or "merged" weights at each push)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    dropout: float = 0.0
    base_dtype: str = "float32"
    decode: str = "unmerged"

    def __post_init__(self):
        if isinstance(self.targets, (list, str)):
            object.__setattr__(self, "targets", tuple([self.targets] if isinstance(self.targets, str)
                                                      else self.targets))
        self.validate()

    def validate(self, prefix: str = "ModelConfig.lora") -> None:
        def bad(field, msg):
            raise ValueError(f"{prefix}.{field}: {msg}")

        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            bad("rank", f"must be a positive int, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            bad("alpha", f"must be a positive finite number, got {self.alpha!r}")
        if not self.targets:
            bad("targets", "needs at least one of " + ", ".join(TARGETS))
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or len(set(self.targets)) != len(self.targets):
            bad("targets", f"{list(self.targets)}: each one of {', '.join(TARGETS)}, no repeats")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            bad("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if self.base_dtype not in BASE_DTYPES:
            bad("base_dtype", f"must be one of {BASE_DTYPES}, got {self.base_dtype!r}")
        if self.decode not in DECODE:
            bad("decode", f"must be one of {DECODE}, got {self.decode!r}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}


def adapter_keys(target: str) -> tuple[str, str]:
    return f"{target}_lora_a", f"{target}_lora_b"


def is_adapter_key(name: str) -> bool:
    return name.endswith("_lora_a") or name.endswith("_lora_b")


#: the stacks of decoder layers that can carry adapters (``ModelConfig.layer_stacks``)
STACKS = ("layers", "dense_layers")


def split(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapters, base): ``{"layers": {..._lora_a/b}}`` (and ``"dense_layers"`` for a mixture of experts with
    dense layers) and the rest of the tree (same leaves, no copy)."""
    adapters, base = {}, dict(params)
    for stack in STACKS:
        if stack in params:
            layers = params[stack]
            adapters[stack] = {k: v for k, v in layers.items() if is_adapter_key(k)}
            base[stack] = {k: v for k, v in layers.items() if not is_adapter_key(k)}
    return adapters, base


def join(adapters: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of ``split``."""
    return {**base, **{stack: {**base[stack], **a} for stack, a in adapters.items()}}


def moe_halves(spec: LoraSpec) -> tuple[str, ...]:
    """The adapted halves of the experts' fused gate_up projection, in their order in ``moe_gate_up_lora_b``."""
    return tuple(t for t in ("gate", "up") if t in spec.targets)


def moe_groups(spec: LoraSpec) -> tuple[str, ...]:
    """The expert adapter groups of ``spec`` (``moe_gate_up``, ``moe_down``), in PEFT's target_parameters order."""
    return tuple(g for g in ("moe_gate_up", "moe_down") if any(MOE_GROUPS[t] == g for t in spec.targets
                                                                 if t in MOE_GROUPS))


def expert_adapters(p: Mapping[str, Any], spec: LoraSpec | None) -> dict[str, Any] | None:
    """One MoE layer's expert adapters as ``moe.grouped_swiglu`` takes them (None when the layer has none):
    ``{"gate_up_a": [X, D, r], "gate_b"/"up_b": [X, r, F], "down_a": [X, F, r], "down_b": [X, r, D]}`` (the
    adapted ones only) and ``"scale"`` (a Python float)."""
    if not any(k.startswith("moe_") and is_adapter_key(k) for k in p):
        return None
    if spec is None:
        raise ValueError("parameters carry LoRA expert adapters but ModelConfig.lora is None")
    out: dict[str, Any] = {"scale": spec.scale}
    if "moe_gate_up_lora_a" in p:
        out["gate_up_a"] = p["moe_gate_up_lora_a"]
        for i, t in enumerate(moe_halves(spec)):
            out[f"{t}_b"] = p["moe_gate_up_lora_b"][..., i, :]
    if "moe_down_lora_a" in p:
        out["down_a"], out["down_b"] = p["moe_down_lora_a"], p["moe_down_lora_b"]
    return out


def has_adapters(params: Mapping[str, Any]) -> bool:
    return any(is_adapter_key(k) for stack in STACKS for k in params.get(stack, {}))


def init_adapter(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype: Any = jnp.float32) -> jax.Array:
    """PEFT's default A: Kaiming-uniform (a = sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


# LoRA dropout (PEFT's lora_dropout on the adapters' input): active only inside `dropout_key(key, rate)`,
# which the train step enters around its loss (a contextvar read at trace time, like the activation rules);
# `forward` folds the layer index in per layer, `delta` the target. Every other forward (proximal log-probs,
# generator, score) runs without it.
_DROPOUT: contextvars.ContextVar = contextvars.ContextVar("jaxrl_async_lora_dropout", default=None)


@contextlib.contextmanager
def dropout_key(key: jax.Array | None, rate: float):
    """Trace the enclosed forward with LoRA dropout of ``rate`` drawn from ``key`` (None or 0: none)."""
    token = _DROPOUT.set(None if key is None or rate <= 0 else (key, float(rate)))
    try:
        yield
    finally:
        _DROPOUT.reset(token)


@contextlib.contextmanager
def dropout_layer(layer_idx):
    """Within ``dropout_key``: the masks of layer ``layer_idx`` (a no-op without dropout)."""
    cur = _DROPOUT.get()
    if cur is None:
        yield
        return
    token = _DROPOUT.set((jax.random.fold_in(cur[0], layer_idx), cur[1]))
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def _dropout(x: jax.Array, target: str) -> jax.Array:
    cur = _DROPOUT.get()
    if cur is None:
        return x
    key, rate = cur
    keep = jax.random.bernoulli(jax.random.fold_in(key, list(TARGETS).index(target)), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def delta(x: jax.Array, a: jax.Array, b: jax.Array, target: str, scale: float, x_sub: str, out_sub: str
          ) -> jax.Array:
    """scale * (dropout(x) A) B in x's dtype: x [..., in], A [in..., r], B [r, out...]."""
    w_sub, n_in = TARGETS[target]
    x = _dropout(x, target)
    dt = x.dtype
    xa = jnp.einsum(f"{x_sub},{w_sub[:n_in]}r->{x_sub[:-n_in]}r", x, a.astype(dt))
    return scale * jnp.einsum(f"{x_sub[:-n_in]}r,r{w_sub[n_in:]}->{out_sub}", xa, b.astype(dt))


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, target: str, scale: float) -> jax.Array:
    """W + scale * A B for stacked [L, ...] weights, computed in float32, stored in W's dtype."""
    w_sub, n_in = TARGETS[target]
    ab = jnp.einsum(f"l{w_sub[:n_in]}r,lr{w_sub[n_in:]}->l{w_sub}", a.astype(jnp.float32), b.astype(jnp.float32))
    return (w.astype(jnp.float32) + scale * ab).astype(w.dtype)


def merged_expert_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """W[l, x] + scale * A[l, x] B[l, x] for stacked expert weights w [L, X, in, out], a [L, X, in, r],
    b [L, X, r, out]: float32, stored in W's dtype."""
    ab = jnp.einsum("lxir,lxro->lxio", a.astype(jnp.float32), b.astype(jnp.float32))
    return (w.astype(jnp.float32) + scale * ab).astype(w.dtype)


def merge(params: Mapping[str, Any], spec: LoraSpec) -> dict[str, Any]:
    """The base tree with every adapter folded into its weight (no adapter leaves left)."""
    adapters, base = split(params)
    out = dict(base)
    for stack, a in adapters.items():
        layers = dict(base[stack])
        for t in spec.targets:
            ka, kb = adapter_keys(t)
            if ka in a:
                layers[t] = merged_weight(layers[t], a[ka], a[kb], t, spec.scale)
        if "moe_gate_up_lora_a" in a:  # a mixture-of-experts stack: per-expert adapters (module doc)
            for i, t in enumerate(moe_halves(spec)):
                layers[f"moe_{t}"] = merged_expert_weight(layers[f"moe_{t}"], a["moe_gate_up_lora_a"],
                                                          a["moe_gate_up_lora_b"][..., i, :], spec.scale)
        if "moe_down_lora_a" in a:
            layers["moe_down"] = merged_expert_weight(layers["moe_down"], a["moe_down_lora_a"], a["moe_down_lora_b"],
                                                      spec.scale)
        out[stack] = layers
    return out


def adapter_bytes(params: Mapping[str, Any]) -> int:
    adapters, _ = split(params)
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(adapters)))
