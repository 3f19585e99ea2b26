"""The generation engine contract (JetStream-style), shared by the engine and the orchestrator.

The engine is the device side: it owns the jitted prefill and decode steps, the paged KV
cache and the page allocator. The orchestrator (`orchestrator.py`) is the host side: request
queue, slot bookkeeping, weight swaps, streaming results. Parameters are always passed as
arguments, so a weight swap never retraces.

Lifecycle of one request with n samples::

    prefix = engine.prefill(params, prompt_ids, sampling, num_samples=n)  # KV + n first tokens
    state  = engine.bulk_insert(prefix, state, slots)                     # n slots share the prompt
    loop:  state, step = engine.generate(params, state)                   # one token for every slot
           ... host reads step.tokens / step.logprobs / step.valid for the slots it owns ...
    state  = engine.release(state, slot)                                  # pages back to the pool

Token bookkeeping: `prefill` samples the first new token of each sample (the token after the
prompt) and returns its log-prob; every `generate` step then appends one token to every live
slot. The log-prob of a token is log-softmax of the temperature-scaled logits over the *full*
vocabulary (before top-k/top-p truncation); with temperature 0 (greedy) it is the log-softmax
of the raw logits. Random streams are per request: the key that samples the token at absolute
position p of sample i of a request with seed s is fold_in(fold_in(PRNGKey(s), i), p), so
results do not depend on the batch composition, the slot or the timing.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 => greedy (argmax)
    top_k: int = 0  # 0 => no top-k truncation
    top_p: float = 1.0  # 1 => no nucleus truncation
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # checked on device each step
    stop_strings: tuple[str, ...] = ()  # checked on the host by the orchestrator (needs detokenizer)
    seed: int = 0
    n: int = 1  # samples per prompt
    # the top_logprobs most likely tokens of each step's distribution (the one the token was drawn from) with their
    # log-probs, per token (engines built with max_top_logprobs >= this; 0: none)
    top_logprobs: int = 0

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.top_logprobs < 0:
            raise ValueError(f"SamplingParams.top_logprobs must be >= 0, got {self.top_logprobs}")


@dataclasses.dataclass
class Prefix:
    """Result of one prefill: the prompt's KV (engine-specific layout) and the first sampled tokens."""

    kv: Any  # engine-specific (device arrays)
    length: int  # true prompt length (tokens in the KV)
    first_tokens: np.ndarray  # [num_samples] int32, host
    first_logprobs: np.ndarray  # [num_samples] float32, host
    sampling: SamplingParams
    sample_indices: tuple[int, ...]  # which sample index of the request each first token belongs to
    # [length, L, k] int16 host array: the experts every prompt token was routed to in each MoE layer (engines
    # built with record_routing; None otherwise)
    routing: np.ndarray | None = None
    # [num_samples, K] float32 / int32 host arrays (engines with max_top_logprobs = K > 0; else None): the K largest
    # log-probs of each first token's distribution, descending, and their token ids
    first_top_logprobs: np.ndarray | None = None
    first_top_ids: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    """One sequence of `Engine.prefill_many` (the arguments of `Engine.prefill`)."""

    tokens: Sequence[int] | np.ndarray
    sampling: SamplingParams
    num_samples: int = 1
    sample_offset: int = 0
    # the prompt's images (`data.images.ImageInputs`; vision-language engines only): the vision tower runs at prefill
    # and the sequence's positions are M-RoPE ones (a re-prefill passes the prompt's images with prompt + generated)
    images: Any = None


@dataclasses.dataclass
class StepResult:
    """Output of one decode step for all slots (device arrays; call `to_host()` when needed)."""

    tokens: Any  # [S] int32: token generated for each slot this step
    logprobs: Any  # [S] float32: behaviour log-prob of that token
    valid: Any  # [S] bool: slot was live and produced a token this step
    done: Any  # [S] bool: slot hit a stop token or its max_new_tokens with this token
    # [S, L, k] int16 (engines built with record_routing; else None): the experts of the token each slot FED
    # this step (its last sampled token, at its position before the step) in each MoE layer
    routing: Any = None
    # [S, K] float32 / int32 (engines built with max_top_logprobs = K > 0; else None): the K largest log-probs of the
    # distribution each slot's token was sampled from (log-softmax of the temperature-scaled logits), descending,
    # and their token ids
    top_logprobs: Any = None
    top_ids: Any = None

    def copy_to_host_async(self) -> "StepResult":
        for a in (self.tokens, self.logprobs, self.valid, self.done, self.routing, self.top_logprobs, self.top_ids):
            if hasattr(a, "copy_to_host_async"):
                a.copy_to_host_async()
        return self

    def to_host(self) -> "StepResult":
        opt = lambda a: None if a is None else np.asarray(a)  # noqa: E731
        return StepResult(*(np.asarray(a) for a in (self.tokens, self.logprobs, self.valid, self.done)),
                          routing=opt(self.routing), top_logprobs=opt(self.top_logprobs), top_ids=opt(self.top_ids))

    @property
    def num_steps(self) -> int:
        """Decode steps this result holds: 1 ([S] arrays) or K (a multi-step dispatch: [K, S] arrays)."""
        return 1 if np.ndim(self.tokens) == 1 else int(np.shape(self.tokens)[0])

    def rows(self) -> list["StepResult"]:
        """One [S] StepResult per step, in order (the result itself when it holds one step)."""
        if self.num_steps == 1 and np.ndim(self.tokens) == 1:
            return [self]
        at = lambda a, i: None if a is None else a[i]  # noqa: E731
        return [StepResult(self.tokens[i], self.logprobs[i], self.valid[i], self.done[i], at(self.routing, i),
                           at(self.top_logprobs, i), at(self.top_ids, i)) for i in range(self.num_steps)]


