"""Export a checkpoint of a run as a Hugging Face model directory.

    python -m jaxrl_async.export --run-dir RUN [--step N] --out DIR [--dtype bfloat16] [--fallback]

writes DIR/model.safetensors (or shards + index), config.json, generation_config.json and the
tokenizer files the run copied into RUN/tokenizer. The model architecture and numerical policy
come from the checkpoint's metadata; the parameters are restored onto the host CPU device (no
mesh, no accelerator, no optimizer state read), then written by `models.save_hf`, which
gathers one tensor kind at a time. Exit status: 0 on success, 1 on a checkpoint error (message
on stderr naming the step/file), 2 on bad arguments.

During training, `export_checkpoint(checkpointer, out_dir)` exports the latest committed step;
export right after a commit or keep keep_last >= 2 so the step is not deleted while it is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence

from jaxrl_async.checkpoint.manager import (HOST, CheckpointError, Checkpointer, CheckpointIncompatibleError,
                                            Restored)

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ExportResult:
    step: int
    out_dir: str
    weight_files: tuple[str, ...]
    tokenizer_copied: bool


def restore_for_export(ckpt: Checkpointer, step: int | None = None, *, fallback: bool = False) -> Restored:
    """The params of checkpoint ``step`` restored onto the host, as ``export_checkpoint`` reads them
    (every process of a trainer group calls this: Orbax restores are collective)."""
    return ckpt.restore(step, targets={"params": HOST}, items=["params"], fallback=fallback,
                        restore_trajectories=False)


def export_checkpoint(run: str | Checkpointer, out_dir: str, *, step: int | None = None, dtype: str | None = None,
                      fallback: bool = False, max_shard_bytes: int = 2 * 2**30) -> ExportResult:
    """Write the Hugging Face directory of checkpoint `step` (default: latest committed) of `run`.

    run: a run directory (opened read-only) or a live Checkpointer. dtype: weight dtype in the
    files (default: the run's param_dtype).
    """
    from jaxrl_async.models.hf_io import save_hf

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"export: dtype must be one of {_DTYPES}, got {dtype!r}")
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
    files = save_hf(restored.arrays["params"], cfg, out_dir, tokenizer_dir=tok, dtype=dtype,
                    max_shard_bytes=max_shard_bytes)
    return ExportResult(step=restored.step, out_dir=os.path.abspath(out_dir), weight_files=tuple(files),
                        tokenizer_copied=tok is not None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxrl_async.export",
                                description="Export a jaxrl_async checkpoint as a Hugging Face model directory.")
    p.add_argument("--run-dir", required=True, help="run directory (holds checkpoints/ and tokenizer/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest committed)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="weight dtype (default: the run's param_dtype)")
    p.add_argument("--fallback", action="store_true",
                   help="if the chosen step is corrupt, export the newest older committed step instead")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size (GiB)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = export_checkpoint(args.run_dir, args.out, step=args.step, dtype=args.dtype, fallback=args.fallback,
                                max_shard_bytes=int(args.max_shard_gb * 2**30))
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported step {res.step} of {os.path.abspath(args.run_dir)} to {res.out_dir}: "
          f"{', '.join(res.weight_files)}, config.json, generation_config.json"
          + (", tokenizer" if res.tokenizer_copied else " (no tokenizer)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
