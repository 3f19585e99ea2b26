"""Decoder-only transformer of the Qwen3 / Qwen2 / Llama family, in Flax NNX.

Design
------
* One parameter table (`param_table`) is the single source of truth for every weight: its
  shape, its logical axis names (for sharding rules, see `jaxrl_async.sharding`) and its
  initialiser. The NNX module `Transformer`, the abstract shapes used for planning, the
  sharding trees and the Hugging Face mapping (`hf_mapping.py`) are all derived from it.
* Layers are stored *stacked* (leading `layers` axis). The forward runs them with
  `jax.lax.scan` (fast compile, `cfg.scan_layers=True`) or a Python loop over static slices;
  both use the same layer function, with optional `jax.checkpoint` (remat). A Qwen3-MoE model with
  dense layers among its sparse ones has two stacks (`layers`: sparse, `dense_layers`: dense) and runs
  them as a static schedule of same-kind runs (`ModelConfig.layer_schedule`), each scanned.
* The hot paths (trainer, generator) call the pure function `forward(params, cfg, ...)` on a
  plain dict of arrays (`nnx.state(model, nnx.Param).to_pure_dict()`), so new weights are
  just new arguments: no retrace, no NNX graph traversal per step.
* Activations carry logical axis names (`RESIDUAL_AXES`, ...): `sharding.activations.constrain`
  pins their layout when a caller traced the function under sharding rules (the trainer and the
  generator engine do, on their meshes), and is a no-op otherwise. Without it GSPMD propagated
  the FSDP weight sharding into the activations (every device ran the whole global batch).
* Attention is pluggable: the layer computes q/k/v and calls
  `attend(q, k, v, layer_idx, state) -> (out, state)`. Training/scoring uses
  `model_attention` (padded *and* packed batches via segment ids: no attention across
  sequences, causal within; the implementation, full-score `xla` or flash-style `blockwise`, is
  `cfg.attention`, see `attention.py`); the generator passes a KV-cache attention whose `state` is the
  cache. The layer code is shared by both.

Shapes: B batch, T time, D hidden, H query heads, K kv heads, G = H // K, E head_dim,
F intermediate (mlp), V vocab, L layers.
"""

from __future__ import annotations

import contextlib
import contextvars

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxrl_async.kernels.attention import (  # noqa: F401  (grouped_attention, segment_mask: re-exported)
    AttendFn, grouped_attention, segment_attention, segment_mask,
)
from jaxrl_async.models.config import ModelConfig, llama3_inv_freq_scale
from jaxrl_async.models.lora import dropout_layer as lora_dropout_layer
from jaxrl_async.models.moe import layer_scope as moe_layer_scope, publish as moe_publish
from jaxrl_async.models.remat import remat
from jaxrl_async.sharding.activations import constrain

Params = dict[str, Any]


# ---------------------------------------------------------------------------------------
# Parameter table
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dimension (None: replicated, the LoRA rank)
    init: str  # "normal" | "ones" | "zeros" | "lora_a" (U(+-1/sqrt(fan_in)), PEFT's default)
    fan_in: int = 0  # "lora_a" only: input features of the adapted projection


