"""`python -m jaxrl_async.generate`: batch generation with the paged engine and the orchestrator.

    python -m jaxrl_async.generate --model DIR --input prompts.jsonl --output out.jsonl \\
        [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--n N] [--seed S] \\
        [--max-concurrent B] [--dtype float32|bfloat16] [--no-chat-template] [--truncate-prompts] \\
        [--stop STR ...] [--ignore-eos] [--max-prompt-length L] [--page-size P] [--num-pages N] [--no-compact-decode]

Input rows: {"prompt": "..."} or {"prompt_ids": [...]}, optionally with an "id" (string or integer).
A text prompt becomes one user message rendered by the tokenizer's chat template when the model
directory's tokenizer has one (as `evaluate` and `score` do; --no-chat-template: the raw text, encoded
with the tokenizer's special tokens); a tokenizer without a template falls back to the raw text with a
note. A model directory without tokenizer files (weights + config only) takes `prompt_ids` rows only
and writes ids without text.

Output rows, in input order, one per sample: {"row": L, ["id": ...,] "prompt": "..." | "prompt_ids":
[...], ["sample_index": k,] "completion_ids": [...], "text": "...", "logprobs": [...], "finish_reason":
"stop" | "length"[, "stop_string": "..." | null]}. `row` is the input's line number (from 1), the prompt is
echoed as given, `sample_index` appears only with --n > 1, `stop_string` only with --stop (the string that
ended the sample, null when an EOS id or the length did), and `text` is null without a tokenizer. `logprobs` are the
behaviour log-probs of the engine (log-softmax of the temperature-scaled logits over the full
vocabulary; raw logits when greedy).

Stopping: the EOS ids of config.json, generation_config.json and the tokenizer (when the directory has
one) unless --ignore-eos, and the --stop strings. As OpenAI's `stop`, a stop string is excluded from `text`:
the text ends where the string begins (anything the same token decoded to after it goes too), while
`completion_ids` and `logprobs` keep every generated token, up to and including the token that completed the
string, with finish_reason "stop" and `stop_string` naming it (an EOS id likewise stays in `completion_ids`
and is left out of `text`, a special token). The RL run's samples are not cut: a trajectory trains on the
tokens generated, and the reward sees their whole text (`rollout.sampling.stop_strings`).

Seeds: the row on line L uses seed S + L - 1, so rows are reproducible and independent of batching.
Prompt length limit: --max-prompt-length (default: the longest prompt of the file, capped
at the model's max_position_embeddings - 1). A longer prompt is an error naming its row, or with
--truncate-prompts keeps its last L tokens (the end of a prompt, where the question and the
generation prompt are) and the number of truncated prompts is printed.

Exit status: 0 done; 2 a user error (bad flag, path, model directory or input row: one line on stderr
naming it); 1 an internal error.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Callable, Iterable

from jaxrl_async.cli.common import (UserError, chat_template_wanted, cli_main, has_tokenizer_files, iter_lines,
                                    load_model, load_tokenizer, make_parser, model_config, note, note_cpu_bfloat16,
                                    require_file, require_output_file)
from jaxrl_async.data.tokenizer import is_real_tokenizer, stop_token_ids  # noqa: F401  (re-exported)
from jaxrl_async.cli.jsonl import BadRowError, bad_rows_error, check_row, iter_json_rows
from jaxrl_async.generator.requests import cut_at_stop  # noqa: F401  (re-exported; the server uses it too)

PROMPT_FIELDS = ("prompt", "prompt_ids")
TOOL = "generate"


@dataclasses.dataclass
class PromptRow:
    row: int  # line number in the input file, from 1
    prompt_ids: list[int]
    truncated_from: int | None = None  # original length when truncated
    echo: dict[str, Any] = dataclasses.field(default_factory=dict)  # id and prompt as given, for the output


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of a text prompt, built as `evaluate` and the RL data pipeline build them
    (`data.datasets.render_prompt` / `encode_prompts`): the chat template's rendering of one user message
    with the generation prompt when `chat` (and the tokenizer has a template), else the raw text encoded
    with the tokenizer's special tokens."""
    from jaxrl_async.data.datasets import encode_prompts, render_prompt

    templated = bool(chat and getattr(tokenizer, "chat_template", None))
    rendered = render_prompt(text, tokenizer, apply_chat_template=templated)
    return encode_prompts([rendered], tokenizer, templated=templated)[0]


