"""The held-out evaluation during a run: the ``evaluate`` CLI's own path (``rollout.evaluation.evaluate_params``) on the
generator service's current weights, n = 1 sample per record at ``eval.temperature`` (greedy by default),
rewards with each record's metadata, as the rollout and the CLI call them. Its settings are the run's recipe
(``data.recipe.run_recipe``), which the run's exports record: ``python -m jaxrl_async.evaluate --model RUN/hf`` (the
same function) renders the same prompts, stops and scores the same way, and with the recipe's ``--n 1
--temperature`` and seed agrees with the in-run accuracy on the same checkpoint and data
(``tests/loop/test_eval_path.py``)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from jaxrl_async.api import GeneratorService

__all__ = ["evaluate_held_out"]


def evaluate_held_out(generator: GeneratorService, records: Sequence[Any], reward_fn: Callable, version: int, *,
                      cfg: Any, eos_ids: Sequence[int], tokenizer: Any,
                      stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The eval metrics row ({} when there are no records, or when ``stop()`` became true while waiting:
    the evaluation is abandoned)."""
    from jaxrl_async.data.recipe import run_recipe
    from jaxrl_async.rollout.evaluation import evaluate_params

    ro = cfg.rollout
    if not records:
        return {}
    rc = run_recipe(cfg)  # the settings a run's export records for `evaluate` (data/recipe.py)
    # each wave of at most max_concurrent_decodes requests is bounded by the group timeout
    waves = math.ceil(len(records) / max(ro.engine.max_concurrent_decodes, 1))
    res = evaluate_params(None, None, tokenizer, records, reward_fn, n=rc.n, temperature=rc.temperature,
                          max_new_tokens=rc.max_new_tokens, seed=rc.seed, generator=generator, top_p=rc.top_p,
                          top_k=rc.top_k, stop_token_ids=list(eos_ids), reward_workers=ro.reward_workers,
                          timeout_s=(ro.group_timeout_s or 600.0) * waves, should_stop=stop,
                          stop_strings=rc.stop_strings)
    if res is None:
        return {}
    s = res.summary()
    return {"eval/accuracy": res.pass_at_1, "eval/reward_mean": s["mean_reward"], "eval/n": len(res.items),
            "eval/length_mean": s["mean_completion_tokens"],
            "eval/seconds": res.elapsed_s, "eval/version_min": res.versions[0] if res.versions else version}