def _layer_specs(cfg: ModelConfig, L: int, sparse: bool) -> dict[str, ParamSpec]:
    """The rows of one stack of L decoder layers: attention and norms, and a dense SwiGLU MLP or (``sparse``)
    a mixture of experts (`models/moe.py`)."""
    D, F, H, K, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers = {
        "attn_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
        "q": ParamSpec((L, D, H, E), ("layers", "embed", "heads", "head_dim"), "normal"),
        "k": ParamSpec((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "v": ParamSpec((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "o": ParamSpec((L, H, E, D), ("layers", "heads", "head_dim", "embed"), "normal"),
        "mlp_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
    }
    if sparse:
        X, Fm = cfg.num_experts, cfg.moe_intermediate_size
        layers["router"] = ParamSpec((L, D, X), ("layers", "embed", "expert_router"), "normal")
        layers["moe_gate"] = ParamSpec((L, X, D, Fm), ("layers", "expert", "embed", "mlp"), "normal")
        layers["moe_up"] = ParamSpec((L, X, D, Fm), ("layers", "expert", "embed", "mlp"), "normal")
        layers["moe_down"] = ParamSpec((L, X, Fm, D), ("layers", "expert", "mlp", "embed"), "normal")
    else:
        layers["gate"] = ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal")
        layers["up"] = ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal")
        layers["down"] = ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal")
    if cfg.qkv_bias:
        layers["q_bias"] = ParamSpec((L, H, E), ("layers", "heads", "head_dim"), "zeros")
        layers["k_bias"] = ParamSpec((L, K, E), ("layers", "kv_heads", "head_dim"), "zeros")
        layers["v_bias"] = ParamSpec((L, K, E), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.o_bias:
        layers["o_bias"] = ParamSpec((L, D), ("layers", "norm"), "zeros")
    if cfg.qk_norm:
        layers["q_norm"] = ParamSpec((L, E), ("layers", "head_dim"), "ones")
        layers["k_norm"] = ParamSpec((L, E), ("layers", "head_dim"), "ones")
    if cfg.mlp_bias and not sparse:
        layers["gate_bias"] = ParamSpec((L, F), ("layers", "mlp"), "zeros")
        layers["up_bias"] = ParamSpec((L, F), ("layers", "mlp"), "zeros")
        layers["down_bias"] = ParamSpec((L, D), ("layers", "norm"), "zeros")
    if cfg.lora is not None:
        layers.update(lora_param_table(cfg, layers))
    return layers


def param_table(cfg: ModelConfig) -> dict[str, Any]:
    """Nested dict of ParamSpec mirroring the parameter tree. The decoder layers are stacked per kind
    (``cfg.layer_stacks()``, MaxText style): ``layers`` holds every layer of a dense model and the
    mixture-of-experts layers of a Qwen3-MoE model, ``dense_layers`` the dense-MLP layers of a Qwen3-MoE
    model that has some (``mlp_only_layers`` / ``decoder_sparse_step``)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    table: dict[str, Any] = {"embed": ParamSpec((V, D), ("vocab", "embed"), "normal")}
    for name, ids in cfg.layer_stacks().items():
        table[name] = _layer_specs(cfg, len(ids), sparse=bool(cfg.num_experts) and name == "layers")
    table["final_norm"] = ParamSpec((D,), ("norm",), "ones")
    if not cfg.tie_word_embeddings:
        table["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
    return table


def lora_param_table(cfg: ModelConfig, layers: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
    """Adapter rows (`models/lora.py`): for a target W [L, in..., out...] with axes (layers, in..., out...),
    A [L, in..., r] (axes of the inputs, rank unnamed) initialised like PEFT and B [L, r, out...] zeros."""
    from jaxrl_async.models.lora import MOE_GROUPS, TARGETS, adapter_keys

    sparse = "moe_gate" in layers  # a mixture-of-experts stack: gate/up/down adapt the experts (below)
    missing = [t for t in cfg.lora.targets if t not in layers and not (sparse and t in MOE_GROUPS)]
    if missing:
        raise ValueError(f"ModelConfig.lora.targets: {', '.join(missing)} has no weight in this model "
                         f"(layer weights: {', '.join(t for t in TARGETS if t in layers)})")
    r = cfg.lora.rank
    rows = {} if not sparse else _expert_lora_rows(cfg, layers)
    for t in (t for t in cfg.lora.targets if t in layers):
        w = layers[t]
        n_in = TARGETS[t][1]
        ka, kb = adapter_keys(t)
        ins, outs = slice(1, 1 + n_in), slice(1 + n_in, None)
        rows[ka] = ParamSpec((w.shape[0], *w.shape[ins], r), (w.axes[0], *w.axes[ins], None), "lora_a",
                             fan_in=int(np.prod(w.shape[ins])))
        rows[kb] = ParamSpec((w.shape[0], r, *w.shape[outs]), (w.axes[0], None, *w.axes[outs]), "zeros")
    return rows


def _expert_lora_rows(cfg: ModelConfig, layers: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
    """Per-expert adapter rows of a mixture-of-experts stack (`models/lora.py` module doc: PEFT's fused-expert
    form): ``moe_gate_up_lora_a`` [L, X, D, r] shared by the adapted halves, ``moe_gate_up_lora_b``
    [L, X, r, n, F] (n = adapted halves of gate, up), ``moe_down_lora_a`` [L, X, F, r], ``moe_down_lora_b``
    [L, X, r, D]; logical axes those of the expert weights (layers, expert, ...), the rank (and the half)
    unnamed."""
    from jaxrl_async.models.lora import moe_halves

    r, rows = cfg.lora.rank, {}
    halves = moe_halves(cfg.lora)
    if halves:
        (L, X, D, F), ax = layers["moe_gate"].shape, layers["moe_gate"].axes
        rows["moe_gate_up_lora_a"] = ParamSpec((L, X, D, r), (*ax[:3], None), "lora_a", fan_in=D)
        rows["moe_gate_up_lora_b"] = ParamSpec((L, X, r, len(halves), F), (*ax[:2], None, None, ax[3]), "zeros")
    if "down" in cfg.lora.targets:
        (L, X, F, D), ax = layers["moe_down"].shape, layers["moe_down"].axes
        rows["moe_down_lora_a"] = ParamSpec((L, X, F, r), (*ax[:3], None), "lora_a", fan_in=F)
        rows["moe_down_lora_b"] = ParamSpec((L, X, r, D), (*ax[:2], None, ax[3]), "zeros")
    return rows


def _is_spec(x):
    return isinstance(x, ParamSpec)


def logical_axes(cfg: ModelConfig) -> Params:
    """Tree (same structure as the params) of logical axis-name tuples."""
    return jax.tree.map(lambda s: s.axes, param_table(cfg), is_leaf=_is_spec)


def param_shapes(cfg: ModelConfig) -> Params:
    """Tree of jax.ShapeDtypeStruct: the parameters without allocating them."""
    dt = jnp.dtype(cfg.param_dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), param_table(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random parameters (normal(0, std) matrices, unit norms, zero biases) as a pure dict."""
    return init_from_table(param_table(cfg), key, cfg.param_dtype, std)


def init_from_table(table: Params, key: jax.Array, param_dtype: str, std: float = 0.02) -> Params:
    """The parameters of a tree of ParamSpec (`init_params`; the vision-language model's table too)."""
    leaves, treedef = jax.tree.flatten(table, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))
    dt = jnp.dtype(param_dtype)

    def make(spec: ParamSpec, k):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dt)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dt)
        if spec.init == "lora_a":
            from jaxrl_async.models.lora import init_adapter

            return init_adapter(k, spec.shape, spec.fan_in, dt)
        return (std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dt)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])


