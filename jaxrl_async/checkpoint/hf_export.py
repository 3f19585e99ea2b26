"""A checkpoint of a run as a Hugging Face model directory, or a LoRA run's adapters as a PEFT adapter
directory: the library half of ``python -m jaxrl_async.export`` (the CLI, its docstring says what is written)
that the RL run calls for its final export."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import sys
from typing import TYPE_CHECKING

__all__ = ["DTYPES", "LORA_FORMATS", "PEFT_CONFIG", "PEFT_WEIGHTS", "ExportError", "ExportResult", "export_checkpoint",
           "peft_adapter_tensors", "peft_expert_tensors", "restore_for_export", "save_peft_adapter"]


class ExportError(ValueError):
    """An export the checkpoint cannot give (a user error: one line naming the setting)."""


if TYPE_CHECKING:  # imported where used: a mistyped command line fails before orbax and JAX load
    from jaxrl_async.checkpoint.manager import Checkpointer, Restored

DTYPES = ("float32", "bfloat16", "float16")
LORA_FORMATS = ("merged", "peft")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


class _DropReadOnlyNotice(logging.Filter):
    """Orbax's CheckpointManager logs an absl WARNING ``Given directory is read only=...`` whenever it is
    opened read-only, which export always does on purpose; drop that one message (nothing else)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


# absl.logging.warning goes through the Python logger "absl" (see absl/logging/__init__.py)
if not any(isinstance(f, _DropReadOnlyNotice) for f in logging.getLogger("absl").filters):
    logging.getLogger("absl").addFilter(_DropReadOnlyNotice())


@dataclasses.dataclass(frozen=True)
class ExportResult:
    step: int
    out_dir: str
    weight_files: tuple[str, ...]
    tokenizer_copied: bool
    recipe_file: str | None = None  # data.recipe.RECIPE_FILE, written when the checkpoint carries the run's config


def restore_for_export(ckpt: Checkpointer, step: int | None = None, *, fallback: bool = False) -> Restored:
    """The params of checkpoint ``step`` restored onto the host, as ``export_checkpoint`` reads them
    (every process of a trainer group calls this: Orbax restores are collective)."""
    from jaxrl_async.checkpoint.manager import HOST

    return ckpt.restore(step, targets={"params": HOST}, items=["params"], fallback=fallback,
                        restore_trajectories=False)


def export_checkpoint(run: str | Checkpointer, out_dir: str, *, step: int | None = None, dtype: str | None = None,
                      fallback: bool = False, max_shard_bytes: int = 2 * 2**30, clean: bool = False,
                      lora: str = "merged") -> ExportResult:
    """Write the Hugging Face directory of checkpoint `step` (default: latest committed) of `run`.

    run: a run directory (opened read-only) or a live Checkpointer. dtype: weight dtype in the
    files (default: the run's model.dtype, which its generator held; the master weights are float32).
    clean: once the checkpoint is restored, remove the files of an earlier export from `out_dir` (weights, shard
    index, configs, tokenizer) before writing.
    lora: for a LoRA run, "merged" weights or a "peft" adapter directory (module docstring).
    """
    from jaxrl_async.checkpoint.manager import Checkpointer, CheckpointIncompatibleError
    from jaxrl_async.data.recipe import write_run_recipe
    from jaxrl_async.models.hf_io import save_hf

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export: dtype must be one of {DTYPES}, got {dtype!r}")
    if lora not in LORA_FORMATS:
        raise ValueError(f"export: lora must be one of {LORA_FORMATS}, got {lora!r}")
    ckpt = run if isinstance(run, Checkpointer) else Checkpointer(run, read_only=True)
    restored = restore_for_export(ckpt, step, fallback=fallback)
    cfg = restored.model_config
    if cfg is None:
        raise CheckpointIncompatibleError(f"{ckpt.step_dir(restored.step)}: checkpoint has no model config "
                                          "(the run's Checkpointer was created without model_config)")
    tok = restored.tokenizer_dir if restored.tokenizer_dir and os.path.isdir(restored.tokenizer_dir) else None
    if tok is None:
        print(f"[jaxrl_async.export] warning: {ckpt.run_dir} has no tokenizer copy; exporting weights and configs only",
              file=sys.stderr)
    if clean and os.path.isdir(out_dir):
        for f in _export_files(out_dir):
            os.remove(f)
    if lora == "peft" and cfg.lora is None:
        raise ExportError(f"--lora peft: {ckpt.step_dir(restored.step)} is not a LoRA run (model.lora.rank 0): there "
                          "is no adapter to export; leave --lora out for the full model")
    dtype = dtype or cfg.dtype  # the run's model.dtype (what its generator held): a bfloat16 run exports bfloat16
    params = restored.arrays["params"]
    base_ref = (restored.meta.extra or {}).get("lora_base") if cfg.lora is not None else None
    if base_ref:  # the checkpoint holds the adapters; the base is the referenced model.path
        from jaxrl_async.checkpoint.lora_base import with_referenced_base

        params = with_referenced_base(params, base_ref, ckpt.step_dir(restored.step))
    if cfg.lora is not None and lora == "peft":
        base_ref = ((restored.meta.config or {}).get("model") or {}).get("path")
        files = save_peft_adapter(params, cfg, out_dir, base_model_name_or_path=base_ref, tokenizer_dir=tok,
                                  dtype=dtype, max_shard_bytes=max_shard_bytes)
    else:
        if cfg.lora is not None:
            params, cfg = _merged_on_host(params, cfg), cfg.replace(lora=None)
        files = save_hf(params, cfg, out_dir, tokenizer_dir=tok, dtype=dtype, max_shard_bytes=max_shard_bytes)
    # the run's prompt recipe from the config saved with this step, so `evaluate --model out_dir` prompts as the run
    recipe = write_run_recipe(out_dir, restored.meta.config, run_dir=ckpt.run_dir, step=restored.step)
    return ExportResult(step=restored.step, out_dir=os.path.abspath(out_dir), weight_files=tuple(files),
                        tokenizer_copied=tok is not None, recipe_file=recipe)


