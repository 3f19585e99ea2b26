"""Mixture-of-experts MLP (Qwen3-MoE): float32 router, top-k routing, dropless grouped matmuls.

Per token x [D]: router logits ``x W_r`` in float32 (W_r [D, X], X experts), probabilities = softmax over
the X experts, the top ``k`` kept (renormalised to sum 1 when ``norm_topk_prob``; HF's order of
operations), cast to the compute dtype; the output is ``sum_j w_j SwiGLU_{e_j}(x)`` over the k chosen
experts e_j. Same function as transformers' ``Qwen3MoeSparseMoeBlock``.

Dropless: no capacity factor, no token is ever dropped or truncated. The N·k (token, expert) pairs are
sorted by expert and every expert's SwiGLU runs as one grouped matmul over its contiguous run of rows
(``jax.lax.ragged_dot`` with the per-expert group sizes: one kernel per projection instead of X), then
the rows are weighted and scatter-added back to their tokens. Compute follows the routed rows, not
X x capacity.

Parameters (``transformer.param_table``, stacked over layers): ``router`` [L, D, X] (logical axes
layers, embed, expert_router), ``moe_gate``/``moe_up`` [L, X, D, F] and ``moe_down`` [L, X, F, D] (the
``expert`` logical axis: sharded over the ``expert`` mesh axis when a rule set has one).

Expert parallelism (``expert_parallel_swiglu``): when the active mesh splits the experts over an ``expert`` axis
(rule sets: logical ``expert`` -> mesh ``expert``; the trainer's ``batch`` is split over ``expert`` too, the
generator's tokens are replicated over it), the expert MLP runs under ``jax.shard_map``: each device keeps its
X / E experts (never gathered over ``expert``), all-gathers the tokens of its expert group with their routing,
computes its experts over the (token, choice) pairs routed to them (grouped matmul with local group sizes; other
pairs carry gate 0 in the static dropless buffer) and reduce-scatters the partial outputs back (psum where the
tokens were not split). Dropless; gradients by the collectives' transposes. Chosen over an all-to-all (see NOTES:
for top-k routing with E <= k expert shards it moves no more bytes, is static and needs no ragged collective).

``routing(...)`` exposes the choices (top-k expert ids and weights per token) so that callers can record
them (the generator) or impose them (routing replay: ``expert_ids`` given, weights recomputed from this
router's logits over those experts).

Routing scopes (``routing_scope``, read at trace time like the activation rules): around a ``forward`` call,
every MoE layer can (a) impose recorded experts (``expert_ids`` [L, B, T, k], entries < 0 = not recorded:
that token routes by its own top-k; rollout routing replay, R3), (b) output the experts it used (``record``:
the generator records them for the trainer), (c) output router statistics over ``stats_mask`` tokens (load
per expert, router-probability sums for the load-balancing loss, entropy, and the tokens whose own top-k
differs from the recorded one). ``forward`` publishes the per-layer outputs, stacked over layers, in
``scope.result``. Without a scope nothing changes (no extra outputs are traced).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


from jaxrl_async.kernels.grouped_matmul import grouped_matmul, grouped_matmul_impl
from jaxrl_async.sharding.activations import active_activation_rules, constrain




def routing(h: jax.Array, router: jax.Array, k: int, norm_topk_prob: bool,
            expert_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [..., D] -> (expert ids [..., k] int32, weights [..., k] float32, router logits [..., X] float32).

    ``expert_ids`` given (routing replay): those experts, weighted by this router's probabilities of them
    (renormalised as the top-k would be)."""
    logits = jnp.einsum("...d,dx->...x", h.astype(jnp.float32), router.astype(jnp.float32),
                        preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if expert_ids is None:
        weights, expert_ids = jax.lax.top_k(probs, k)
    else:
        expert_ids = expert_ids.astype(jnp.int32)
        weights = jnp.take_along_axis(probs, expert_ids, axis=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return expert_ids.astype(jnp.int32), weights, logits


def grouped_swiglu(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, impl: str | None = None, lora: dict | None = None) -> jax.Array:
    """Dropless expert computation. x [N, D], expert_ids/weights [N, k], w_gate/w_up [X, D, F], w_down [X, F, D]
    -> [N, D]: sum over j of weights[:, j] * SwiGLU_{expert_ids[:, j]}(x), in x's dtype (float32 accumulation).

    ``lora`` (``models.lora.expert_adapters``): per-expert LoRA adapters, applied on the expert-sorted rows with
    the same group sizes: gate/up += scale (rows A_gu[x]) B_{gate,up}[x] (one A shared by both halves, as PEFT's
    fused gate_up adapter), down += scale (h A_d[x]) B_d[x]."""
    N, D = x.shape
    k = expert_ids.shape[-1]
    X = w_gate.shape[0]
    flat = expert_ids.reshape(-1)  # [N k]: pair p = token p // k, its (p % k)-th choice
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // k
    group_sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
    rows = jnp.take(x, token, axis=0)  # [N k, D]
    dt = x.dtype
    g = grouped_matmul(rows, w_gate, group_sizes, impl).astype(dt)
    u = grouped_matmul(rows, w_up, group_sizes, impl).astype(dt)
    if lora is not None and "gate_up_a" in lora:
        g, u = _expert_lora(rows, lora, "gate_up_a", ("gate_b", "up_b"), (g, u), group_sizes, impl)
    h = jax.nn.silu(g) * u
    y = grouped_matmul(h, w_down, group_sizes, impl).astype(dt)
    if lora is not None and "down_a" in lora:
        (y,) = _expert_lora(h, lora, "down_a", ("down_b",), (y,), group_sizes, impl)
    w = jnp.take(weights.reshape(-1), order).astype(dt)  # HF casts the routing weights to the compute dtype
    y = y * w[:, None]
    return jnp.zeros((N, D), jnp.float32).at[token].add(y.astype(jnp.float32)).astype(dt)


def _expert_lora(rows: jax.Array, lora: dict, a_key: str, b_keys: tuple[str, ...], ys: tuple, group_sizes, impl):
    """ys[i] + scale (rows A[x]) B_i[x] for the adapted b_keys (the others pass through), on the expert-sorted
    rows in their dtype; the barrier keeps XLA from fusing the low-rank dots into the base one (a zero B then
    leaves ys bit-identical, as ``transformer._proj``)."""
    dt = rows.dtype
    xa = grouped_matmul(rows, lora[a_key], group_sizes, impl).astype(dt)
    out = []
    for y, kb in zip(ys, b_keys):
        if kb in lora:
            y = jax.lax.optimization_barrier(y) + lora["scale"] * grouped_matmul(xa, lora[kb], group_sizes,
                                                                                  impl).astype(dt)
        out.append(y)
    return tuple(out)


def moe_mlp(p, h: jax.Array, cfg, expert_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The MoE MLP of one layer: h [B, T, D] -> (out [B, T, D], expert ids [B, T, k], router logits [B, T, X])."""
    B, T, D = h.shape
    scope, layer = _SCOPE.get(), _LAYER.get()
    if expert_ids is None and scope is not None and layer is not None:
        ids, weights, logits = _scoped_routing(p, h, cfg, scope, *layer)
    else:
        ids, weights, logits = routing(h, p["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob, expert_ids)
    from jaxrl_async.models.lora import expert_adapters

    out = expert_swiglu(h, ids, weights, p, grouped_matmul_impl(cfg.moe_kernel),
                        lora=expert_adapters(p, getattr(cfg, "lora", None)))
    return constrain(out, "batch", "length", "activation_embed"), ids, logits


def expert_swiglu(h: jax.Array, ids: jax.Array, weights: jax.Array, p, impl: str, lora: dict | None = None
                  ) -> jax.Array:
    """``grouped_swiglu`` of h [B, T, D] with ids/weights [B, T, k] and the layer's expert weights (+ their LoRA
    adapters ``lora``, ``models.lora.expert_adapters``). When the active mesh splits the experts (an ``expert``
    axis), any kernel runs in the expert-parallel exchange (``expert_parallel_swiglu``; the adapters are split
    over ``expert`` with their experts). Otherwise: the megablox kernel is a Mosaic custom call that GSPMD cannot
    partition: under an active mesh it runs inside ``shard_map``, tokens split as the residual stream's batch and
    length (each device sorts and computes its own tokens) and the expert weights (and adapters) all-gathered per
    layer (as FSDP gathers any weight; ``tensor`` too)."""
    B, T, D = h.shape
    adapters = {} if lora is None else {n: v for n, v in lora.items() if n != "scale"}
    w = {**{name: p[name] for name in EXPERT_WEIGHT_AXES}, **adapters}  # expert weights + adapters, one dict

    def swiglu(x, i, g, wl):  # grouped_swiglu on rows with the weights (and adapters) in wl
        kw = {"lora": {**{n: wl[n] for n in adapters}, "scale": lora["scale"]}} if adapters else {}
        return grouped_swiglu(x, i, g, wl["moe_gate"], wl["moe_up"], wl["moe_down"], impl, **kw)

    active = active_activation_rules()
    if active is not None and expert_parallel_size(*active, p["moe_gate"].shape[0]) > 1:
        return expert_parallel_swiglu(h, ids, weights, w, *active, impl=impl, local_fn=swiglu,
                                      weight_axes={n: EXPERT_ADAPTER_AXES[n] for n in adapters})

    def local(h, ids, weights, wl):
        b, t, _ = h.shape
        return swiglu(h.reshape(b * t, D), ids.reshape(b * t, -1), weights.reshape(b * t, -1), wl).reshape(b, t, D)

    if impl != "megablox" or active is None:
        return local(h, ids, weights, w)
    from jaxrl_async.sharding.rules import logical_to_spec

    mesh, rules = active
    tok = logical_to_spec(("batch", "length", None), h.shape, rules, mesh)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, jax.tree.map(lambda _: P(), w)), out_specs=tok,
                       check_vma=False)
    return fn(h, ids, weights, w)


# ---------------------------------------------------------------------------------------
# Expert parallelism: experts sharded over the `expert` mesh axis, tokens exchanged under shard_map
# ---------------------------------------------------------------------------------------
#: expert weights of the EP path: key -> logical axes of one layer's slice (the ``embed`` dimension is
#: gathered inside the exchange, as FSDP gathers any weight; ``expert`` and ``mlp`` stay split)
EXPERT_WEIGHT_AXES = {"moe_gate": ("expert", "embed", "mlp"), "moe_up": ("expert", "embed", "mlp"),
                      "moe_down": ("expert", "mlp", "embed")}


#: the expert adapters (``models.lora.expert_adapters``) in the EP path: split over ``expert`` like their experts,
#: the MLP width like the experts' (so a tensor-split down projection's low-rank term is a partial sum as its base
#: product is), the rank dimension whole
EXPERT_ADAPTER_AXES = {"gate_up_a": ("expert", "embed", None), "gate_b": ("expert", None, "mlp"),
                       "up_b": ("expert", None, "mlp"), "down_a": ("expert", "mlp", None),
                       "down_b": ("expert", None, "embed")}


def expert_parallel_size(mesh, rules, num_experts: int) -> int:
    """Expert shards of ``num_experts`` experts on ``mesh`` under ``rules`` (1: no expert parallelism)."""
    from jaxrl_async.sharding.rules import logical_to_spec, spec_axes_size

    return spec_axes_size(mesh, logical_to_spec(("expert",), (num_experts,), rules, mesh)[0])


def expert_parallel_swiglu(h: jax.Array, ids: jax.Array, weights: jax.Array, w: dict, mesh, rules,
                           impl: str | None = None, local_fn=None, weight_axes: dict | None = None) -> jax.Array:
    """Dropless expert parallelism: h [B, T, D], ids/weights [B, T, k] (the routing of every token), ``w`` the
    layer's expert weights (``moe_gate``/``moe_up`` [X, D, F], ``moe_down`` [X, F, D], plus any other per-expert
    leaf named in ``weight_axes``) with experts sharded over the rule set's ``expert`` mesh axes -> [B, T, D].

    Under ``jax.shard_map`` each device holds X / E experts (E expert shards) and:
      1. gathers the tokens (with their ids and gates) of its expert group (``all_gather`` over the expert axes
         the residual stream's batch/length are split over; none on the generator, whose tokens are replicated
         over ``expert`` like over ``tensor``);
      2. computes its local experts over every gathered (token, choice) pair routed to them (``local_fn``, by
         default ``grouped_swiglu`` with the local group sizes; pairs routed elsewhere join the last local group
         with gate 0: the grouped matmul's buffer is the static dropless bound, N E k rows, nothing dropped);
      3. sums the partial outputs over the expert shards and scatters them back to the tokens' owners
         (``psum_scatter``; ``psum`` when the tokens were not gathered), and over ``tensor`` when the expert
         width is split there (Megatron: gate/up by columns, down by rows).
    ``all_gather`` and ``psum_scatter`` are each other's transposes: gradients flow through the exchange.
    ``local_fn(x [M, D], local_ids [M, k], gates [M, k], local weights dict) -> [M, D]`` in the compute dtype
    (each (token, choice) row's result is complete on the device that owns its expert; a token's k rows are
    summed within a shard in float32 by ``grouped_swiglu``, across shards in the compute dtype).

    Cost: the local grouped matmul runs over the static dropless buffer of every gathered (token, choice) pair,
    E N k rows for N tokens per device (pairs routed elsewhere have gate 0), i.e. E times the routed rows for the
    static-shape kernels (ragged_dot's dense lowerings, ``tiled``, megablox's grid); a kernel that skips the
    zero-gate tail would recover it (open)."""
    from jaxrl_async.sharding.rules import logical_to_spec, spec_axes, spec_axes_size

    B, T, D = h.shape
    k = ids.shape[-1]
    X = w["moe_gate"].shape[0]
    weight_axes = dict(EXPERT_WEIGHT_AXES, **(weight_axes or {}))
    if local_fn is None:
        local_fn = lambda x, i, g, wl: grouped_swiglu(x, i, g, wl["moe_gate"], wl["moe_up"],  # noqa: E731
                                                      wl["moe_down"], impl)

    tok = logical_to_spec(("batch", "length", None), h.shape, rules, mesh)
    w_specs = {}
    for name, leaf in w.items():
        spec = logical_to_spec(weight_axes[name], leaf.shape, rules, mesh)
        w_specs[name] = P(*(None if ax == "embed" else s for ax, s in zip(weight_axes[name], spec)))
    ep_axes = spec_axes(w_specs["moe_gate"][0])
    tp_axes = spec_axes(w_specs["moe_gate"][2])
    tok_axes = set(spec_axes(tok[0])) | set(spec_axes(tok[1]))
    gather = tuple(a for a in ep_axes if a in tok_axes)  # token shards inside an expert group
    Xl = X // spec_axes_size(mesh, w_specs["moe_gate"][0])

    def local(h, ids, weights, wl):
        b, t, _ = h.shape
        x, i, g = h.reshape(b * t, D), ids.reshape(b * t, k), weights.reshape(b * t, k)
        if gather:
            x, i, g = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, i, g))
        if checked and rest:
            # tokens replicated over the expert shards that split the work: marked varying explicitly (the
            # cast's transpose sums their cotangents; left implicit, part of them was lost: h's gradient 0.84x)
            x, g = (jax.lax.pcast(a, rest, to="varying") for a in (x, g))
        first = jax.lax.axis_index(ep_axes) * Xl  # this device's experts: [first, first + Xl)
        lid = i - first
        mine = (lid >= 0) & (lid < Xl)
        # partial sums are reduced in the compute dtype (local_fn's output; bf16 in training: half the bytes)
        y = local_fn(x, jnp.where(mine, lid, Xl - 1), jnp.where(mine, g, jnp.zeros_like(g)), wl)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        if rest:
            y = jax.lax.psum(y, rest)
        return y.astype(h.dtype).reshape(b, t, D)

    rest = tuple(a for a in ep_axes if a not in gather) + tp_axes  # summed with psum (tokens not split there)
    # the Pallas (megablox) call has no varying-axes typing: unchecked there (the unchecked transpose divides an
    # unmapped output's cotangent by the devices it is replicated over and transposes psum to psum: same gradient)
    checked = impl != "megablox"
    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, w_specs), out_specs=tok, check_vma=checked)
    return fn(h, ids, weights, w)


def load_balancing_loss(logits: jax.Array, expert_ids: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Switch-Transformer auxiliary loss as transformers computes it for Qwen3-MoE: X * sum_x f_x P_x, with
    f_x the fraction of routed (token, choice) pairs sent to expert x and P_x the mean router probability of
    x, over the tokens where ``mask`` (default: all). logits [..., X], expert_ids [..., k]."""
    X = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).reshape(-1, X)
    onehot = jax.nn.one_hot(expert_ids.reshape(-1, expert_ids.shape[-1]), X, dtype=jnp.float32)  # [N, k, X]
    m = jnp.ones(probs.shape[:1], jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    frac = (onehot * m[:, None, None]).sum(axis=0) / n  # [k, X]
    prob = (probs * m[:, None]).sum(axis=0) / n  # [X]
    return X * jnp.sum(frac * prob[None, :])


# ---------------------------------------------------------------------------------------
# Routing scopes: record / impose (replay) the experts, router statistics
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class RoutingScope:
    """What the MoE layers of one ``forward`` trace do besides computing (see the module doc).

    expert_ids: [L, B, T, k] recorded experts per layer and token (< 0: none recorded), or None.
    replay: route by ``expert_ids`` where recorded (gates from this router's probabilities over them).
    record: output the experts used, ``result["ids"]`` [L, B, T, k] int32.
    stats_mask: [B, T] tokens over which ``result`` gets the router statistics (``router_stats``), or None.
    result: set by ``forward``: per-layer outputs stacked over the layers (empty for a dense model)."""

    expert_ids: Any = None
    replay: bool = False
    record: bool = False
    stats_mask: Any = None
    result: dict | None = None


_SCOPE: contextvars.ContextVar = contextvars.ContextVar("jaxrl_async_moe_scope", default=None)
_LAYER: contextvars.ContextVar = contextvars.ContextVar("jaxrl_async_moe_layer", default=None)


@contextlib.contextmanager
def routing_scope(**kw):
    """``with routing_scope(record=True) as scope: forward(...)`` then ``scope.result`` (see ``RoutingScope``)."""
    scope = RoutingScope(**kw)
    if scope.replay and scope.expert_ids is None:
        raise ValueError("routing_scope: replay needs expert_ids")
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def layer_scope(layer_idx):
    """Entered by ``forward`` around decoder layer ``layer_idx`` (traced in a scan); yields the dict the layer's
    MoE MLP fills (None without a routing scope: nothing to collect)."""
    if _SCOPE.get() is None:
        yield None
        return
    out: dict = {}
    token = _LAYER.set((layer_idx, out))
    try:
        yield out
    finally:
        _LAYER.reset(token)


def publish(per_layer) -> None:
    """Called by ``forward`` with the layers' outputs stacked over layers (a no-op without a scope)."""
    scope = _SCOPE.get()
    if scope is not None:
        scope.result = dict(per_layer or {})


def router_stats(logits: jax.Array, ids: jax.Array, own_ids: jax.Array, mask: jax.Array,
                 recorded: jax.Array | None = None) -> dict[str, jax.Array]:
    """One layer's router statistics over the tokens where ``mask`` ([B, T]); logits [B, T, X] float32, ids (used)
    and own_ids (this router's top-k) [B, T, k], recorded [B, T, k] (< 0: none) or None.

    count [X]: routed (token, choice) pairs per expert; prob_sum [X]: sum of router probabilities (the only entry
    with a gradient, for ``aux_loss``); entropy_sum, tokens; with ``recorded``: recorded (tokens with a
    recording) and mismatch (those whose own top-k SET differs from the recorded one)."""
    X, k = logits.shape[-1], ids.shape[-1]
    m = mask.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    probs = jnp.exp(logp)
    sg = jax.lax.stop_gradient
    count = jnp.zeros((X,), jnp.float32).at[ids.reshape(-1)].add(jnp.repeat(m.reshape(-1), k))
    out = {"count": count, "prob_sum": jnp.einsum("btx,bt->x", probs, m),
           "entropy_sum": sg(jnp.sum(-jnp.sum(probs * logp, axis=-1) * m)), "tokens": m.sum()}
    if recorded is not None:
        rec = recorded.astype(jnp.int32)
        has = (rec[..., 0] >= 0) & (m > 0)
        differ = jnp.any(jnp.sort(own_ids, axis=-1) != jnp.sort(rec, axis=-1), axis=-1)
        out["recorded"] = has.sum().astype(jnp.float32)
        out["mismatch"] = (has & differ).sum().astype(jnp.float32)
    return out


def aux_loss(stats: dict[str, jax.Array]) -> jax.Array:
    """The load-balancing loss of all layers from ``router_stats`` stacked over layers ([L, X] count/prob_sum,
    [L] tokens), as transformers computes it for Qwen3-MoE (every layer's router logits concatenated along the
    tokens): X * sum_x f_x P_x, f_x = routed pairs to x / (L N), P_x = summed probability of x / (L N)."""
    X = stats["count"].shape[-1]
    n = jnp.maximum(stats["tokens"].sum(), 1.0)
    return X * jnp.sum(stats["count"].sum(0) / n * stats["prob_sum"].sum(0) / n)


def _scoped_routing(p, h: jax.Array, cfg, scope: RoutingScope, layer_idx, out: dict):
    """Routing of one layer under a scope: own top-k, recorded experts imposed where replaying, outputs."""
    k = cfg.num_experts_per_tok
    own_ids, weights, logits = routing(h, p["router"], k, cfg.norm_topk_prob)
    ids, rec = own_ids, None
    if scope.expert_ids is not None:
        rec = jax.lax.dynamic_index_in_dim(scope.expert_ids, layer_idx, axis=0, keepdims=False).astype(jnp.int32)
        if scope.replay:
            ids = jnp.where(rec[..., :1] >= 0, rec, own_ids)
            ids, weights, _ = routing(h, p["router"], k, cfg.norm_topk_prob, expert_ids=ids)
    if scope.record:
        out["ids"] = ids
    if scope.stats_mask is not None:
        out.update(router_stats(logits, ids, own_ids, scope.stats_mask, rec))
    return ids, weights, logits
