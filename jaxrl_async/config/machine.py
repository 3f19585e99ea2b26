"""A published config on the machine you have: ``mesh.layout=auto`` and accelerator layouts on a CPU-only host.

A recipe names the hardware it was sized for (``mesh.layout``: ``h100x8``, ``v5p-64``, ...). On that hardware
the run checks the device count (``validation``); on another kind of machine :func:`fit_to_machine` rewrites
only what belongs to the machine, never the algorithm, and says each change in one line:

* ``mesh.layout=auto``, or a GPU/TPU layout on a host whose JAX has no accelerator: the machine's layout.
  - CPU: two simulated devices, one generator (one decode replica) and one trainer (``mesh.cpu_devices=2``);
    compute in float32 (bfloat16 matmuls are emulated on CPUs: decode measured 1.6 vs 6.8 tokens/s for a
    Qwen3-0.6B shape, issue 31), the KV pool sized from the host's available RAM (``rollout.engine.num_pages``
    None, ``generator.kv_cache``), trainer micro-batches of one row of the longest bucket (the recipe's
    32k-token micro-batches are sized for 80 GB devices), at most one reward worker per core.
  - GPU/TPU (``auto`` only): one device: generator and trainer time-share it (``mesh.colocate``); N >= 2:
    AReaL's 3:1 split (``round(0.75 N)`` decode replicas over ``data``, the rest FSDP).
* Batch size, samples per prompt, lengths, learning rate, loss: unchanged. A recipe's step then costs what it
  costs (``main --dry-run`` prints a rough time per step on a CPU); lower ``trainer.batch_size`` /
  ``rollout.n_samples`` / ``rollout.sampling.max_new_tokens`` to shorten it.

``main`` calls :func:`cpu_devices_before_start` before JAX starts (the simulated CPU devices must be set
then) and :func:`fit_to_machine` before validation; the fitted config is what ``RUN/config.json`` records.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

AUTO = "auto"
#: simulated CPU devices of the CPU layout: one generator, one trainer
CPU_DEVICES = 2

__all__ = ["AUTO", "CPU_DEVICES", "needs_fit", "cpu_devices_before_start", "fit_to_machine", "machine"]


def _layout_platform(name: str | None) -> str | None:
    from jaxrl_async.config.layouts import LAYOUTS

    return LAYOUTS[name].kind.platform if name in LAYOUTS else None


def needs_fit(cfg: Any) -> bool:
    """Whether ``cfg``'s mesh may be rewritten for the machine (``auto``, or a named GPU/TPU layout)."""
    return cfg.mesh.layout == AUTO or _layout_platform(cfg.mesh.layout) is not None


def cpu_devices_before_start(cfg: Any) -> int | None:
    """``jax_num_cpu_devices`` to set before JAX starts: the CPU layout's count where the mesh may be fitted (it
    only affects JAX's CPU backend, so it is harmless where an accelerator runs the job), else
    ``mesh.cpu_devices``."""
    return max(cfg.mesh.cpu_devices or 0, CPU_DEVICES) if needs_fit(cfg) else cfg.mesh.cpu_devices


def machine() -> tuple[str, int]:
    """(JAX's default platform: cpu | gpu | tpu, its device count) of this process (starts JAX's backend)."""
    import jax

    platform = jax.default_backend()
    return ("gpu" if platform in ("cuda", "rocm", "gpu") else platform), jax.device_count()


def fit_to_machine(cfg: Any, platform: str | None = None, num_devices: int | None = None,
                   cores: int | None = None) -> tuple[Any, list[str]]:
    """(``cfg`` fitted to this machine, one line per change) (module doc); ``cfg`` itself where nothing needs it."""
    if not needs_fit(cfg):
        return cfg, []
    if platform is None or num_devices is None:
        platform, num_devices = machine()
    target = _layout_platform(cfg.mesh.layout)
    if target is not None and (target == platform or platform != "cpu"):
        return cfg, []  # the named layout's kind of machine (or another accelerator: validation checks the count)
    if platform == "cpu":
        return _fit_cpu(cfg, cores or os.cpu_count() or 1)
    return _fit_accelerator(cfg, platform, num_devices)


def _mesh(**kw):
    from jaxrl_async.config.sections import MeshAxesConfig, MeshConfig

    gen, trn = kw.pop("generator"), kw.pop("trainer")
    return MeshConfig(generator=MeshAxesConfig(shape=gen, axis_names=("data", "tensor")),
                      trainer=MeshAxesConfig(shape=trn, axis_names=("fsdp",)), layout=None, **kw)


def _fit_cpu(cfg: Any, cores: int) -> tuple[Any, list[str]]:
    from jaxrl_async.config.layouts import LAYOUTS

    was = cfg.mesh.layout
    why = (f"mesh.layout={was} is sized for {LAYOUTS[was].num_devices} x {LAYOUTS[was].kind.label} and this "
           "machine has no accelerator" if was in LAYOUTS else "mesh.layout=auto on a CPU-only machine")
    lines = [f"{why}: running on {CPU_DEVICES} simulated CPU devices (generator 1, trainer 1; "
             f"mesh.cpu_devices={CPU_DEVICES})"]
    mesh = _mesh(generator=(1, 1), trainer=(1,), num_generator_devices=1, cpu_devices=CPU_DEVICES)
    model = cfg.model
    if model.dtype != "float32":
        lines.append(f"model.dtype={model.dtype} -> float32: {model.dtype} matmuls are emulated on CPUs and run "
                     "~4x slower (decode 1.6 vs 6.8 tokens/s measured on a Qwen3-0.6B shape)")
        model = dataclasses.replace(model, dtype="float32")
    ro, en = cfg.rollout, cfg.rollout.engine
    if en.num_pages is not None:
        lines.append(f"rollout.engine.num_pages={en.num_pages} -> sized from this host's available memory")
        en = dataclasses.replace(en, num_pages=None)
    workers = ro.reward_workers
    if workers > cores:
        lines.append(f"rollout.reward_workers={workers} -> {cores} (one per core)")
        workers = cores
    ro = dataclasses.replace(ro, engine=en, reward_workers=workers)
    tr = cfg.trainer
    one_row = max(tr.packing.row_len_buckets)
    if tr.packing.tokens_per_micro > one_row:
        lines.append(f"trainer.packing.tokens_per_micro={tr.packing.tokens_per_micro} -> {one_row} (one row of the "
                     "longest bucket per micro-batch; the same batch, accumulated in more micro-steps)")
        tr = dataclasses.replace(tr, packing=dataclasses.replace(tr.packing, tokens_per_micro=one_row))
    return dataclasses.replace(cfg, mesh=mesh, model=model, rollout=ro, trainer=tr), lines


def _fit_accelerator(cfg: Any, platform: str, n: int) -> tuple[Any, list[str]]:
    if n == 1:
        mesh = _mesh(generator=(1, 1), trainer=(1,), colocate=True)
        return dataclasses.replace(cfg, mesh=mesh), [
            f"mesh.layout=auto on one {platform.upper()} device: the generator and the trainer time-share it "
            "(mesh.colocate=true)"]
    ng = min(n - 1, max(1, round(0.75 * n)))
    slots = cfg.rollout.engine.max_concurrent_decodes
    while ng > 1 and slots % ng:  # every decode replica gets the same number of slots
        ng -= 1
    mesh = _mesh(generator=(ng, 1), trainer=(n - ng,), num_generator_devices=ng)
    return dataclasses.replace(cfg, mesh=mesh), [
        f"mesh.layout=auto on {n} {platform.upper()} devices: generator {ng} (data-parallel decode replicas), "
        f"trainer {n - ng} (FSDP)"]
