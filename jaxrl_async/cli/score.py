"""`python -m jaxrl_async.score`: teacher-forced per-token log-probs and entropies of completions.

    python -m jaxrl_async.score --model DIR --input in.jsonl --output out.jsonl \
        [--dtype float32|bfloat16] [--batch-tokens N] [--temperature T] [--no-chat-template] [--skip-bad-rows]

Input rows: {"prompt_ids": [...], "completion_ids": [...]} or {"prompt": "...", "completion": "..."}.
Text is tokenised with the model directory's tokenizer the way `generate` and `evaluate` build their
prompts: the prompt as one user message rendered by the tokenizer's chat template with the
generation prompt (--no-chat-template, or a tokenizer without a template: the raw prompt text with the
tokenizer's special tokens), the completion without special tokens. So a `generate` output row scored
here gets the log-probs of the exact sequence that was sampled.
Output rows, in input order: {"row": L, "logprobs": [...], "entropy": [...]}, aligned with the
completion tokens; `row` is the input's line number (from 1). The computation is
`models.transformer.sequence_logprobs`, the trainer's own log-prob path. Sequences are packed several
per row (segment ids, no cross-attention) into power-of-two row lengths and row counts, so a file with
many lengths compiles only a handful of shapes.

Exit status: 0 done; 2 a user error (bad flag, path, model directory or input row: one line on stderr
naming it); 1 an internal error.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Iterable

import numpy as np

from jaxrl_async.cli.common import (UserError, chat_template_wanted, cli_main, iter_lines, load_model, load_tokenizer,
                                    make_parser, model_config, note_cpu_bfloat16, require_file, require_output_file)
from jaxrl_async.cli.jsonl import BadRowError, check_row, iter_json_rows

TOOL = "score"


@dataclasses.dataclass
class ScoreItem:
    row: int
    prompt_ids: list[int]
    completion_ids: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def _int_list(v, field, row):
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise BadRowError(f"row {row}: field {field!r} must be a list of integers")
    return v


def parse_row(obj: Any, row: int, tokenizer_fn, vocab_size: int, max_len: int) -> ScoreItem:
    """Validate one input row; raise BadRowError naming the row and the problem.
    ``tokenizer_fn(text, row, is_prompt) -> ids`` encodes text rows."""
    if not isinstance(obj, dict):
        raise BadRowError(f"row {row}: expected a JSON object")
    if "prompt_ids" in obj or "completion_ids" in obj:
        for f in ("prompt_ids", "completion_ids"):
            if f not in obj:
                raise BadRowError(f"row {row}: missing field {f!r}")
        prompt = _int_list(obj["prompt_ids"], "prompt_ids", row)
        completion = _int_list(obj["completion_ids"], "completion_ids", row)
    elif "prompt" in obj or "completion" in obj:
        for f in ("prompt", "completion"):
            if f not in obj:
                raise BadRowError(f"row {row}: missing field {f!r}")
            if not isinstance(obj[f], str):
                raise BadRowError(f"row {row}: field {f!r} must be a string")
        prompt = tokenizer_fn(obj["prompt"], row, True)
        completion = tokenizer_fn(obj["completion"], row, False)
    else:
        raise BadRowError(f"row {row}: missing fields: need prompt_ids+completion_ids or prompt+completion")
    if not completion:
        raise BadRowError(f"row {row}: empty completion")
    if not prompt:
        raise BadRowError(f"row {row}: empty prompt (the first completion token needs a context)")
    bad = [t for t in prompt + completion if not 0 <= t < vocab_size]
    if bad:
        raise BadRowError(f"row {row}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    n = len(prompt) + len(completion)
    if n > max_len:
        raise BadRowError(f"row {row}: sequence of {n} tokens is longer than the model maximum {max_len}")
    return ScoreItem(row, list(prompt), list(completion))


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def pack(items: list[ScoreItem], batch_tokens: int) -> Iterable[tuple[list[list[ScoreItem]], int]]:
    """Group items into batches of rows (first-fit decreasing within power-of-two row lengths).

    Yields (rows, row_len) with len(rows) * row_len <= max(batch_tokens, row_len).
    """
    by_len: dict[int, list[ScoreItem]] = {}
    for it in items:
        by_len.setdefault(_pow2(it.length), []).append(it)
    for row_len in sorted(by_len):
        rows: list[list[ScoreItem]] = []
        free: list[int] = []
        for it in sorted(by_len[row_len], key=lambda x: -x.length):
            for r, f in enumerate(free):
                if f >= it.length:
                    rows[r].append(it)
                    free[r] -= it.length
                    break
            else:
                rows.append([it])
                free.append(row_len - it.length)
        per_batch = max(1, batch_tokens // row_len)
        for k in range(0, len(rows), per_batch):
            yield rows[k:k + per_batch], row_len


def score_items(params, cfg, items: list[ScoreItem], batch_tokens: int = 8192, temperature: float = 1.0,
                progress=None) -> dict[int, tuple[list[float], list[float]]]:
    """Per-item (logprobs, entropy) of the completion tokens, keyed by row."""
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models.transformer import sequence_logprobs

    fn = jax.jit(sequence_logprobs, static_argnames=("cfg", "temperature", "chunk"))
    out: dict[int, tuple[list[float], list[float]]] = {}
    for rows, row_len in pack(items, batch_tokens):
        n_rows = _pow2(len(rows), lo=1)
        tokens = np.zeros((n_rows, row_len), np.int32)
        seg = np.zeros((n_rows, row_len), np.int32)
        pos = np.zeros((n_rows, row_len), np.int32)
        where = []
        for r, row in enumerate(rows):
            o = 0
            for k, it in enumerate(row):
                seq = it.prompt_ids + it.completion_ids
                tokens[r, o:o + len(seq)] = seq
                seg[r, o:o + len(seq)] = k + 1
                pos[r, o:o + len(seq)] = np.arange(len(seq))
                where.append((it, r, o + len(it.prompt_ids), o + len(seq)))
                o += len(seq)
        lp, ent = fn(params, cfg=cfg, tokens=jnp.asarray(tokens), segment_ids=jnp.asarray(seg),
                     positions=jnp.asarray(pos), temperature=temperature, chunk=2048)
        lp, ent = np.asarray(lp), np.asarray(ent)
        for it, r, a, b in where:
            out[it.row] = (lp[r, a:b].tolist(), ent[r, a:b].tolist())
        if progress is not None:
            progress.update(sum(len(row) for row in rows))
    return out


def build_demo(out_dir: str) -> dict[str, str]:
    """A self-contained demo: tiny random Qwen3 (saved as a HF directory) + local tokenizer + input rows."""
    import os

    import jax

    from jaxrl_async.data.tokenizer import build_tokenizer
    from jaxrl_async.models import ModelConfig, init_params, save_hf

    model_dir = os.path.join(out_dir, "model")
    build_tokenizer(model_dir, kind="arithmetic")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = ModelConfig(model_type="qwen3", vocab_size=len(tok), hidden_size=128, intermediate_size=384,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
                      max_position_embeddings=512, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_hf(init_params(cfg, jax.random.PRNGKey(0)), cfg, model_dir)
    input_path = os.path.join(out_dir, "input.jsonl")
    with open(input_path, "w") as fh:
        for a, b in ((12, 30), (7, 8), (250, 750)):
            fh.write(json.dumps({"prompt": f"What is {a}+{b}?", "completion": f" \\boxed{{{a + b}}}"}) + "\n")
    return {"model": model_dir, "input": input_path, "output": os.path.join(out_dir, "scores.jsonl")}


def build_parser():
    ap = make_parser("python -m jaxrl_async.score", __doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Hugging Face model directory (config.json + safetensors [+ tokenizer])")
    ap.add_argument("--input", help="input JSONL")
    ap.add_argument("--output", help="output JSONL")
    ap.add_argument("--demo", metavar="DIR", help="build a tiny random Qwen3 model, a tokenizer and an input file "
                    "in DIR (nothing downloaded) and score them; --model/--input/--output default into DIR")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute and parameter dtype")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="tokens per forward batch (memory bound)")
    ap.add_argument("--temperature", type=float, default=1.0, help="score log_softmax(logits / T)")
    ap.add_argument("--no-chat-template", action="store_true",
                    help="encode text prompts as raw text (default: the tokenizer's chat template, when it has one)")
    ap.add_argument("--skip-bad-rows", action="store_true", help="report bad rows on stderr and skip them")
    return ap


@cli_main(TOOL)
def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from jaxrl_async.cli import compile_cache

    compile_cache.enable()
    if args.batch_tokens < 1:
        ap.error("--batch-tokens must be >= 1")
    if args.temperature <= 0:
        ap.error("--temperature must be > 0")
    if args.demo:
        defaults = build_demo(args.demo)
        for k, v in defaults.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    missing = [f"--{k}" for k in ("model", "input", "output") if getattr(args, k) is None]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)} (or --demo DIR)")
    require_file("--input", args.input)
    require_output_file("--output", args.output)

    from tqdm import tqdm

    from jaxrl_async.cli.generate import encode_prompt

    note_cpu_bfloat16(TOOL, "--dtype bfloat16", args.dtype)
    cfg = model_config("--model", args.model, dtype=args.dtype, param_dtype=args.dtype)
    tokenizer = None  # loaded at the first text row
    chat: bool | None = None  # decided at the first text row (the note about a missing template only matters then)

    def tokenize(text: str, row: int, prompt: bool) -> list[int]:
        nonlocal chat, tokenizer
        if chat is None:
            tokenizer = load_tokenizer("--model", args.model)
        if tokenizer is None:
            raise BadRowError(f"row {row}: text input needs a tokenizer, but --model {args.model} has no tokenizer "
                              "files; give prompt_ids and completion_ids")
        if chat is None:
            chat = chat_template_wanted(TOOL, tokenizer, args.model, not args.no_chat_template)
        if prompt:
            return encode_prompt(tokenizer, text, chat)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    items: list[ScoreItem] = []
    skipped = 0
    for i, obj in iter_json_rows(iter_lines("--input", args.input)):
        try:
            items.append(parse_row(check_row(i, obj), i, tokenize, cfg.vocab_size, cfg.max_position_embeddings))
        except BadRowError as e:
            if not args.skip_bad_rows:
                raise UserError(f"{args.input}: {e} (--skip-bad-rows skips such rows)") from None
            skipped += 1
            print(f"skipped: {args.input}: {e}", file=sys.stderr)
    if not items:
        raise UserError(f"--input {args.input}: no rows to score")
    cfg, params = load_model("--model", args.model, cfg=cfg)
    with tqdm(total=len(items), desc="score", unit="seq", file=sys.stderr, disable=None) as bar:
        results = score_items(params, cfg, items, args.batch_tokens, args.temperature, bar)
    with open(args.output, "w") as fh:
        for it in items:
            lp, ent = results[it.row]
            fh.write(json.dumps({"row": it.row, "logprobs": lp, "entropy": ent}) + "\n")
    print(f"scored {len(items)} rows" + (f", skipped {skipped} bad rows" if skipped else "") + f" -> {args.output}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
