"""Rollout workflows: how an episode is run against the generator, grouped and fed to the trainer.

Writing your own workflow
=========================

Subclass :class:`RolloutWorkflow` in one file and implement ONE method, ``run_episode``. It runs a
single episode for one data item and returns a :class:`Trajectory` (or None to reject the item's
group). It runs in a worker thread, so it may block; ``ctx.generate`` submits to the shared
generator and waits (with the configured timeout), ``ctx.reward`` runs a function in the reward
thread pool (off the generator's decode thread). Example, a two-turn "answer, then double-check"
episode::

    # my_project/check_twice.py
    from jaxrl_async.rollout.workflow import EpisodeContext, RolloutWorkflow, Trajectory

    class CheckTwice(RolloutWorkflow):
        def __init__(self, tokenizer, reward_fn):
            self.tok, self.reward_fn = tokenizer, reward_fn

        def run_episode(self, item, ctx: EpisodeContext) -> Trajectory | None:
            first = ctx.generate(item.prompt_ids)[0]                 # one SampleOutput
            follow_up = self.tok.encode("\\nAre you sure? Answer again.\\n")
            second = ctx.generate(item.prompt_ids + first.completion_ids + follow_up)[0]
            text = self.tok.decode(second.completion_ids, skip_special_tokens=True)
            reward = ctx.reward(self.reward_fn, item.prompt, text, item.answer)
            return Trajectory.from_turns(item.prompt_ids, [first, (follow_up, False), second], reward)

and select it with ``rollout.workflow=my_project.check_twice:CheckTwice`` (the loop passes the
tokenizer and the reward function when the constructor takes them). Group sampling (n episodes per
prompt, run concurrently) comes for free from :meth:`RolloutWorkflow.run_group`; override
``run_group`` only to batch the n samples into one request, as :class:`RLVRWorkflow` does (one
prefill shared by the n samples).

Failure handling: an episode that raises, times out or returns None rejects its group with a
reason (``error:<Type>``, ``timeout``, ``episode_none``); the :class:`RolloutDispatcher` counts it,
gives the group's staleness budget back and keeps going. Only a broken generator or too many
consecutive failures are fatal (``RolloutDispatcher.fatal_error``).

Token conventions of a :class:`Trajectory` (all arrays of length T = prompt + completion):
``logprobs[t] = log π_behav(tokens[t] | tokens[:t])`` for generated tokens and 0 elsewhere,
``versions[t]`` = policy version that generated ``tokens[t]`` and −1 elsewhere, ``loss_mask[t] = 1``
on generated tokens that are trained on. The one-position shift to next-token prediction
(AReaL's roll of the loss mask) is the trainer's job.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures as cf
import dataclasses
import hashlib
import importlib
import itertools
import logging
import math
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.generator.requests import GeneratorClosedError
from jaxrl_async.rollout.staleness import StalenessManager, StalenessViolation, Ticket

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Generator protocol (implemented by generator.orchestrator.Generator)
# ---------------------------------------------------------------------------------------------
class _Handle(Protocol):
    def result(self, timeout: float | None = None) -> Any: ...

    def abort(self) -> None: ...


class GeneratorLike(Protocol):
    """What workflows need from the generator: ``submit`` → handle with ``result(timeout)``/``abort()``.

    ``result()`` returns an object with ``samples``: a list of objects with ``prompt_ids``,
    ``completion_ids``, ``logprobs``, ``versions``, ``finish_reason`` and optionally ``text``
    (``orchestrator.RequestOutput`` / ``SampleOutput``).
    """

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
               request_id: str | None = None, metadata: Any = None, *, images: Any = None) -> _Handle: ...


class EpisodeTimeout(TimeoutError):
    """A generation request of an episode did not finish within the group timeout."""


class GroupRejected(Exception):
    """Raised inside a group run to reject the group with ``reason``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers (stable across processes; distinct inputs ⇒ independent seeds)."""
    h = hashlib.blake2b(b",".join(str(int(p)).encode() for p in parts), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFFFFFF


def item_field(item: Any, name: str, default: Any = None) -> Any:
    """``item.name`` for records/dataclasses, ``item[name]`` for mappings."""
    if isinstance(item, Mapping):
        return item.get(name, default)
    return getattr(item, name, default)


def item_images(item: Any) -> Any:
    """The prompt images of a data item (``data.images.ImageInputs``: a ``VLPromptRecord``'s, shared by every
    sample and request of the item), or None for a text item."""
    get = getattr(item, "image_inputs", None)
    if callable(get):
        return get()
    return item_field(item, "image_inputs")


# ---------------------------------------------------------------------------------------------
# Trajectories
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Trajectory:
    """One episode, token-aligned (see the module docstring for the conventions).

    Attributes:
      tokens: int32 [T], prompt then everything after it (completions, tool outputs, ...).
      loss_mask: int32 [T], 1 on generated tokens that are trained on (0 on the first prompt_len).
      logprobs: float32 [T], behaviour log-probs of generated tokens, 0 elsewhere.
      versions: int32 [T], generating policy version, −1 on tokens the policy did not generate.
      reward: scalar episode reward.
      prompt_len: length of the initial prompt.
      metadata: free-form (``finish_reason``, ``sample_index``, timings, ...).
      routing: optional int16 [T, L, k], the experts the generator routed each token to in each MoE layer
        (``rollout.record_routing``), -1 where not recorded; used by rollout routing replay.
      images: the prompt's images (``data.images.ImageInputs``: encoded files + grids, one object shared by the
        samples of a prompt; pickles carry the bytes, never pixels), or None for a text prompt. Its placeholder
        tokens must lie in the prompt; the trainer checks their count against the grids (naming the trajectory).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    prompt_len: int
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    routing: np.ndarray | None = None
    images: Any = None

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int32).reshape(-1)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.int32).reshape(-1)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32).reshape(-1)
        self.versions = np.asarray(self.versions, dtype=np.int32).reshape(-1)
        T = self.tokens.shape[0]
        for name in ("loss_mask", "logprobs", "versions"):
            if getattr(self, name).shape[0] != T:
                raise ValueError(f"Trajectory.{name} has length {getattr(self, name).shape[0]}, tokens has {T}")
        if not 0 < self.prompt_len <= T:
            raise ValueError(f"Trajectory.prompt_len must be in [1, {T}], got {self.prompt_len}")
        if not np.isin(self.loss_mask, (0, 1)).all():
            raise ValueError("Trajectory.loss_mask must be 0/1")
        if self.loss_mask[: self.prompt_len].any():
            raise ValueError("Trajectory.loss_mask must be 0 on the prompt")
        if (self.versions[: self.prompt_len] != -1).any():
            raise ValueError("Trajectory.versions must be -1 on the prompt")
        if (self.versions[self.loss_mask == 1] < 0).any():
            raise ValueError("Trajectory.versions must be >= 0 on trained (loss_mask = 1) tokens")
        if self.routing is not None:
            self.routing = np.asarray(self.routing, dtype=np.int16)
            if self.routing.ndim != 3 or self.routing.shape[0] != T:
                raise ValueError(f"Trajectory.routing must be [T={T}, layers, k], got shape {self.routing.shape}")
        self.reward = float(self.reward)
        if not math.isfinite(self.reward):
            raise ValueError(f"Trajectory.reward must be finite, got {self.reward}")
        if self.images is not None:
            if not (hasattr(self.images, "grid_thw") and hasattr(self.images, "num_tokens")):
                raise ValueError(f"Trajectory.images must be a data.images.ImageInputs or None, got "
                                 f"{type(self.images).__name__}")
            if self.images.num_tokens > self.prompt_len:
                raise ValueError(f"Trajectory.images: {len(self.images)} images of {self.images.num_tokens} "
                                 f"placeholder tokens do not fit the {self.prompt_len}-token prompt")

    @classmethod
    def from_completion(cls, prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float],
                        versions: Sequence[int], reward: float, finish_reason: str, *, routing: Any = None,
                        images: Any = None, **metadata: Any) -> "Trajectory":
        """Single-turn episode: prompt (mask 0, version −1, logprob 0) + completion (mask 1); ``routing``: the
        sample's recorded experts over prompt + completion (``SampleOutput.routing``), or None; ``images``: the
        prompt's ``ImageInputs`` (or None)."""
        P, C = len(prompt_ids), len(completion_ids)
        if len(logprobs) != C or len(versions) != C:
            raise ValueError(f"completion has {C} tokens but {len(logprobs)} logprobs and {len(versions)} versions")
        return cls(tokens=np.concatenate([np.asarray(prompt_ids, np.int32), np.asarray(completion_ids, np.int32)]),
                   loss_mask=np.concatenate([np.zeros(P, np.int32), np.ones(C, np.int32)]),
                   logprobs=np.concatenate([np.zeros(P, np.float32), np.asarray(logprobs, np.float32)]),
                   versions=np.concatenate([np.full(P, -1, np.int32), np.asarray(versions, np.int32)]),
                   reward=reward, prompt_len=P, metadata={"finish_reason": finish_reason, **metadata}, routing=routing,
                   images=images)

    @classmethod
    def from_turns(cls, prompt_ids: Sequence[int], turns: Sequence[Any], reward: float, *, images: Any = None,
                   **metadata: Any) -> "Trajectory":
        """Multi-turn episode: ``turns`` are generator samples (trained) or ``(token_ids, trained=False)``
        pairs for inserted text (tool outputs, user turns). Each sample's ``prompt_ids`` must extend the
        tokens so far (token-in, token-out: no re-tokenisation drift). Recorded routing (``SampleOutput.routing``)
        is merged over the turns, the last turn that routed a position winning (``assemble_routing``).
        ``images``: the first prompt's ``ImageInputs`` (or None)."""
        tokens, mask, lps, vers = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids), [-1] * len(prompt_ids)
        finish = None
        routed = []
        for i, turn in enumerate(turns):
            if isinstance(turn, tuple):
                ids, trained = turn
                if trained:
                    raise ValueError(f"turn {i}: inserted tokens cannot be trained (no behaviour log-probs)")
                tokens += list(ids)
                mask += [0] * len(ids)
                lps += [0.0] * len(ids)
                vers += [-1] * len(ids)
                continue
            if list(turn.prompt_ids) != tokens:
                raise ValueError(f"turn {i}: the sample's prompt_ids do not equal the tokens so far "
                                 f"({len(turn.prompt_ids)} vs {len(tokens)} tokens)")
            c = list(turn.completion_ids)
            tokens += c
            mask += [1] * len(c)
            lps += list(turn.logprobs)
            vers += list(turn.versions)
            finish = turn.finish_reason
            if getattr(turn, "routing", None) is not None:
                routed.append((0, turn.routing))
        from jaxrl_async.generator.requests import assemble_routing

        return cls(tokens=np.asarray(tokens), loss_mask=np.asarray(mask), logprobs=np.asarray(lps),
                   versions=np.asarray(vers), reward=reward, prompt_len=len(prompt_ids),
                   metadata={"finish_reason": finish, "num_turns": len(turns), **metadata},
                   routing=assemble_routing(routed, len(tokens)), images=images)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def prompt_ids(self) -> np.ndarray:
        return self.tokens[: self.prompt_len]

    @property
    def completion_ids(self) -> np.ndarray:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def head_version(self) -> int | None:
        """Version of the first generated token (None if nothing was generated)."""
        gen = np.flatnonzero(self.versions >= 0)
        return int(self.versions[gen[0]]) if gen.size else None

    @property
    def finish_reason(self) -> str | None:
        return self.metadata.get("finish_reason")


