"""Verified math reward: answer extraction + equivalence by ``math-verify`` in a killable pool.

Pipeline of :meth:`MathReward.score` for one (completion, gold answer):

1. **Format gate** (``MathRewardConfig.format``): ``"none"``; ``"single_boxed"`` (exactly one
   ``\\boxed{...}`` in the completion); ``"regex"`` (``re.search(format_regex, completion, re.DOTALL)``).
   A failed gate gives ``format_fail_reward`` without verification.
2. **Extraction** of the predicted answer: the ``extractors`` are tried in order, first hit wins:
   ``"boxed"`` (content of the last ``\\boxed{...}``/``\\fbox{...}``, nested braces and escaped
   ``\\{ \\}`` handled), ``"gsm8k"`` (number after the last ``#### ``), ``"last_number"`` (last number
   in the text).  No hit → ``incorrect_reward``.  The gold answer goes through ``gold_extractors``
   (default ``gsm8k``, ``boxed``, then ``raw`` = the whole stripped string), so a full GSM8K solution
   ``"... #### 72"`` and a bare ``"72"`` both work.
3. **Fast path** (in-process, no pool round trip): if both extracted strings are plain decimal
   numbers (optional sign, optional ``1,234`` thousands separators, optional fraction part; a
   leading ``$``/``\\$`` and a trailing ``.`` are stripped), they are equal iff
   ``round(pred, d) == round(gold, d)`` with ``d = float_rounding`` (exact decimal arithmetic,
   half-even), which is the same rounding rule math-verify applies to numbers.  This is the whole
   of GSM8K and most of the numeric answers of MATH/AIME.
4. **Pool path**: otherwise both strings are wrapped as ``\\boxed{...}`` and compared by
   ``math_verify.verify(parse(gold), parse(pred))`` inside a :class:`~.pool.WorkerPool` worker
   (main thread there, so math-verify's own ``signal.alarm`` timeouts work; the pool adds a hard
   per-call kill deadline + retries).  Any error or timeout → ``incorrect_reward`` (counted).

Thread-safe: call :meth:`MathReward.__call__` from any number of threads.  The pool starts lazily
on the first non-numeric comparison and stops on :meth:`close` / context exit / interpreter exit.
"""
from __future__ import annotations

import dataclasses
import re
import threading
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Any, Literal, Sequence

from jaxrl_async.rewards.pool import PoolConfig, WorkerPool

__all__ = [
    "MathRewardConfig",
    "MathScore",
    "MathReward",
    "extract_last_boxed",
    "count_boxed",
    "extract_gsm8k",
    "extract_last_number",
    "extract_answer",
    "parse_plain_number",
    "numbers_equal",
    "verify_with_math_verify",
]

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K_RE = re.compile(r"####\s*(\$?\s*[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+))")
_NUMBER_RE = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


# --------------------------------------------------------------------------------------- extraction
def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of every balanced ``\\boxed{...}`` / ``\\fbox{...}``."""
    spans, pos = [], 0
    while (m := _BOXED_RE.search(text, pos)) is not None:
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\":
                i += 2  # escaped char such as \{ or \} does not count as a brace
                continue
            depth += (c == "{") - (c == "}")
            i += 1
        if depth:  # unbalanced: no more complete boxes
            break
        spans.append((m.end(), i - 1))
        pos = i
    return spans


def extract_last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (nested braces kept), stripped; else ``None``."""
    spans = _boxed_spans(text)
    return text[spans[-1][0]:spans[-1][1]].strip() if spans else None


def count_boxed(text: str) -> int:
    """Number of balanced ``\\boxed{...}`` / ``\\fbox{...}`` (top level and nested alike)."""
    return len(_boxed_spans(text))


def extract_gsm8k(text: str) -> str | None:
    """The number after the last ``####`` (GSM8K answer format), e.g. ``"#### 1,234"`` → ``"1,234"``."""
    matches = _GSM8K_RE.findall(text)
    return matches[-1].strip() if matches else None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (``-3``, ``1,234.5``, ``.5``); trailing sentence period excluded."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].rstrip(",") if matches else None