def _merged_on_host(params, cfg):
    """W + (alpha/r) A B of every target (float32 on the host CPU device), the adapters removed."""
    import jax

    from jaxrl_async.models import lora as lora_lib

    with jax.default_device(jax.devices("cpu")[0]):
        return jax.device_get(lora_lib.merge(params, cfg.lora))


def peft_adapter_tensors(params, cfg) -> dict:
    """PEFT's ``adapter_model.safetensors`` contents: for target module M of layer i,
    ``base_model.model.model.layers.{i}.M.lora_A.weight`` [r, in] and ``....lora_B.weight`` [out, r]
    (in/out features flattened as in the HF weight of M: heads-major, as ``hf_mapping``)."""
    import jax
    import numpy as np

    from jaxrl_async.models import lora as lora_lib

    stacks = jax.device_get(lora_lib.split(params)[0])
    out = {}
    r = cfg.lora.rank
    for stack, adapters in stacks.items():
        for t in cfg.lora.targets:
            ka, kb = lora_lib.adapter_keys(t)
            if ka not in adapters:  # gate/up/down of a mixture-of-experts stack: the expert adapters below
                continue
            a, b = np.asarray(adapters[ka], np.float32), np.asarray(adapters[kb], np.float32)
            for s, i in enumerate(cfg.layer_stacks()[stack]):  # slice s of the stack is model layer i
                name = f"base_model.model.model.layers.{i}.{lora_lib.HF_MODULES[t]}"
                out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[s].reshape(-1, r).T)
                out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[s].reshape(r, -1).T)
        for s, i in enumerate(cfg.layer_stacks()[stack]):
            out.update(peft_expert_tensors(adapters, cfg.lora, s, f"base_model.model.model.layers.{i}.mlp.experts"))
    return out


def peft_expert_tensors(adapters, spec, s: int, prefix: str) -> dict:
    """PEFT's adapters on transformers' fused expert parameters (``target_parameters``, ``lora.ParamWrapper``)
    for slice ``s`` of a mixture-of-experts stack. Per parameter: ``lora_A.weight`` [X r, in] (row x r + k =
    A[x][:, k]) and ``lora_B.weight`` [out, r X] (column k X + x = B[x][k, :]); PEFT computes expert x's
    delta as scale * B[:, :, x] A[x] on the [X, out, in] parameter. gate_up_proj [X, 2F, D] holds gate's rows
    then up's: an unadapted half has zero B rows. The wrappers nest in the order of ``target_parameters``
    (gate_up first): the first one's tensors are named ``...mlp.experts.base_layer.lora_*`` when down is
    wrapped around it."""
    import numpy as np

    from jaxrl_async.models import lora as lora_lib

    groups = lora_lib.moe_groups(spec)
    out = {}
    for g in groups:
        ka = f"{g}_lora_a"
        if ka not in adapters:
            continue
        a = np.asarray(adapters[ka][s], np.float32)  # [X, in, r]
        b = np.asarray(adapters[f"{g}_lora_b"][s], np.float32)  # [X, r, out] or [X, r, n, F]
        if g == "moe_gate_up":
            X, r, _, F = b.shape
            full = np.zeros((X, r, 2, F), np.float32)
            for j, t in enumerate(lora_lib.moe_halves(spec)):
                full[:, :, ("gate", "up").index(t)] = b[:, :, j]
            b = full.reshape(X, r, 2 * F)
        X, r, o = b.shape
        name = prefix + (".base_layer" if g == "moe_gate_up" and len(groups) == 2 else "")
        out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.transpose(0, 2, 1).reshape(X * r, -1))
        out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.transpose(2, 1, 0).reshape(o, r * X))
    return out


