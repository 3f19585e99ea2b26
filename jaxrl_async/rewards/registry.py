"""Reward functions by name or import string, with failure accounting.

Signature of every reward function (built-in or custom)::

    fn(prompt: str, completion: str, answer: str, **metadata) -> float

``metadata`` carries the remaining fields of the dataset row (e.g. ``tests`` for code).  A custom
function is named by an import string ``"package.module:function"`` (a dotted attribute path after
the colon is allowed, e.g. ``"pkg.mod:Class.method"``).

:class:`SafeReward` wraps any such function so that it can never take down the caller: an
exception, a non-numeric result, NaN or ±inf gives ``default`` (0.0) and is counted.  It cannot
interrupt a function that *hangs* (threads cannot be killed); for untrusted or possibly slow
functions use :class:`PooledReward`, which runs the import string in a killable
:class:`~.pool.WorkerPool` with a per-call timeout (arguments and result must be JSON-able).
"""
from __future__ import annotations

import importlib
import math
import threading
from typing import Any, Callable, Protocol

from jaxrl_async.rewards.pool import PoolConfig, WorkerPool

__all__ = [
    "RewardFn",
    "RewardLoadError",
    "load_reward_fn",
    "SafeReward",
    "PooledReward",
    "BUILTIN_REWARDS",
    "make_reward",
]


class RewardFn(Protocol):
    def __call__(self, prompt: str, completion: str, answer: str, **metadata: Any) -> float: ...


class RewardLoadError(ImportError):
    """A reward import string could not be resolved; the message names the string."""


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Resolve ``"module:attr[.attr...]"`` to a callable; errors name ``spec``."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise RewardLoadError(f"reward import string {spec!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardLoadError(f"reward {spec!r}: cannot import module {module_name!r}: "
                              f"{type(exc).__name__}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise RewardLoadError(f"reward {spec!r}: {module_name!r} has no attribute path {attr_path!r} "
                                  f"(missing {part!r})") from exc
    if not callable(obj):
        raise RewardLoadError(f"reward {spec!r} resolved to a non-callable {type(obj).__name__}")
    return obj


def _to_reward(value: Any) -> float:
    """float(value) if it is a finite real number (bool allowed), else raise TypeError/ValueError."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"reward function returned {type(value).__name__}, expected a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward function returned non-finite {out}")
    return out


class SafeReward:
    """``fn`` with accounting: never raises; failures give ``default`` and count in :meth:`stats`.

    Counters: ``calls``, ``errors`` (raised), ``invalid`` (non-numeric / non-finite result).
    ``last_error`` keeps the most recent message for logs.
    """

    def __init__(self, fn: Callable[..., Any] | str, name: str | None = None, default: float = 0.0):
        self.fn = load_reward_fn(fn) if isinstance(fn, str) else fn
        self.name = name or (fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn)))
        self.default = float(default)
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._counters = dict(calls=0, errors=0, invalid=0)

    def __call__(self, prompt: str, completion: str, answer: str, **metadata: Any) -> float:
        self._bump("calls")
        try:
            value = self.fn(prompt, completion, answer, **metadata)
        except Exception as exc:  # noqa: BLE001 - a reward must never kill the RL loop
            self._fail("errors", f"{self.name} raised {type(exc).__name__}: {exc}")
            return self.default
        try:
            return _to_reward(value)
        except (TypeError, ValueError) as exc:
            self._fail("invalid", f"{self.name}: {exc}")
            return self.default

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        close = getattr(self.fn, "close", None)
        if callable(close):
            close()

    def _bump(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _fail(self, counter: str, message: str) -> None:
        with self._lock:
            self._counters[counter] += 1
            self.last_error = message


class PooledReward:
    """Runs the reward import string ``spec`` in a killable worker pool with a per-call timeout.

    The import string is checked in the parent at construction (so a typo fails fast with the
    string in the message).  Counters: ``calls``, ``invalid`` plus the pool's ``timeouts``,
    ``errors``, ``worker_restarts``, ``failed_calls``.
    """

    def __init__(self, spec: str, pool: PoolConfig | None = None, default: float = 0.0):
        load_reward_fn(spec)
        self.spec = spec
        self.default = float(default)
        self._pool = WorkerPool(spec, pool or PoolConfig())
        self._invalid = 0
        self._lock = threading.Lock()

    def __call__(self, prompt: str, completion: str, answer: str, **metadata: Any) -> float:
        outcome = self._pool.call(prompt, completion, answer, **metadata)
        if not outcome.ok:
            return self.default
        try:
            return _to_reward(outcome.value)
        except (TypeError, ValueError):
            with self._lock:
                self._invalid += 1
            return self.default

    def stats(self) -> dict[str, int]:
        with self._lock:
            invalid = self._invalid
        return {**self._pool.stats(), "invalid": invalid}

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "PooledReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _math(**kw):
    from jaxrl_async.rewards.math_reward import MathReward, MathRewardConfig
    return MathReward(MathRewardConfig(**kw))


def _gsm8k(**kw):
    from jaxrl_async.rewards.math_reward import MathReward, MathRewardConfig
    kw.setdefault("extractors", ("gsm8k", "boxed", "last_number"))
    return MathReward(MathRewardConfig(**kw))


def _code(**kw):
    from jaxrl_async.rewards.code_reward import CodeReward, CodeRewardConfig
    return CodeReward(CodeRewardConfig(**kw))


BUILTIN_REWARDS: dict[str, Callable[..., RewardFn]] = {"math": _math, "gsm8k": _gsm8k, "code": _code}


def make_reward(spec: str, pool: PoolConfig | None = None, **kwargs: Any) -> SafeReward:
    """A :class:`SafeReward` for a built-in name (``math``, ``gsm8k``, ``code``; ``kwargs`` go to its
    config) or a custom ``"module:function"`` import string (``kwargs`` must then be empty; with
    ``pool`` the function runs in a killable :class:`PooledReward` instead of the calling thread)."""
    if spec in BUILTIN_REWARDS:
        return SafeReward(BUILTIN_REWARDS[spec](**kwargs), name=spec)
    if ":" not in spec:
        raise RewardLoadError(f"unknown reward {spec!r}: not one of {sorted(BUILTIN_REWARDS)} and not a "
                              "'module:function' import string")
    if kwargs:
        raise TypeError(f"make_reward({spec!r}): keyword arguments are only for built-in rewards, got {sorted(kwargs)}")
    return SafeReward(PooledReward(spec, pool), name=spec) if pool is not None else SafeReward(spec)