# ---------------------------------------------------------------------------------------
# Building blocks (pure functions)
# ---------------------------------------------------------------------------------------
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32, output in x's dtype (as HF)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def init_adapters(cfg: Any, key: jax.Array, dtype: Any = jnp.float32) -> dict[str, Any]:
    """Fresh LoRA adapters ``{"layers": {...}}`` of ``cfg`` (``cfg.lora`` set) from their rows of
    ``param_table`` (A as PEFT, B = 0), independent of the base's initialisation."""
    from jaxrl_async.models.lora import STACKS, init_adapter, is_adapter_key

    table = param_table(cfg)
    result = {}
    for stack in (s for s in STACKS if s in table):  # "layers" first: a dense model's draws are unchanged
        specs = {k: v for k, v in table[stack].items() if is_adapter_key(k)}
        key, sub = jax.random.split(key) if stack != "layers" else (key, key)
        keys = jax.random.split(sub, len(specs))
        out = {}
        for k, (name, spec) in zip(keys, sorted(specs.items())):
            out[name] = (init_adapter(k, spec.shape, spec.fan_in, dtype) if spec.init == "lora_a"
                         else jnp.zeros(spec.shape, dtype))
        result[stack] = out
    return result


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies theta^(-2i/E), with llama3 scaling when configured (float32, as HF)."""
    E = cfg.head_dim
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, E, 2, dtype=np.int64).astype(np.float32) / E))
    inv = inv.astype(np.float32)
    if cfg.rope_type == "llama3":
        inv = llama3_inv_freq_scale(cfg, inv).astype(np.float32)
    return inv


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + (E,), float32 (HF layout: frequencies repeated twice).

    With M-RoPE (``cfg.mrope_section``, Qwen2.5-VL) ``positions`` may be [3, B, T] (temporal, height, width rows):
    frequency i of section s turns with row s (transformers' ``Qwen2_5_VLRotaryEmbedding``); cos, sin [B, T, E].
    """
    return rope_full(rope_half_cos_sin(cfg, positions))


