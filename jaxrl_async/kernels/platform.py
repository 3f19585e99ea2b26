"""Which platform a traced program targets, and running a kernel at a matmul precision: shared by every
kernel switch (training attention, decode attention, grouped matmuls)."""

from __future__ import annotations

from typing import Callable

import jax

from jaxrl_async.sharding.activations import active_activation_rules

__all__ = ["at_precision", "kernel_platform"]


def kernel_platform() -> str:
    """The platform the traced program targets: the active mesh's devices, else the default backend."""
    active = active_activation_rules()
    if active is not None:
        return active[0].devices.flat[0].platform
    return jax.devices()[0].platform


def at_precision(fn: Callable, precision: str) -> Callable:
    """``fn`` traced at ``precision`` in its forward AND its backward pass (a plain context manager
    would not cover the backward, which is traced later, under the caller's precision)."""

    @jax.custom_vjp
    def f(*args):
        with jax.default_matmul_precision(precision):
            return fn(*args)

    def fwd(*args):
        with jax.default_matmul_precision(precision):
            return jax.vjp(fn, *args)

    def bwd(vjp, g):
        with jax.default_matmul_precision(precision):
            return vjp(g)

    f.defvjp(fwd, bwd)
    return f
