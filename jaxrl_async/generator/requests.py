"""The generator's public request types (``generator/orchestrator.py`` runs them): errors, results
(``StreamChunk``, ``SampleOutput``, ``RequestOutput``), statistics (``GeneratorStats``), the caller-side
``RequestHandle``, the stop rules (``finish_reason_for``, ``stop_string_hit``, ``continuation_sampling``), and
the generator's per-request state (``SampleState``, ``RequestState``, work items and decode-thread messages:
used by ``orchestrator.Generator`` only).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from jaxrl_async.generator.engine_api import SamplingParams

class GeneratorError(RuntimeError):
    """A request could not be completed; `__cause__` is the original exception."""


class GeneratorClosedError(GeneratorError):
    """The generator was stopped before the request finished, or is not accepting requests."""


# ---------------------------------------------------------------------------------------------
# Public result types
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """Tokens of one sample delivered by one dispatch (one or more decode steps; or its finish without a token)."""

    request_id: str
    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str | None  # set on the last chunk of the sample
    # per token: its request's `top_logprobs` most likely tokens as (token id, log-prob) pairs, descending (`()` each
    # when the request asks for none)
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclasses.dataclass
class SampleOutput:
    """One completed sample. `logprobs[j]`/`versions[j]` belong to `completion_ids[j]`."""

    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-probs (engine_api: full-vocab, temperature-scaled)
    versions: list[int]  # policy version whose weights produced each token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str | None  # detokenised completion (None without a tokenizer)
    submit_time: float  # time.perf_counter() clock
    first_token_time: float | None
    finish_time: float
    num_preemptions: int = 0
    num_recomputes: int = 0
    # [len(prompt_ids) + len(completion_ids), L, k] int16: the experts each token was routed to in each MoE layer
    # (engines with record_routing; else None). -1 where not recorded: the last token (never fed back) and the
    # tokens after a stop string. A position routed again (a re-prefill: recompute_kv, a preempted continuation)
    # keeps its LAST routing: the one of the KV every later token attended to.
    routing: Any = None
    # per completion token: the `SamplingParams.top_logprobs` most likely tokens of the distribution it was sampled
    # from (log-softmax of the temperature-scaled logits, full vocabulary) as (token id, log-prob) pairs, descending;
    # each `()` when the request asks for none
    top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.submit_time

    @property
    def latency_s(self) -> float:
        return self.finish_time - self.submit_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    samples: list[SampleOutput]  # sorted by sample_index
    metadata: Any = None


@dataclasses.dataclass(frozen=True)
class GeneratorStats:
    version: int
    steps: int
    generated_tokens: int
    prefills: int
    prefill_tokens: int
    weight_updates: int
    preemptions: int
    recomputed_sequences: int
    finished_samples: int
    live_slots: int
    queued_requests: int
    stream_backlog: int
    busy_s: float  # sum of decode-iteration wall times (time with work on the device)
    tokens_per_s: float  # generated_tokens / busy_s
    slot_utilisation: float  # mean live slots / max_concurrent_decodes over steps
    step_s: float  # mean wall time of one decode step (an iteration's time over the steps it dispatched)
    host_s_per_step: float  # mean Python time per decode step (excl. device wait and prefills)
    device_wait_s_per_step: float
    host_overhead_fraction: float  # sum(host_s) / sum(step_s)
    recompute_fallbacks: int = 0  # recompute_kv: live sequences that could not be re-prefilled (kept their KV)
    partial_admissions: int = 0  # groups whose first samples started before slots for all of them were free
    dispatches: int = 0  # decode dispatches (multi-step decode: each runs up to max_decode_steps of the steps)


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------
def finish_reason_for(token: int, num_generated: int, max_new_tokens: int, stop_token_ids: Sequence[int],
                      engine_done: bool) -> str | None:
    """Finish reason after appending `token` (the `num_generated`-th new token), or None.

    "stop" if the token is a stop token; "length" if the budget is used up
    (num_generated >= max_new_tokens, the budget already clamped to the sequence limit) or the
    engine marked the slot done for another reason (its own sequence limit).
    """
    if token in stop_token_ids:
        return "stop"
    if num_generated >= max_new_tokens or engine_done:
        return "length"
    return None


def cut_at_stop(text: str, stop_strings: Iterable[str]) -> tuple[str, str | None]:
    """(``text`` before the first stop string in it, that string), or (``text``, None) when none is in it. The
    generator stops a sample at the token completing a stop string, so the first one found is that one."""
    hits = [(text.find(st), -len(st), st) for st in stop_strings if st and st in text]
    if not hits:
        return text, None
    i, _, st = min(hits)  # the earliest; of two starting there, the longer
    return text[:i], st


def stop_string_hit(decode: Callable[[list[int]], str], ids: Sequence[int], stop_strings: Sequence[str],
                    window: int) -> str | None:
    """The stop string completed by the last token of `ids`, if any.

    Decodes the last `window` tokens with and without the newest one; a stop string present in
    the former and absent from the latter was completed by the newest token. `window` must
    cover the longest stop string (in tokens) plus a few tokens of context for detokenisers
    whose output depends on the previous token (byte fallback, leading spaces).
    """
    tail = list(ids[-window:])
    after = decode(tail)
    before = decode(tail[:-1]) if len(tail) > 1 else ""
    for s in stop_strings:
        if s in after and s not in before:
            return s
    return None


def continuation_sampling(sampling: SamplingParams, max_new_tokens: int, remaining: int) -> SamplingParams:
    """Sampling params of a continuation that has `remaining` of `max_new_tokens` left."""
    del max_new_tokens
    return dataclasses.replace(sampling, max_new_tokens=remaining, n=1)


def top_pairs(top_logprobs: Any, top_ids: Any, row: int, k: int) -> tuple[tuple[int, float], ...]:
    """The first `k` (token id, log-prob) pairs of row `row` of an engine's top log-probs and ids ([N, K] host
    arrays, descending; None when the engine computes none), `()` for k = 0."""
    if not k or top_logprobs is None:
        return ()
    return tuple(zip(top_ids[row, :k].tolist(), top_logprobs[row, :k].tolist()))


_END = object()


# ---------------------------------------------------------------------------------------------
# Handle
# ---------------------------------------------------------------------------------------------
class RequestHandle:
    """Caller-side view of one request: `result()`, iteration over `StreamChunk`s, `abort()`."""

    def __init__(self, generator: Any, request_id: str, stream: bool, poll_s: float):  # orchestrator.Generator
        self.request_id = request_id
        self._generator = generator
        self._event = threading.Event()
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._chunks: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self._poll_s = poll_s

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; raises TimeoutError, or GeneratorError if it failed."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} not finished after {timeout} s")
        if self._error is not None:
            raise self._wrap_error()
        assert self._output is not None
        return self._output

    def __iter__(self) -> Iterator[StreamChunk]:
        """Yield the request's chunks in generation order (per sample); requires submit(stream=True)."""
        if self._chunks is None:
            raise RuntimeError(f"request {self.request_id!r} was submitted without stream=True")
        while True:
            try:
                item = self._chunks.get(timeout=self._poll_s)
            except queue.Empty:
                continue  # _END is always enqueued on completion, failure or stop
            if item is _END:
                if self._error is not None:
                    raise self._wrap_error()
                return
            yield item

    def abort(self) -> None:
        self._generator.abort(self.request_id)

    # -- called by the generator's threads ------------------------------------------------
    def _wrap_error(self) -> GeneratorError:
        err = self._error
        cls = GeneratorClosedError if isinstance(err, GeneratorClosedError) else GeneratorError
        wrapped = cls(f"request {self.request_id!r} failed: {type(err).__name__}: {err}")
        wrapped.__cause__ = err
        return wrapped

    def _push(self, chunk: StreamChunk) -> None:
        if self._chunks is not None:
            self._chunks.put(chunk)

    def _complete(self, output: RequestOutput) -> None:
        if self._event.is_set():
            return
        self._output = output
        self._event.set()
        if self._chunks is not None:
            self._chunks.put(_END)

    def _fail(self, error: BaseException) -> None:
        if self._event.is_set():
            return
        self._error = error
        self._event.set()
        if self._chunks is not None:
            self._chunks.put(_END)