def rope_half_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`rope_cos_sin` of each frequency once: cos, sin [..., E / 2] (`rope_full` repeats them)."""
    inv = jnp.asarray(rope_inv_freq(cfg))
    if cfg.mrope_section and positions.ndim == 3:
        rows = np.repeat(np.arange(3), cfg.mrope_section)  # the position row of each frequency
        freqs = jnp.moveaxis(positions, 0, -1).astype(jnp.float32)[..., rows] * inv
    else:
        freqs = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(freqs), jnp.sin(freqs)


def rope_full(half: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [..., E] from `rope_half_cos_sin`'s [..., E / 2]: each frequency twice (the same values as the
    cos / sin of the repeated angles)."""
    return tuple(jnp.concatenate([h, h], axis=-1) for h in half)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin, with x [..., T, N, E] and cos/sin [..., T, E]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c = cos[..., None, :].astype(x.dtype)
    s = sin[..., None, :].astype(x.dtype)
    return x * c + rot * s


def model_attention(cfg: ModelConfig, segment_ids: jax.Array) -> AttendFn:
    """The training/scoring attention of ``cfg`` (``cfg.attention``: xla | blockwise | auto) over
    padded or packed rows: causal within a segment, none across (``kernels/attention.py``)."""
    return segment_attention(segment_ids, cfg.head_dim ** -0.5, cfg.attention, cfg.attention_block)


# Logical axes of the activations (`jaxrl_async.sharding.activations`): no-ops unless a caller
# activated sharding rules for the trace (the trainer and the engine do, on their meshes).
RESIDUAL_AXES = ("batch", "length", "activation_embed")
Q_AXES = ("batch", "length", "activation_heads", "head_dim")
KV_AXES = ("batch", "length", "activation_kv_heads", "head_dim")
MLP_AXES = ("batch", "length", "activation_mlp")
# vocabulary projection (`token_logprobs_from_hidden`): vocabulary-parallel (Megatron) under the trainer
# rules, i.e. the chunk's positions gathered and the logits split over the vocabulary
LOGITS_HIDDEN_AXES = ("logits_batch", "length", "activation_embed")
LOGITS_AXES = ("logits_batch", "length", "activation_vocab")


_STACKED_MATMUL: contextvars.ContextVar = contextvars.ContextVar("stacked_layer_matmul", default=None)


@contextlib.contextmanager
def stacked_layer_matmul(fn, packed: dict | None = None, packed_fn=None):
    """While a forward is traced under this scope, its scan over a dense layer stack leaves the float32 projection
    matrices (q k v o gate up down without adapters) in their stacks: `_proj` computes x @ w[layer] as
    ``fn(x2 [M, K], stack [L, K, N], layer) -> [M, N]`` (`kernels.cpu_kernels.stacked_matmul`, reading the layer's
    matrix in place). Scanned slices are copied out of the stack by XLA:CPU before its dots, every step, which at a
    few rows costs more than the dots (the generator's small decode programs; NOTES, session 16).

    ``packed``: {stack name: {matrix name: copy}} of some of those matrices packed per column block ([L, ceil(N /
    64), K, 64], `cpu_kernels.pack_columns`); `_proj` then computes theirs as ``packed_fn(x2, copy, layer, N)``
    (`cpu_kernels.stacked_matmul_packed`, the same bits; the engine's ``packed_weights``, NOTES session 24)."""
    token = _STACKED_MATMUL.set((fn, packed or {}, packed_fn))
    try:
        yield
    finally:
        _STACKED_MATMUL.reset(token)


