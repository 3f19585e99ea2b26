"""The OpenAI wire format of ``serve``: request validation (one :class:`APIError` naming the offending field), the
tool-call parser of the Qwen/Hermes ``<tool_call>`` format, and the response bodies.

Requests are checked by hand rather than by pydantic models so that every refusal names the field the way OpenAI's
API does (``{"error": {"message", "type", "param", "code"}}``, ``param`` the field), and so that this module
imports nothing outside the standard library (the ``serve`` extra's packages are imported where the server starts).
Unknown fields are ignored (as vLLM does), and so are known ones that change nothing about the output here
(``store``, ``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``, ``prediction``, ``reasoning_effort``,
``verbosity``); fields the engine cannot honour (penalties, ``logit_bias``, forced tool choices, ``response_format`` other
than text, audio output, the deprecated ``functions``, more ``top_logprobs`` / completions ``logprobs`` than the
server's ``--max-top-logprobs``) are refused with a 400 naming them
rather than silently ignored. ``parallel_tool_calls`` false keeps the first parsed call (as vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import time
import uuid
from typing import Any

MAX_N = 128
MAX_TOP_LOGPROBS = 20  # OpenAI's largest top_logprobs (chat); the server's own limit is --max-top-logprobs
MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                             409: "invalid_request_error", 429: "rate_limit_error",
                             504: "timeout_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}" if not message.startswith(param) else message, param=param, code=code)


# ---------------------------------------------------------------------------------------------
# Field checks
# ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, name: str, default: Any = None) -> Any:
    v = body.get(name, default)
    return default if v is None else v


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = _get(body, name, default)
    if not _is_num(v) or v != v:
        raise bad(name, f"must be a number, got {v!r}")
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = _get(body, name, default)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise bad(name, f"must be in [{lo}, {hi}], got {v}" if hi is not None else f"must be >= {lo}, got {v}")
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = _get(body, name, default)
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {v!r}")
    return v


@dataclasses.dataclass
class Sampling:
    """The sampling fields shared by both endpoints (``max_tokens`` None: up to the context)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False


