"""Host side of the generator: request queue, continuous batching, weight swaps, streaming.

`Generator` drives an `engine_api.Engine` (device side: jitted prefill/decode, paged KV cache)
from two threads. Callers talk to it through `submit()` (-> `RequestHandle`), `update_params()`,
`abort()` and `stats()`; all of them are non-blocking.

Threads and queues
==================

::

    callers ──submit/abort──► inbox (SimpleQueue, unbounded) ──► DECODE thread ──► outbox (SimpleQueue, unbounded)
       ▲       update_params ─► _pending_params (lock, newest wins) ─┘   ▲   │                     │
       │                                                                  │   ▼                     ▼
       │                                                        release(sample) ◄──────── STREAM thread
       └── RequestHandle.result()/iteration ◄── handle event + chunk queue ◄──────────────────────┘

* **Caller threads** (any number). `submit()` validates the request, registers its
  `RequestHandle` and puts a `SubmitMsg` message on the inbox; `abort()` puts an `AbortMsg`;
  `update_params()` lets the engine derive what its decode programs need from the new weights
  (`Engine.prepare_params`, on the caller's thread: `PagedEngine` packs its layer matrices there, not
  between two decode steps), stores `(params, version)` in a one-element mailbox (a newer update
  replaces an older one not yet applied) and wakes the decode thread. None of them block on the
  decode thread.
  Callers block only in `RequestHandle.result(timeout)` (a `threading.Event`) and in handle
  iteration (a per-handle chunk queue polled with a timeout); both are released when the
  request finishes *or* when the generator fails or stops, so a caller never hangs.

* **Decode thread** (one; the only thread that touches the engine, the decode state, the
  slot table and the admission queue, so none of these need a lock). One iteration:

  1. drain the inbox (non-blocking while any slot is live; when idle, one blocking
     `inbox.get(timeout=idle_poll_s)` so the thread sleeps instead of spinning);
  2. apply a pending weight update (between two decode steps; in-flight requests are kept):
     `keep_kv` swaps the params and continues on the existing cache; `recompute_kv` first
     reads the in-flight step's tokens, then re-prefills every live sequence (prompt +
     tokens so far) under the new weights and re-inserts it into its slot;
  3. admit queued work into free slots (continuous batching): the queue items that fit now are
     prefilled by one `prefill_many` (one prefill per request or continuation, packed by the
     engine), then the n samples of each are inserted (`bulk_insert`) into free slots. Admission
     is FIFO and by slots: when fewer than n slots are free, the first samples of the group start
     now and the rest wait at the head of the queue, keeping the prefill (and sharing its prompt
     pages) until slots free up; an item needs the page pool to hold at least one copy of its
     prompt (`free_pages`/`pages_needed`); an insert that raises
     `OutOfPagesError` leaves the request queued with its prefill kept for the retry (dropped
     if the weights change). A request that does not fit the *empty* cache fails alone;
  4. dispatch decode step k+1 (`engine.generate`, asynchronous under JAX), start its
     device-to-host copy (`copy_to_host_async`), and only *then* read step k's results
     (`to_host`): the host work of step k overlaps the device work of step k+1. Each
     dispatched step carries a snapshot of the slot owners and the policy version, so a
     token is credited to the sample that owned the slot when the step was dispatched and
     tagged with the version of the weights that produced it. A slot whose sample finished
     (stop token, max_new_tokens, sequence limit) is released at once and refilled in the
     next iteration's admission. If `generate` raises `OutOfPagesError`, the decode thread
     reads the in-flight step, then preempts the most recently admitted sequence: its slot
     is released and it is re-queued at the head as a continuation (prompt + tokens so far,
     remaining budget, same seed and sample index; the engine's random key depends only on
     (seed, sample index, absolute position), so the continuation samples the same tokens
     it would have sampled without preemption). Admission pauses until a step succeeds.
     The decode thread runs prefills itself (interleaved mode): on one device prefill and
     decode serialise on the device anyway; a separate prefill thread would only add a
     hand-off of the KV prefix and GIL contention, and the single owner of the decode state
     needs no locking.

  Per step the decode thread sends ONE message to the outbox: the list of
  `(sample, token, logprob, version, finish_reason, top)` it produced (prefill first tokens and
  aborts use the same message shape; `top`: the token's `SamplingParams.top_logprobs` alternatives as
  (token id, log-prob) pairs, `()` when the request asks for none).

* **Stream thread** (one). Blocks on `outbox.get(timeout=stream_poll_s)`. Appends tokens to
  each sample's output, checks stop strings on the detokenised tail (tokenizer work stays off
  the decode thread), pushes `StreamChunk`s to streaming handles, and completes a request's
  handle when its last sample finishes. A stop string finishes the sample immediately (its
  tokens end with the token that completed the stop string) and sends a `ReleaseMsg` message
  back through the inbox so the decode thread frees the slot; tokens the decode thread
  produced for that sample in the meantime (at most one or two steps) are dropped here.

Why there is no deadlock: the inbox and the outbox are unbounded, so no put ever blocks; the
decode thread never waits on the stream thread (it only drains the inbox without blocking
while it has work, or waits on it with a timeout when idle); the stream thread waits only on
the outbox, with a timeout; callers wait only on their own handle, which the stream thread (on
completion) or `_fail`/`stop` (on error or shutdown) always releases. The only lock shared by
threads (`_lock`: handle registry, param mailbox) is never held while blocking or while
calling the engine.

Errors: an exception in either thread calls `_fail(exc)`: the generator records it, sets the
stop flag (both threads exit at their next check) and fails every outstanding handle, whose
`result()`/iteration then raise `GeneratorError` chained to the original exception. A request
that can never fit the KV cache (a lone sequence that cannot grow) fails alone with
`OutOfPagesError`. `stop()` ends both threads (joins with a timeout) and fails the handles of
unfinished requests with `GeneratorClosedError`.

Overhead accounting (`stats()`): per decode iteration, `step_s` is the wall time between two
dispatches, `device_wait_s` the time blocked in `to_host` (waiting for the device),
`prefill_s` the time in prefill/insert; `host_s = step_s - device_wait_s - prefill_s` is the
Python work of the iteration (bookkeeping, dispatch). `host_overhead_fraction` =
sum(host_s) / sum(step_s).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Any, Sequence

import numpy as np

from jaxrl_async.generator.engine_api import Engine, OutOfPagesError, PrefillRequest, SamplingParams
# the public request types live in generator/requests.py; re-exported here
from jaxrl_async.generator.requests import (  # noqa: F401
    GeneratorClosedError, GeneratorError, GeneratorStats, RequestHandle, RequestOutput, SampleOutput, StreamChunk,
    assemble_routing, continuation_sampling, finish_reason_for, stop_string_hit, top_pairs,
)
from jaxrl_async.generator.requests import (
    WAKE, AbortMsg, InFlight, ReleaseMsg, RequestState, RequestFailedMsg, SampleState, SubmitMsg, WorkItem,
)

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
KV_UPDATE_POLICIES = ("keep_kv", "recompute_kv")


# ---------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------
class Generator:
    """Continuous-batching generator over an `Engine` (see the module docstring).

    Args:
      engine: the device-side engine.
      params: initial weights (any pytree the engine accepts).
      version: policy version of `params` (recorded on every token they produce).
      tokenizer: object with `decode(ids, skip_special_tokens=...)`; needed for stop strings
        and for `SampleOutput.text`.
      kv_update_policy: "keep_kv" (continue on the old cache after `update_params`) or
        "recompute_kv" (re-prefill in-flight sequences under the new weights).
      max_prefills_per_step: admissions (prefills) between two decode steps; None = fill every
        free slot at once (highest decode batch; larger values favour TTFT over inter-token latency).
      stop_string_window: tokens of context decoded to detect a stop string (>= its length in tokens).
      idle_poll_s / stream_poll_s: timeouts of the idle waits of the two threads.
      join_timeout_s: how long `stop()` waits for each thread.
    """

    def __init__(self, engine: Engine, params: Any, version: int = 0, *, tokenizer: Any = None,
                 kv_update_policy: str = "keep_kv", max_prefills_per_step: int | None = None,
                 stop_string_window: int = 16, idle_poll_s: float = 0.01, stream_poll_s: float = 0.05,
                 join_timeout_s: float = 30.0):
        if kv_update_policy not in KV_UPDATE_POLICIES:
            raise ValueError(f"Generator.kv_update_policy must be one of {KV_UPDATE_POLICIES}, got {kv_update_policy!r}")
        if max_prefills_per_step is not None and max_prefills_per_step < 1:
            raise ValueError(f"Generator.max_prefills_per_step must be >= 1 or None, got {max_prefills_per_step}")
        if stop_string_window < 2:
            raise ValueError(f"Generator.stop_string_window must be >= 2, got {stop_string_window}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.kv_update_policy = kv_update_policy
        self.max_prefills_per_step = max_prefills_per_step
        self.stop_string_window = stop_string_window
        self.idle_poll_s = idle_poll_s
        self.stream_poll_s = stream_poll_s
        self.join_timeout_s = join_timeout_s
        self.num_slots = int(engine.max_concurrent_decodes)
        self.max_decode_steps = max(1, int(getattr(engine, "max_decode_steps", 1)))
        engine.prepare_params(params)  # as every later weight set (`update_params`): on the caller's thread

        # shared (guarded by _lock)
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}
        self._pending_params: tuple[Any, int, list[threading.Event]] | None = None
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._decode_exited = threading.Event()
        self._error: BaseException | None = None
        self._started = False
        self._closed = False
        self._threads: list[threading.Thread] = []

        # decode-thread state
        self._params = params
        self._version = int(version)
        self._state: Any = None
        self._slot_owner: list[SampleState | None] = [None] * self.num_slots
        self._live = 0
        self._queue: collections.deque[WorkItem] = collections.deque()
        self._requests: dict[str, RequestState] = {}
        self._inflight: InFlight | None = None
        self._admit_seq = itertools.count()
        self._admission_paused = False

        # stats (written by the decode thread; read racily by stats())
        self._n_steps = self._n_tokens = self._n_prefills = self._n_prefill_tokens = 0
        self._n_updates = self._n_preempt = self._n_recompute = self._n_finished = 0
        self._n_recompute_fallback = 0
        self._n_partial_admissions = 0
        self._n_dispatches = 0
        self._live_sum = 0
        self._t_busy = self._t_host = self._t_wait = 0.0
        self._t_prefill_iter = self._t_wait_iter = 0.0

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "Generator":
        with self._lock:
            if self._started:
                raise RuntimeError("Generator.start() called twice")
            self._started = True
            self._state = self.engine.init_decode_state()
            self._threads = [threading.Thread(target=self._decode_main, name="generator-decode", daemon=True),
                             threading.Thread(target=self._stream_main, name="generator-stream", daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop both threads; unfinished requests fail with GeneratorClosedError."""
        with self._lock:
            self._closed = True
        self._stop.set()
        self._inbox.put(WAKE)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(self.join_timeout_s)
        alive = [t.name for t in self._threads if t.is_alive()]
        self._fail_all_handles(GeneratorClosedError("generator stopped"))
        if alive:
            raise RuntimeError(f"Generator.stop(): threads {alive} did not exit within {self.join_timeout_s} s")

    def __enter__(self) -> "Generator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def version(self) -> int:
        """Version of the weights the decode thread currently uses."""
        return self._version

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- caller API -----------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, request_id: str | None = None,
               metadata: Any = None, *, stream: bool = False, images: Any = None) -> RequestHandle:
        """Queue a request of `sampling.n` samples; returns at once.

        ``images``: the prompt's images (`data.images.ImageInputs`), for an engine of a vision-language model; the
        prompt holds their placeholder tokens (``images.num_tokens`` of them, expanded as the processor does).

        Raises ValueError for an empty prompt, a prompt longer than the engine's
        `max_prefill_length` (or leaving no room in `max_sequence_length`), stop strings without
        a tokenizer, a duplicate live request id, images for a text model or image placeholders that do not match
        the images' grids; GeneratorError if the generator failed or stopped.
        """
        sampling = sampling if sampling is not None else SamplingParams()
        sampling.validate()
        prompt = [int(t) for t in prompt_ids]
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        max_prefill = int(self.engine.max_prefill_length)
        max_seq = int(self.engine.max_sequence_length)
        if not prompt:
            raise ValueError(f"request {rid!r}: empty prompt")
        if len(prompt) > max_prefill:
            raise ValueError(f"request {rid!r}: prompt has {len(prompt)} tokens > engine max_prefill_length {max_prefill}")
        if len(prompt) >= max_seq:
            raise ValueError(f"request {rid!r}: prompt has {len(prompt)} tokens, no room for a new token "
                             f"(engine max_sequence_length {max_seq})")
        max_top = int(getattr(self.engine, "max_top_logprobs", 0))
        if sampling.top_logprobs > max_top:
            raise ValueError(f"request {rid!r}: SamplingParams.top_logprobs={sampling.top_logprobs} exceeds the engine's "
                             f"max_top_logprobs={max_top}")
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError(f"request {rid!r}: stop_strings {sampling.stop_strings} need a tokenizer (Generator(tokenizer=...))")
        self._check_images(rid, prompt, images)
        handle = RequestHandle(self, rid, stream, self.stream_poll_s)
        request = RequestState(rid, prompt, sampling, min(sampling.max_new_tokens, max_seq - len(prompt)), metadata, handle,
                               images)
        with self._lock:
            if self._error is not None:
                raise GeneratorError(f"generator failed: {type(self._error).__name__}: {self._error}") from self._error
            if self._closed:
                raise GeneratorClosedError("generator is stopped")
            if rid in self._handles:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._handles[rid] = handle
        self._inbox.put(SubmitMsg(request))
        return handle

    def _check_images(self, rid: str, prompt: list[int], images: Any) -> None:
        vl_cfg = getattr(self.engine, "vl_cfg", None)  # (`Engine.vl_cfg`; engines outside the package may lack it)
        if vl_cfg is None:
            if images is not None:
                raise ValueError(f"request {rid!r}: images given but the engine's model is text-only (not a "
                                 f"vision-language model)")
            return
        from jaxrl_async.generator.vision_prefill import check_placeholders

        try:
            check_placeholders(vl_cfg, prompt, images)
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None

    def abort(self, request_id: str) -> None:
        """Finish the request's unfinished samples with finish_reason "abort" (tokens so far are kept)."""
        self._inbox.put(AbortMsg(str(request_id)))

    def update_params(self, params: Any, version: int, *, wait: bool = False, timeout: float | None = 60.0) -> None:
        """Use `params` (policy `version`) from the next decode step on; in-flight requests continue.

        A newer update replaces one that was not applied yet. With wait=True, block until the
        decode thread has applied it (TimeoutError after `timeout`).
        """
        self.engine.prepare_params(params)  # on this thread: what the decode programs derive from the weights
        applied = threading.Event()
        with self._lock:
            if not self._started:  # no decode thread yet: apply directly
                self._params, self._version = params, int(version)
                self._n_updates += 1
                applied.set()
            else:  # a superseded update counts as applied when its successor is
                waiters = self._pending_params[2] if self._pending_params is not None else []
                self._pending_params = (params, int(version), waiters + [applied])
        self._inbox.put(WAKE)
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not applied.wait(0.05):
                if self._error is not None:
                    raise GeneratorError("generator failed before the weight update was applied") from self._error
                if self._stop.is_set():
                    raise GeneratorClosedError("generator stopped before the weight update was applied")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"weight update to version {version} not applied after {timeout} s")

    def stats(self) -> GeneratorStats:
        steps = max(self._n_steps, 1)
        busy = self._t_busy
        return GeneratorStats(
            version=self._version, steps=self._n_steps, generated_tokens=self._n_tokens, prefills=self._n_prefills,
            prefill_tokens=self._n_prefill_tokens, weight_updates=self._n_updates, preemptions=self._n_preempt,
            recomputed_sequences=self._n_recompute, finished_samples=self._n_finished, live_slots=self._live,
            queued_requests=len(self._queue), stream_backlog=self._outbox.qsize(), busy_s=busy,
            tokens_per_s=self._n_tokens / busy if busy > 0 else 0.0,
            slot_utilisation=self._live_sum / (steps * self.num_slots),
            step_s=busy / steps, host_s_per_step=self._t_host / steps, device_wait_s_per_step=self._t_wait / steps,
            host_overhead_fraction=self._t_host / busy if busy > 0 else 0.0,
            recompute_fallbacks=self._n_recompute_fallback, partial_admissions=self._n_partial_admissions,
            dispatches=self._n_dispatches)

    # -- failure --------------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._stop.set()
        self._inbox.put(WAKE)
        self._fail_all_handles(error)

    def _fail_all_handles(self, error: BaseException) -> None:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for h in handles:
            h._fail(error)

    # =====================================================================================
    # Decode thread
    # =====================================================================================
    def _decode_main(self) -> None:
        try:
            self._decode_loop()
        except BaseException as e:  # noqa: BLE001 - propagated to every waiter
            self._fail(e)
        finally:
            self._decode_exited.set()

    def _decode_loop(self) -> None:
        eng = self.engine
        t_last = None
        while not self._stop.is_set():
            self._drain_inbox(block=not (self._live or self._queue or self._inflight))
            if self._stop.is_set():
                return
            self._maybe_swap_params()
            if not self._admission_paused or not self._live:  # paused after a preemption until a step succeeds
                self._admit()
            if not self._live:
                if self._inflight is not None:
                    self._flush()
                t_last = None
                continue
            if self._inflight is not None and not self._useful_after_inflight():
                self._flush()  # every live sample ends in the dispatch in flight: read it instead of dispatching
                t_last = self._account(t_last)
                continue
            k = self._dispatch_steps()
            try:
                self._state, step = eng.generate(self._params, self._state, k) if k > 1 else eng.generate(
                    self._params, self._state)
            except OutOfPagesError as e:
                self._on_out_of_pages(e)
                t_last = None
                continue
            self._admission_paused = False
            step.copy_to_host_async()
            prev, self._inflight = self._inflight, InFlight(step, tuple(self._slot_owner), self._version)
            self._n_steps += k
            self._n_dispatches += 1
            self._live_sum += self._live * k
            if prev is not None:
                self._process(prev)
            t_last = self._account(t_last)

    def _account(self, t_last: float | None) -> float:
        """Busy-time accounting: one iteration = dispatch to dispatch (or to the read of the last one)."""
        now = time.perf_counter()
        if t_last is not None:
            dt = now - t_last
            self._t_busy += dt
            self._t_host += max(dt - self._t_wait_iter - self._t_prefill_iter, 0.0)
            self._t_wait += self._t_wait_iter
        self._t_wait_iter = self._t_prefill_iter = 0.0
        return now

    def _useful_after_inflight(self) -> bool:
        """Whether a live sample can still take a token after the dispatch in flight (its results not read yet):
        by its length budget (stop tokens are only known from the results). When none can, the next dispatch
        would only run finished slots (at the end of a batch: K steps of every slot's compute for nothing)."""
        k, owners = self._inflight.step.num_steps, self._inflight.owners
        return any(o is not None and len(o.tokens) + (k if owners[slot] is o else 0) < o.request.max_new
                   for slot, o in enumerate(self._slot_owner))

    def _dispatch_steps(self) -> int:
        """Decode steps of the next dispatch (multi-step decode): the engine's `max_decode_steps` K while nothing
        waits on the decode thread, else 1, so admission and weight updates are not held back: a weight update
        is pending, or queued work could start in a free slot. Queued work with every slot busy waits for a slot
        either way (a sample that finishes mid-dispatch leaves its slot idle for at most K - 1 steps); so do
        requests submitted during a dispatch (at most K steps) and aborts (their tokens are dropped)."""
        K = self.max_decode_steps
        if K <= 1 or self._pending_params is not None or (self._queue and self._live < self.num_slots):
            return 1
        return K

    # -- inbox ------------------------------------------------------------------------------
    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=self.idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_message(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle_message(self, msg: Any) -> None:
        if isinstance(msg, SubmitMsg):
            req = msg.request
            self._requests[req.id] = req
            for lo in range(0, len(req.samples), self.num_slots):
                chunk = req.samples[lo:lo + self.num_slots]
                self._queue.append(WorkItem(req, req.prompt, chunk,
                                             continuation_sampling(req.sampling, req.max_new, req.max_new)))
        elif isinstance(msg, AbortMsg):
            self._abort(msg.request_id)
        elif isinstance(msg, ReleaseMsg):
            s = msg.sample
            if not s.finished:
                self._finish(s)

    def _abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return  # already finished (or unknown): nothing to do
        self._queue = collections.deque(w for w in self._queue if w.request is not req)
        emits = []
        for s in req.samples:
            if not s.finished:
                self._finish(s)
                emits.append((s, [], [], self._version, "abort", []))
        if emits:
            self._outbox.put((time.perf_counter(), emits))

    # -- slots ------------------------------------------------------------------------------
    def _finish(self, s: SampleState) -> None:
        """Mark a sample finished (decode view) and release its slot at once."""
        s.finished = True
        if s.slot is not None:
            self._release_slot(s)
        req = s.request
        req.num_finished_decode += 1
        self._n_finished += 1
        if req.num_finished_decode == len(req.samples):
            self._requests.pop(req.id, None)

    def _release_slot(self, s: SampleState) -> None:
        slot = s.slot
        self._state = self.engine.release(self._state, slot)
        self._slot_owner[slot] = None
        s.slot = None
        self._live -= 1

    def _free_slots(self) -> list[int]:
        """Free slots in the engine's preferred order (`Engine.order_free_slots`: e.g. the decode replica with
        the most free pages first)."""
        return self.engine.order_free_slots(self._state, [i for i, o in enumerate(self._slot_owner) if o is None])

    def _append(self, s: SampleState, token: int, logprob: float, version: int, engine_done: bool) -> str | None:
        s.tokens.append(token)
        s.logprobs.append(logprob)
        s.versions.append(version)
        self._n_tokens += 1
        sp = s.request.sampling
        return finish_reason_for(token, len(s.tokens), s.request.max_new, sp.stop_token_ids, engine_done)

    # -- admission --------------------------------------------------------------------------
    def _admit(self) -> None:
        """Admit the head of the queue (FIFO) into free slots: the items that fit now are prefilled in one
        `prefill_many` (packed prompts, one host read), then inserted in order."""
        eng = self.engine
        budget = self.max_prefills_per_step if self.max_prefills_per_step is not None else 1 << 30
        while self._queue and budget > 0:
            batch, n_free, pages = [], len(self._free_slots()), eng.free_pages(self._state)
            busy = self._live or self._inflight is not None
            for item in self._queue:
                need = len(item.samples)
                if n_free < 1 or len(batch) >= budget:
                    break  # FIFO: wait for slots to free up
                # admission by slots: a group's samples start as slots free up (the rest wait at the head,
                # keeping the prefill whose prompt pages they share)
                if (busy or batch) and pages < eng.pages_needed(len(item.tokens) + 1):
                    break  # not even one sequence fits now: wait for finishing sequences to free pages
                batch.append(item)
                n_free -= need
                pages -= eng.pages_needed(len(item.tokens) + 1)
                if n_free < 0:
                    break
            if not batch:
                return
            t0 = time.perf_counter()
            try:
                todo = [it for it in batch if it.prefix is None or it.prefix_version != self._version]
                if todo:
                    prefixes = eng.prefill_many(self._params, [PrefillRequest(
                        it.tokens, it.sampling, len(it.samples), it.samples[0].index, it.request.images)
                        for it in todo])
                    for it, pre in zip(todo, prefixes):
                        it.prefix, it.prefix_version = pre, self._version
                        self._n_prefills += 1
                        self._n_prefill_tokens += len(it.tokens)
                for item in batch:
                    idle = not self._live and self._inflight is None
                    free = self._free_slots()
                    part = item if len(free) >= len(item.samples) else WorkItem(
                        item.request, item.tokens, item.samples[:len(free)], item.sampling, item.prefix,
                        item.prefix_version)
                    try:
                        self._admit_item(part, free[:len(part.samples)])
                    except OutOfPagesError as e:
                        if idle:  # cannot fit even into the empty cache
                            self._queue.popleft()
                            self._fail_request(item.request, OutOfPagesError(
                                f"request {item.request.id!r}: {len(item.samples)} sequence(s) of {len(item.tokens)} "
                                f"tokens do not fit the empty KV cache: {e}"))
                            budget -= 1
                            continue
                        return  # stays queued with the ones behind it (their prefills are kept)
                    budget -= 1
                    if part is not item:  # the rest of the group waits at the head for slots
                        item.samples = item.samples[len(part.samples):]
                        self._n_partial_admissions += 1
                        return
                    self._queue.popleft()
            finally:
                self._t_prefill_iter += time.perf_counter() - t0

    def _admit_item(self, item: WorkItem, slots: list[int]) -> None:
        """Prefill `item` and insert its unfinished samples into `slots`; all-or-nothing."""
        eng = self.engine
        first = item.samples[0].index
        if item.prefix is not None and item.prefix_version == self._version:
            prefix = item.prefix
        else:  # not reached from _admit (which prefills its batch first); kept for direct use
            prefix = eng.prefill_many(self._params, [PrefillRequest(item.tokens, item.sampling, len(item.samples), first,
                                                                    item.request.images)])[0]
            self._n_prefills += 1
            self._n_prefill_tokens += len(item.tokens)
        item.prefix, item.prefix_version = None, -1
        # sample s is row s.index - first index of the prefill (a group admitted by parts shares one prefill)
        rows = [s.index - prefix.sample_indices[0] for s in item.samples]
        toks = [int(prefix.first_tokens[r]) for r in rows]
        lps = [float(prefix.first_logprobs[r]) for r in rows]
        k_top = item.request.sampling.top_logprobs
        tops = [top_pairs(prefix.first_top_logprobs, prefix.first_top_ids, r, k_top) for r in rows]
        reasons = []
        for k, s in enumerate(item.samples):
            s.tokens.append(toks[k])  # tentatively, for the finish check; rolled back on failure
            reasons.append(finish_reason_for(toks[k], len(s.tokens), s.request.max_new,
                                             s.request.sampling.stop_token_ids, False))
        to_insert = [(rows[k], s) for k, (s, r) in enumerate(zip(item.samples, reasons)) if r is None]
        inserted: list[int] = []
        try:
            if len(to_insert) == len(prefix.first_tokens):  # the whole prefill: bulk_insert is all-or-nothing
                self._state = eng.bulk_insert(prefix, self._state, slots[:len(to_insert)])
                inserted = slots[:len(to_insert)]
            else:
                for (k, _), slot in zip(to_insert, slots):
                    self._state = eng.insert(prefix, self._state, slot, sample=k)
                    inserted.append(slot)
        except OutOfPagesError:
            for slot in inserted:
                self._state = eng.release(self._state, slot)
            for s in item.samples:
                s.tokens.pop()
            item.prefix, item.prefix_version = prefix, self._version
            raise
        emits = []
        version = self._version
        for k, s in enumerate(item.samples):
            s.tokens.pop()
            if prefix.routing is not None:  # experts of item.tokens (prompt + tokens so far), from position 0
                s.routing.append((0, prefix.routing))
            reason = self._append(s, toks[k], lps[k], version, False)
            emits.append((s, [toks[k]], [lps[k]], version, reason, [tops[k]]))
        for (_k, s), slot in zip(to_insert, inserted):
            s.slot = slot
            s.admit_seq = next(self._admit_seq)
            self._slot_owner[slot] = s
            self._live += 1
        for k, s in enumerate(item.samples):
            if reasons[k] is not None:
                self._finish(s)
        self._outbox.put((time.perf_counter(), emits))

    def _fail_request(self, req: RequestState, error: BaseException) -> None:
        self._queue = collections.deque(w for w in self._queue if w.request is not req)
        for s in req.samples:
            if not s.finished:
                self._finish(s)
        self._outbox.put(RequestFailedMsg(req, error))

    # -- decode step results ----------------------------------------------------------------
    def _process(self, inflight: InFlight) -> None:
        """Append a dispatch's tokens to their samples, sample by sample: an owned slot's valid rows (one per decode
        step; a slot that stops is inactive for the rest of the dispatch) up to the first that finishes it
        (`finish_reason_for`: a stop token, the budget, the engine's done), in one emit per sample (issue 28: the
        host's work per dispatch is per sample, not per token)."""
        t0 = time.perf_counter()
        host = inflight.step.to_host()
        self._t_wait_iter += time.perf_counter() - t0
        S = len(inflight.owners)
        # per slot, its row of every step: [S][K] Python lists (one conversion per dispatch, not per slot or token)
        valid, tokens, logprobs, done = (np.reshape(a, (-1, S)).T.tolist() for a in (
            host.valid, host.tokens, host.logprobs, host.done))
        per_step = lambda a: None if a is None else np.reshape(a, (-1, S) + np.shape(a)[np.ndim(host.tokens):])  # noqa: E731
        routing, top_lp, top_ids = per_step(host.routing), per_step(host.top_logprobs), per_step(host.top_ids)
        version = inflight.version
        emits: list = []
        for slot, owner in enumerate(inflight.owners):
            if owner is None or owner.finished or owner.slot != slot:
                continue
            steps = [i for i, ok in enumerate(valid[slot]) if ok]
            if not steps:
                continue
            row_t, row_l, row_d = tokens[slot], logprobs[slot], done[slot]
            toks, lps, ended = [row_t[i] for i in steps], [row_l[i] for i in steps], [row_d[i] for i in steps]
            req, n0 = owner.request, len(owner.tokens)
            stop_ids = req.sampling.stop_token_ids
            # the first token that finishes the sample, if any (its reason); the rest is dropped
            j, reason = next(((j, r) for j, t in enumerate(toks) if (
                r := finish_reason_for(t, n0 + j + 1, req.max_new, stop_ids, ended[j]))), (len(toks), None))
            toks, lps, steps = toks[:j + 1], lps[:j + 1], steps[:j + 1]
            if routing is not None:  # each step fed the sample's last token (its position before the step)
                base = len(req.prompt) + n0 - 1
                owner.routing.extend((base + j, routing[i, slot][None]) for j, i in enumerate(steps))
            k_top = req.sampling.top_logprobs
            tops = ([top_pairs(top_lp[i], top_ids[i], slot, k_top) for i in steps] if k_top
                    else [()] * len(toks))
            owner.tokens.extend(toks)
            owner.logprobs.extend(lps)
            owner.versions.extend([version] * len(toks))
            self._n_tokens += len(toks)
            emits.append((owner, toks, lps, version, reason, tops))
            if reason is not None:
                self._finish(owner)
        if emits:  # one message per dispatch
            self._outbox.put((time.perf_counter(), emits))

    def _flush(self) -> None:
        """Read the in-flight step's results now (before preemption or re-prefill)."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._process(prev)

    # -- weight update ----------------------------------------------------------------------
    def _maybe_swap_params(self) -> None:
        with self._lock:
            pending, self._pending_params = self._pending_params, None
        if pending is None:
            return
        params, version, waiters = pending
        if self.kv_update_policy == "recompute_kv" and (self._live or self._inflight is not None):
            self._flush()
            self._params, self._version = params, version
            self._recompute_live()
        else:
            self._params, self._version = params, version
        self._n_updates += 1
        for ev in waiters:
            ev.set()

    def _recompute_live(self) -> None:
        """Re-prefill every live sequence under the current (new) weights, in its own slot."""
        eng = self.engine
        live = sorted((s for s in self._slot_owner if s is not None), key=lambda s: s.admit_seq)
        emits = []
        t0 = time.perf_counter()
        todo = []
        for s in live:
            req = s.request
            tokens = req.prompt + s.tokens
            if len(tokens) > eng.max_reprefill_length:  # an engine without chunked prefill: keeps its old KV
                self._n_recompute_fallback += 1
                logger.warning("recompute_kv: request %r sample %d (%d tokens) is longer than the engine's "
                               "max_reprefill_length %d and keeps its KV of the previous weights (fallback #%d)",
                               req.id, s.index, len(tokens), eng.max_reprefill_length, self._n_recompute_fallback)
                continue
            sampling = continuation_sampling(req.sampling, req.max_new, req.max_new - len(s.tokens))
            todo.append((s, PrefillRequest(tokens, sampling, 1, s.index, req.images)))
        prefixes = eng.prefill_many(self._params, [r for _, r in todo]) if todo else []  # one batch
        for (s, r), prefix in zip(todo, prefixes):
            req, tokens = s.request, r.tokens
            self._n_prefills += 1
            self._n_prefill_tokens += len(tokens)
            self._n_recompute += 1
            s.num_recomputes += 1
            slot = s.slot
            self._release_slot(s)
            if prefix.routing is not None:
                s.routing.append((0, prefix.routing))
            tok, lp = int(prefix.first_tokens[0]), float(prefix.first_logprobs[0])
            reason = finish_reason_for(tok, len(s.tokens) + 1, req.max_new, req.sampling.stop_token_ids, False)
            if reason is None:
                try:
                    self._state = eng.insert(prefix, self._state, slot, sample=0)
                except OutOfPagesError:
                    self._requeue_continuation(s)
                    continue
                s.slot = slot
                self._slot_owner[slot] = s
                self._live += 1
            reason = self._append(s, tok, lp, self._version, False)
            top = top_pairs(prefix.first_top_logprobs, prefix.first_top_ids, 0, req.sampling.top_logprobs)
            emits.append((s, [tok], [lp], self._version, reason, [top]))
            if reason is not None:
                self._finish(s)
        self._t_prefill_iter += time.perf_counter() - t0
        if emits:
            self._outbox.put((time.perf_counter(), emits))

    # -- preemption -------------------------------------------------------------------------
    def _requeue_continuation(self, s: SampleState) -> None:
        req = s.request
        s.num_preemptions += 1
        self._n_preempt += 1
        sampling = continuation_sampling(req.sampling, req.max_new, req.max_new - len(s.tokens))
        self._queue.appendleft(WorkItem(req, req.prompt + s.tokens, [s], sampling))

    def _on_out_of_pages(self, err: OutOfPagesError) -> None:
        """`generate` could not grow some slots: free pages by preempting the newest sequence."""
        live_before = self._live
        self._flush()
        self._admission_paused = True
        if self._live < live_before or not self._live:
            return  # finished sequences freed pages: retry first
        # the newest sequence, preferably one of the page pool(s) that ran short (`Engine.pool_of`)
        short = {self.engine.pool_of(slot) for slot in (getattr(err, "slots", None) or ())}
        victims = sorted((s for s in self._slot_owner if s is not None),
                         key=lambda s: (bool(short) and self.engine.pool_of(s.slot) not in short, -s.admit_seq))
        fits = [s for s in victims if len(s.request.prompt) + len(s.tokens) <= self.engine.max_reprefill_length]
        if self._live == 1 or not fits:
            s = victims[0]
            self._fail_request(s.request, OutOfPagesError(
                f"request {s.request.id!r}: KV cache cannot hold sequence of {len(s.request.prompt) + len(s.tokens)} "
                f"tokens alongside {self._live - 1} other live sequence(s) and it cannot be preempted "
                f"(engine slots needing pages: {getattr(err, 'slots', '?')})"))
            return
        victim = fits[0]
        self._release_slot(victim)
        self._requeue_continuation(victim)

    # =====================================================================================
    # Stream thread
    # =====================================================================================
    def _stream_main(self) -> None:
        try:
            while True:
                try:
                    msg = self._outbox.get(timeout=self.stream_poll_s)
                except queue.Empty:
                    if self._error is not None or self._decode_exited.is_set():
                        return
                    continue
                if self._error is not None:
                    return
                if isinstance(msg, RequestFailedMsg):
                    self._deliver_failure(msg.request, msg.error)
                else:
                    self._deliver(*msg)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _deliver(self, t: float, emits: list) -> None:
        """Emits are (sample, tokens, log-probs, version, finish reason, top log-probs per token): a sample's
        tokens of one dispatch (none: an abort), the reason set when its last one finishes the sample."""
        for s, toks, lps, version, reason, tops in emits:
            v = s.view
            if v.finish_reason is not None:
                continue  # finished here already (stop string); late tokens are dropped
            req = s.request
            if toks:
                n, stops = len(toks), req.sampling.stop_strings
                if stops:  # the token completing a stop string ends the sample (a stop token ends it anyway)
                    for j in range(n):
                        v.tokens.append(toks[j])
                        r = reason if j == n - 1 else None
                        if r != "stop" and stop_string_hit(self._decode_text, v.tokens, stops, self.stop_string_window):
                            if r is None:  # the decode side has not finished it
                                self._inbox.put(ReleaseMsg(s))
                            n, reason = j + 1, "stop"
                            toks, lps, tops = toks[:n], lps[:n], tops[:n]
                            break
                else:
                    v.tokens.extend(toks)
                v.logprobs.extend(lps)
                v.versions.extend([version] * n)
                v.top_logprobs.extend(tops)
                if v.first_token_time is None:
                    v.first_token_time = t
            if req.handle._chunks is not None:
                req.handle._push(StreamChunk(req.id, s.index, tuple(toks), tuple(lps), (version,) * len(toks), reason,
                                             tuple(tops)))
            if reason is not None:
                v.finish_reason = reason
                v.finish_time = t
                req.num_finished_stream += 1
                if req.num_finished_stream == len(req.samples):
                    self._complete(req)

    def _complete(self, req: RequestState) -> None:
        samples = []
        for s in req.samples:
            v = s.view
            text = None if self.tokenizer is None else self.tokenizer.decode(v.tokens, skip_special_tokens=True)
            samples.append(SampleOutput(
                sample_index=s.index, prompt_ids=req.prompt, completion_ids=v.tokens, logprobs=v.logprobs,
                versions=v.versions, finish_reason=v.finish_reason, text=text, submit_time=req.submit_time,
                first_token_time=v.first_token_time, finish_time=v.finish_time,
                num_preemptions=s.num_preemptions, num_recomputes=s.num_recomputes,
                routing=assemble_routing(s.routing, len(req.prompt) + len(v.tokens)), top_logprobs=v.top_logprobs))
        with self._lock:
            self._handles.pop(req.id, None)
        req.handle._complete(RequestOutput(req.id, req.prompt, samples, req.metadata))

    def _deliver_failure(self, req: RequestState, error: BaseException) -> None:
        with self._lock:
            self._handles.pop(req.id, None)
        req.handle._fail(error)
