"""A LoRA run's checkpoints that refer to their base model instead of holding it: the reference (``model.path``
with its config.json and weight files fingerprinted), its check on resume and export, and the base joined back
for export (``hf_export``)."""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Any, Mapping

import jax

def _file_digest(path: str, edge: int = 1 << 20) -> str:
    """size + sha256 of the first and last ``edge`` bytes (a different checkpoint of the same architecture
    differs there; hashing 16 GB at every resume would not be affordable)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(edge))
        if size > edge:
            fh.seek(max(edge, size - edge))
            h.update(fh.read(edge))
    return h.hexdigest()


def base_reference(cfg: Any, model_cfg: Any) -> dict[str, Any] | None:
    """The base a LoRA run's checkpoints refer to instead of holding it: ``model.path`` (its config.json and
    weight files fingerprinted), when the run never changes the base (LoRA, no SFT warm start). None: the
    checkpoints hold the base (random init or a warm-started base exist nowhere else)."""
    if getattr(model_cfg, "lora", None) is None or cfg.model.path is None or cfg.trainer.sft.steps > 0:
        return None
    path = os.path.abspath(cfg.model.path)
    names = sorted({"config.json", *(os.path.basename(f) for f in glob.glob(os.path.join(glob.escape(path),
                                                                                        "*.safetensors*")))})
    return {"path": path, "files": {n: _file_digest(os.path.join(path, n)) for n in names
                                    if os.path.isfile(os.path.join(path, n))}}


def check_base_reference(saved: Mapping[str, Any] | None, where: str, *, current: Mapping[str, Any] | None = None
                         ) -> None:
    """CheckpointIncompatibleError (naming model.path) unless ``saved`` (a checkpoint's base reference)
    matches ``current`` (default: the files at ``saved["path"]`` now)."""
    from jaxrl_async.checkpoint.manager import CheckpointIncompatibleError

    if not saved:
        raise CheckpointIncompatibleError(f"{where}: holds LoRA adapters without a base reference; this run expects "
                                          f"adapters on model.path {current['path'] if current else '?'}")
    path = saved["path"]
    if current is None:
        if not os.path.isdir(path):
            raise CheckpointIncompatibleError(f"{where}: its LoRA base model.path {path} is not a directory")
        current = {"path": path, "files": {n: _file_digest(os.path.join(path, n)) for n in saved["files"]
                                           if os.path.isfile(os.path.join(path, n))}}
    if dict(current["files"]) != dict(saved["files"]):
        changed = sorted(set(current["files"]) ^ set(saved["files"]) |
                         {n for n in saved["files"] if current["files"].get(n) not in (None, saved["files"][n])})
        raise CheckpointIncompatibleError(f"{where}: model.path {path} is not the base these LoRA adapters were "
                                          f"trained on (changed: {', '.join(changed)})")


def with_referenced_base(adapters: Any, saved: Mapping[str, Any], where: str) -> Any:
    """Host params of a base-referencing checkpoint: its adapters joined with the base read from the
    referenced ``model.path`` (checked first); for export."""
    from jaxrl_async.models import lora
    from jaxrl_async.models.hf_io import load_hf

    check_base_reference(saved, where)
    _, base = load_hf(saved["path"])
    return lora.join(adapters, jax.device_get(base))
