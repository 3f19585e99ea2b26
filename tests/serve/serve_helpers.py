"""Helpers of the ``serve`` tests: a tiny model directory whose character-level tokenizer has a Qwen-style chat
template (tools, ``<tool_call>`` JSON), a scripted host-only engine, and a uvicorn server in a thread."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_async.generator.engine_api import Engine, Prefix, SamplingParams, StepResult

# a Qwen-like template without newlines (the character tokenizer has printable ASCII only)
CHAT_TEMPLATE = (
    "{%- if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif -%}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")


def make_model_dir(d: str) -> str:
    from transformers import AutoTokenizer

    from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer

    make_tiny_hf_model(d, "qwen3", vocab_size=128)
    make_tiny_tokenizer(d, vocab_size=128)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    return d


class ScriptEngine(Engine):
    """Sample k of a request emits ``script(prompt, k, sampling)`` token by token (then repeats its last token);
    log-prob of the j-th token -0.1 * (j + 1). ``step_latency_s`` slows each decode step."""

    def __init__(self, script: Callable[[list[int], int, SamplingParams], list[int]], num_slots: int = 4,
                 max_len: int = 2048, step_latency_s: float = 0.0):
        self.script, self.num_slots, self.max_len, self.step_latency_s = script, num_slots, max_len, step_latency_s
        self.num_steps = 0

    @property
    def max_concurrent_decodes(self) -> int:
        return self.num_slots

    @property
    def max_prefill_length(self) -> int:
        return self.max_len - 1

    @property
    def max_sequence_length(self) -> int:
        return self.max_len

    def init_decode_state(self) -> list:
        return [None] * self.num_slots

    def prefill(self, params, tokens, sampling, num_samples=1, sample_offset=0) -> Prefix:
        seqs = [list(self.script([int(t) for t in tokens], sample_offset + k, sampling)) for k in range(num_samples)]
        return Prefix(kv=(len(tokens), seqs), length=len(tokens), first_tokens=np.asarray([s[0] for s in seqs], np.int32),
                      first_logprobs=np.full(num_samples, -0.1, np.float32), sampling=sampling,
                      sample_indices=tuple(range(sample_offset, sample_offset + num_samples)))

    def insert(self, prefix, state, slot, sample=0):
        if state[slot] is not None:
            raise RuntimeError(f"insert into busy slot {slot}")
        state[slot] = {"seq": prefix.kv[1][sample], "pos": 1, "sp": prefix.sampling, "len": prefix.length + 1}
        return state

    def generate(self, params, state, num_steps=1):
        self.num_steps += 1
        if self.step_latency_s:
            time.sleep(self.step_latency_s)
        S = self.num_slots
        tokens, lps = np.zeros(S, np.int32), np.zeros(S, np.float32)
        valid, done = np.zeros(S, bool), np.zeros(S, bool)
        for i, s in enumerate(state):
            if s is None or s.get("done"):
                continue
            seq, j = s["seq"], s["pos"]
            tok = seq[min(j, len(seq) - 1)]
            s["pos"] += 1
            s["len"] += 1
            s["done"] = (tok in s["sp"].stop_token_ids or s["pos"] >= s["sp"].max_new_tokens
                         or s["len"] >= self.max_len)
            tokens[i], lps[i], valid[i], done[i] = tok, -0.1 * (j + 1), True, s["done"]
        return state, StepResult(tokens, lps, valid, done)

    def release(self, state, slot):
        state[slot] = None
        return state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capturing(app: Any, bodies: list) -> Any:
    """The ASGI ``app`` appending the JSON body of every POST it receives to ``bodies`` (what a client sent);
    a plain ASGI wrapper, so the routes still see their client disconnect."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        try:
            bodies.append(json.loads(body))
        except ValueError:
            bodies.append(body)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await app(scope, replay, send)
    return wrapped


@contextlib.contextmanager
def running_server(backend: Any, api_key: str | None = None, bodies: list | None = None):
    """A uvicorn server of ``build_app(backend)`` on a free port in a thread; yields its base URL (``.../v1``).
    With ``bodies``, the JSON body of every POST request is appended to it."""
    import uvicorn

    from jaxrl_async.serve.app import build_app

    app = build_app(backend, api_key=api_key)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app if bodies is None else capturing(app, bodies), host="127.0.0.1",
                                          port=port, log_level="warning", timeout_graceful_shutdown=2))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not t.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        t.join(15)


@contextlib.contextmanager
def script_backend(tokenizer: Any, script: Callable, *, num_slots: int = 4, step_latency_s: float = 0.0,
                   eos_ids: Sequence[int] = (2,), **kw: Any):
    """A started generator on a ``ScriptEngine`` and its ``ServeBackend``."""
    from jaxrl_async.generator.orchestrator import Generator
    from jaxrl_async.serve.backend import ServeBackend

    engine = ScriptEngine(script, num_slots=num_slots, step_latency_s=step_latency_s)
    with Generator(engine, params=None, tokenizer=tokenizer) as gen:
        yield ServeBackend(gen, tokenizer, model_name="tiny", vocab_size=128, eos_ids=eos_ids, **kw)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
