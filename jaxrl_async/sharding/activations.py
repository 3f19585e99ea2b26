"""Activation sharding constraints by logical axis names, applied while a context is active.

Why: without constraints, GSPMD is free to choose the layout of every activation inside a
jitted function, and in the FSDP train step it chooses badly: it propagates the parameters'
FSDP sharding (on `embed`) into the activations, so every device computes the *whole global
batch* on a slice of the contraction dimension (the 32B step held `f32[16,2048,25600]` MLP
activations per device: the global batch; see docs/planning.md). FSDP only works as intended
when the activations stay split over the batch axes and the weights are all-gathered per layer.

How (MaxText style): the pure model code names its activations' dimensions with logical axes,
e.g. `constrain(x, "batch", "length", "activation_embed")` for the residual stream, and the
rule tables of `sharding/rules.py` map those names to mesh axes exactly as they do for the
parameters (same resolution: a dimension no candidate axis divides is replicated). The mesh and
rules are not arguments of the model functions: a caller that owns a mesh activates them for the
duration of *tracing*:

    with activation_rules(mesh, "trainer"):
        loss = loss_fn(params, batch)          # inside a function being traced by jax.jit

or wraps the function it jits with `traced_with_activation_rules(fn, mesh, rules)`. Outside such
a context (tests, single-device paths, the score CLI) `constrain` returns its input unchanged,
so the traced program is exactly what it was before. On a one-device mesh it is also a no-op.

The context is a `contextvars.ContextVar` read at trace time. `jax.jit` does not include it in
its cache key, so enter it *inside* the jitted function (or use the wrapper), never around the
call of an already-jitted function whose cache may hold a trace made without it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator, TypeVar

import jax
from jax.sharding import Mesh, NamedSharding

from jaxrl_async.sharding.rules import Rules, get_rules, logical_to_spec

__all__ = ["activation_rules", "active_activation_rules", "constrain", "traced_with_activation_rules"]

F = TypeVar("F", bound=Callable)

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jaxrl_async_activation_rules", default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh | None, rules: Rules | str) -> Iterator[None]:
    """Make `constrain` shard activations on `mesh` by `rules` (a rule-set name or table) in this
    block. `mesh=None` or a one-device mesh deactivates constraints (an enclosing context too)."""
    value = None if mesh is None or mesh.size == 1 else (mesh, get_rules(rules))
    token = _ACTIVE.set(value)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_activation_rules() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) that `constrain` currently applies, or None."""
    return _ACTIVE.get()


def traced_with_activation_rules(fn: F, mesh: Mesh | None, rules: Rules | str) -> F:
    """`fn` running under `activation_rules(mesh, rules)`: pass this to `jax.jit` so that every
    trace of `fn` (first call, new shapes, `.lower()`) sees the rules."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with activation_rules(mesh, rules):
            return fn(*args, **kwargs)

    if isinstance(fn, functools.partial):  # keep the jitted program's name (HLO dumps, profiles)
        wrapped.__name__ = wrapped.__qualname__ = getattr(fn.func, "__name__", "partial")
    return wrapped  # type: ignore[return-value]


def constrain(x: jax.Array, *axes: str | None) -> jax.Array:
    """`x` constrained to the sharding its logical `axes` resolve to under the active rules
    (`rules.logical_to_spec`: divisibility checked, unknown names are an error); `x` itself when no
    rules are active. A `None` axis is replicated."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(axes, x.shape, rules, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