@dataclasses.dataclass(frozen=True)
class _StackedWeight:
    """A layer's projection matrix left in its stack (`stacked_layer_matmul`): ``stack[layer]``, never sliced."""

    stack: jax.Array
    layer: jax.Array
    packed: jax.Array | None = None  # the stack packed per column block (`stacked_layer_matmul`'s ``packed``)


def _in_place_matrices(stack: dict, n: int, name: str = "layers") -> dict:
    """The matrices of a dense layer stack that `stacked_layer_matmul` reads in place (none outside its scope), as
    _StackedWeight's of layer None, with their packed copies where the scope has them for stack `name`."""
    scope = _STACKED_MATMUL.get()
    if scope is None:
        return {}
    packed = scope[1].get(name, {})
    return {k: _StackedWeight(a, None, packed.get(k)) for k, a in in_place_candidates(stack).items()
            if a.shape[0] == n}


def in_place_candidates(stack: dict) -> dict:
    """The float32 projection matrices of a dense layer stack (no router) without LoRA adapters: what
    `stacked_layer_matmul` may read in place, and what the engine packs (`generator/packed_weights.py`)."""
    from jaxrl_async.models.lora import TARGETS, adapter_keys

    if "router" in stack:
        return {}
    return {k: stack[k] for k in TARGETS if k in stack and adapter_keys(k)[0] not in stack
            and stack[k].dtype == jnp.float32}


def _proj(p: Params, name: str, x: jax.Array, x_sub: str, out_sub: str, cfg: ModelConfig) -> jax.Array:
    """x W_name in x's dtype, + (alpha / r) (x A) B when the layer carries LoRA adapters for `name`
    (`models/lora.py`; a generator holding merged weights has none, and computes x W alone)."""
    from jaxrl_async.models.lora import TARGETS, adapter_keys, delta

    w_sub, nc = TARGETS[name]
    w = p[name]
    if isinstance(w, _StackedWeight) and x.dtype == jnp.float32 and x_sub[-nc:] == w_sub[:nc] and (
            out_sub == x_sub[:-nc] + w_sub[nc:]):  # x [..., contracted] @ w [contracted, free]: one 2-D product
        k_in = math.prod(x.shape[x.ndim - nc:])
        fn, _, packed_fn = _STACKED_MATMUL.get()
        if w.packed is not None:  # the copy packed per column block: same products, contiguous blocks
            y = packed_fn(x.reshape(-1, k_in), w.packed, w.layer, math.prod(w.stack.shape[1 + nc:]))
        else:
            stack = w.stack.reshape(w.stack.shape[0], k_in, -1)  # row-major: a free reshape
            y = fn(x.reshape(-1, k_in), stack, w.layer)
        y = y.reshape(*x.shape[:x.ndim - nc], *w.stack.shape[1 + nc:])
    else:
        if isinstance(w, _StackedWeight):
            w = w.stack[w.layer]
        y = jnp.einsum(f"{x_sub},{w_sub}->{out_sub}", x, w.astype(x.dtype))
    ka, kb = adapter_keys(name)
    if ka in p:
        if cfg.lora is None:
            raise ValueError(f"parameters carry LoRA adapters for {name!r} but ModelConfig.lora is None")
        # the barrier keeps XLA from fusing the low-rank dot into the base one (it reassociated the sums:
        # logits 1 ulp off with a zero adapter); with it a zero B leaves the output bit-identical
        y = jax.lax.optimization_barrier(y) + delta(x, p[ka], p[kb], name, cfg.lora.scale, x_sub, out_sub)
    return y


