"""Mesh construction helpers.

`jax.make_mesh` defaults to Explicit axis types in jax 0.10; this project uses GSPMD-style
(Auto) sharding everywhere, so every mesh is built here with `AxisType.Auto`.
The generator and trainer meshes are built over disjoint device lists (`split_devices`).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(shape: Mapping[str, int] | Sequence[int], axis_names: Sequence[str] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh with Auto axes. `shape` is {"fsdp": 4, "tensor": 2} or a tuple with `axis_names`.

    A size of -1 (at most one) takes the remaining devices. With `devices` given the mesh is
    built over exactly those (in order); otherwise over all devices via jax.make_mesh, which
    picks a topology-aware order on accelerators.
    """
    if isinstance(shape, Mapping):
        axis_names = tuple(shape.keys())
        sizes = list(shape.values())
    else:
        if axis_names is None:
            raise ValueError("make_mesh: axis_names are required when shape is a sequence")
        sizes = list(shape)
        axis_names = tuple(axis_names)
    if len(sizes) != len(axis_names):
        raise ValueError(f"make_mesh: shape {sizes} and axis names {axis_names} differ in length")
    devs = list(devices) if devices is not None else jax.devices()
    n = len(devs)
    if sizes.count(-1) > 1:
        raise ValueError(f"make_mesh: at most one axis may be -1, got {dict(zip(axis_names, sizes))}")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if n % rest:
            raise ValueError(f"make_mesh: {n} devices are not divisible by {rest} ({dict(zip(axis_names, sizes))})")
        sizes[sizes.index(-1)] = n // rest
    if math.prod(sizes) != n:
        raise ValueError(
            f"make_mesh: mesh {dict(zip(axis_names, sizes))} needs {math.prod(sizes)} devices, {n} given")
    types = (AxisType.Auto,) * len(sizes)
    if devices is None:
        return jax.make_mesh(tuple(sizes), axis_names, axis_types=types)
    return Mesh(np.asarray(devs, dtype=object).reshape(sizes), axis_names, axis_types=types)


def split_devices(devices: Sequence[jax.Device] | None = None, generator_fraction: float = 0.75,
                  num_generator: int | None = None) -> tuple[list[jax.Device], list[jax.Device]]:
    """Split devices into (generator, trainer) lists; one device => both share it (time-sharing)."""
    devs = list(devices) if devices is not None else jax.devices()
    if len(devs) == 1:
        return devs, devs
    if num_generator is None:
        if not 0.0 < generator_fraction < 1.0:
            raise ValueError(f"generator_fraction must be in (0, 1), got {generator_fraction}")
        num_generator = max(1, min(len(devs) - 1, round(len(devs) * generator_fraction)))
    if not 0 < num_generator < len(devs):
        raise ValueError(f"num_generator={num_generator} must be in [1, {len(devs) - 1}] for {len(devs)} devices")
    return devs[:num_generator], devs[num_generator:]