_EXTRACTORS = {
    "boxed": extract_last_boxed,
    "gsm8k": extract_gsm8k,
    "last_number": extract_last_number,
    "raw": lambda text: text.strip() or None,
}


def extract_answer(text: str, extractors: Sequence[str]) -> str | None:
    """First non-empty result of ``extractors`` (names from ``boxed, gsm8k, last_number, raw``)."""
    for name in extractors:
        got = _EXTRACTORS[name](text)
        if got:
            return got
    return None


# --------------------------------------------------------------------------------------- numeric fast path
def parse_plain_number(s: str) -> Decimal | None:
    """``Decimal`` if ``s`` is a plain decimal number (see module docstring, step 3), else ``None``."""
    t = s.strip()
    for prefix in ("\\$", "$"):
        if t.startswith(prefix):
            t = t[len(prefix):].strip()
            break
    if t.endswith(".") and not t.endswith(".."):
        t = t[:-1]
    if not _PLAIN_NUMBER_RE.fullmatch(t):
        return None
    try:
        return Decimal(t.replace(",", ""))
    except InvalidOperation:
        return None


def numbers_equal(a: Decimal, b: Decimal, float_rounding: int) -> bool:
    """``round(a, d) == round(b, d)``, exact decimal half-even rounding, ``d = float_rounding``."""
    q = Decimal(1).scaleb(-float_rounding)
    return a.quantize(q, rounding=ROUND_HALF_EVEN) == b.quantize(q, rounding=ROUND_HALF_EVEN)