# ---------------------------------------------------------------------------------------------
# Internal bookkeeping
# ---------------------------------------------------------------------------------------------
class SampleState:
    """One sample of a request. Decode-side fields are owned by the decode thread; `view` by the stream thread."""

    __slots__ = ("request", "index", "tokens", "logprobs", "versions", "slot", "finished", "admit_seq",
                 "num_preemptions", "num_recomputes", "view", "routing")

    def __init__(self, request: "RequestState", index: int):
        self.request = request
        self.index = index
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.slot: int | None = None
        self.finished = False
        self.admit_seq = -1
        self.num_preemptions = 0
        self.num_recomputes = 0
        self.view = SampleView()
        self.routing: list[tuple[int, Any]] = []  # (first position, [n, L, k] experts), decode thread appends


class SampleView:
    """Stream-thread view of a sample: what is delivered to the caller."""

    __slots__ = ("tokens", "logprobs", "versions", "top_logprobs", "finish_reason", "first_token_time", "finish_time")

    def __init__(self):
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.top_logprobs: list[tuple[tuple[int, float], ...]] = []
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None
        self.finish_time = 0.0


class RequestState:
    __slots__ = ("id", "prompt", "sampling", "max_new", "metadata", "handle", "samples", "submit_time",
                 "num_finished_decode", "num_finished_stream", "images")

    def __init__(self, request_id: str, prompt: list[int], sampling: SamplingParams, max_new: int, metadata: Any,
                 handle: "RequestHandle", images: Any = None):
        self.id = request_id
        self.prompt = prompt
        self.sampling = sampling
        self.max_new = max_new  # sampling.max_new_tokens clamped to the engine's sequence limit
        self.metadata = metadata
        self.handle = handle
        self.samples = [SampleState(self, i) for i in range(sampling.n)]
        self.submit_time = time.perf_counter()
        self.num_finished_decode = 0
        self.num_finished_stream = 0
        self.images = images  # the prompt's images (`data.images.ImageInputs`) or None


