"""`python -m jaxrl_async.evaluate`: pass@k of a Hugging Face model on a prompt dataset.

    python -m jaxrl_async.evaluate --model DIR --data FILE [--format auto|generic|gsm8k|math|code] [--n 4] \\
        [--temperature 0.6] [--top-p P] [--max-new-tokens N] [--output results.jsonl] [--reward math] \\
        [--seed S] [--max-items K] [--no-chat-template] [--boxed-instruction | --prompt-suffix TEXT] \\
        [--system-prompt TEXT] [--max-prompt-length L] [--stop STR ...] [--no-run-recipe] [--skip-bad-rows] \\
        [--max-concurrent B] [--dtype float32|bfloat16] [--page-size P] [--num-pages N] [--summary-json PATH]

Data: read with the project's loaders (``data.DatasetConfig`` / ``load_prompt_dataset``: JSONL or
Parquet, formats gsm8k / math / generic / code; ``--format auto``, the default, tells it from the
columns of the first rows, says which on stderr and stops when that is ambiguous). The prompt is
the problem (+ a suffix) rendered as one user turn by the model directory's chat template, as ``generate``
and ``score`` do (``--no-chat-template``, or a tokenizer without a template: the raw text). Generation
stops at the EOS ids of config.json, generation_config.json and the tokenizer, and at the ``--stop`` strings.
Rewards: ``--reward`` is a built-in name (``math``, ``gsm8k``, ``code``) or ``package.module:function`` (see
``rewards.registry``), called as ``fn(prompt, completion, answer, **row_metadata)``.

A run's export (``RUN/hf``, ``python -m jaxrl_async.export``) carries the run's recipe in
``jaxrl_async_run.json`` (``data.recipe``; an older export inside its run directory: ``RUN/config.json``), and
``--model`` on it takes its defaults from there, so the prompts are the token ids the run's own held-out
evaluation gave the policy: the chat-template choice, ``data.system_prompt``, ``data.prompt_suffix`` (e.g. the
``\\boxed{}`` instruction of the math recipes) and ``data.max_prompt_len``, and the reward
(``rollout.reward``), ``--max-new-tokens`` (``eval.max_new_tokens`` or ``rollout.sampling.max_new_tokens``) and
``--stop`` (``rollout.sampling.stop_strings``). One line on stderr says where the recipe came from and which
flags override it; ``--no-run-recipe`` ignores it. The protocol's ``--n``, ``--temperature``, ``--top-p/k`` and
``--seed`` are always the flags' (that line gives the run's: ``--n 1 --temperature 0`` by default, greedy, and
its seed reproduce the in-run accuracy). A model that is not a run's export: the flags' defaults (chat
template, no suffix, no length limit, ``math``, 1024 new tokens). A run directory itself is refused, naming its
export.

Protocol (AReaL's): n samples per item at ``--temperature``; a sample is *correct* when its reward
exceeds 0.5 (``math`` rewards are 1/0). With c_i correct samples of item i out of n:

    pass@1 = mean_i c_i / n                               (accuracy averaged over the n samples)
    pass@k = mean_i 1 - C(n - c_i, k) / C(n, k)            (unbiased estimator, Chen et al. 2021)
    pass@n = mean_i [c_i > 0]                             (some sample is correct)

Seeds: item i samples with ``derive_seed(seed, i)``, so results do not depend on batching.
Outputs: ``--output`` JSONL, one row per item in data order: ``id, prompt, answer, completions,
rewards, correct, finish_reasons, completion_tokens, pass@1``; the summary table goes to stdout
(``--summary-json`` also writes it as JSON, with ``prompt_recipe``: the file the recipe came from, or null).
Exit status 2 on bad arguments, paths or rows (one line on stderr naming the flag, file or row), 1 on an
internal error.

Library use (the RL loop's held-out evaluation calls it with its running generator):
``rollout.evaluation.evaluate_params`` ``(params, model_cfg, tokenizer, records, reward_fn, n=..., temperature=...,
max_new_tokens=..., seed=..., generator=gen) -> EvalResult``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from jaxrl_async.cli.common import (UserError, chat_template_wanted, check_model_dir, cli_main, load_model, load_tokenizer,
                                    make_parser, model_config, note_cpu_bfloat16, require_file, require_output_file)

from jaxrl_async.rollout.evaluation import (  # noqa: F401  (the library half, importable from here too)
    SUCCESS_THRESHOLD, EvalResult, ItemResult, evaluate_params, pass_at_k, report_ks,
)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
TOOL = "evaluate"
CliError = UserError  # the former name of the CLI's user error


def build_parser() -> argparse.ArgumentParser:
    from jaxrl_async.data.formats import AUTO, FORMATS

    ap = make_parser("python -m jaxrl_async.evaluate", __doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors + tokenizer)")
    ap.add_argument("--data", required=True, help="dataset file (.jsonl/.json/.parquet)")
    ap.add_argument("--format", default=AUTO, choices=(AUTO,) + FORMATS,
                    help="row format (data/formats.py); auto: told from the columns of the first rows")
    ap.add_argument("--n", type=int, default=4, help="samples per item")
    ap.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    ap.add_argument("--top-k", type=int, default=0, help="0 = no top-k truncation")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens generated per sample at most (default: a run's export: its recipe's; else 1024)")
    ap.add_argument("--output", default=None, help="per-item results JSONL")
    ap.add_argument("--summary-json", default=None, help="write the summary as JSON here")
    ap.add_argument("--reward", default=None,
                    help="math | gsm8k | code | package.module:function (default: a run's export: its rollout.reward; "
                         "else math)")
    ap.add_argument("--seed", type=int, default=0, help="item i samples with derive_seed(seed, i)")
    ap.add_argument("--max-items", type=int, default=None, help="evaluate the first K rows only")
    ap.add_argument("--no-chat-template", action="store_true",
                    help="use the raw problem text as the prompt (default: the tokenizer's chat template, when it "
                         "has one, unless a run's export recipe says raw text)")
    ap.add_argument("--boxed-instruction", action="store_true",
                    help="append 'Please put your final answer within \\boxed{}.' to every problem "
                         "(= --prompt-suffix with that text)")
    ap.add_argument("--prompt-suffix", default=None, metavar="TEXT",
                    help="append TEXT to every problem ('' for none; default: a run's export: its data.prompt_suffix; "
                         "else none)")
    ap.add_argument("--system-prompt", default=None,
                    help="system message, chat template only (default: a run's export: its data.system_prompt)")
    ap.add_argument("--max-prompt-length", type=int, default=None,
                    help="drop (and count) longer prompts (default: a run's export: its data.max_prompt_len; else "
                         "keep all)")
    ap.add_argument("--stop", nargs="+", default=None, metavar="STR",
                    help="stop strings (default: a run's export: its rollout.sampling.stop_strings; else none)")
    ap.add_argument("--no-run-recipe", action="store_true",
                    help="ignore the run recipe of an export (jaxrl_async_run.json): the flags' defaults only")
    ap.add_argument("--skip-bad-rows", action="store_true", help="skip (and count) malformed rows instead of failing")
    ap.add_argument("--max-concurrent", type=int, default=32, help="decode slots")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute/param/KV dtype")
    ap.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="KV pages (default: sized from the free memory; on a CPU the host's available RAM)")
    return ap


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("n", "max_concurrent", "page_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_new_tokens", "max_items", "max_prompt_length", "num_pages"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        ap.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    if args.boxed_instruction and args.prompt_suffix is not None:
        ap.error("--boxed-instruction and --prompt-suffix both set the suffix: give one")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the flags and a run's recipe make of the prompts, the reward and the generation's end."""

    prompt: Any  # data.recipe.PromptRecipe (format: the run's, used when --format auto cannot tell)
    reward: str
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    source: str | None  # the file the run's recipe came from, None without one


