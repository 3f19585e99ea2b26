"""`python -m jaxrl_async.evaluate`: pass@k of a Hugging Face model on a prompt dataset.

    python -m jaxrl_async.evaluate --model DIR --data FILE [--format auto|generic|gsm8k|math|code] [--n 4] \\
        [--temperature 0.6] [--top-p P] [--max-new-tokens N] [--output results.jsonl] [--reward math] \\
        [--seed S] [--max-items K] [--no-chat-template] [--boxed-instruction] [--system-prompt TEXT] \\
        [--max-prompt-length L] [--skip-bad-rows] [--max-concurrent B] [--dtype float32|bfloat16] \\
        [--page-size P] [--num-pages N] [--summary-json PATH]

Data: read with the project's loaders (``data.DatasetConfig`` / ``load_prompt_dataset``: JSONL or
Parquet, formats gsm8k / math / generic / code; ``--format auto``, the default, tells it from the
columns of the first rows, says which on stderr and stops when that is ambiguous). The prompt is
the problem rendered as one user turn by the model directory's chat template, as ``generate`` and
``score`` do (``--no-chat-template``, or a tokenizer without a template: the raw text). Generation
stops at the EOS ids of config.json, generation_config.json and the tokenizer. Rewards: ``--reward``
is a built-in name (``math``, ``gsm8k``, ``code``) or ``package.module:function`` (see
``rewards.registry``), called as ``fn(prompt, completion, answer, **row_metadata)``.

Protocol (AReaL's): n samples per item at ``--temperature``; a sample is *correct* when its reward
exceeds 0.5 (``math`` rewards are 1/0). With c_i correct samples of item i out of n:

    pass@1 = mean_i c_i / n                               (accuracy averaged over the n samples)
    pass@k = mean_i 1 - C(n - c_i, k) / C(n, k)            (unbiased estimator, Chen et al. 2021)
    pass@n = mean_i [c_i > 0]                             (some sample is correct)

Seeds: item i samples with ``derive_seed(seed, i)``, so results do not depend on batching.
Outputs: ``--output`` JSONL, one row per item in data order: ``id, prompt, answer, completions,
rewards, correct, finish_reasons, completion_tokens, pass@1``; the summary table goes to stdout
(``--summary-json`` also writes it as JSON). Exit status 2 on bad arguments, paths or rows (one line
on stderr naming the flag, file or row), 1 on an internal error.

Library use (e.g. from the RL loop, with an already running generator):
:func:`evaluate_params` ``(params, model_cfg, tokenizer, records, reward_fn, n=..., temperature=...,
max_new_tokens=..., seed=..., generator=gen) -> EvalResult``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import sys
import time
import uuid
from typing import Any, Callable, Iterator, Sequence

from jaxrl_async.cli import (UserError, chat_template_wanted, check_model_dir, cli_main, load_model, load_tokenizer,
                             make_parser, model_config, require_file, require_output_file)

SUCCESS_THRESHOLD = 0.5


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one item with ``c`` correct out of ``n`` samples: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def report_ks(n: int) -> list[int]:
    """The k of the summary: 1, the powers of two below n, and n."""
    return sorted({1, n, *(2 ** j for j in range(1, max(n.bit_length(), 1)) if 2 ** j < n)})


@dataclasses.dataclass
class ItemResult:
    """The n samples of one dataset item."""

    id: str
    prompt: str
    answer: Any
    completions: list[str]
    rewards: list[float]
    finish_reasons: list[str]
    completion_tokens: list[int]

    def correct(self, threshold: float = SUCCESS_THRESHOLD) -> list[bool]:
        return [r > threshold for r in self.rewards]

    def to_row(self, threshold: float = SUCCESS_THRESHOLD) -> dict[str, Any]:
        ok = self.correct(threshold)
        return {"id": self.id, "prompt": self.prompt, "answer": self.answer, "completions": self.completions,
                "rewards": self.rewards, "correct": ok, "finish_reasons": self.finish_reasons,
                "completion_tokens": self.completion_tokens, "pass@1": sum(ok) / len(ok)}


@dataclasses.dataclass
class EvalResult:
    """Per-item results plus the aggregate metrics (see the module docstring for the formulas)."""

    items: list[ItemResult]
    n: int
    elapsed_s: float = 0.0
    success_threshold: float = SUCCESS_THRESHOLD
    versions: tuple[int, int] | None = None  # (min, max) policy version of the generated tokens

    def pass_at(self, k: int) -> float:
        if not self.items:
            return float("nan")
        return sum(pass_at_k(self.n, sum(it.correct(self.success_threshold)), k) for it in self.items) / len(self.items)

    @property
    def pass_at_1(self) -> float:
        return self.pass_at(1)

    @property
    def pass_at_n(self) -> float:
        return self.pass_at(self.n)

    def summary(self) -> dict[str, Any]:
        rewards = [r for it in self.items for r in it.rewards]
        toks = [t for it in self.items for t in it.completion_tokens]
        reasons = [f for it in self.items for f in it.finish_reasons]
        out: dict[str, Any] = {"items": len(self.items), "n": self.n, "samples": len(rewards)}
        out.update({f"pass@{k}": self.pass_at(k) for k in report_ks(self.n)})
        out.update(mean_reward=sum(rewards) / len(rewards) if rewards else float("nan"),
                   mean_completion_tokens=sum(toks) / len(toks) if toks else float("nan"),
                   truncated_fraction=reasons.count("length") / len(reasons) if reasons else float("nan"),
                   generated_tokens=sum(toks), elapsed_s=self.elapsed_s,
                   tokens_per_s=sum(toks) / self.elapsed_s if self.elapsed_s > 0 else float("nan"))
        if self.versions is not None:
            out["policy_versions"] = list(self.versions)
        return out

    def table(self) -> str:
        s = self.summary()
        rows = [("items", f"{s['items']}"), ("samples per item", f"{s['n']}")]
        for k in report_ks(self.n):
            label = f"pass@{k}" + (f" (mean over {self.n} samples)" if k == 1 and self.n > 1 else "")
            rows.append((label, f"{s[f'pass@{k}']:.4f}"))
        rows += [("mean reward", f"{s['mean_reward']:.4f}"),
                 ("mean completion tokens", f"{s['mean_completion_tokens']:.1f}"),
                 ("truncated (length)", f"{100 * s['truncated_fraction']:.1f} %"),
                 ("wall time", f"{s['elapsed_s']:.1f} s ({s['tokens_per_s']:.1f} generated tok/s)")]
        w = max(len(a) for a, _ in rows)
        return "\n".join([f"{'metric':<{w}}  value", f"{'-' * w}  {'-' * 10}"] + [f"{a:<{w}}  {b}" for a, b in rows])

    def rows(self) -> Iterator[dict[str, Any]]:
        for it in self.items:
            yield it.to_row(self.success_threshold)


# ---------------------------------------------------------------------------------------------
# Evaluation with the paged engine + generator
# ---------------------------------------------------------------------------------------------
def _field(rec: Any, name: str, default: Any = None) -> Any:
    return rec.get(name, default) if isinstance(rec, dict) else getattr(rec, name, default)


def _text(sample: Any, tokenizer: Any) -> str:
    if sample.text is not None:
        return sample.text
    return tokenizer.decode(list(sample.completion_ids), skip_special_tokens=True)


def evaluate_params(params: Any, model_cfg: Any, tokenizer: Any, records: Sequence[Any], reward_fn: Callable[..., float],
                    *, n: int, temperature: float, max_new_tokens: int, seed: int, mesh: Any = None,
                    generator: Any = None, top_p: float = 1.0, top_k: int = 0,
                    stop_token_ids: Sequence[int] | None = None, success_threshold: float = SUCCESS_THRESHOLD,
                    max_concurrent: int = 32, page_size: int = 16, num_pages: int | None = None,
                    reward_workers: int = 4, timeout_s: float | None = None, progress: bool = False,
                    poll_s: float = 0.02, should_stop: Callable[[], bool] | None = None) -> EvalResult | None:
    """Generate ``n`` samples per record, score them with ``reward_fn`` and aggregate pass@k.

    Args:
      params / model_cfg: the model (``models.load_hf`` output); ignored when ``generator`` is given.
      tokenizer: decodes completions (and supplies the EOS id).
      records: items with ``id``, ``prompt``, ``prompt_ids``, ``answer`` and optional ``metadata``
        (``data.PromptRecord`` or dicts).
      reward_fn: ``fn(prompt, completion, answer, **metadata) -> float``, run in a thread pool while
        later items are still generating.
      generator: an already running ``orchestrator.Generator`` (e.g. the RL loop's); its current
        weights are evaluated and it is left running. Otherwise a PagedEngine (on ``mesh``, sized for
        the longest prompt + ``max_new_tokens``) and a Generator are built and stopped afterwards.
      stop_token_ids: default: the model's and the tokenizer's EOS ids.
      timeout_s: wall-clock limit of the whole evaluation (outstanding requests are aborted).
      progress: show a tqdm bar on stderr.
      should_stop: polled while waiting; once true the outstanding requests are aborted and None is returned
        (the RL loop abandons an evaluation on a stop signal).

    This is the one evaluation path: the ``evaluate`` CLI and the RL loop's held-out evaluation
    (``loop.evaluation``) both call it, so they score the same records the same way.
    """
    from jaxrl_async.generate import stop_token_ids as default_stops
    from jaxrl_async.rollout.engine_api import SamplingParams
    from jaxrl_async.rollout.orchestrator import GeneratorError
    from jaxrl_async.rollout.workflow import derive_seed

    if n < 1 or max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"need n >= 1, max_new_tokens >= 1, temperature >= 0; got {n}, {max_new_tokens}, {temperature}")
    records = list(records)
    if not records:
        raise ValueError("evaluate_params: no records")
    for i, r in enumerate(records):
        if not _field(r, "prompt_ids"):
            raise ValueError(f"record {i} (id {_field(r, 'id')!r}) has no prompt_ids")
    cfg = model_cfg
    own = generator is None
    if own:
        if params is None or cfg is None:
            raise ValueError("evaluate_params needs params and model_cfg when no generator is given")
        generator = _start_generator(params, cfg, tokenizer, records, max_new_tokens, mesh, max_concurrent, page_size,
                                     num_pages)
    else:
        limit = getattr(getattr(generator, "engine", None), "max_prefill_length", None)
        long = [(_field(r, "id"), len(_field(r, "prompt_ids"))) for r in records
                if limit is not None and len(_field(r, "prompt_ids")) > limit]
        if long:
            raise ValueError(f"{len(long)} prompt(s) longer than the generator's max_prefill_length {limit}, "
                             f"e.g. id {long[0][0]!r} with {long[0][1]} tokens")
    if stop_token_ids is None:
        stop_token_ids = default_stops(cfg, tokenizer) if cfg is not None else \
            ((int(tokenizer.eos_token_id),) if getattr(tokenizer, "eos_token_id", None) is not None else ())
    base = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                          stop_token_ids=tuple(stop_token_ids), n=n)
    base.validate()
    tag = f"eval-{uuid.uuid4().hex[:8]}"
    bar = None
    pool = cf.ThreadPoolExecutor(reward_workers, thread_name_prefix="eval-reward")
    t0 = time.perf_counter()
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(records) * n, desc="evaluate", unit="sample", file=sys.stderr, disable=None)
        pending = {i: generator.submit(list(_field(r, "prompt_ids")), dataclasses.replace(base, seed=derive_seed(seed, i)),
                                       request_id=f"{tag}-{i}") for i, r in enumerate(records)}
        samples: dict[int, list[Any]] = {}
        futures: dict[int, list[cf.Future]] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            err = getattr(generator, "error", None)
            if err is not None:
                raise GeneratorError(f"generator failed during evaluation: {type(err).__name__}: {err}") from err
            done = [i for i, h in pending.items() if h.done()]
            for i in done:
                out = pending.pop(i).result(0)  # raises GeneratorError if this request failed
                r = records[i]
                samples[i] = list(out.samples)
                meta = {k: v for k, v in (_field(r, "metadata") or {}).items()
                        if k not in ("prompt", "completion", "answer")}
                futures[i] = [pool.submit(reward_fn, _field(r, "prompt", ""), _text(s, tokenizer), _field(r, "answer"),
                                          **meta) for s in samples[i]]
                if bar is not None:
                    bar.update(n)
            if should_stop is not None and should_stop():
                for h in pending.values():
                    h.abort()
                return None
            if deadline is not None and time.monotonic() > deadline:
                for h in pending.values():
                    h.abort()
                raise TimeoutError(f"evaluation not finished within {timeout_s} s ({len(pending)} items outstanding)")
            if not done:
                time.sleep(poll_s)
        items, versions = [], []
        for i, r in enumerate(records):
            ss = samples[i]
            versions += [v for s in ss for v in s.versions]
            items.append(ItemResult(
                id=str(_field(r, "id", i)), prompt=_field(r, "prompt", ""), answer=_field(r, "answer"),
                completions=[_text(s, tokenizer) for s in ss], rewards=[float(f.result()) for f in futures[i]],
                finish_reasons=[s.finish_reason for s in ss], completion_tokens=[len(s.completion_ids) for s in ss]))
    finally:
        if bar is not None:
            bar.close()
        pool.shutdown(wait=False, cancel_futures=True)
        if own:
            generator.stop()
    return EvalResult(items, n, time.perf_counter() - t0, success_threshold,
                      (min(versions), max(versions)) if versions else None)


def _start_generator(params: Any, cfg: Any, tokenizer: Any, records: Sequence[Any], max_new_tokens: int, mesh: Any,
                     max_concurrent: int, page_size: int, num_pages: int | None) -> Any:
    from jaxrl_async.rollout.engine import PagedEngine
    from jaxrl_async.rollout.orchestrator import Generator

    model_max = cfg.max_position_embeddings - 1
    lengths = [len(_field(r, "prompt_ids")) for r in records]
    too_long = [(_field(r, "id"), n) for r, n in zip(records, lengths) if n > model_max]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) longer than the model maximum of {model_max} tokens "
                         f"(max_position_embeddings - 1), e.g. id {too_long[0][0]!r} with {too_long[0][1]} tokens")
    max_prompt = max(lengths)
    engine = PagedEngine(cfg, mesh, max_concurrent_decodes=max_concurrent,
                         max_sequence_length=min(max_prompt + max_new_tokens, cfg.max_position_embeddings),
                         max_prefill_length=max_prompt, page_size=page_size, num_pages=num_pages)
    return Generator(engine, engine.place_params(params), tokenizer=tokenizer).start()


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
    ap.add_argument("--max-new-tokens", type=int, default=1024, help="tokens generated per sample at most")
    ap.add_argument("--output", default=None, help="per-item results JSONL")
    ap.add_argument("--summary-json", default=None, help="write the summary as JSON here")
    ap.add_argument("--reward", default="math", help="math | gsm8k | code | package.module:function")
    ap.add_argument("--seed", type=int, default=0, help="item i samples with derive_seed(seed, i)")
    ap.add_argument("--max-items", type=int, default=None, help="evaluate the first K rows only")
    ap.add_argument("--no-chat-template", action="store_true",
                    help="use the raw problem text as the prompt (default: the tokenizer's chat template, when it "
                         "has one)")
    ap.add_argument("--boxed-instruction", action="store_true",
                    help="append 'Please put your final answer within \\boxed{}.' to every problem")
    ap.add_argument("--system-prompt", default=None, help="system message (chat template only)")
    ap.add_argument("--max-prompt-length", type=int, default=None, help="drop (and count) longer prompts")
    ap.add_argument("--skip-bad-rows", action="store_true", help="skip (and count) malformed rows instead of failing")
    ap.add_argument("--max-concurrent", type=int, default=32, help="decode slots")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute/param/KV dtype")
    ap.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized from device memory)")
    return ap


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("n", "max_new_tokens", "max_concurrent", "page_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_items", "max_prompt_length", "num_pages"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        ap.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")


def _load_inputs(args: argparse.Namespace) -> tuple[Any, list[Any], Any]:
    """(tokenizer, records, reward_fn); UserError naming the path/row on any user error."""
    from jaxrl_async.data.datasets import BOXED_INSTRUCTION, DataFormatError, DatasetConfig, load_prompt_dataset, \
        sniff_format
    from jaxrl_async.data.formats import AUTO, FormatDetectionError
    from jaxrl_async.rewards.registry import RewardLoadError, make_reward

    check_model_dir("--model", args.model)
    require_file("--data", args.data)
    for flag in ("--output", "--summary-json"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None:
            require_output_file(flag, path)
    try:
        reward_fn = make_reward(args.reward)
    except (RewardLoadError, TypeError, ValueError) as e:
        raise UserError(f"--reward {args.reward}: {e}") from None
    fmt = args.format
    if fmt == AUTO:
        try:
            fmt, how = sniff_format(args.data)
        except FormatDetectionError as e:
            raise UserError(f"--format auto: {e}") from None
        except (OSError, ValueError) as e:
            raise UserError(f"--data {args.data}: {e}") from None
        print(f"{TOOL}: format {fmt} ({how}; --format to choose another)", file=sys.stderr)
    tokenizer = load_tokenizer("--model", args.model)
    if tokenizer is None:
        raise UserError(f"--model {args.model}: no tokenizer files (tokenizer.json / tokenizer_config.json); "
                        "evaluate needs the model's tokenizer to encode the problems")
    chat = chat_template_wanted(TOOL, tokenizer, args.model, not args.no_chat_template)
    cfg = DatasetConfig(path=args.data, format=fmt, max_prompt_len=args.max_prompt_length,
                        apply_chat_template=chat, system_prompt=args.system_prompt,
                        prompt_suffix=BOXED_INSTRUCTION if args.boxed_instruction else "",
                        skip_bad_rows=args.skip_bad_rows, max_rows=args.max_items)
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
        print(f"dropped {st.too_long} prompt(s) longer than --max-prompt-length {args.max_prompt_length}",
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
    from jaxrl_async.generate import stop_token_ids

    ap = build_parser()
    args = ap.parse_args(argv)
    from jaxrl_async import compile_cache

    compile_cache.enable()
    _check_args(ap, args)
    cfg = model_config("--model", args.model, dtype=args.dtype, param_dtype=args.dtype)  # fails fast on bad files
    tokenizer, records, reward_fn = _load_inputs(args)
    try:
        cfg, params = load_model("--model", args.model, cfg=cfg)
        model_max = cfg.max_position_embeddings - 1
        long = [r for r in records if len(r.prompt_ids) > model_max]
        if long:
            raise UserError(f"--data {args.data}: item {long[0].id}: prompt has {len(long[0].prompt_ids)} tokens, "
                            f"more than the model maximum {model_max} (max_position_embeddings - 1); "
                            f"{len(long)} such prompt(s) (--max-prompt-length {model_max} drops them)")
        result = evaluate_params(params, cfg, tokenizer, records, reward_fn, n=args.n, temperature=args.temperature,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed, top_p=args.top_p,
                                 top_k=args.top_k, max_concurrent=args.max_concurrent, page_size=args.page_size,
                                 num_pages=args.num_pages, progress=True,
                                 stop_token_ids=stop_token_ids(cfg, tokenizer, args.model))
    finally:
        _report_reward_failures(reward_fn)
        close = getattr(reward_fn, "close", None)
        if callable(close):
            close()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            for row in result.rows():
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {"model": args.model, "data": args.data, "temperature": args.temperature, "reward": args.reward,
               **result.summary()}
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    print(result.table())
    if args.output:
        print(f"per-item results -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