@dataclasses.dataclass
class TrajectoryGroup:
    """The n trajectories of one prompt (a GRPO group), in sample order."""

    item: Any
    trajectories: list[Trajectory]
    group_id: int = -1
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def rewards(self) -> np.ndarray:
        return np.asarray([t.reward for t in self.trajectories], np.float32)

    @property
    def head_version(self) -> int | None:
        """min over samples of the first generated token's version (the group's head version)."""
        heads = [h for h in (t.head_version for t in self.trajectories) if h is not None]
        return min(heads) if heads else None


# ---------------------------------------------------------------------------------------------
# Episode context
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class EpisodeContext:
    """Everything an episode needs: the generator, default sampling, pools, seeds and limits."""

    generator: GeneratorLike
    sampling: SamplingParams
    reward_executor: cf.Executor
    episode_executor: cf.Executor | None = None
    group_id: int = 0
    sample_index: int = 0
    timeout_s: float | None = None  # per generate call
    reward_timeout_s: float | None = None
    deadline: float | None = None  # time.monotonic() by which the group must finish
    tokenizer: Any = None
    _requests: Iterator[int] = dataclasses.field(default_factory=itertools.count, repr=False)

    def for_sample(self, index: int) -> "EpisodeContext":
        """Context of sample ``index`` of the group: own seed, n = 1."""
        return dataclasses.replace(self, sample_index=index, _requests=itertools.count(),
                                   sampling=dataclasses.replace(self.sampling, n=1,
                                                                seed=derive_seed(self.sampling.seed, index)))

    def _remaining(self) -> float | None:
        t = self.timeout_s
        if self.deadline is not None:
            left = max(self.deadline - time.monotonic(), 0.0)
            t = left if t is None else min(t, left)
        return t

    def generate(self, prompt_ids: Sequence[int], n: int | None = None, *, images: Any = None,
                 **overrides: Any) -> list[Any]:
        """Submit one request (``n`` samples, sampling fields overridden by ``overrides``; ``images``: the
        prompt's ``ImageInputs`` for a vision-language policy) and wait.

        Returns the samples (``orchestrator.SampleOutput``) in sample order. On timeout the request
        is aborted and EpisodeTimeout raised.
        """
        sampling = dataclasses.replace(self.sampling, n=n or self.sampling.n, **overrides)
        rid = f"g{self.group_id}-s{self.sample_index}-r{next(self._requests)}"
        kw = {} if images is None else {"images": images}
        handle = self.generator.submit(list(prompt_ids), sampling, request_id=rid, **kw)
        timeout = self._remaining()
        try:
            out = handle.result(timeout)
        except TimeoutError:
            handle.abort()
            raise EpisodeTimeout(f"request {rid} not finished within {timeout:.1f} s") from None
        return list(out.samples)

    def reward(self, fn: Callable[..., float], *args: Any, **kwargs: Any) -> float:
        """Run ``fn(*args, **kwargs)`` in the reward thread pool and wait for it."""
        return self.reward_executor.submit(fn, *args, **kwargs).result(self.reward_timeout_s)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("EpisodeContext.decode needs a tokenizer")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# Workflows