def resolve_settings(args: argparse.Namespace) -> Settings:
    """The run's recipe of ``--model`` (``data.recipe.find_run_recipe``) overridden by the flags given, or the
    flags' defaults; says on stderr where the recipe came from (one line)."""
    from jaxrl_async.data.datasets import BOXED_INSTRUCTION
    from jaxrl_async.data.recipe import RECIPE_FILE, PromptRecipe, find_run_recipe

    found = None
    if not args.no_run_recipe:
        try:
            found = find_run_recipe(args.model)
        except ValueError as e:
            raise UserError(f"--model {args.model}: {e} (--no-run-recipe ignores it)") from None
    rc, source = found if found is not None else (None, None)
    base = rc.prompt if rc is not None else PromptRecipe(format="generic")
    given = {k: v for k, v in (
        ("--no-chat-template", False if args.no_chat_template else None),
        ("--boxed-instruction", BOXED_INSTRUCTION if args.boxed_instruction else None),
        ("--prompt-suffix", args.prompt_suffix), ("--system-prompt", args.system_prompt),
        ("--max-prompt-length", args.max_prompt_length), ("--reward", args.reward),
        ("--max-new-tokens", args.max_new_tokens),
        ("--stop", tuple(args.stop) if args.stop is not None else None)) if v is not None}
    suffix = given.get("--boxed-instruction", given.get("--prompt-suffix", base.prompt_suffix))
    prompt = dataclasses.replace(base, apply_chat_template=given.get("--no-chat-template", base.apply_chat_template),
                                 prompt_suffix=suffix, system_prompt=given.get("--system-prompt", base.system_prompt),
                                 max_prompt_len=given.get("--max-prompt-length", base.max_prompt_len))
    st = Settings(prompt, given.get("--reward", rc.reward if rc else "math"),
                  given.get("--max-new-tokens", rc.max_new_tokens if rc else 1024),
                  given.get("--stop", rc.stop_strings if rc else ()), source)
    if rc is None:
        why = "--no-run-recipe" if args.no_run_recipe else f"{args.model} has no {RECIPE_FILE}: not a run's export"
        print(f"{TOOL}: prompt recipe: the flags' ({why})", file=sys.stderr)
        return st
    run = f"run {rc.run_dir}" + (f" step {rc.step}" if rc.step is not None else "")
    p = st.prompt
    what = ", ".join([
        "chat template" if p.apply_chat_template else "raw text",
        f"system prompt {p.system_prompt!r}" if p.system_prompt else "no system prompt",
        f"suffix {p.prompt_suffix!r}" if p.prompt_suffix else "no suffix",
        f"prompts <= {p.max_prompt_len} tokens" if p.max_prompt_len else "no prompt length limit",
        f"reward {st.reward}", f"<= {st.max_new_tokens} new tokens",
        f"stop strings {list(st.stop_strings)}" if st.stop_strings else "no stop strings"])
    flags = f"; overridden by {' '.join(given)}" if given else ""
    items = f" --max-items {rc.max_items}" if rc.max_items is not None else ""
    print(f"{TOOL}: prompt recipe of {run} ({source}): {what}{flags}; the run evaluated with --n {rc.n} "
          f"--temperature {rc.temperature:g} --seed {rc.seed}{items} (--no-run-recipe ignores the recipe)",
          file=sys.stderr)
    return st