def decoder_layer(p: Params, x: jax.Array, cos, sin, cfg: ModelConfig, attend: AttendFn, state, layer_idx):
    """One pre-norm block: x + Attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x)). Returns (x, state)."""
    dt = x.dtype
    eps = cfg.rms_norm_eps
    x = constrain(x, *RESIDUAL_AXES)
    h = rms_norm(x, p["attn_norm"], eps)
    q = constrain(checkpoint_name(_proj(p, "q", h, "btd", "bthe", cfg), "query_proj"), *Q_AXES)
    k = constrain(checkpoint_name(_proj(p, "k", h, "btd", "btke", cfg), "key_proj"), *KV_AXES)
    v = constrain(checkpoint_name(_proj(p, "v", h, "btd", "btke", cfg), "value_proj"), *KV_AXES)
    if cfg.qkv_bias:
        q = q + p["q_bias"].astype(dt)
        k = k + p["k_bias"].astype(dt)
        v = v + p["v_bias"].astype(dt)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], eps)
        k = rms_norm(k, p["k_norm"], eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    a, state = attend(q, k, v, layer_idx, state)
    a = constrain(a, *Q_AXES)
    out = checkpoint_name(_proj(p, "o", a, "bthe", "btd", cfg), "out_proj")
    if cfg.o_bias:
        out = out + p["o_bias"].astype(dt)
    x = constrain(x + out, *RESIDUAL_AXES)
    h = rms_norm(x, p["mlp_norm"], eps)
    if "router" in p:  # a mixture-of-experts layer (a Qwen3-MoE model's dense layers have gate/up/down)
        from jaxrl_async.models.moe import moe_mlp

        y, _, _ = moe_mlp(p, h, cfg)
        return constrain(x + checkpoint_name(y, "mlpwo"), *RESIDUAL_AXES), state
    g = checkpoint_name(_proj(p, "gate", h, "btd", "btf", cfg), "mlpwi")
    u = checkpoint_name(_proj(p, "up", h, "btd", "btf", cfg), "mlpwi")
    if cfg.mlp_bias:
        g = g + p["gate_bias"].astype(dt)
        u = u + p["up_bias"].astype(dt)
    g, u = constrain(g, *MLP_AXES), constrain(u, *MLP_AXES)
    y = checkpoint_name(_proj(p, "down", jax.nn.silu(g) * u, "btf", "btd", cfg), "mlpwo")
    if cfg.mlp_bias:
        y = y + p["down_bias"].astype(dt)
    return constrain(x + y, *RESIDUAL_AXES), state


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            attend: AttendFn, state: Any = None, embeds: jax.Array | None = None,
            rope: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, Any]:
    """Embeddings -> L decoder layers -> final RMSNorm. Returns (hidden [B, T, D], state).

    ``embeds`` [B, T, D]: the input embeddings in place of the token lookup (a vision-language model's, with the
    image features scattered in: `models/qwen2_5_vl.py`); ``positions`` [3, B, T] under M-RoPE (`rope_cos_sin`).
    ``rope``: `rope_cos_sin(cfg, positions)` computed by the caller (a multi-step decode computes its K steps' at
    once, `engine_steps.decode_multi_fn`); ``positions`` is then unused.
    """
    dt = jnp.dtype(cfg.dtype)
    x = jnp.take(params["embed"], tokens, axis=0) if embeds is None else embeds
    x = constrain(x.astype(dt), *RESIDUAL_AXES)
    cos, sin = rope_cos_sin(cfg, positions) if rope is None else rope

    axes = logical_axes(cfg)

    def make_body(layer_axes, routed_stack: bool, in_place: dict | None = None):
        def body(carry, xs):
            x, state = carry
            p, i, j = xs
            # the layer's weights keep their own (FSDP) sharding inside the loop: each is all-gathered where it
            # is used and its gradient reduce-scattered per layer (without this, GSPMD accumulated full-size
            # float32 gradients of every layer in the scan's backward: 7 GiB for one MLP matrix of 8B)
            p = {k: constrain(w, *layer_axes[k][1:]) if k in layer_axes else w for k, w in p.items()}
            if in_place:  # `stacked_layer_matmul`: these matrices stay in their stacks, read at layer j
                p.update({k: dataclasses.replace(a, layer=j) for k, a in in_place.items()})
            # LoRA dropout masks per layer (training steps only; else a no-op); the MoE routing outputs of a sparse
            # layer under a `moe.routing_scope`, indexed by its slice j of the sparse stack (None without a
            # scope: nothing extra is traced)
            with lora_dropout_layer(i), (moe_layer_scope(j) if routed_stack else contextlib.nullcontext()) as routed:
                x, state = decoder_layer(p, x, cos, sin, cfg, attend, state, i)
            return (x, state), routed

        return remat(body, cfg.remat)

    # MoE routing is recorded / replayed per sparse layer: slice j of the `layers` stack (every layer of an
    # all-sparse model; dense-MLP layers route nothing)
    routed_name = "layers" if cfg.num_experts else None
    bodies = {name: make_body(axes[name], name == routed_name) for name in cfg.layer_stacks()}
    routed_runs = []
    # runs of consecutive same-kind layers (one run over all layers unless a mixture of experts has dense
    # layers among its sparse ones), each scanned over its slice of its stack or unrolled
    for name, s0, n, i0 in cfg.layer_schedule():
        stack, body = params[name], bodies[name]
        in_place = (_in_place_matrices(stack, n, name) if cfg.scan_layers and s0 == 0 and isinstance(stack, dict)
                    else {})
        if in_place:  # the matrices read in place leave the scanned xs (nothing copies them out per layer)
            body = make_body(axes[name], name == routed_name, in_place)
            stack = {k: a for k, a in stack.items() if k not in in_place}
        if cfg.scan_layers:
            xs = stack if n == jax.tree.leaves(stack)[0].shape[0] else jax.tree.map(lambda a: a[s0:s0 + n], stack)  # noqa: B023 (used within this iteration)
            (x, state), routed = jax.lax.scan(body, (x, state), (xs, jnp.arange(i0, i0 + n), jnp.arange(s0, s0 + n)))
        else:
            outs = []
            for j in range(n):
                p_j = jax.tree.map(lambda a: a[s0 + j], stack)  # noqa: B023 (used within this iteration)
                (x, state), r = body((x, state), (p_j, i0 + j, s0 + j))
                outs.append(r)
            routed = None if outs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
        if name == routed_name and routed is not None:
            routed_runs.append(routed)
    # per-sparse-layer routing outputs, stacked in the sparse stack's order, to the active routing scope
    moe_publish(None if not routed_runs else routed_runs[0] if len(routed_runs) == 1
                else jax.tree.map(lambda *a: jnp.concatenate(a), *routed_runs))
    return constrain(rms_norm(x, params["final_norm"], cfg.rms_norm_eps), *RESIDUAL_AXES), state


