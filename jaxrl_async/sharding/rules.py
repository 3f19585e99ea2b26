"""Logical-axis -> mesh-axis sharding rules, as data (MaxText style).

Every parameter and activation dimension carries a *logical* name (`embed`, `vocab`,
`heads`, `kv_heads`, `head_dim`, `mlp`, `layers`, `norm`, `batch`, ...; activations inside the
model use `activation_*` names, applied by `sharding/activations.py`, so that e.g. the residual
stream's hidden dimension is not sharded over `fsdp` like the weights' `embed`). A rule set maps each
logical name to an ordered tuple of candidate mesh axes. The same model tree therefore gets
a different layout on each mesh by swapping the rules: the trainer shards weights fully
(FSDP over `fsdp`, Megatron-style over `tensor`), the generator keeps weights replicated over
`data` and split over `tensor` only (no all-gathers in the decode loop).

Resolution (`logical_to_spec`): for each dimension, the candidate mesh axes that exist in the
mesh, have size > 1, are not already used by another dimension of the same array, and whose
cumulative product divides the dimension size are taken in order; a dimension that no axis
divides is replicated (e.g. 2 kv heads on a tensor axis of 4). Logical names missing from the
rules are an error, so a typo never silently replicates a 32B model.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

Rules = tuple[tuple[str, tuple[str, ...]], ...]

# Trainer: FSDP over `fsdp` (and `data` for the batch), tensor parallel over `tensor`, context
# (sequence) parallel over `context`.
TRAINER_RULES: Rules = (
    # the batch is split over `expert` too (MaxText): an expert shard's devices hold different tokens, which
    # the MoE layers exchange (`moe.expert_parallel_swiglu`); everywhere else `expert` acts as data parallelism
    ("batch", ("data", "fsdp", "expert")),
    # context parallelism: rows split over `context` (attention: `kernels.attention_pallas.context_parallel_attention`)
    ("length", ("context",)),
    ("vocab", ("tensor",)),
    # weights and optimizer state are sharded over `context` too (its devices would otherwise hold copies)
    ("embed", ("fsdp", "context")),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    ("layers", ()),
    ("norm", ()),
    # mixture of experts: experts over `expert` (expert parallelism), the router replicated over experts
    ("expert", ("expert",)),
    ("expert_router", ()),
    # activations (`sharding/activations.py`): batch over the data-parallel axes, the hidden
    # dimension of the residual stream replicated (never over fsdp: FSDP shards weights, not
    # activations), heads and the MLP width over `tensor` (Megatron)
    ("activation_embed", ()),
    ("activation_heads", ("tensor",)),
    ("activation_kv_heads", ("tensor",)),
    ("activation_mlp", ("tensor",)),
    # vocabulary projection: positions gathered over fsdp, logits split over the vocabulary on tensor
    # and fsdp (the FSDP-sharded unembedding is resharded, not all-gathered, and no device holds a
    # full-vocabulary gradient), and over expert (which splits the batch like fsdp: else its devices would
    # compute the same logits)
    ("logits_batch", ("data",)),
    ("activation_vocab", ("tensor", "fsdp", "expert")),
)

# Generator: weights replicated over `data` (independent decode replicas), split over `tensor`.
GENERATOR_RULES: Rules = (
    ("batch", ("data",)),
    ("length", ()),
    ("vocab", ("tensor",)),
    ("embed", ()),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    ("layers", ()),
    ("norm", ()),
    ("expert", ("expert",)),
    ("expert_router", ()),
    # activations: decode slots over `data` (one replica each), heads and MLP width over `tensor`
    ("activation_embed", ()),
    ("activation_heads", ("tensor",)),
    ("activation_kv_heads", ("tensor",)),
    ("activation_mlp", ("tensor",)),
    ("logits_batch", ("data",)),
    ("activation_vocab", ("tensor",)),
    # KV cache
    ("cache_pages", ()),
    ("cache_page", ()),
    ("cache_kv_heads", ("tensor",)),
)

RULE_SETS: dict[str, Rules] = {"trainer": TRAINER_RULES, "generator": GENERATOR_RULES}


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one `PartitionSpec` entry (None, an axis name or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes_size(mesh: Mesh, entry) -> int:
    """How many ways one `PartitionSpec` entry splits its dimension on `mesh` (1: replicated)."""
    return math.prod(mesh.shape[a] for a in spec_axes(entry))


def get_rules(name_or_rules: str | Rules) -> Rules:
    if isinstance(name_or_rules, str):
        try:
            return RULE_SETS[name_or_rules]
        except KeyError:
            raise ValueError(f"unknown sharding rule set {name_or_rules!r}; known: {', '.join(RULE_SETS)}") from None
    return tuple((k, tuple(v) if isinstance(v, (tuple, list)) else ((v,) if v else ())) for k, v in name_or_rules)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], rules: Rules | str, mesh: Mesh) -> P:
    """PartitionSpec for an array with logical `axes` and `shape` on `mesh` (see module doc)."""
    rules_d: Mapping[str, tuple[str, ...]] = dict(get_rules(rules))
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    out = []
    for name, size in zip(axes, shape):
        if name is None:
            out.append(None)
            continue
        if name not in rules_d:
            raise ValueError(f"logical axis {name!r} has no sharding rule (rules cover: {', '.join(rules_d)})")
        chosen = []
        prod = 1
        for ax in rules_d[name]:
            if ax not in mesh.shape or ax in used or mesh.shape[ax] == 1:
                continue
            if size % (prod * mesh.shape[ax]) == 0:
                chosen.append(ax)
                prod *= mesh.shape[ax]
        used.update(chosen)
        out.append(None if not chosen else (chosen[0] if len(chosen) == 1 else tuple(chosen)))
    return P(*out)


def tree_shardings(shapes, axes, rules: Rules | str, mesh: Mesh):
    """NamedSharding tree for a tree of arrays/ShapeDtypeStructs and a matching tree of logical axes."""
    return jax.tree.map(
        lambda ax, s: NamedSharding(mesh, logical_to_spec(ax, s.shape, rules, mesh)),
        axes, shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x),
    )


def activation_sharding(mesh: Mesh, rules: Rules | str, *axes: str | None) -> NamedSharding:
    """Sharding for an activation by logical names, e.g. ("batch", "length"); divisibility not checked."""
    rules_d = dict(get_rules(rules))
    spec = []
    used: set[str] = set()
    for name in axes:
        if name is None:
            spec.append(None)
            continue
        chosen = [a for a in rules_d[name] if a in mesh.shape and mesh.shape[a] > 1 and a not in used]
        used.update(chosen)
        spec.append(None if not chosen else (chosen[0] if len(chosen) == 1 else tuple(chosen)))
    return NamedSharding(mesh, P(*spec))