def save_peft_adapter(params, cfg, out_dir: str, *, base_model_name_or_path: str | None = None,
                      tokenizer_dir: str | None = None, dtype: str | None = None,
                      max_shard_bytes: int = 2 * 2**30) -> list[str]:
    """A PEFT LoRA adapter directory of ``params`` (base + adapters of ``cfg.lora``) in ``out_dir``. Without
    ``base_model_name_or_path`` the base is written as a Hugging Face model into ``out_dir/base`` and the
    adapter config names that directory. Returns the written weight files (relative to ``out_dir``)."""
    import json

    import jax.numpy as jnp
    import numpy as np

    from jaxrl_async.models import lora as lora_lib
    from jaxrl_async.models.hf_io import copy_tokenizer, save_hf
    from jaxrl_async.models.safetensors_io import write_safetensors

    dense_mlp = sorted(set(cfg.lora.targets) & {"gate", "up", "down"})
    if cfg.num_experts and "dense_layers" in cfg.layer_stacks() and dense_mlp:
        # PEFT (0.21) on transformers 5 rewrites gate_proj/up_proj/down_proj target_modules of a Qwen3-MoE model
        # into its experts' fused target_parameters (its v4 -> v5 conversion), so the adapters of the dense-MLP
        # layers could not be loaded as such (checked: it refuses gate_proj without up_proj, and drops them)
        raise ExportError(f"--lora peft: model.lora.targets {dense_mlp} on a mixture of experts with dense-MLP layers "
                        "(mlp_only_layers): PEFT maps gate_proj/up_proj/down_proj of Qwen3-MoE onto the experts, so "
                        "those layers' adapters cannot be expressed; export --lora merged")
    os.makedirs(out_dir, exist_ok=True)
    files = []
    if base_model_name_or_path is None:
        base = lora_lib.split(params)[1]
        files += [os.path.join("base", f) for f in save_hf(base, cfg.replace(lora=None), os.path.join(out_dir, "base"),
                                                           tokenizer_dir=tokenizer_dir, dtype=dtype,
                                                           max_shard_bytes=max_shard_bytes)]
        base_model_name_or_path = os.path.abspath(os.path.join(out_dir, "base"))
    np_dtype = np.dtype(jnp.dtype(dtype or "float32"))
    tensors = {k: v.astype(np_dtype) for k, v in peft_adapter_tensors(params, cfg).items()}
    write_safetensors(os.path.join(out_dir, PEFT_WEIGHTS), tensors, metadata={"format": "pt"})
    spec = cfg.lora
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": sorted(lora_lib.HF_MODULES[t].rsplit(".", 1)[-1] for t in spec.targets
                                 if t in ("q", "k", "v", "o") or not cfg.num_experts),
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    if cfg.num_experts and lora_lib.moe_groups(spec):  # the experts' fused parameters, in PEFT's nesting order
        config["target_parameters"] = [lora_lib.MOE_HF_PARAMS[g] for g in lora_lib.moe_groups(spec)]
    with open(os.path.join(out_dir, PEFT_CONFIG), "w") as fh:
        json.dump(config, fh, indent=2)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    return [*files, PEFT_WEIGHTS]


def _export_files(out_dir: str) -> list[str]:
    """The files of an earlier export in ``out_dir`` (weights, index, configs, tokenizer)."""
    from jaxrl_async.data.recipe import RECIPE_FILE
    from jaxrl_async.models.hf_io import TOKENIZER_FILES
    from jaxrl_async.models.safetensors_io import INDEX_NAME, SINGLE_NAME

    names = {SINGLE_NAME, INDEX_NAME, "config.json", "generation_config.json", PEFT_CONFIG, PEFT_WEIGHTS,
             RECIPE_FILE, *TOKENIZER_FILES}
    found = [os.path.join(out_dir, n) for n in names if os.path.isfile(os.path.join(out_dir, n))]
    return found + glob.glob(os.path.join(glob.escape(out_dir), "model-*-of-*.safetensors"))
