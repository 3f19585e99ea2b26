"""Export a checkpoint of a run as a Hugging Face model directory.

    python -m jaxrl_async.export --run-dir RUN [--step N] --out DIR [--overwrite] [--dtype bfloat16] [--fallback]

writes DIR/model.safetensors (or shards + index), config.json, generation_config.json and the
tokenizer files the run copied into RUN/tokenizer. The model architecture and numerical policy
come from the checkpoint's metadata; the parameters are restored onto the host CPU device (no
mesh, no accelerator, no optimizer state read), then written by `models.save_hf`, which
gathers one tensor kind at a time. An existing non-empty --out is only written with --overwrite
(which first removes the files an export writes, so no stale weight shard or index stays behind;
other files are left alone). Exit status: 0 on success, 2 on a user error (bad flag, missing run
directory, no or corrupt checkpoint, --out in the way: one line on stderr naming the step/file),
1 on an internal error.

During training, `export_checkpoint(checkpointer, out_dir)` exports the latest committed step;
export right after a commit or keep keep_last >= 2 so the step is not deleted while it is read.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import sys
from typing import TYPE_CHECKING, Sequence

from jaxrl_async.cli import UserError, cli_main, make_parser

if TYPE_CHECKING:  # imported where used: a mistyped command line fails before orbax and JAX load
    from jaxrl_async.checkpoint.manager import Checkpointer, Restored

_DTYPES = ("float32", "bfloat16", "float16")
TOOL = "export"


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


def restore_for_export(ckpt: Checkpointer, step: int | None = None, *, fallback: bool = False) -> Restored:
    """The params of checkpoint ``step`` restored onto the host, as ``export_checkpoint`` reads them
    (every process of a trainer group calls this: Orbax restores are collective)."""
    from jaxrl_async.checkpoint.manager import HOST

    return ckpt.restore(step, targets={"params": HOST}, items=["params"], fallback=fallback,
                        restore_trajectories=False)


def export_checkpoint(run: str | Checkpointer, out_dir: str, *, step: int | None = None, dtype: str | None = None,
                      fallback: bool = False, max_shard_bytes: int = 2 * 2**30, clean: bool = False) -> ExportResult:
    """Write the Hugging Face directory of checkpoint `step` (default: latest committed) of `run`.

    run: a run directory (opened read-only) or a live Checkpointer. dtype: weight dtype in the
    files (default: the run's param_dtype). clean: once the checkpoint is restored, remove the files
    of an earlier export from `out_dir` (weights, shard index, configs, tokenizer) before writing.
    """
    from jaxrl_async.checkpoint.manager import Checkpointer, CheckpointIncompatibleError
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
    if clean and os.path.isdir(out_dir):
        for f in _export_files(out_dir):
            os.remove(f)
    files = save_hf(restored.arrays["params"], cfg, out_dir, tokenizer_dir=tok, dtype=dtype,
                    max_shard_bytes=max_shard_bytes)
    return ExportResult(step=restored.step, out_dir=os.path.abspath(out_dir), weight_files=tuple(files),
                        tokenizer_copied=tok is not None)


def build_parser():
    p = make_parser("python -m jaxrl_async.export", "Export a jaxrl_async checkpoint as a Hugging Face model directory.")
    p.add_argument("--run-dir", required=True, help="run directory (holds checkpoints/ and tokenizer/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest committed)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--overwrite", action="store_true", help="write into an existing non-empty --out (replacing the "
                   "weight, config and tokenizer files of an earlier export)")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="weight dtype (default: the run's param_dtype)")
    p.add_argument("--fallback", action="store_true",
                   help="if the chosen step is corrupt, export the newest older committed step instead")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size (GiB)")
    return p


def _export_files(out_dir: str) -> list[str]:
    """The files of an earlier export in ``out_dir`` (weights, index, configs, tokenizer)."""
    from jaxrl_async.models.hf_io import TOKENIZER_FILES
    from jaxrl_async.models.safetensors_io import INDEX_NAME, SINGLE_NAME

    names = {SINGLE_NAME, INDEX_NAME, "config.json", "generation_config.json", *TOKENIZER_FILES}
    found = [os.path.join(out_dir, n) for n in names if os.path.isfile(os.path.join(out_dir, n))]
    return found + glob.glob(os.path.join(glob.escape(out_dir), "model-*-of-*.safetensors"))


def check_out_dir(out: str, overwrite: bool) -> None:
    """UserError when --out is a file, or a non-empty directory without --overwrite."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out}: exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise UserError(f"--out {out}: directory exists and is not empty (pass --overwrite to replace its "
                        "model files)")


@cli_main(TOOL)
def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.step is not None and args.step < 0:
        p.error("--step must be >= 0")
    if args.max_shard_gb <= 0:
        p.error("--max-shard-gb must be > 0")
    if not os.path.isdir(args.run_dir):
        raise UserError(f"--run-dir {args.run_dir}: " + ("not a directory" if os.path.exists(args.run_dir)
                                                         else "not found"))
    check_out_dir(args.out, args.overwrite)
    from jaxrl_async.checkpoint.manager import CheckpointError

    try:
        res = export_checkpoint(args.run_dir, args.out, step=args.step, dtype=args.dtype, fallback=args.fallback,
                                max_shard_bytes=int(args.max_shard_gb * 2**30), clean=args.overwrite)
    except (CheckpointError, FileNotFoundError) as e:
        msg = str(e)
        named = args.run_dir in msg or os.path.abspath(args.run_dir) in msg  # the checkpoint errors name their path
        raise UserError(msg if named else f"--run-dir {args.run_dir}: {msg}") from None
    print(f"exported step {res.step} of {os.path.abspath(args.run_dir)} to {res.out_dir}: "
          f"{', '.join(res.weight_files)}, config.json, generation_config.json"
          + (", tokenizer" if res.tokenizer_copied else " (no tokenizer)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