@dataclasses.dataclass
class WorkItem:
    """Queued prefill: a request's consecutive samples (same tokens) or one preempted continuation."""

    request: RequestState
    tokens: list[int]
    samples: list[SampleState]
    sampling: SamplingParams
    prefix: Any = None  # kept when the insert ran out of pages, reused while the version is unchanged
    prefix_version: int = -1


@dataclasses.dataclass
class InFlight:
    step: Any  # StepResult (device arrays)
    owners: tuple  # slot -> SampleState | None at dispatch
    version: int


@dataclasses.dataclass
class SubmitMsg:
    request: RequestState


@dataclasses.dataclass
class AbortMsg:
    request_id: str


@dataclasses.dataclass
class ReleaseMsg:
    sample: SampleState


@dataclasses.dataclass
class RequestFailedMsg:
    request: RequestState
    error: BaseException


WAKE = object()


def assemble_routing(chunks, length: int):
    """[length, L, k] int16 from (first position, [n, L, k]) chunks; -1 where none; the LAST chunk that covers a
    position wins: a re-prefill (recompute_kv after a weight update, a preempted continuation, the next turn of an
    episode) routes the earlier tokens again and every later token attends to the KV of that routing (tokens
    sampled before it were produced with the earlier routing: with recompute_kv they are also of the earlier
    weights, the off-policy part the decoupled loss corrects). None without chunks."""
    chunks = list(chunks)  # a snapshot (the decode thread may still append)
    if not chunks:
        return None
    out = np.full((length,) + tuple(chunks[0][1].shape[1:]), -1, np.int16)
    for start, ids in chunks:
        stop = min(start + len(ids), length)
        if stop > start:
            out[start:stop] = np.asarray(ids[:stop - start])
    return out
