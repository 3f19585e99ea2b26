"""Export a checkpoint of a run as a Hugging Face model directory.

    python -m jaxrl_async.export --run-dir RUN [--step N] --out DIR [--overwrite] [--dtype bfloat16] [--fallback]
                                 [--lora merged|peft]

writes DIR/model.safetensors (or shards + index), config.json, generation_config.json, the
tokenizer files the run copied into RUN/tokenizer, and jaxrl_async_run.json: the run's prompt recipe, reward and
held-out evaluation settings from the config saved with the step (``data.recipe``), which ``evaluate --model DIR``
uses by default so that it prompts the policy as the run did. The model architecture and numerical policy
come from the checkpoint's metadata; the parameters are restored onto the host CPU device (no
mesh, no accelerator, no optimizer state read), then written by `models.save_hf`, which
gathers one tensor kind at a time. An existing non-empty --out is only written with --overwrite
(which first removes the files an export writes, so no stale weight shard or index stays behind;
other files are left alone). Exit status: 0 on success, 2 on a user error (bad flag, missing run
directory, no or corrupt checkpoint, --out in the way: one line on stderr naming the step/file),
1 on an internal error.

During training, `checkpoint.hf_export.export_checkpoint(checkpointer, out_dir)` exports the latest committed step;
export right after a commit or keep keep_last >= 2 so the step is not deleted while it is read.

LoRA runs (``model.lora``): ``--lora merged`` (default) writes the merged weights ``W + (alpha/r) A B``
as a plain Hugging Face model; ``--lora peft`` writes a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``, PEFT's tensor names and [r, in] / [out, r] layouts) that
``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the base model, plus the base itself in
``DIR/base`` unless the run's base is a ``model.path`` checkpoint (then ``base_model_name_or_path``
names it and nothing of the base is written). A mixture of experts' expert adapters go to PEFT's
``target_parameters`` on transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``
(``checkpoint.hf_export.peft_expert_tensors``).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from jaxrl_async.cli.common import UserError, cli_main, make_parser

from jaxrl_async.checkpoint.hf_export import (  # noqa: F401  (the library half, importable from here too)
    DTYPES, LORA_FORMATS, PEFT_CONFIG, PEFT_WEIGHTS, ExportResult, export_checkpoint, peft_adapter_tensors,
    restore_for_export, save_peft_adapter,
)

TOOL = "export"


def build_parser():
    p = make_parser("python -m jaxrl_async.export", "Export a jaxrl_async checkpoint as a Hugging Face model directory.")
    p.add_argument("--run-dir", required=True, help="run directory (holds checkpoints/ and tokenizer/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest committed)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--overwrite", action="store_true", help="write into an existing non-empty --out (replacing the "
                   "weight, config and tokenizer files of an earlier export)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="weight dtype (default: the run's model.dtype)")
    p.add_argument("--fallback", action="store_true",
                   help="if the chosen step is corrupt, export the newest older committed step instead")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size (GiB)")
    p.add_argument("--lora", choices=LORA_FORMATS, default="merged",
                   help="LoRA runs: merged Hugging Face weights, or a PEFT adapter directory (+ the base in DIR/base "
                        "unless the run's base is its model.path)")
    return p


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
                                max_shard_bytes=int(args.max_shard_gb * 2**30), clean=args.overwrite, lora=args.lora)
    except (CheckpointError, FileNotFoundError) as e:
        msg = str(e)
        named = args.run_dir in msg or os.path.abspath(args.run_dir) in msg  # the checkpoint errors name their path
        raise UserError(msg if named else f"--run-dir {args.run_dir}: {msg}") from None
    configs = [f for f in ("config.json", "generation_config.json", "adapter_config.json")
               if os.path.isfile(os.path.join(res.out_dir, f))]  # what is there (a PEFT directory has no config.json)
    configs += [os.path.basename(res.recipe_file)] if res.recipe_file else []
    print(f"exported step {res.step} of {os.path.abspath(args.run_dir)} to {res.out_dir}: "
          f"{', '.join(list(res.weight_files) + configs)}" + (", tokenizer" if res.tokenizer_copied else " (no tokenizer)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
