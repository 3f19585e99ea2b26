"""What a run directory already holds, checked against a config before anything is built.

* ``checkpoint.resume=never`` in a directory with committed checkpoints (RL, or an interrupted warm start)
  is refused: every save of the new run would collide with the old steps, and the next default run would
  resume the old run's checkpoint.
* Resuming (``auto`` / ``must``) compares the config saved in the newest committed checkpoint with this
  one: a change to a field that defines the saved state or the data stream the ledger indexes
  (``RESUME_FIXED``: the architecture, LoRA adapters, tokenizer, data, seed) is refused in one line naming
  the fields with old -> new values; other changes (steps, eta, timeouts, logging, meshes, ...) are
  allowed and listed by the loop when it resumes (``changed_fields``).

Directory listings and one JSON read (``RUN/checkpoints/<step>/meta/metadata``): no JAX, no Orbax.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from jaxrl_async.config.sections import ConfigError, RunConfig

__all__ = ["RESUME_FIXED", "changed_fields", "check_resume", "committed_steps", "saved_config"]

CHECKPOINTS_DIR, WARM_START_CHECKPOINTS = "checkpoints", os.path.join("warm_start", "checkpoints")

# dotted prefixes whose change makes a checkpoint's state or ledger mean something else
RESUME_FIXED = (
    "seed", "model.model_type", "model.vocab_size", "model.hidden_size", "model.intermediate_size",
    "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.head_dim", "model.max_position_embeddings",
    "model.rope_theta", "model.tie_word_embeddings", "model.num_experts", "model.num_experts_per_tok",
    "model.moe_intermediate_size", "model.norm_topk_prob", "model.init_seed", "model.tokenizer_path",
    "model.lora.rank", "model.lora.alpha", "model.lora.targets", "model.lora.init_seed", "model.lora.base_dtype",
    "data.task", "data.train_path", "data.format", "data.arithmetic", "data.max_prompt_len", "data.apply_chat_template",
    "data.system_prompt", "data.prompt_suffix", "data.tokenizer_kind", "data.shuffle", "data.skip_bad_rows",
    "model.mrope_section", "model.vision", "data.visual", "data.image_min_pixels", "data.image_max_pixels",
    "trainer.freeze_vision",  # the optimizer state holds the vision tower's moments or not
)


def committed_steps(directory: str) -> list[int]:
    """Committed checkpoint steps under ``directory`` (a listing)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isfile(os.path.join(directory, n, "commit_success.txt")))


def saved_config(run_dir: str) -> tuple[int, dict[str, Any]] | None:
    """(step, config dict) of the newest committed RL checkpoint whose metadata is readable, else None."""
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    for step in reversed(committed_steps(root)):
        try:
            with open(os.path.join(root, str(step), "meta", "metadata")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue  # the loop's restore falls back past an unreadable step the same way
        if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
            return step, meta["config"]
    return None


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def changed_fields(saved: Mapping[str, Any], cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Dotted field -> (saved value, value now) for every field that differs (``run_dir`` ignored)."""
    old, new = _flat(saved), _flat(json.loads(json.dumps(dataclasses.asdict(cfg))))  # as config.to_dict
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k != "run_dir" and old.get(k) != new.get(k)}


def _fixed(field: str) -> bool:
    return any(field == p or field.startswith(p + ".") for p in RESUME_FIXED)


def check_resume(cfg: RunConfig) -> None:
    """Raise ``ConfigError`` for a ``resume=never`` run on a used directory, or a resume that changes a
    field of ``RESUME_FIXED`` (module docstring)."""
    run_dir = cfg.resolved_run_dir
    if cfg.checkpoint.resume == "never":
        for sub in (CHECKPOINTS_DIR, WARM_START_CHECKPOINTS):
            steps = committed_steps(os.path.join(run_dir, sub))
            if steps:
                raise ConfigError("checkpoint.resume", f"'never', but {os.path.join(run_dir, sub)} holds committed "
                                  f"checkpoints (steps {steps}): use a new run_dir, or delete that directory to start over")
        return
    got = saved_config(run_dir)
    if got is None:
        return
    step, saved = got
    fixed = {k: v for k, v in changed_fields(saved, cfg).items() if _fixed(k)}
    if fixed:
        field = next(iter(fixed))
        changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in fixed.items())
        where = os.path.join(run_dir, CHECKPOINTS_DIR, str(step))
        raise ConfigError(field, f"differs from the checkpoint this run resumes ({where}): "
                          f"{changes}; these define the saved state and data order: restore them, or use a new run_dir")
