"""Compile-only accelerator devices on a machine without them (``../shared/reference/accelerator-aot.md``).

* TPU: ``libtpu`` (extra ``[aot-tpu]``) + ``jax.experimental.topologies``: a described slice (``v5e:2x2``,
  ``v5:2x2x1`` for v5p, ``v6e:2x2``, multi-host and multi-slice) whose devices ``jax.jit(...).lower().compile()``
  targets; ``memory_analysis()`` is the TPU compiler's.
* NVIDIA H100: ``jax-cuda12-plugin`` + ptxas (extra ``[aot-gpu]``) + the target description shipped in
  ``jaxrl_async/targets/h100_sxm.txtpb``; XLA logs "Performing a deviceless compilation".

Nothing is executed: build abstract arguments only (``jax.ShapeDtypeStruct`` with shardings; an
eager op or ``device_put`` on these devices fails: "not available with compile-only client").
"""

from __future__ import annotations

import importlib.util
import os

TARGETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "targets")  # jaxrl_async/targets
H100_TARGET = os.path.join(TARGETS_DIR, "h100_sxm.txtpb")


class AOTUnavailableError(RuntimeError):
    """The compiler of that target is not installed (say which extra installs it)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a missing parent package
        return False


def tpu_available() -> bool:
    return _installed("libtpu")


def gpu_available() -> bool:
    return _installed("jax_plugins.xla_cuda12") or _installed("jax_cuda12_plugin")


def tpu_devices(topology: str = "v5e:2x2", *, num_slices: int = 1) -> list:
    """Compile-only TPU devices of a slice, e.g. ``v5e:2x2`` (4 chips), ``v5:2x2x2`` (v5p, 8 chips)."""
    if not tpu_available():
        raise AOTUnavailableError("compiling for TPU needs libtpu: pip install 'jaxrl_async[aot-tpu]'")
    from jax.experimental import topologies

    kind, _, shape = topology.partition(":")
    dims = [int(x) for x in shape.split("x")]
    bounds = (min(dims[0], 2), min(dims[1], 2), 1) if len(dims) == 2 else (2, 2, 1)
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu", chip_config_name="default",
                                        chips_per_host_bounds=bounds, num_slices=num_slices,
                                        wrap=(False, False, False))
    return list(topo.devices)


def h100_devices(n: int = 8, *, hosts: int = 1) -> list:
    """Compile-only H100 SXM devices: ``hosts`` x ``n`` GPUs."""
    if not gpu_available():
        raise AOTUnavailableError("compiling for H100 needs the CUDA plugin: pip install 'jaxrl_async[aot-gpu]'")
    from jax.experimental import topologies

    with open(H100_TARGET, encoding="utf-8") as f:
        target = f.read()
    topo = topologies.get_topology_desc(platform="cuda", topology_name="", topology=f"{hosts}x1x{n}",
                                        target_config=target)
    return list(topo.devices)


# chips of a TPU slice -> its topology (v5p / v4: 3D tori, 4 chips a host; v5e / v6e: 2D)
_TPU_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}
_TPU_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TPU_PREFIX = {"v5p": "v5", "v4": "v4", "v5e": "v5e", "v6e": "v6e"}


#: XLA options for deviceless GPU compiles: CUB radix sort (XLA's choice for large sorts, e.g. a
#: full-vocabulary sort in sampling) sizes its scratch through the CUDA runtime at compile time and
#: fails without a GPU ("Error loading CUDA libraries"); the XLA sort kernel compiles anywhere. The
#: plan then omits CUB's scratch (a few MB for [slots, vocab] on H100).
GPU_DEVICELESS_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def compiler_options(devices) -> dict | None:
    """Options for ``Lowered.compile`` on compile-only ``devices`` (None: the defaults)."""
    platform = next(iter(devices)).platform if devices else None
    return dict(GPU_DEVICELESS_OPTIONS) if platform in ("gpu", "cuda") else None


def target_devices(kind: str, n: int) -> tuple[list, str]:
    """(compile-only devices, description) of ``n`` devices of a ``layouts.DEVICE_KINDS`` kind.

    GPUs: H100 and H200 compile against the H100 SXM description (the same sm_90 compute; the memory
    budget is the kind's own). TPUs: the slice of ``n`` chips. AOTUnavailableError when the kind
    has no description here or its compiler is not installed."""
    if kind in ("h100", "h200"):
        if n > 8 and n % 8:
            raise AOTUnavailableError(f"{n} GPUs: a multi-host H100 topology needs a multiple of 8")
        hosts, per_host = (n // 8, 8) if n > 8 else (1, n)
        what = "H100 SXM" if kind == "h100" else "H200 (the H100 SXM description: same sm_90a compute)"
        return h100_devices(per_host, hosts=hosts), f"{n} x {what} (deviceless CUDA compile)"
    if kind in _TPU_PREFIX:
        table = _TPU_3D if kind in ("v5p", "v4") else _TPU_2D
        if n not in table:
            raise AOTUnavailableError(f"no {kind} slice of {n} chips here (sizes: {sorted(table)})")
        topology = f"{_TPU_PREFIX[kind]}:{table[n]}"
        return tpu_devices(topology), f"TPU {topology} ({n} chips, libtpu deviceless compile)"
    raise AOTUnavailableError(f"no compile-only target for device kind {kind!r}")