def parse_row(obj: Any, row: int, encode: Callable[[str, int], list[int]], vocab_size: int) -> list[int]:
    """Prompt ids of one input row; BadRowError naming the row and the problem."""
    if not isinstance(obj, dict):
        raise BadRowError(f"row {row}: expected a JSON object, got {type(obj).__name__}")
    present = [f for f in PROMPT_FIELDS if f in obj]
    if len(present) != 1:
        raise BadRowError(f"row {row}: needs exactly one of the fields {PROMPT_FIELDS}, got {sorted(obj)}")
    if "id" in obj and (isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int))):
        raise BadRowError(f"row {row}: field 'id' must be a string or an integer")
    if present[0] == "prompt":
        if not isinstance(obj["prompt"], str):
            raise BadRowError(f"row {row}: field 'prompt' must be a string")
        ids = encode(obj["prompt"], row)
    else:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise BadRowError(f"row {row}: field 'prompt_ids' must be a list of integers")
        bad = [x for x in ids if not 0 <= x < vocab_size]
        if bad:
            raise BadRowError(f"row {row}: prompt_ids {bad[:5]} out of the model's vocabulary [0, {vocab_size})")
    if not ids:
        raise BadRowError(f"row {row}: empty prompt")
    return list(ids)


def apply_length_limit(rows: list[PromptRow], max_len: int, truncate: bool) -> tuple[list[PromptRow], list[str]]:
    """Truncate (keep the last `max_len` tokens) or report rows longer than `max_len`."""
    errors = []
    for r in rows:
        n = len(r.prompt_ids)
        if n > max_len:
            if truncate:
                r.truncated_from, r.prompt_ids = n, r.prompt_ids[-max_len:]
            else:
                errors.append(f"row {r.row}: prompt has {n} tokens > max prompt length {max_len} "
                              f"(pass --truncate-prompts to keep the last {max_len} tokens)")
    return rows, errors


def read_rows(lines: Iterable[str], encode: Callable[[str, int], list[int]], vocab_size: int
              ) -> tuple[list[PromptRow], list[str]]:
    """(valid rows, one `row N: ...` message per bad row); N is the line number (from 1)."""
    rows, errors = [], []
    for i, obj in iter_json_rows(lines):
        try:
            ids = parse_row(check_row(i, obj), i, encode, vocab_size)
        except BadRowError as e:
            errors.append(str(e))
            continue
        echo = {k: obj[k] for k in ("id", "prompt", "prompt_ids") if k in obj}
        rows.append(PromptRow(i, ids, echo=echo))
    return rows, errors


def output_rows(row: int, samples: list, n: int, echo: dict[str, Any] | None = None,
                stop_strings: tuple[str, ...] = ()) -> list[dict]:
    """The output rows of one input row's samples; with ``stop_strings`` the text ends before the stop string
    that ended a sample (``cut_at_stop``), the token ids keep it, and ``stop_string`` names it."""
    out = []
    for s in samples:
        d: dict[str, Any] = {"row": row, **(echo or {})}
        if n > 1:
            d["sample_index"] = s.sample_index
        text, hit = s.text, None
        if stop_strings and text is not None and s.finish_reason == "stop":
            text, hit = cut_at_stop(text, stop_strings)
        d.update(completion_ids=s.completion_ids, text=text, logprobs=s.logprobs, finish_reason=s.finish_reason)
        if stop_strings:
            d["stop_string"] = hit
        out.append(d)
    return out