# ---------------------------------------------------------------------------------------------
class RolloutWorkflow(abc.ABC):
    """Base class of all workflows: implement :meth:`run_episode` (see the module docstring)."""

    @abc.abstractmethod
    def run_episode(self, item: Any, ctx: EpisodeContext) -> Trajectory | list[Trajectory] | None:
        """Run one episode for ``item``; return its Trajectory (or, for an episode that trains on several samples,
        a non-empty list of them: all go into the group), or None to reject the group."""

    def run_group(self, item: Any, ctx: EpisodeContext, n: int) -> list[Trajectory | None]:
        """n episodes of ``item``, run concurrently on ``ctx.episode_executor`` (sample i gets
        ``ctx.for_sample(i)``: its own seed). All episodes are waited for (none outlives its group);
        then the first exception, if any, propagates."""
        if n == 1 or ctx.episode_executor is None:
            return [self.run_episode(item, ctx.for_sample(i)) for i in range(n)]
        futures = [ctx.episode_executor.submit(self.run_episode, item, ctx.for_sample(i)) for i in range(n)]
        cf.wait(futures)
        return [f.result() for f in futures]


class RLVRWorkflow(RolloutWorkflow):
    """Single-turn RL with verifiable rewards: prompt → completion → ``reward_fn``.

    The n samples of a group are one generator request (one prefill shared by n slots). Rewards
    ``reward_fn(prompt, completion, answer, **metadata)`` (the ``rewards`` package signature) run in
    the reward thread pool, all n samples concurrently.

    Args:
      reward_fn: the reward function (wrap untrusted ones in ``rewards.SafeReward``/``PooledReward``).
      tokenizer: decodes completions when the generator has no tokenizer (``SampleOutput.text`` is None).
    """

    def __init__(self, reward_fn: Callable[..., float], tokenizer: Any = None):
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer

    def run_episode(self, item: Any, ctx: EpisodeContext) -> Trajectory | None:
        return self.run_group(item, ctx, 1)[0]

    def run_group(self, item: Any, ctx: EpisodeContext, n: int) -> list[Trajectory | None]:
        prompt_ids = item_field(item, "prompt_ids")
        if not prompt_ids:
            raise ValueError(f"data item {item_field(item, 'id')!r} has no prompt_ids")
        images = item_images(item)
        samples = ctx.generate(prompt_ids, n=n, images=images)
        texts = [self._text(s, ctx) for s in samples]
        prompt, answer = item_field(item, "prompt", ""), item_field(item, "answer")
        meta = {k: v for k, v in (item_field(item, "metadata") or {}).items()
                if k not in ("prompt", "completion", "answer")}
        t0 = time.monotonic()
        futures = [ctx.reward_executor.submit(self.reward_fn, prompt, text, answer, **meta) for text in texts]
        rewards = [f.result(ctx.reward_timeout_s) for f in futures]
        reward_s = time.monotonic() - t0
        out = []
        for s, text, r in zip(samples, texts, rewards):
            out.append(Trajectory.from_completion(
                s.prompt_ids, s.completion_ids, s.logprobs, s.versions, r, s.finish_reason,
                routing=getattr(s, "routing", None), images=images,
                sample_index=s.sample_index, item_id=item_field(item, "id"), completion_text=text,
                latency_s=getattr(s, "latency_s", None), num_preemptions=getattr(s, "num_preemptions", 0),
                reward_s=reward_s))
        return out

    def _text(self, sample: Any, ctx: EpisodeContext) -> str:
        text = getattr(sample, "text", None)
        if text is not None:
            return text
        tok = self.tokenizer if self.tokenizer is not None else ctx.tokenizer
        if tok is None:
            raise ValueError("RLVRWorkflow needs a tokenizer (generator without tokenizer returns no text)")
        return tok.decode(list(sample.completion_ids), skip_special_tokens=True)


