"""Evaluation of a policy on prompt records: n samples per record from a generator service, rewards with each
record's metadata, pass@k (AReaL's protocol; formulas in ``jaxrl_async.cli.evaluate``'s docstring).

The one evaluation path: the ``evaluate`` CLI (``jaxrl_async/cli/evaluate.py``) and the RL loop's held-out
evaluation (``loop/evaluation.py``, on its running generator) both call :func:`evaluate_params`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import sys
import time
import uuid
from typing import Any, Callable, Iterator, Sequence

__all__ = ["SUCCESS_THRESHOLD", "EvalResult", "ItemResult", "evaluate_params", "pass_at_k", "report_ks"]

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
                    poll_s: float = 0.02, should_stop: Callable[[], bool] | None = None,
                    stop_strings: Sequence[str] = (), fields: Any = None) -> EvalResult | None:
    """Generate ``n`` samples per record, score them with ``reward_fn`` and aggregate pass@k.

    Args:
      params / model_cfg: the model (``models.load_hf`` output); ignored when ``generator`` is given.
      tokenizer: decodes completions (and supplies the EOS id).
      records: items with ``id``, ``prompt``, ``prompt_ids``, ``answer`` and optional ``metadata``
        (``data.PromptRecord`` or dicts).
      reward_fn: ``fn(prompt, completion, answer, **metadata) -> float``, run in a thread pool while
        later items are still generating.
      generator: an already running ``orchestrator.Generator`` (e.g. the RL loop's); its current
        weights are evaluated and it is left running. Otherwise an engine (on ``mesh``, sized for these prompts
        by ``generator.factory.for_prompts``) and a Generator are built and stopped afterwards.
      stop_token_ids: default: the model's and the tokenizer's EOS ids.
      timeout_s: wall-clock limit of the whole evaluation (outstanding requests are aborted).
      progress: show a tqdm bar on stderr.
      stop_strings: generation also stops at these strings (the run's ``rollout.sampling.stop_strings``).
      should_stop: polled while waiting; once true the outstanding requests are aborted and None is returned
        (the RL loop abandons an evaluation on a stop signal).
      fields: what the caller calls the engine's sizing settings (``generator.factory.EngineFields``, default the
        CLI flags), named by a sizing error.

    This is the one evaluation path: the ``evaluate`` CLI and the RL loop's held-out evaluation
    (``loop.evaluation``) both call it, so they score the same records the same way.
    """
    from jaxrl_async.data.tokenizer import stop_token_ids as default_stops
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.orchestrator import GeneratorError
    from jaxrl_async.rollout.workflow import derive_seed, item_images

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
                                     num_pages, n, fields)
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
                          stop_token_ids=tuple(stop_token_ids), stop_strings=tuple(stop_strings), n=n)
    base.validate()
    tag = f"eval-{uuid.uuid4().hex[:8]}"
    bar = None
    pool = cf.ThreadPoolExecutor(reward_workers, thread_name_prefix="eval-reward")
    t0 = time.perf_counter()
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(records) * n, desc="evaluate", unit="sample", file=sys.stderr, disable=None)
        def submit(i: int, r: Any) -> Any:
            images = item_images(r)
            kw = {} if images is None else {"images": images}
            return generator.submit(list(_field(r, "prompt_ids")), dataclasses.replace(base, seed=derive_seed(seed, i)),
                                    request_id=f"{tag}-{i}", **kw)

        pending = {i: submit(i, r) for i, r in enumerate(records)}
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
                     max_concurrent: int, page_size: int, num_pages: int | None, n: int, fields: Any) -> Any:
    from jaxrl_async.generator.factory import CLI_FLAGS, build_engine, for_prompts
    from jaxrl_async.generator.orchestrator import Generator

    model_max = cfg.max_position_embeddings - 1
    lengths = [len(_field(r, "prompt_ids")) for r in records]
    too_long = [(_field(r, "id"), length) for r, length in zip(records, lengths) if length > model_max]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) longer than the model maximum of {model_max} tokens "
                         f"(max_position_embeddings - 1), e.g. id {too_long[0][0]!r} with {too_long[0][1]} tokens")
    spec = for_prompts(lengths, max_new_tokens, cfg, max_concurrent=max_concurrent, samples_per_prompt=n,
                       page_size=page_size, num_pages=num_pages)
    engine = build_engine(spec, cfg, mesh, fields=fields or CLI_FLAGS)
    return Generator(engine, engine.place_params(params), tokenizer=tokenizer).start()