def unembed_matrix(params: Params) -> jax.Array:
    """[D, V] output projection (the transposed embedding when tied)."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def logits_from_hidden(params: Params, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., V] (matmul in the compute dtype, accumulated in float32)."""
    w = unembed_matrix(params).astype(hidden.dtype)
    return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)


def apply(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array | None = None,
          segment_ids: jax.Array | None = None) -> jax.Array:
    """Full-sequence logits [B, T, V] (float32) for padded or packed batches.

    segment_ids: [B, T] ints, 0 marks padding; tokens with equal non-zero ids form one
    sequence (packing). Defaults: one sequence per row, positions 0..T-1.
    """
    B, T = tokens.shape
    if segment_ids is None:
        segment_ids = jnp.ones((B, T), jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _ = forward(params, cfg, tokens, positions, model_attention(cfg, segment_ids))
    return logits_from_hidden(params, hidden)


def token_logprobs_from_hidden(params: Params, hidden: jax.Array, targets: jax.Array, temperature: float = 1.0,
                               chunk: int = 2048) -> tuple[jax.Array, jax.Array]:
    """log softmax(logits / temperature)[target] and the entropy of that distribution, per position.

    hidden [B, T, D], targets [B, T] -> (logprobs [B, T], entropy [B, T]), float32.
    The vocabulary projection runs over chunks inside a scan so that the [B, T, V] float32 logits
    never exist at once (rematerialised in the backward pass). A chunk is `tc = max(1, chunk // B)`
    positions (strided by T / tc) of *every* row (about `chunk` positions in all; each device holds its
    batch shard of them): chunking along time keeps the batch dimension whole in every chunk, so
    batch-sharded activations stay batch-sharded. (Chunks of the flattened positions cut across
    the batch shards: each device then computed every chunk's logits with a partial contraction
    and all-reduced [chunk, V] float32 logits.)

    Under the trainer's activation rules the projection is vocabulary-parallel (Megatron): the
    unembedding matrix is resharded once per call from its FSDP layout to vocabulary shards over
    tensor x fsdp (an all-to-all, no device holds all of it), each chunk's positions are gathered
    over fsdp, and the log-sum-exp and the target logit combine the vocabulary shards with
    all-reduces of [rows, tc] scalars (GSPMD partitions the target gather by masking). The cast
    to the compute dtype stays inside the chunk, so the unembedding gradient is accumulated over
    chunks in float32.
    """
    B, T, D = hidden.shape
    tc = max(1, min(T, chunk // B))
    n_chunks = -(-T // tc)
    pad = n_chunks * tc - T
    # chunk j holds the positions j, j + n_chunks, j + 2 n_chunks, ... of every row (strided): the chunk's
    # position axis is the major factor of the row, so rows split over the `context` mesh axis (context
    # parallelism) stay split in every chunk, with no resharding of the hidden states
    h = jnp.moveaxis(jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, tc, n_chunks, D), 2, 0)
    t = jnp.moveaxis(jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, tc, n_chunks), 2, 0)
    w = constrain(unembed_matrix(params), "activation_embed", "activation_vocab")

    @jax.checkpoint
    def one(h_c, t_c):
        h_c = constrain(h_c, *LOGITS_HIDDEN_AXES)
        logits = jnp.einsum("btd,dv->btv", h_c, w.astype(h_c.dtype), preferred_element_type=jnp.float32)
        logits = constrain(logits / temperature, *LOGITS_AXES)
        lse = jax.nn.logsumexp(logits, axis=-1)
        lp = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0] - lse
        probs = jnp.exp(logits - lse[..., None])
        ent = lse - jnp.sum(probs * logits, axis=-1)
        return constrain(lp, *LOGITS_AXES[:2]), constrain(ent, *LOGITS_AXES[:2])

    if n_chunks == 1:
        lp, ent = one(h[0], t[0])
        return lp, ent
    lp, ent = jax.lax.map(lambda ht: one(*ht), (h, t))
    unchunk = lambda x: jnp.moveaxis(x, 0, 2).reshape(B, n_chunks * tc)[:, :T]  # noqa: E731
    return unchunk(lp), unchunk(ent)


def sequence_logprobs(params: Params, cfg: ModelConfig, tokens: jax.Array, segment_ids: jax.Array,
                      positions: jax.Array | None = None, temperature: float = 1.0,
                      chunk: int = 2048, embeds: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced per-token log-probs, aligned with the tokens.

    out[b, t] = log p(tokens[b, t] | tokens of the same segment before t), for t that is not
    the first token of its segment; 0 elsewhere (first tokens and padding). The entropy at
    [b, t] is that of the distribution that predicted tokens[b, t]. This is the one log-prob
    computation shared by the trainer, the `score` CLI and the generator parity checks.
    `chunk`: positions per chunk of the vocabulary projection (`token_logprobs_from_hidden`).
    `embeds` [B, T, D] / `positions` [3, B, T]: a vision-language model's input embeddings and M-RoPE positions
    (`forward`; the trainer's packed rows with images, `trainer/vl_batch.py`).
    """
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _ = forward(params, cfg, tokens, positions, model_attention(cfg, segment_ids), embeds=embeds)
    # position t predicts tokens[t + 1]; the last position's (dummy) target is dropped below. Projecting
    # all T positions avoids a sliced copy of the hidden states and keeps power-of-two row lengths
    # whole multiples of the chunk (no padding).
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
    lp, ent = token_logprobs_from_hidden(params, hidden, targets, temperature, chunk)
    valid = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    zero = jnp.zeros((B, 1), jnp.float32)
    lp = jnp.concatenate([zero, jnp.where(valid, lp[:, :-1], 0.0)], axis=1)
    ent = jnp.concatenate([zero, jnp.where(valid, ent[:, :-1], 0.0)], axis=1)
    return lp, ent