def parse_sampling(body: dict, vocab_size: int, max_tokens_default: int | None) -> Sampling:
    s = Sampling()
    s.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    s.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _get(body, "top_k", 0)
    if not _is_int(top_k) or top_k < -1:
        raise bad("top_k", f"must be an integer >= -1 (-1 or 0: no top-k), got {top_k!r}")
    s.top_k = max(top_k, 0)
    s.max_tokens = max_tokens_default
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins
        v = _integer(body, name, None, 1)
        if v is not None:
            s.max_tokens = v
    s.n = _integer(body, "n", 1, 1, MAX_N)
    stop = _get(body, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise bad("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP:
        raise bad("stop", f"at most {MAX_STOP} stop strings, got {len(stop)}")
    if any(x == "" for x in stop):
        raise bad("stop", "stop strings must not be empty")
    s.stop = tuple(dict.fromkeys(stop))
    ids = _get(body, "stop_token_ids", [])
    if not isinstance(ids, list) or not all(_is_int(x) and 0 <= x < vocab_size for x in ids):
        raise bad("stop_token_ids", f"must be a list of token ids in [0, {vocab_size})")
    s.stop_token_ids = tuple(ids)
    s.ignore_eos = _bool(body, "ignore_eos")
    seed = _get(body, "seed", None)
    if seed is not None and not _is_int(seed):
        raise bad("seed", f"must be an integer, got {seed!r}")
    s.seed = seed
    s.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "must be an object")
        if not s.stream:
            raise bad("stream_options", "is only allowed when stream is true")
        s.include_usage = _bool(opts, "include_usage") if "include_usage" in opts else False
    for name in ("presence_penalty", "frequency_penalty"):
        v = _get(body, name, 0)
        if not _is_num(v) or v != 0:
            raise bad(name, "is not supported by this server (only 0)")
    rp = _get(body, "repetition_penalty", 1)
    if not _is_num(rp) or rp != 1:
        raise bad("repetition_penalty", "is not supported by this server (only 1)")
    if body.get("logit_bias"):
        raise bad("logit_bias", "is not supported by this server")
    return s


def seed_of(s: Sampling) -> int:
    """The engine's seed of a request: its own modulo 2**32, else a random one."""
    return s.seed % 2 ** 32 if s.seed is not None else secrets.randbits(32)


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise APIError(400, f"model: the model {model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


# ---------------------------------------------------------------------------------------------
# Chat requests
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ChatRequest:
    messages: list[dict]
    sampling: Sampling
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict] | None = None
    parse_tools: bool = False  # tools given and tool_choice "auto"
    parallel_tool_calls: bool = True  # False: only the first parsed call is returned (as vLLM)
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def _content_text(content: Any, where: str, role: str | None = None) -> str | None:
    """A message's content as text: text parts joined; an assistant's ``refusal`` parts are its text (as vLLM)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            key = "refusal" if kind == "refusal" and role == "assistant" else "text"
            if kind != key or not isinstance(part.get(key), str):
                raise bad(f"{where}.content[{j}]", f"only text parts are supported, got {kind!r}")
            parts.append(part[key])
        return "".join(parts)
    raise bad(f"{where}.content", "must be a string, a list of text parts or null")


def _tool_calls_for_template(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool calls as chat templates expect them: ``arguments`` a JSON string in the API, an
    object for the template (as vLLM passes them), so the model sees the JSON it would have produced."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls", "must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}.tool_calls[{j}]", "must be {'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"{where}.tool_calls[{j}].function.arguments", "must be a JSON object (as a string)") from None
        out.append({**c, "type": c.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


def parse_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"must be one of {list(ROLES)}, got {role!r}")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = _content_text(m.get("content"), where, role)
        if role == "developer":  # OpenAI's newer name of the system role; templates know "system"
            msg["role"] = "system"
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls_for_template(m["tool_calls"], where)
        elif msg["content"] is None:
            if role != "assistant":
                raise bad(f"{where}.content", f"a {role} message needs content")
            msg["content"] = ""
        if role == "tool" and "tool_call_id" in m and not isinstance(m["tool_call_id"], str):
            raise bad(f"{where}.tool_call_id", "must be a string")
        out.append(msg)
    return out


def parse_tools(body: dict) -> tuple[list[dict] | None, bool]:
    for name in ("functions", "function_call"):  # the deprecated function calling: a client would wait for calls
        if body.get(name) is not None:
            raise bad(name, "the deprecated function-calling fields are not supported; use tools and tool_choice")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools")
        return None, False
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of {'type': 'function', 'function': {...}}")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{j}]", "must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{j}].function.name", "must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{j}].function.parameters", "must be a JSON schema object")
    choice = "auto" if choice is None else choice
    if choice not in ("auto", "none"):
        raise bad("tool_choice", "only 'auto' and 'none' are supported (forcing a call needs constrained decoding, "
                                 f"which this server does not do), got {choice!r}")
    return (tools or None), bool(tools) and choice == "auto"


def _top_limit(name: str, k: int, max_top_logprobs: int) -> None:
    if k > max_top_logprobs:
        raise bad(name, f"at most {max_top_logprobs} on this server (serve's --max-top-logprobs; in an RL run "
                        f"rollout.engine.max_top_logprobs), got {k}")


def parse_chat(body: Any, served: str, vocab_size: int, max_top_logprobs: int = 0) -> ChatRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_model(body, served)
    messages = parse_messages(body.get("messages"))
    sampling = parse_sampling(body, vocab_size, None)
    logprobs = _bool(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top > 0 and not logprobs:
        raise bad("top_logprobs", "needs logprobs to be true")
    _top_limit("top_logprobs", top, max_top_logprobs)
    tools, parse = parse_tools(body)
    parallel = _bool(body, "parallel_tool_calls", True)  # (accepted without tools, as vLLM)
    modalities = _get(body, "modalities", ["text"])
    if not isinstance(modalities, list) or any(m != "text" for m in modalities):
        raise bad("modalities", f"this server produces text only (['text']), got {modalities!r}")
    if body.get("audio") is not None:
        raise bad("audio", "audio output is not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("response_format", "only {'type': 'text'} is supported")
    kwargs = _get(body, "chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "must be an object")
    reserved = {"messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message", "conversation"}
    if reserved & set(kwargs):
        raise bad("chat_template_kwargs", f"must not set {sorted(reserved & set(kwargs))}")
    cont = _bool(body, "continue_final_message")
    agp = _bool(body, "add_generation_prompt", not cont)
    if cont and (agp or messages[-1]["role"] != "assistant"):
        raise bad("continue_final_message", "needs a final assistant message and add_generation_prompt false")
    return ChatRequest(messages, sampling, logprobs, top, tools, parse, parallel, kwargs, agp, cont)


# ---------------------------------------------------------------------------------------------
# Completion requests
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CompletionRequest:
    prompts: list[str | list[int]]  # text or token ids, one per prompt
    sampling: Sampling
    logprobs: bool = False
    echo: bool = False
    top_logprobs: int = 0  # the ``logprobs`` field: alternatives per token


def parse_completion(body: Any, served: str, vocab_size: int, max_top_logprobs: int = 0) -> CompletionRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_model(body, served)
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(x) for x in p)):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in p):
        prompts = list(p)
    else:
        raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of lists of token ids")
    for i, q in enumerate(prompts):
        if not q:
            raise bad("prompt", f"prompt {i} is empty")
        if isinstance(q, list) and any(not 0 <= t < vocab_size for t in q):
            raise bad("prompt", f"prompt {i}: token ids must be in [0, {vocab_size})")
    if body.get("suffix"):
        raise bad("suffix", "is not supported by this server")
    if _get(body, "best_of", 1) != 1:
        raise bad("best_of", "is not supported by this server (only 1)")
    sampling = parse_sampling(body, vocab_size, 16)  # OpenAI's default max_tokens of /v1/completions
    lp = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    if lp is not None:
        _top_limit("logprobs", lp, max_top_logprobs)
    echo = _bool(body, "echo")
    if echo and lp is not None:
        raise bad("echo", "echo with logprobs (prompt log-probs) is not supported; score prompts with "
                          "python -m jaxrl_async.score")
    return CompletionRequest(prompts, sampling, lp is not None, echo, lp or 0)


# ---------------------------------------------------------------------------------------------
# Tool calls (Qwen2.5 / Qwen3 / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>)
# ---------------------------------------------------------------------------------------------
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the first call, tool calls) of a completion in the ``<tool_call>`` JSON format; a text
    with no call, or one whose calls are not all valid JSON with a ``name``, is content only."""
    if TOOL_OPEN not in text:
        return text, []
    calls = []
    for m in _TOOL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1).strip())
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    content = text[:text.index(TOOL_OPEN)].strip()
    return (content or None), calls


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_entry(t: str, lp: float) -> dict:
    return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}