class OutOfPagesError(RuntimeError):
    """The paged KV cache has no free page for an insert or a decode step.

    Raised *before* any state changes. `slots` lists the slots that could not get a page (decode)
    or the slots of the failed insert; the caller preempts (release + re-queue as a continuation)
    and retries.
    """

    def __init__(self, message: str = "out of KV-cache pages", *, slots: Sequence[int] = (),
                 pages_needed: int = 0, pages_free: int = 0):
        super().__init__(message)
        self.slots = tuple(slots)
        self.pages_needed = pages_needed
        self.pages_free = pages_free


class Engine(abc.ABC):
    """Abstract generation engine. Implementations: `engine.PagedEngine` (and a mock in tests)."""

    #: most decode steps one `generate` dispatch may run (multi-step decode); 1 = one step per dispatch
    max_decode_steps: int = 1
    #: the vision-language model's config (`qwen2_5_vl.VLConfig`) of an engine that serves prompts with images
    #: (`PrefillRequest.images`); None: a text engine (the generator refuses requests with images)
    vl_cfg: Any = None
    #: K: every prefill and decode step also returns the K most likely tokens and their log-probs (`Prefix.first_top_*`,
    #: `StepResult.top_*`); requests take up to K (`SamplingParams.top_logprobs`); 0 = none
    max_top_logprobs: int = 0

    @property
    @abc.abstractmethod
    def max_concurrent_decodes(self) -> int:
        """Number of decode slots (static decode batch)."""

    @property
    @abc.abstractmethod
    def max_prefill_length(self) -> int:
        """Longest prompt (or prompt + continuation for re-prefill) the engine accepts."""

    @property
    def max_sequence_length(self) -> int:
        """Longest total length (prompt + generated) of one slot."""
        return self.max_prefill_length

    @property
    def max_reprefill_length(self) -> int:
        """Longest sequence `prefill` accepts for a re-prefill (recompute_kv, a preempted continuation);
        engines with chunked prefill take up to max_sequence_length - 1, others max_prefill_length."""
        return self.max_prefill_length

    def prepare_params(self, params: Any) -> None:
        """Called with a weight set before the generator decodes with it (`Generator.update_params`, on the
        caller's thread, e.g. the weight push's): engines that derive per-weight data for their decode programs
        make it here, off the decode thread (`PagedEngine`: the packed copy of the layer matrices). Default:
        nothing."""
        return None

    @abc.abstractmethod
    def init_decode_state(self) -> Any:
        """Empty decode state: all slots free, all pages free."""

    @abc.abstractmethod
    def prefill(self, params: Any, tokens: Sequence[int] | np.ndarray, sampling: SamplingParams,
                num_samples: int = 1, sample_offset: int = 0, images: Any = None) -> Prefix:
        """Run the prompt (padded to a bucket), sample `num_samples` first tokens (``images``: `PrefillRequest.images`).

        Sample k of the result has request-level sample index `sample_offset + k` (for its
        random stream). Raises ValueError if the prompt is longer than `max_reprefill_length`.
        """

    def prefill_many(self, params: Any, requests: Sequence[PrefillRequest]) -> list[Prefix]:
        """`prefill` of several sequences, one `Prefix` each, in order. Engines batch them (`PagedEngine`:
        prompts packed into rows of a bucket, one host transfer for all first tokens); this default loops."""
        return [self.prefill(params, r.tokens, r.sampling, num_samples=r.num_samples, sample_offset=r.sample_offset,
                             **({"images": r.images} if r.images is not None else {})) for r in requests]

    @abc.abstractmethod
    def insert(self, prefix: Prefix, state: Any, slot: int, sample: int = 0) -> Any:
        """Place sample `sample` of `prefix` into free decode slot `slot` (allocates pages)."""

    def bulk_insert(self, prefix: Prefix, state: Any, slots: Sequence[int]) -> Any:
        """Place the samples of one prefill into `slots` (one slot per sample).

        All-or-nothing: if any insert raises OutOfPagesError, the slots already filled are released
        before re-raising, so the caller can retry the whole group later.
        """
        done: list[int] = []
        try:
            for k, slot in enumerate(slots):
                state = self.insert(prefix, state, slot, sample=k)
                done.append(slot)
        except OutOfPagesError:
            for slot in done:
                state = self.release(state, slot)
            raise
        return state

    @abc.abstractmethod
    def generate(self, params: Any, state: Any, num_steps: int = 1) -> tuple[Any, StepResult]:
        """Advance every live slot by `num_steps` tokens (engines with `max_decode_steps` > 1; else one) in one
        dispatch. Slots that finish are marked done (not freed); a slot that finishes on the way stops there."""

    @abc.abstractmethod
    def release(self, state: Any, slot: int) -> Any:
        """Free a slot and its pages."""

    def free_pages(self, state: Any) -> int:
        """Pages currently free in the KV pool (for admission control)."""
        return 1 << 30

    def pages_needed(self, num_tokens: int) -> int:
        return 0

    def pool_of(self, slot: int) -> int:
        """The page pool (decode replica) `slot` takes its pages from; engines with one pool: 0."""
        return 0

    def order_free_slots(self, state: Any, slots: Sequence[int]) -> list[int]:
        """Free `slots` in the order new sequences should take them (e.g. the pool with the most free pages
        first); default: as given."""
        return list(slots)
