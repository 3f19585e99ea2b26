"""Reward functions and workflows the loop tests select by import string (``loop_targets:...``)."""
from __future__ import annotations

import threading

from jaxrl_async.rollout.workflow import RLVRWorkflow

_lock = threading.Lock()
_calls = {"n": 0}


def has_digit(prompt: str, completion: str, answer: str, **metadata) -> float:
    """1 if the completion contains a digit (a random tiny policy gets ~0.3: a reward GRPO climbs fast)."""
    return float(any(ch.isdigit() for ch in completion))


def has_digit_slow(prompt: str, completion: str, answer: str, **metadata) -> float:
    """has_digit after 50 ms (a run that paces itself without burning CPU: the replica-restart test needs its
    steps to outlast a generator process's restart)."""
    import time

    time.sleep(0.05)
    return has_digit(prompt, completion, answer)


def has_digit_given_row(prompt: str, completion: str, answer: str, **metadata) -> float:
    """has_digit, but only when the row's metadata reached the reward (its ``source``: file and row), as the
    rollout and the evaluate CLI pass it; 0 without it."""
    return has_digit(prompt, completion, answer) if metadata.get("source") else 0.0


def has_digit_flaky(prompt: str, completion: str, answer: str, **metadata) -> float:
    """Like has_digit, but every 5th call raises (the loop must count it and go on)."""
    with _lock:
        _calls["n"] += 1
        n = _calls["n"]
    if n % 5 == 0:
        raise RuntimeError(f"reward exploded on call {n}")
    return has_digit(prompt, completion, answer)


class SometimesNoneWorkflow(RLVRWorkflow):
    """RLVR, but every 4th group is rejected by returning None for its episodes."""

    def __init__(self, reward_fn, tokenizer):
        super().__init__(reward_fn, tokenizer)
        self._n = 0
        self._lock = threading.Lock()

    def run_group(self, item, ctx, n):
        with self._lock:
            self._n += 1
            k = self._n
        if k % 4 == 0:
            return [None] * n
        return super().run_group(item, ctx, n)


async def two_turn_agent(client, row):
    """An ``openai_agent`` agent (``rollout.agent=loop_targets:two_turn_agent``): asks, then asks again with its
    answer in the history, through the run's endpoint with the plain ``openai`` SDK; the reward is has_digit of
    the second answer."""
    msgs = list(row["messages"])
    r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=12)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""}, {"role": "user", "content": "again"}]
    r2 = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=12)
    return has_digit("", r2.choices[0].message.content or "", "")