def build_parser():
    ap = make_parser("python -m jaxrl_async.generate", __doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors "
                    "[+ tokenizer])")
    ap.add_argument("--input", required=True, help="input JSONL ({'prompt': str} or {'prompt_ids': [int]} rows)")
    ap.add_argument("--output", required=True, help="output JSONL")
    ap.add_argument("--max-new-tokens", type=int, default=1024, help="tokens generated per sample at most")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    ap.add_argument("--top-k", type=int, default=0, help="0 = no top-k truncation")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (one prefill shared by the n samples)")
    ap.add_argument("--seed", type=int, default=0, help="the row on line L uses seed + L - 1")
    ap.add_argument("--max-concurrent", type=int, default=32, help="decode slots (static decode batch)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute/param/KV dtype")
    ap.add_argument("--no-chat-template", action="store_true",
                    help="encode text prompts as raw text (default: the tokenizer's chat template, when it has one)")
    ap.add_argument("--chat", action="store_true", help="deprecated, no effect: the chat template is the default")
    ap.add_argument("--truncate-prompts", action="store_true", help="keep the last --max-prompt-length tokens")
    ap.add_argument("--stop", nargs="+", default=[], metavar="STR",
                    help="stop strings: a sample ends at the token completing one; its text ends before the string "
                         "(completion_ids keep the tokens, stop_string names it)")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token(s)")
    ap.add_argument("--max-prompt-length", type=int, default=None,
                    help="longest prompt (largest prefill bucket; default: the longest of the file)")
    ap.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="KV pages (default: sized from the free memory; on a CPU the host's available RAM)")
    ap.add_argument("--no-compact-decode", dest="compact_decode", action="store_false",
                    help="always decode with the full batch of --max-concurrent rows, so that a row's tokens never "
                         "depend on the rest of the batch (default: batches of 1/2 or 1/4 of it while the live "
                         "sequences fit, compiled beside the first steps; rounding-level differences can flip a sampled token)")
    ap.add_argument("--decode-steps", type=int, default=1,
                    help="multi-step decode: up to this many decode steps per dispatch (one program, one copy to the "
                         "host), at most --page-size; the same tokens as single steps")
    return ap


