"""The server's side of the generator: prompts (chat template, tools), admission (the queue bound: 429), the bridge
from a ``RequestHandle`` (generator threads) to the event loop, timeouts, aborts and the per-request records.

Threads: the generator's decode and stream threads run the engine (``generator/orchestrator.py``); uvicorn's event
loop runs the routes. Each request gets one small pump thread that iterates its handle (a handle always ends:
finished, aborted, failed or stopped) and hands every chunk to the loop with ``call_soon_threadsafe``; the loop
side waits on an ``asyncio.Queue`` in slices of ``POLL_S`` so that it notices a disconnected client and its
deadline (``request_timeout_s``) and then aborts the request (``Generator.abort``: the slot is freed at the next
decode step). No wait anywhere is unbounded.

Records (for the agent workflow of issue 25 part 2): every finished request calls the ``recorders`` with a
:class:`ServeRecord`: the prompt token ids the server built, and per sample the completion ids, the behaviour
log-probs and the policy version of every token, exactly as the engine produced them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.generator.requests import GeneratorError, RequestOutput, cut_at_stop
from jaxrl_async.serve.protocol import TOOL_OPEN, APIError, ChatRequest, Sampling, parse_tool_calls, seed_of

logger = logging.getLogger(__name__)
POLL_S = 0.25  # how often a waiting request checks its client and its deadline


class ClientGone(Exception):
    """The client disconnected; its request was aborted."""


@dataclasses.dataclass
class ServeRecord:
    """One finished request as the engine ran it (``samples``: the generator's ``SampleOutput``s)."""

    request_id: str
    endpoint: str
    prompt_ids: list[int]
    samples: list[Any]
    metadata: Any = None
    lost: bool = False  # the request failed or was never submitted: no samples (every request gets one record)


class Batch:
    """The requests of one HTTP call (one per prompt), their events in one queue: ("chunk", prompt index,
    ``StreamChunk``), ("done", prompt index, ``RequestOutput``), ("error", prompt index, exception)."""

    def __init__(self, backend: "ServeBackend", handles: list[Any], samples_each: int, stream: bool,
                 loop: asyncio.AbstractEventLoop, endpoint: str = "", metadata: Any = None):
        self.backend, self.handles, self.stream = backend, handles, stream
        self.endpoint, self.metadata = endpoint, metadata
        self.queue: asyncio.Queue = asyncio.Queue()
        self.outputs: list[RequestOutput | None] = [None] * len(handles)
        self.finished = False
        self._left = len(handles)
        for i, h in enumerate(handles):
            threading.Thread(target=self._pump, args=(i, h, samples_each, loop), name=f"serve-pump-{h.request_id}",
                             daemon=True).start()

    def _pump(self, i: int, handle: Any, samples: int, loop: asyncio.AbstractEventLoop) -> None:
        """(A pump thread.) Hands the handle's chunks and its end to the loop; frees its admission when it ends."""
        def put(ev: tuple) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, ev)
            except RuntimeError:  # the loop is closed (server shutdown)
                pass

        try:
            if self.stream:
                for chunk in handle:
                    put(("chunk", i, chunk))
            # a handle always ends (finished, aborted, failed or stopped); the bound is a safety net
            out = handle.result(timeout=self.backend.request_timeout_s + 60)
            self.backend.record(out)
            put(("done", i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the request
            self.backend.record_lost(handle.request_id, self.endpoint, self.metadata)
            put(("error", i, e))
        finally:
            self.backend.release(samples)

    def abort(self) -> None:
        for h in self.handles:
            if not h.done():
                h.abort()

    async def events(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[tuple]:
        """The batch's events until every request is done; aborts the batch (and raises ClientGone or a 504
        APIError) when the client goes away or the deadline passes; a failed request raises a 500 APIError."""
        deadline = time.monotonic() + self.backend.request_timeout_s
        try:
            while self._left:
                try:
                    ev = await asyncio.wait_for(self.queue.get(), timeout=POLL_S)
                except asyncio.TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        raise ClientGone() from None
                    if time.monotonic() > deadline:
                        raise APIError(504, f"the request did not finish within {self.backend.request_timeout_s} s "
                                            "(--request-timeout)", code="timeout") from None
                    continue
                kind, i, payload = ev
                if kind == "error":
                    if isinstance(payload, GeneratorError):
                        raise APIError(500, f"generation failed: {payload}", code="generation_failed")
                    raise payload
                if kind == "done":
                    self.outputs[i] = payload
                    self._left -= 1
                yield ev
            self.finished = True
        finally:
            if not self.finished:
                self.abort()


class ServeBackend:
    """What the routes need from the model: tokenizer, limits, prompt building and request submission.

    Args:
      generator: a started ``orchestrator.Generator`` (submitted with ``stream=True``).
      tokenizer: the model directory's tokenizer, or None (token-id prompts only).
      model_name: the served model name (``/v1/models``, the ``model`` field).
      vocab_size: the model's vocabulary size (token ids are checked against it).
      eos_ids: the ids generation stops at (``data.tokenizer.stop_token_ids``) unless ``ignore_eos``.
      max_queue: samples that may wait for a slot; beyond them a request is refused with 429.
      request_timeout_s: longest time a request may take (queue + generation) before it is aborted (504).
      default_max_tokens: new tokens of a request that sets no ``max_tokens`` (None: the rest of the context; the
        agent endpoint uses the run's ``rollout.sampling.max_new_tokens``).
    """

    def __init__(self, generator: Any, tokenizer: Any, *, model_name: str, vocab_size: int,
                 eos_ids: Sequence[int] = (), max_queue: int = 256, request_timeout_s: float = 600.0,
                 default_max_tokens: int | None = None):
        self.generator = generator
        self.default_max_tokens = default_max_tokens
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.slots = int(generator.num_slots)
        self.max_queue = int(max_queue)
        self.request_timeout_s = float(request_timeout_s)
        self.max_model_len = int(generator.engine.max_sequence_length)
        self.max_prompt_len = min(int(generator.engine.max_prefill_length), self.max_model_len - 1)
        self.max_top_logprobs = int(getattr(generator.engine, "max_top_logprobs", 0))
        self.recorders: list[Callable[[ServeRecord], None]] = []
        self.created = int(time.time())
        self._lock = threading.Lock()
        self._in_flight = 0  # samples submitted and not finished
        self._ids = itertools.count()
        self._token_strings: dict[int, str] = {}  # id -> its text alone (at most the vocabulary)

    # -- text ---------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in ids]
        cache = self._token_strings
        out = []
        for t in ids:
            s = cache.get(t)
            if s is None:
                s = cache[t] = self.tokenizer.decode([t], skip_special_tokens=False)
            out.append(s)
        return out

    def top_strings(self, tops: Sequence[Sequence[tuple[int, float]]]) -> list[list[tuple[str, float]]]:
        """Per token its (token id, log-prob) alternatives (``SampleOutput.top_logprobs``) as (string, log-prob)."""
        return [list(zip(self.token_strings([i for i, _ in top]), [lp for _, lp in top])) for top in tops]

    def render_chat(self, req: ChatRequest) -> list[int]:
        """Token ids of the conversation as the chat template renders it (tools included), encoded without added
        special tokens: the ids ``generate`` builds for a one-user-message prompt."""
        tok = self.tokenizer
        if tok is None:
            raise APIError(400, "messages: the model directory has no tokenizer; use /v1/completions with token-id "
                                "prompts", param="messages")
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: the model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        kw: dict[str, Any] = dict(req.template_kwargs, tokenize=False, add_generation_prompt=req.add_generation_prompt)
        if req.continue_final_message:
            kw["continue_final_message"] = True
        if req.tools:
            kw["tools"] = req.tools
        try:
            text = tok.apply_chat_template(req.messages, **kw)
        except Exception as e:  # noqa: BLE001 - the template's own checks (jinja raise_exception) are the user's
            raise APIError(400, f"messages: the chat template rejects them: {' '.join(str(e).split())}",
                           param="messages") from None
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A completion prompt: token ids as given, or raw text with the tokenizer's special tokens (as
        ``generate --no-chat-template``)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise APIError(400, f"{param}: the model directory has no tokenizer; give token ids", param=param)
        return list(self.tokenizer(prompt)["input_ids"])

    # -- limits -------------------------------------------------------------------------------
    def budget(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """New tokens a request may generate; 400 when the prompt (plus ``max_tokens``) exceeds the context."""
        if prompt_len > self.max_prompt_len:
            raise APIError(400, f"{param}: the prompt has {prompt_len} tokens, more than the {self.max_prompt_len} this "
                                f"server accepts (context {self.max_model_len} tokens, --max-model-len)",
                           param=param, code="context_length_exceeded")
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            return room if self.default_max_tokens is None else min(room, self.default_max_tokens)
        if max_tokens > room:
            raise APIError(400, f"max_tokens: {max_tokens} new tokens after a prompt of {prompt_len} exceed the context "
                                f"of {self.max_model_len} tokens (at most {room})", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def sampling_params(self, s: Sampling, max_new: int, top_logprobs: int = 0) -> SamplingParams:
        if s.stop and self.tokenizer is None:
            raise APIError(400, "stop: stop strings need a tokenizer; the model directory has none", param="stop")
        eos = () if s.ignore_eos else self.eos_ids
        return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_new_tokens=max_new,
                              stop_token_ids=tuple(sorted(set(eos) | set(s.stop_token_ids))), stop_strings=s.stop,
                              seed=seed_of(s), n=s.n, top_logprobs=top_logprobs)

    def release(self, samples: int) -> None:
        with self._lock:
            self._in_flight -= samples

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- submission ---------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], sampling: SamplingParams, stream: bool, endpoint: str,
               metadata: Any = None) -> Batch:
        """Submit one request per prompt (429 when the samples would exceed the slots plus ``max_queue``)."""
        total = sampling.n * len(prompts)
        with self._lock:
            busy = self._in_flight + total > self.slots + self.max_queue
            if not busy:
                self._in_flight += total
        if busy:
            for _ in prompts:
                self.record_lost("", endpoint, metadata)
            raise APIError(429, f"the server is busy: {self._in_flight} samples in flight, {self.slots} slots and "
                                    f"a queue of {self.max_queue} (--max-queue); retry later", code="queue_full")
        loop = asyncio.get_running_loop()
        handles = []
        try:
            for p in prompts:
                rid = f"{endpoint}-{next(self._ids)}"
                handles.append(self.generator.submit(p, sampling, request_id=rid, metadata=(endpoint, metadata),
                                                     stream=stream))
        except BaseException as e:
            for h in handles:
                h.abort()
            self.release(total)  # (the aborted ones end at the next decode step)
            for _ in prompts:  # none of them is pumped: each gets its (empty) record here
                self.record_lost("", endpoint, metadata)
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            if isinstance(e, GeneratorError):
                raise APIError(503, f"the generator is not running: {e}", code="generator_stopped") from None
            raise
        return Batch(self, handles, sampling.n, stream, loop, endpoint, metadata)

    def record(self, out: RequestOutput) -> None:
        """Hands a finished request to the recorders (each request gets exactly one record: this or
        ``record_lost``)."""
        if not self.recorders:
            return
        endpoint, meta = out.metadata if isinstance(out.metadata, tuple) else (None, out.metadata)
        self._to_recorders(ServeRecord(out.request_id, endpoint, list(out.prompt_ids), list(out.samples), meta))

    def record_lost(self, request_id: str, endpoint: str, metadata: Any) -> None:
        """A request that failed or was never submitted: an empty record (``lost``)."""
        if self.recorders:
            self._to_recorders(ServeRecord(request_id, endpoint, [], [], metadata, lost=True))

    def _to_recorders(self, rec: ServeRecord) -> None:
        for r in self.recorders:
            try:
                r(rec)
            except Exception:  # noqa: BLE001 - a recorder must not fail the request
                logger.exception("serve: recorder %r failed on request %s", r, rec.request_id)


# ---------------------------------------------------------------------------------------------
# Text of a sample: stop strings cut, tool calls parsed, streamed deltas held back where a stop string or a tool
# call may begin
# ---------------------------------------------------------------------------------------------
def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def final_text(text: str, finish_reason: str, stops: Sequence[str], parse_tools: bool, parallel_tool_calls: bool = True
               ) -> tuple[str | None, list[dict], str]:
    """(content, tool calls, finish reason) of a finished sample's text; without ``parallel_tool_calls`` the
    first call only (as vLLM: the later ones are dropped, the tokens keep them)."""
    if stops and finish_reason == "stop":
        text, _ = cut_at_stop(text, stops)
    if parse_tools:
        content, calls = parse_tool_calls(text)
        if calls:
            return content, calls if parallel_tool_calls else calls[:1], \
                "tool_calls" if finish_reason == "stop" else finish_reason
    return text, [], finish_reason


class TextStream:
    """The text deltas of one streamed sample."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str], parse_tools: bool,
                 parallel_tool_calls: bool = True):
        self.decode, self.stops, self.parse_tools = decode, tuple(stops), parse_tools
        self.parallel_tool_calls = parallel_tool_calls
        self.ids: list[int] = []
        self.sent = ""

    def push(self, ids: Sequence[int]) -> str:
        self.ids += list(ids)
        text = self.decode(self.ids)
        if self.stops:
            text, hit = cut_at_stop(text, self.stops)
            if hit is None:
                text = text[:len(text) - partial_suffix(text, self.stops)]
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its next token
        if self.parse_tools:
            i = text.find(TOOL_OPEN)
            text = text[:i] if i >= 0 else text[:len(text) - partial_suffix(text, [TOOL_OPEN])]
        if len(text) > len(self.sent) and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
            return delta
        return ""

    def finish(self, finish_reason: str) -> tuple[str, list[dict], str]:
        """(the rest of the content, tool calls, finish reason)."""
        content, calls, reason = final_text(self.decode(self.ids), finish_reason, self.stops, self.parse_tools,
                                            self.parallel_tool_calls)
        if calls:
            return "", calls, reason
        content = content or ""
        return (content[len(self.sent):] if content.startswith(self.sent) else ""), [], reason