def _is_episode_result(r: Any) -> bool:
    """An episode's result: one Trajectory, or a non-empty list of them (an episode that trains on several
    samples, e.g. one per agent turn)."""
    if isinstance(r, Trajectory):
        return True
    return isinstance(r, list) and bool(r) and all(isinstance(t, Trajectory) for t in r)


class GroupSampler:
    """Runs one group (n samples of one item) and validates it into a :class:`TrajectoryGroup`.

    Raises :class:`GroupRejected` with reason ``episode_none`` (a sample returned None and
    ``allow_partial`` is False, or all did), ``invalid_trajectory``, ``wrong_group_size``,
    ``timeout`` or ``error:<ExceptionType>``, and ``filtered`` when ``should_accept(group)`` is False.
    """

    def __init__(self, workflow: RolloutWorkflow, n_samples: int, *, allow_partial: bool = False,
                 should_accept: Callable[[TrajectoryGroup], bool] | None = None):
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        self.workflow, self.n_samples = workflow, n_samples
        self.allow_partial, self.should_accept = allow_partial, should_accept

    def run(self, item: Any, ctx: EpisodeContext) -> TrajectoryGroup:
        try:
            results = self.workflow.run_group(item, ctx, self.n_samples)
        except GroupRejected:
            raise
        except (EpisodeTimeout, cf.TimeoutError) as e:
            raise GroupRejected("timeout", str(e)) from e
        except Exception as e:  # noqa: BLE001 - a workflow must never kill the loop
            raise GroupRejected(f"error:{type(e).__name__}", str(e)) from e
        if len(results) != self.n_samples:
            raise GroupRejected("wrong_group_size", f"run_group returned {len(results)} results, expected {self.n_samples}")
        bad = [type(r).__name__ for r in results if r is not None and not _is_episode_result(r)]
        if bad:
            raise GroupRejected("invalid_trajectory",
                                f"workflow returned {bad[0]} instead of Trajectory, a non-empty list of them, or None")
        episodes = [r for r in results if r is not None]
        if not episodes or (len(episodes) < len(results) and not self.allow_partial):
            raise GroupRejected("episode_none", f"{len(results) - len(episodes)} of {len(results)} episodes returned None")
        kept = [t for r in episodes for t in (r if isinstance(r, list) else [r])]
        meta = {"dropped_episodes": len(results) - len(episodes)}
        if len(kept) != len(episodes):
            meta["episodes"] = len(episodes)  # episodes gave several samples each (e.g. one per agent turn)
        group = TrajectoryGroup(item, kept, ctx.group_id, meta)
        if self.should_accept is not None and not self.should_accept(group):
            raise GroupRejected("filtered")
        return group