def check_not_a_run_dir(model: str) -> None:
    """UserError when ``--model`` is a run directory (``checkpoints/`` and no model's config.json: the run's),
    naming its export."""
    if not os.path.isdir(os.path.join(model, "checkpoints")):
        return
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as fh:
            if "model_type" in json.load(fh):  # a Hugging Face config: a model directory after all
                return
    except (OSError, ValueError, TypeError):
        pass
    hf = os.path.join(model, "hf")
    where = (f"its export is {hf}" if os.path.isfile(os.path.join(hf, "config.json"))
             else f"export a step first: python -m jaxrl_async.export --run-dir {model} --out DIR")
    raise UserError(f"--model {model}: a jaxrl_async run directory, not a model directory; {where}")


def _load_inputs(args: argparse.Namespace, settings: Settings, model_cfg: Any = None) -> tuple[Any, list[Any], Any]:
    """(tokenizer, records, reward_fn); UserError naming the path/row on any user error. A vision-language model
    (``model_cfg`` a Qwen2.5-VL config) reads rows with images (data/images.py) with its image processor."""
    from jaxrl_async.data.datasets import DataFormatError, load_prompt_dataset, sniff_format
    from jaxrl_async.data.formats import AUTO, FormatDetectionError
    from jaxrl_async.rewards.registry import RewardLoadError, make_reward

    check_model_dir("--model", args.model)
    require_file("--data", args.data)
    for flag in ("--output", "--summary-json"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None:
            require_output_file(flag, path)
    try:
        reward_fn = make_reward(settings.reward)
    except (RewardLoadError, TypeError, ValueError) as e:
        raise UserError(f"--reward {settings.reward}: {e}" + ("" if args.reward or not settings.source else
                                                        f" (the run's rollout.reward, from {settings.source})")) from None
    fmt = args.format
    if fmt == AUTO:
        try:
            fmt, how = sniff_format(args.data)
        except FormatDetectionError as e:
            if settings.source is None:
                raise UserError(f"--format auto: {e}") from None
            fmt, how = settings.prompt.format, f"the run's data format ({settings.source}): the columns do not tell"
        except (OSError, ValueError) as e:
            raise UserError(f"--data {args.data}: {e}") from None
        print(f"{TOOL}: format {fmt} ({how}; --format to choose another)", file=sys.stderr)
    tokenizer = load_tokenizer("--model", args.model)
    if tokenizer is None:
        raise UserError(f"--model {args.model}: no tokenizer files (tokenizer.json / tokenizer_config.json); "
                        "evaluate needs the model's tokenizer to encode the problems")
    chat = chat_template_wanted(TOOL, tokenizer, args.model, settings.prompt.apply_chat_template)
    # the run's own rendering (data.recipe.PromptRecipe.dataset_config, as loop.setup loads the held-out set)
    cfg = settings.prompt.dataset_config(args.data, apply_chat_template=chat, format=fmt, skip_bad_rows=args.skip_bad_rows,
                                   max_rows=args.max_items)
    from jaxrl_async.models.qwen2_5_vl import is_vl

    if is_vl(model_cfg):
        from jaxrl_async.data.images import image_processor_for, load_vl_prompt_dataset, vl_tokens_of

        try:
            processor, vl_tokens = image_processor_for(model_cfg.vision, args.model), vl_tokens_of(tokenizer)
        except (OSError, ValueError) as e:
            raise UserError(f"--model {args.model}: {e}") from None
        load_prompt_dataset = lambda c, tok: load_vl_prompt_dataset(c, tok, processor, vl_tokens)  # noqa: E731
    try:
        ds = load_prompt_dataset(cfg, tokenizer)
    except DataFormatError as e:
        raise UserError(f"{e} (--format {fmt}; --skip-bad-rows skips such rows)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"--data {args.data}: {e}") from None
    st = ds.stats
    if st.bad_rows:
        print(f"skipped {st.bad_rows} malformed row(s), e.g. {st.bad_row_examples[0]}", file=sys.stderr)
    if st.too_long:
        print(f"dropped {st.too_long} prompt(s) longer than --max-prompt-length {cfg.max_prompt_len}",
              file=sys.stderr)
    if not ds.records:
        raise UserError(f"--data {args.data}: no usable rows ({st.rows_read} read)")
    return tokenizer, ds.records, reward_fn


def _report_reward_failures(reward_fn: Any) -> None:
    """Warn on stderr when the reward function raised or returned non-numbers (scored as 0 by SafeReward)."""
    stats = getattr(reward_fn, "stats", None)
    counts = stats() if callable(stats) else {}
    bad = counts.get("errors", 0) + counts.get("invalid", 0)
    if bad:
        print(f"warning: the reward function failed on {bad} of {counts.get('calls', '?')} samples (scored 0); "
              f"last: {getattr(reward_fn, 'last_error', None)}", file=sys.stderr)


@cli_main(TOOL)
def main(argv: list[str] | None = None) -> int:
    from jaxrl_async.data.tokenizer import stop_token_ids

    ap = build_parser()
    args = ap.parse_args(argv)
    from jaxrl_async.cli import compile_cache

    compile_cache.enable()
    _check_args(ap, args)
    check_not_a_run_dir(args.model)
    note_cpu_bfloat16(TOOL, "--dtype bfloat16", args.dtype)
    cfg = model_config("--model", args.model, dtype=args.dtype, param_dtype=args.dtype)  # fails fast on bad files
    settings = resolve_settings(args)
    tokenizer, records, reward_fn = _load_inputs(args, settings, cfg)
    try:
        cfg, params = load_model("--model", args.model, cfg=cfg)
        model_max = cfg.max_position_embeddings - 1
        long = [r for r in records if len(r.prompt_ids) > model_max]
        if long:
            raise UserError(f"--data {args.data}: item {long[0].id}: prompt has {len(long[0].prompt_ids)} tokens, "
                            f"more than the model maximum {model_max} (max_position_embeddings - 1); "
                            f"{len(long)} such prompt(s) (--max-prompt-length {model_max} drops them)")
        result = evaluate_params(params, cfg, tokenizer, records, reward_fn, n=args.n, temperature=args.temperature,
                                 max_new_tokens=settings.max_new_tokens, seed=args.seed, top_p=args.top_p,
                                 top_k=args.top_k, max_concurrent=args.max_concurrent, page_size=args.page_size,
                                 num_pages=args.num_pages, progress=True,
                                 stop_token_ids=stop_token_ids(cfg, tokenizer, args.model),
                                 stop_strings=settings.stop_strings)
    finally:
        _report_reward_failures(reward_fn)
        close = getattr(reward_fn, "close", None)
        if callable(close):
            close()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            for row in result.rows():
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {"model": args.model, "data": args.data, "temperature": args.temperature, "reward": settings.reward,
               "prompt_recipe": settings.source, **result.summary()}
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    print(result.table())
    if args.output:
        print(f"per-item results -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
