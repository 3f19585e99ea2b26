"""The held-out evaluation during a run: greedy (``eval.temperature``) pass@1 on the held-out records with
the generator service's current weights."""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_async.api import GeneratorService

__all__ = ["evaluate_held_out"]


def evaluate_held_out(generator: GeneratorService, records: Sequence[Any], reward_fn: Callable, pool: cf.Executor,
                      version: int, *, cfg: Any, eos_ids: Sequence[int], tokenizer: Any,
                      stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The eval metrics row ({} when there are no records, or when ``stop()`` became true while waiting:
    the evaluation is abandoned)."""
    ev, sa = cfg.eval, cfg.rollout.sampling
    if not records:
        return {}
    t0 = time.monotonic()
    sp = sa.params(n=1, seed=cfg.seed, stop_token_ids=list(eos_ids), temperature=ev.temperature,
                   max_new_tokens=ev.max_new_tokens or sa.max_new_tokens)
    handles = [generator.submit(r.prompt_ids, sp, request_id=f"eval-v{version}-{i}") for i, r in enumerate(records)]
    timeout = cfg.rollout.group_timeout_s or 600.0
    lengths, versions, futures = [], set(), []
    for r, h in zip(records, handles):
        s = _first_sample(h, timeout, stop)
        if s is None:
            return {}
        text = s.text if s.text is not None else tokenizer.decode(s.completion_ids, skip_special_tokens=True)
        futures.append(pool.submit(reward_fn, r.prompt, text, r.answer))
        lengths.append(len(s.completion_ids))
        versions.update(s.versions)
    rewards = [f.result(timeout) for f in futures]
    return {"eval/accuracy": float(np.mean(np.asarray(rewards) > 0.5)), "eval/reward_mean": float(np.mean(rewards)),
            "eval/n": len(rewards), "eval/length_mean": float(np.mean(lengths)), "eval/seconds": time.monotonic() - t0,
            "eval/version_min": min(versions) if versions else version}


def _first_sample(handle: Any, timeout: float, stop: Callable[[], bool] | None) -> Any:
    """The request's first sample; None when ``stop()`` became true first; ``TimeoutError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return handle.result(min(1.0, max(deadline - time.monotonic(), 0.01))).samples[0]
        except TimeoutError:
            if stop is not None and stop():
                return None
            if time.monotonic() > deadline:
                raise