def chat_logprobs(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]] | None = None
                  ) -> dict:
    """``choices[i].logprobs`` of a chat completion: per token ``{token, logprob, bytes, top_logprobs}``, the
    ``top_logprobs`` a list of ``{token, logprob, bytes}`` (``tops``: per token (string, log-prob) pairs, descending;
    None: none)."""
    tops = tops if tops is not None else [[] for _ in tokens]
    return {"content": [{**_token_entry(t, lp), "top_logprobs": [_token_entry(a, b) for a, b in top]}
                        for t, lp, top in zip(tokens, logprobs, tops)]}


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int = 0,
                        tops: list[list[tuple[str, float]]] | None = None) -> dict:
    """``choices[i].logprobs`` of a (legacy) completion; ``top_logprobs`` (with ``tops``: per token its (string,
    log-prob) pairs) is per token a dict string -> log-prob that, as OpenAI's, also holds the sampled token (up to
    ``logprobs`` + 1 entries; tokens decoding to the same string share an entry, the likelier one's); None without."""
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top_dicts = None
    if tops is not None:
        top_dicts = []
        for t, lp, top in zip(tokens, logprobs, tops):
            d: dict[str, float] = {}
            for a, b in top:
                d.setdefault(a, b)
            d.setdefault(t, lp)
            top_dicts.append(d)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_dicts, "text_offset": offsets}