# ---------------------------------------------------------------------------------------------
# Producer: admission → data → group run → accept / reject
# ---------------------------------------------------------------------------------------------
class RolloutDispatcher:
    """The producer side of the asynchronous loop (AReaL's ``BatchTaskDispatcher``).

    A commit thread repeatedly takes a ticket from the :class:`StalenessManager` (blocking while
    capacity ≤ 0), draws the next data item and runs its group on a worker pool; the group is then
    accepted (with its head version) or rejected with a reason. Every admitted group therefore ends
    accepted or rejected — none is lost.

    Fatal conditions (``fatal_error``, the trainer checks it while waiting for a batch): a
    ``StalenessViolation`` (broken version protocol), a generator error reported by
    ``generator.error``, or ``max_consecutive_failures`` failed groups in a row.

    Args:
      workflow / generator / staleness: the parts.
      data: iterator of items (e.g. ``data.PromptIterator``); exhaustion stops admission.
      n_samples: samples per prompt (group size).
      sampling: default SamplingParams (``n`` and ``seed`` are set per group).
      should_accept: optional group filter (dynamic sampling); rejected groups count as ``filtered``.
      seed: base seed; group g samples with ``derive_seed(seed, g)``.
      group_timeout_s: wall-clock cap per group (its requests are aborted, reason ``timeout``).
      max_workers: concurrent groups (default: staleness.max_concurrent).
      reward_workers: reward thread-pool size.
      group_seed: ``f(ticket, item) -> seed`` of a group's sampling (default ``derive_seed(seed, ticket.id)``);
        the RL loop seeds by the item's draw index so a resumed run samples what the original would have.
      on_draw / on_reject: ``f(ticket, item)`` after an item is drawn for a ticket, ``f(ticket, item, reason)``
        when its group is rejected (the loop's data ledger: every drawn item is consumed, rejected or
        outstanding).
    """

    def __init__(self, workflow: RolloutWorkflow, generator: GeneratorLike, staleness: StalenessManager,
                 data: Iterator[Any], *, n_samples: int, sampling: SamplingParams = SamplingParams(),  # noqa: B008 (a frozen dataclass)
                 should_accept: Callable[[TrajectoryGroup], bool] | None = None, allow_partial_groups: bool = False,
                 seed: int = 0, group_timeout_s: float | None = None, reward_timeout_s: float | None = None,
                 max_workers: int | None = None, reward_workers: int = 4, max_consecutive_failures: int = 100,
                 tokenizer: Any = None, poll_s: float = 0.05,
                 group_seed: Callable[[Ticket, Any], int] | None = None,
                 on_draw: Callable[[Ticket, Any], None] | None = None,
                 on_reject: Callable[[Ticket, Any, str], None] | None = None):
        self.group_seed, self.on_draw, self.on_reject = group_seed, on_draw, on_reject
        self.sampler = GroupSampler(workflow, n_samples, allow_partial=allow_partial_groups, should_accept=should_accept)
        self.generator, self.staleness, self.data = generator, staleness, data
        self.sampling, self.seed = sampling, seed
        self.group_timeout_s, self.reward_timeout_s = group_timeout_s, reward_timeout_s
        self.max_consecutive_failures, self.tokenizer, self.poll_s = max_consecutive_failures, tokenizer, poll_s
        workers = max_workers or staleness.max_concurrent
        self._groups = cf.ThreadPoolExecutor(workers, thread_name_prefix="rollout-group")
        self._episodes = cf.ThreadPoolExecutor(workers * n_samples, thread_name_prefix="rollout-episode")
        self._rewards = cf.ThreadPoolExecutor(reward_workers, thread_name_prefix="reward")
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        self._consecutive_failures = 0
        self._failures: collections.Counter[str] = collections.Counter()
        self.abandoned_at_stop = 0  # groups cut off by the generator's stop after stop(): expected, not failures
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=20)
        self.data_exhausted = False
        self._inflight: set[cf.Future] = set()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> "RolloutDispatcher":
        if self._thread is not None:
            raise RuntimeError("RolloutDispatcher.start() called twice")
        self._thread = threading.Thread(target=self._commit_loop, name="rollout-dispatcher", daemon=True)
        self._thread.start()
        return self

    def pause(self) -> None:
        """Stop *starting* groups (in-flight groups continue)."""
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    def stop(self, timeout: float = 30.0, cancel_pending: bool = True) -> None:
        """Stop admitting; wait up to ``timeout`` for in-flight groups (their tickets are settled)."""
        self._stop.set()
        self._resume.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            pending = list(self._inflight)
        cf.wait(pending, timeout=timeout)
        self._groups.shutdown(wait=False, cancel_futures=cancel_pending)
        self._episodes.shutdown(wait=False, cancel_futures=cancel_pending)
        self._rewards.shutdown(wait=False, cancel_futures=cancel_pending)
        if pending:
            log.info("rollout dispatcher: stopped with %d group(s) in flight; what the generator does not finish is "
                     "abandoned (the prompts stay unconsumed in the ledger)", len(pending))

    @property
    def fatal_error(self) -> BaseException | None:
        gen_err = getattr(self.generator, "error", None)
        return self._fatal if self._fatal is not None else gen_err

    def failure_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._failures)

    # -- threads ----------------------------------------------------------------------------
    def _commit_loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._resume.wait(self.poll_s):
                    continue
                ticket = self.staleness.acquire(timeout=self.poll_s)
                if ticket is None:
                    if self.staleness.closed:
                        return
                    continue
                if self._stop.is_set():
                    self.staleness.reject(ticket, "shutdown")
                    return
                try:
                    item = next(self.data)
                except StopIteration:
                    self.staleness.reject(ticket, "data_exhausted")
                    self.data_exhausted = True
                    return
                if self.on_draw is not None:
                    self.on_draw(ticket, item)
                fut = self._groups.submit(self._run_group, ticket, item)
                with self._lock:
                    self._inflight.add(fut)
                fut.add_done_callback(self._discard)
        except BaseException as e:  # noqa: BLE001
            self._set_fatal(e, "dispatcher thread crashed")

    def _discard(self, fut: cf.Future) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def _context(self, ticket: Ticket, item: Any = None) -> EpisodeContext:
        deadline = None if self.group_timeout_s is None else time.monotonic() + self.group_timeout_s
        seed = self.group_seed(ticket, item) if self.group_seed is not None else derive_seed(self.seed, ticket.id)
        return EpisodeContext(
            generator=self.generator, sampling=dataclasses.replace(self.sampling, seed=seed),
            reward_executor=self._rewards, episode_executor=self._episodes, group_id=ticket.id,
            timeout_s=self.group_timeout_s, reward_timeout_s=self.reward_timeout_s, deadline=deadline,
            tokenizer=self.tokenizer)

    def _run_group(self, ticket: Ticket, item: Any) -> None:
        try:
            group = self.sampler.run(item, self._context(ticket, item))
        except GroupRejected as r:
            self._reject(ticket, item, r.reason)
            self._record_failure(r)
            return
        except BaseException as e:  # noqa: BLE001 - never lose a ticket
            self._reject(ticket, item, f"error:{type(e).__name__}")
            if isinstance(e, GeneratorClosedError) and self._stop.is_set():
                with self._lock:  # the run is ending: the generator stopped under it (the prompt is replayed)
                    self.abandoned_at_stop += 1
                return
            self._record_failure(GroupRejected(f"error:{type(e).__name__}", str(e)))
            return
        try:
            self.staleness.accept(ticket, group, group.head_version)
        except StalenessViolation as e:
            self._reject(ticket, item, "staleness_violation")
            self._set_fatal(e, "version protocol broken")
            return
        with self._lock:
            self._consecutive_failures = 0

    def _reject(self, ticket: Ticket, item: Any, reason: str) -> None:
        if self.on_reject is not None:
            try:
                self.on_reject(ticket, item, reason)
            except Exception as e:  # noqa: BLE001 - bookkeeping must not lose the ticket
                log.error("on_reject hook failed: %s: %s", type(e).__name__, e)
        self.staleness.reject(ticket, reason)

    def _record_failure(self, r: GroupRejected) -> None:
        if r.reason == "filtered":
            return  # a policy decision, not a failure
        msg = f"group rejected ({r.reason}): {r.detail}"[:500]
        with self._lock:
            self._failures[r.reason] += 1
            self.recent_errors.append(msg)
            self._consecutive_failures += 1
            too_many = self._consecutive_failures >= self.max_consecutive_failures
        log.warning(msg)
        if too_many:
            self._set_fatal(RuntimeError(f"{self.max_consecutive_failures} consecutive failed groups; last: {msg}"),
                            "too many consecutive failures")

    def _set_fatal(self, error: BaseException, what: str) -> None:
        with self._lock:
            if self._fatal is None:
                self._fatal = error
        log.error("rollout dispatcher: %s: %s: %s", what, type(error).__name__, error)
        self._stop.set()


def workflow_class(spec: str) -> type:
    """``rollout.workflow``'s ``module:Class`` -> the class, which must be a ``RolloutWorkflow`` subclass; a
    ``ValueError`` saying what is wrong otherwise (config validation and the run both resolve it here)."""
    mod, sep, attr = spec.partition(":")
    if not (sep and mod and attr):
        raise ValueError(f"{spec!r} is neither 'rlvr' nor a 'module:Class' string")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is the user's to see, in one line
        raise ValueError(f"cannot import {spec!r}: {type(e).__name__}: {e}") from None
    if not (isinstance(obj, type) and issubclass(obj, RolloutWorkflow)):
        raise ValueError(f"{spec!r} is not a RolloutWorkflow subclass")
    return obj