@cli_main(TOOL)
def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name, lo in (("max_new_tokens", 1), ("n", 1), ("max_concurrent", 1), ("page_size", 1), ("decode_steps", 1)):
        if getattr(args, name) < lo:
            ap.error(f"--{name.replace('_', '-')} must be >= {lo}")
    if args.decode_steps > args.page_size:
        ap.error(f"--decode-steps must be <= --page-size ({args.page_size})")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        ap.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    for name in ("max_prompt_length", "num_pages"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.seed < 2 ** 32:
        ap.error("--seed must be in [0, 2**32)")
    from jaxrl_async.cli import compile_cache

    cache_dir = compile_cache.enable()
    if args.chat:
        note(TOOL, "--chat is deprecated and has no effect: the chat template is used by default "
                   "(--no-chat-template turns it off)")
    require_file("--input", args.input)
    require_output_file("--output", args.output)

    note_cpu_bfloat16(TOOL, "--dtype bfloat16", args.dtype)
    cfg = model_config("--model", args.model, dtype=args.dtype, param_dtype=args.dtype)

    has_tokenizer = has_tokenizer_files(args.model)
    if not has_tokenizer:
        if args.stop:
            raise UserError(f"--stop needs a tokenizer, but --model {args.model} has no tokenizer files "
                            "(tokenizer.json / tokenizer_config.json)")
        note(TOOL, f"{args.model} has no tokenizer files: rows must give prompt_ids, outputs carry ids only")
    tok: dict[str, Any] = {}  # loaded at the first text prompt, else after the rows are checked

    def tokenizer() -> Any:
        if "tok" not in tok:
            tok["tok"] = load_tokenizer("--model", args.model) if has_tokenizer else None
        return tok["tok"]

    chat: bool | None = None  # decided at the first text prompt (the note only matters then)

    def encode(text: str, row: int) -> list[int]:
        nonlocal chat
        if not has_tokenizer:
            raise BadRowError(f"row {row}: a text prompt needs a tokenizer, but --model {args.model} has no "
                              "tokenizer files; give prompt_ids")
        if chat is None:
            chat = chat_template_wanted(TOOL, tokenizer(), args.model, not args.no_chat_template)
        return encode_prompt(tokenizer(), text, chat)

    rows, errors = read_rows(iter_lines("--input", args.input), encode, cfg.vocab_size)
    model_max = cfg.max_position_embeddings - 1
    max_prompt = args.max_prompt_length or min(max((len(r.prompt_ids) for r in rows), default=1), model_max)
    max_prompt = min(max_prompt, model_max)
    rows, len_errors = apply_length_limit(rows, max_prompt, args.truncate_prompts)
    errors = sorted(errors + len_errors, key=lambda e: int(e.split(":", 1)[0].removeprefix("row ")))
    if errors:
        raise UserError(bad_rows_error(args.input, errors) + "; nothing generated")
    if not rows:
        raise UserError(f"--input {args.input}: no prompts (the file has no non-blank rows)")
    n_trunc = sum(r.truncated_from is not None for r in rows)
    if n_trunc:
        print(f"truncated {n_trunc} prompt(s) to their last {max_prompt} tokens", file=sys.stderr)

    from tqdm import tqdm

    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.factory import CLI_FLAGS, build_engine, for_prompts
    from jaxrl_async.generator.orchestrator import Generator

    tokenizer = tokenizer()

    cfg, params = load_model("--model", args.model, cfg=cfg)
    # every prompt is queued at once, so prefills pack several prompts into rows of the one bucket (one bucket up to
    # 512 tokens saves a compilation per smaller bucket, seconds on a CPU, for little padding)
    spec = for_prompts([len(r.prompt_ids) for r in rows], args.max_new_tokens, cfg, max_concurrent=args.max_concurrent,
                       samples_per_prompt=args.n, page_size=args.page_size, num_pages=args.num_pages,
                       compact_decode=args.compact_decode, decode_steps=args.decode_steps, reusable=True,
                       max_prompt=max_prompt if args.max_prompt_length else None)
    engine = build_engine(spec, cfg, fields=CLI_FLAGS, program_cache=compile_cache.program_cache(cache_dir))
    params = engine.place_params(params)
    # compile up front, every program at once ahead of time (instead of one after the other at first use); a packed
    # prefill row holds up to max_prefill_pack prompts x n samples
    t_compile = time.perf_counter()
    engine.warmup(params, max_samples=engine.max_prefill_pack * args.n,
                  truncation=args.temperature > 0 and (args.top_k > 0 or args.top_p < 1),
                  max_live=min(engine.max_concurrent_decodes, len(rows) * args.n))
    t_compile = time.perf_counter() - t_compile
    stops = () if args.ignore_eos else stop_token_ids(cfg, tokenizer, args.model)

    def sampling(row: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                              stop_strings=tuple(args.stop), seed=(args.seed + row - 1) % 2 ** 32, n=args.n)

    t0 = time.perf_counter()
    total = len(rows) * args.n
    gen = Generator(engine, params, tokenizer=tokenizer)
    # every request is queued before the decode thread starts: the admissions, hence the decode batches (and the
    # compacted ones), are the same in every run of the same input, so the output is reproducible
    handles = [gen.submit(r.prompt_ids, sampling(r.row), request_id=str(r.row)) for r in rows]
    with gen:
        with tqdm(total=total, desc="generate", unit="sample", file=sys.stderr, disable=None) as bar:
            shown = 0
            while gen.error is None and not all(h.done() for h in handles):
                time.sleep(0.05)
                now = min(gen.stats().finished_samples, total)
                bar.update(now - shown)
                shown = now
            bar.update(total - shown)
        outputs = [h.result(timeout=None) for h in handles]  # raises GeneratorError on failure
        stats = gen.stats()
    elapsed = time.perf_counter() - t0
    with open(args.output, "w", encoding="utf-8") as fh:
        for r, out in zip(rows, outputs):
            for d in output_rows(r.row, out.samples, args.n, r.echo, tuple(args.stop)):
                fh.write(json.dumps(d, ensure_ascii=False) + "\n")
    n_tok = sum(len(s.completion_ids) for o in outputs for s in o.samples)
    print(f"generated {total} sample(s), {n_tok} tokens in {elapsed:.1f} s after {t_compile:.1f} s of compilation "
          f"({n_tok / (elapsed + t_compile):.1f} tok/s incl. compilation; decode {stats.tokens_per_s:.1f} tok/s, "
          f"slot utilisation {stats.slot_utilisation:.2f}, {engine.compact_steps} compacted decode steps) -> "
          f"{args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