# --------------------------------------------------------------------------------------- pool target
def verify_with_math_verify(pred: str, gold: str, float_rounding: int = 6, inner_timeout_s: int = 1) -> bool:
    """math-verify equivalence of two extracted answers (runs inside a pool worker's main thread).

    Both strings are wrapped as ``\\boxed{...}`` and parsed with LaTeX + plain-expression extraction;
    ``verify(gold, pred)`` (argument order matters in math-verify: gold first).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_parsed = parse(f"\\boxed{{{gold}}}", cfg, parsing_timeout=inner_timeout_s)
    pred_parsed = parse(f"\\boxed{{{pred}}}", cfg, parsing_timeout=inner_timeout_s)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, float_rounding=float_rounding, timeout_seconds=inner_timeout_s))


# --------------------------------------------------------------------------------------- reward
@dataclasses.dataclass(frozen=True)
class MathRewardConfig:
    """Attributes:
      extractors: predicted-answer extractors, tried in order.
      gold_extractors: gold-answer extractors, tried in order.
      format: format gate (``"none"``, ``"single_boxed"``, ``"regex"``).
      format_regex: pattern for ``format="regex"`` (``re.search``, ``re.DOTALL``).
      correct_reward / incorrect_reward / format_fail_reward: reward values.
      float_rounding: decimals compared for numbers (fast path and math-verify).
      pool: worker-pool settings of the math-verify path (timeout, retries, workers).
      verify_target: ``"module:function"`` run in the pool as ``fn(pred, gold, float_rounding,
        inner_timeout_s) -> bool`` (default: :func:`verify_with_math_verify`).
    """

    extractors: tuple[str, ...] = ("boxed", "gsm8k", "last_number")
    gold_extractors: tuple[str, ...] = ("gsm8k", "boxed", "raw")
    format: Literal["none", "single_boxed", "regex"] = "none"
    format_regex: str | None = None
    correct_reward: float = 1.0
    incorrect_reward: float = 0.0
    format_fail_reward: float = 0.0
    float_rounding: int = 6
    pool: PoolConfig = dataclasses.field(
        default_factory=lambda: PoolConfig(num_workers=2, timeout_s=5.0, retries=1, preload=("math_verify",)))
    verify_target: str = "jaxrl_async.rewards.math_reward:verify_with_math_verify"

    def __post_init__(self):
        for field in ("extractors", "gold_extractors"):
            names = getattr(self, field)
            bad = [n for n in names if n not in _EXTRACTORS]
            if bad or not names:
                raise ValueError(f"MathRewardConfig.{field}: unknown or empty extractors {bad or names!r}; "
                                 f"choose from {sorted(_EXTRACTORS)}")
        if self.format not in ("none", "single_boxed", "regex"):
            raise ValueError(f"MathRewardConfig.format must be none|single_boxed|regex, got {self.format!r}")
        if self.format == "regex":
            if not self.format_regex:
                raise ValueError("MathRewardConfig.format='regex' needs format_regex")
            re.compile(self.format_regex)


@dataclasses.dataclass(frozen=True)
class MathScore:
    """``path``: ``"format"`` (gate failed), ``"no_answer"``, ``"fast"``, ``"pool"``, ``"failed"``
    (pool error/timeout)."""

    reward: float
    correct: bool
    path: str
    predicted: str | None = None
    gold: str | None = None
    error: str | None = None


class MathReward:
    """``reward = MathReward(cfg); r = reward(prompt, completion, answer)`` (see module docstring)."""

    def __init__(self, config: MathRewardConfig | None = None):
        self.config = config or MathRewardConfig()
        self._regex = re.compile(self.config.format_regex, re.DOTALL) if self.config.format == "regex" else None
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()
        self._counters = dict(calls=0, fast_path=0, pool_path=0, no_answer=0, format_failures=0, failures=0)

    def __call__(self, prompt: str, completion: str, answer: str, **metadata: Any) -> float:
        try:
            return self.score(completion, answer).reward
        except Exception:  # noqa: BLE001 - e.g. a non-string completion; never kill the RL loop
            self._bump("failures")
            return self.config.incorrect_reward

    def score(self, completion: str, answer: str) -> MathScore:
        cfg = self.config
        self._bump("calls")
        if not self._format_ok(completion):
            self._bump("format_failures")
            return MathScore(cfg.format_fail_reward, False, "format")
        pred = extract_answer(completion, cfg.extractors)
        gold = None if answer is None else extract_answer(str(answer), cfg.gold_extractors)
        if pred is None or gold is None:
            self._bump("no_answer")
            return MathScore(cfg.incorrect_reward, False, "no_answer", pred, gold)
        pred_num, gold_num = parse_plain_number(pred), parse_plain_number(gold)
        if pred_num is not None and gold_num is not None:
            self._bump("fast_path")
            ok = numbers_equal(pred_num, gold_num, cfg.float_rounding)
            return MathScore(cfg.correct_reward if ok else cfg.incorrect_reward, ok, "fast", pred, gold)
        self._bump("pool_path")
        inner = max(1, int(cfg.pool.timeout_s // 3))
        outcome = self._get_pool().call(pred, gold, cfg.float_rounding, inner)
        if not outcome.ok:
            self._bump("failures")
            return MathScore(cfg.incorrect_reward, False, "failed", pred, gold, outcome.error)
        ok = bool(outcome.value)
        return MathScore(cfg.correct_reward if ok else cfg.incorrect_reward, ok, "pool", pred, gold)

    def stats(self) -> dict[str, int]:
        """Counters: ``calls``, ``fast_path``, ``pool_path``, ``no_answer``, ``format_failures``,
        ``failures`` (pool path gave no verdict → incorrect_reward), and from the pool ``timeouts``,
        ``errors``, ``worker_restarts`` (see :mod:`.pool`)."""
        with self._lock:
            out = dict(self._counters)
            pool = self._pool
        pool_stats = pool.stats() if pool is not None else dict(calls=0, timeouts=0, errors=0, worker_restarts=0,
                                                                failed_calls=0)
        out.update(timeouts=pool_stats["timeouts"], errors=pool_stats["errors"],
                   worker_restarts=pool_stats["worker_restarts"])
        return out

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __enter__(self) -> "MathReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _format_ok(self, completion: str) -> bool:
        if self.config.format == "single_boxed":
            return count_boxed(completion) == 1
        if self._regex is not None:
            return self._regex.search(completion) is not None
        return True

    def _get_pool(self) -> WorkerPool:
        with self._lock:
            if self._pool is None:
                self._pool = WorkerPool(self.config.verify_target, self.config.pool)
            return self._pool

    def _bump(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1
