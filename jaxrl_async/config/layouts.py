"""Named hardware layouts: target device kind, device count, generator/trainer meshes and split.

A layout is data, not code that runs anywhere: a config selects one by name
(``layouts.mesh_config("h100x8")`` fills the ``mesh`` section and records ``mesh.layout``), and
``python -m jaxrl_async.plan --layout NAME`` swaps it. ``plan`` builds the meshes on simulated CPU
devices and budgets memory against :data:`DEVICE_KINDS` (so a layout can be checked without its
hardware); ``main`` requires exactly ``num_devices`` devices when ``mesh.layout`` is set.

Device order: the generator takes the first ``num_generator_devices`` device indices, the trainer
the rest (``config.resolve_device_split``); meshes are filled in index order, so the last mesh axis
(``tensor``) groups consecutive devices, i.e. devices of one node on GPU clusters (8 per node).
Multi-node layouts describe the target; running them needs one process per host (not implemented
yet: ``main`` is single-process).

Device memory (:data:`DEVICE_KINDS`) is the published HBM capacity per device (one JAX device =
one GPU or one TPU chip; a v5p/v4 chip is one megacore device). ``plan`` keeps a headroom
(default 10 %) for the runtime, allocator fragmentation and GB/GiB rounding. On GPUs, JAX
preallocates 75 % of the memory by default: run with ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``
(or preallocation off) to use what the plan budgets.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DeviceKind", "Layout", "DEVICE_KINDS", "LAYOUTS", "get_layout", "get_device_kind", "mesh_config",
           "apply_layout"]

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    name: str
    label: str
    memory_bytes: int
    platform: str  # "gpu" | "tpu"


def _kind(name: str, label: str, gib: float, platform: str) -> DeviceKind:
    return DeviceKind(name, label, int(gib * GiB), platform)


DEVICE_KINDS: dict[str, DeviceKind] = {k.name: k for k in (
    _kind("h100", "NVIDIA H100 SXM 80 GB", 80, "gpu"),
    _kind("h200", "NVIDIA H200 141 GB", 141, "gpu"),
    _kind("a100-80", "NVIDIA A100 80 GB", 80, "gpu"),
    _kind("a100-40", "NVIDIA A100 40 GB", 40, "gpu"),
    _kind("v5p", "TPU v5p chip, 95 GB HBM", 95, "tpu"),
    _kind("v5e", "TPU v5e chip, 16 GB HBM", 16, "tpu"),
    _kind("v6e", "TPU v6e (Trillium) chip, 32 GB HBM", 32, "tpu"),
    _kind("v4", "TPU v4 chip, 32 GB HBM", 32, "tpu"),
)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """``num_devices`` devices of ``device``: the first ``num_generator_devices`` form the generator
    mesh (axes among data, tensor), the rest the trainer mesh (axes among data, fsdp, tensor, context)."""

    name: str
    device: str
    num_devices: int
    num_generator_devices: int
    generator_shape: tuple[int, ...]
    generator_axes: tuple[str, ...]
    trainer_shape: tuple[int, ...]
    trainer_axes: tuple[str, ...]
    description: str

    def __post_init__(self):
        import math

        if self.device not in DEVICE_KINDS:
            raise ValueError(f"layout {self.name}: unknown device kind {self.device!r}")
        if not 0 < self.num_generator_devices < self.num_devices:
            raise ValueError(f"layout {self.name}: num_generator_devices must be in [1, {self.num_devices - 1}]")
        if math.prod(self.generator_shape) != self.num_generator_devices:
            raise ValueError(f"layout {self.name}: generator mesh {self.generator_shape} != {self.num_generator_devices} devices")
        if math.prod(self.trainer_shape) != self.num_devices - self.num_generator_devices:
            raise ValueError(f"layout {self.name}: trainer mesh {self.trainer_shape} != "
                             f"{self.num_devices - self.num_generator_devices} devices")

    @property
    def kind(self) -> DeviceKind:
        return DEVICE_KINDS[self.device]


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (
    Layout("h100x8", "h100", 8, 6, (6, 1), ("data", "tensor"), (2,), ("fsdp",),
           "1 node x 8 H100: generator 6 (6 data-parallel decode replicas), trainer 2 (FSDP); AReaL's 3:1 "
           "generation/training split (paper: 75 % of the GPUs for inference)"),
    Layout("h100x8-tp2", "h100", 8, 4, (2, 2), ("data", "tensor"), (4,), ("fsdp",),
           "1 node x 8 H100: generator 4 (2 replicas x tensor 2), trainer 4 (FSDP); the 4+4 split of AReaL's "
           "single-node examples (gsm8k_grpo.yaml allocation_mode sglang:d4p1t1+d4p1t1)"),
    Layout("h200x8", "h200", 8, 6, (3, 2), ("data", "tensor"), (2,), ("fsdp",),
           "1 node x 8 H200: generator 6 (3 replicas x tensor 2), trainer 2 (FSDP)"),
    Layout("h100x32", "h100", 32, 24, (12, 2), ("data", "tensor"), (8,), ("fsdp",),
           "4 nodes x 8 H100: generator 24 (12 replicas x tensor 2, nodes 0-2), trainer 8 (FSDP, node 3); 3:1"),
    Layout("h100x64", "h100", 64, 48, (12, 4), ("data", "tensor"), (8, 2), ("fsdp", "tensor"),
           "8 nodes x 8 H100: generator 48 (12 replicas x tensor 4, nodes 0-5), trainer 16 (FSDP 8 x tensor 2, "
           "nodes 6-7); 3:1"),
    Layout("v5p-64", "v5p", 32, 16, (4, 4), ("data", "tensor"), (16,), ("fsdp",),
           "TPU v5p-64 slice (32 chips): generator 16 (4 replicas x tensor 4), trainer 16 (FSDP)"),
    Layout("h100x8-tp2-cp2", "h100", 8, 4, (2, 2), ("data", "tensor"), (2, 2), ("fsdp", "context"),
           "1 node x 8 H100: generator 4 (2 replicas x tensor 2), trainer 4 (FSDP 2 x context 2: every trainer "
           "row split over 2 GPUs, for reasoning-length rows that do not fit one)"),
    Layout("v5p-64-cp4", "v5p", 32, 16, (4, 4), ("data", "tensor"), (4, 4), ("fsdp", "context"),
           "TPU v5p-64 slice (32 chips): generator 16 (4 replicas x tensor 4), trainer 16 (FSDP 4 x context 4: "
           "every trainer row split over 4 chips)"),
    Layout("v4-32", "v4", 16, 8, (4, 2), ("data", "tensor"), (8,), ("fsdp",),
           "TPU v4-32 slice (16 chips, 32 GiB each): generator 8 (4 replicas x tensor 2), trainer 8 (FSDP)"),
)}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}") from None


def get_device_kind(name: str) -> DeviceKind:
    try:
        return DEVICE_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown device kind {name!r}; known: {', '.join(DEVICE_KINDS)}") from None


def mesh_config(name: str, **overrides):
    """The ``mesh`` section (``config.MeshConfig``) of layout ``name`` (``mesh.layout`` set to it)."""
    from jaxrl_async.config.sections import MeshAxesConfig, MeshConfig

    lay = get_layout(name)
    kw = dict(generator=MeshAxesConfig(shape=lay.generator_shape, axis_names=lay.generator_axes),
              trainer=MeshAxesConfig(shape=lay.trainer_shape, axis_names=lay.trainer_axes),
              num_generator_devices=lay.num_generator_devices, layout=lay.name)
    kw.update(overrides)
    return MeshConfig(**kw)


def apply_layout(cfg, name: str):
    """``cfg`` (a ``RunConfig``) with the ``mesh`` section of layout ``name``; other sections unchanged."""
    import dataclasses

    return dataclasses.replace(cfg, mesh=mesh_config(name))
