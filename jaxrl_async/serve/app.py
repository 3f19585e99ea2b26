"""The routes of ``serve`` (FastAPI): ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /health``; OpenAI's error shape for every failure; the API key; server-sent events for ``stream``.

Every response carries, beyond OpenAI's fields, the exact tokens of the request (as vLLM's ``return_token_ids``):
``prompt_token_ids`` (top level for chat, per choice for completions), and per choice ``token_ids``,
``token_logprobs`` (the behaviour log-probs of those tokens: log-softmax of the temperature-scaled logits the token
was sampled from; raw logits when greedy) and ``policy_versions`` (the weights' version of every token), and
``policy_version`` at the top (the newest version that produced a token of the response).

FastAPI is imported inside :func:`build_app` (the ``serve`` extra; the package imports without it).
"""

import json
import secrets
from typing import Any, AsyncIterator

from jaxrl_async.serve.backend import Batch, ClientGone, ServeBackend, TextStream, final_text
from jaxrl_async.serve.sessions import Session, SessionStore
from jaxrl_async.serve.protocol import (APIError, chat_logprobs, completion_logprobs, new_id, now, parse_chat,
                                        parse_completion, usage)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _versions_top(outputs: list, backend: ServeBackend) -> int:
    vs = [v for o in outputs if o is not None for s in o.samples for v in s.versions]
    return max(vs) if vs else int(backend.generator.version)


def _record_fields(sample: Any) -> dict:
    return {"token_ids": list(sample.completion_ids), "token_logprobs": list(sample.logprobs),
            "policy_versions": list(sample.versions)}


def build_app(backend: ServeBackend, api_key: str | None = None, sessions: SessionStore | None = None) -> Any:
    """The FastAPI application serving ``backend``; with ``api_key`` every ``/v1`` route needs
    ``Authorization: Bearer <api_key>``; with ``sessions`` (the agent workflow's endpoint) the session routes too
    (``add_session_routes``)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="jaxrl_async serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, e: HTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, str(e)))

    def check_key(request: Request) -> None:
        """(A route's first step; not a BaseHTTPMiddleware, under which a route cannot see its client leave.)"""
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "policy_version": int(backend.generator.version), "in_flight": backend.in_flight}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_key(request)
        return {"object": "list", "data": [{"id": backend.model_name, "object": "model", "created": backend.created,
                                            "owned_by": "jaxrl_async", "max_model_len": backend.max_model_len}]}

    # -- chat -------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_key(request)
        return await chat_call(request, None)

    async def chat_call(request: Request, session: Session | None):
        req = parse_chat(await read_json(request), backend.model_name, backend.vocab_size, backend.max_top_logprobs)
        prompt = backend.render_chat(req)
        sp = backend.sampling_params(req.sampling, backend.budget(len(prompt), req.sampling.max_tokens, "messages"),
                                     req.top_logprobs)
        batch = backend.submit([prompt], sp, req.sampling.stream, "chat", metadata=call_meta(session, 1))
        rid, created = new_id("chatcmpl"), now()
        head = {"id": rid, "created": created, "model": backend.model_name}
        if req.sampling.stream:
            return StreamingResponse(chat_stream(request, batch, req, prompt, head), media_type="text/event-stream")
        try:
            async for _ in batch.events(request.is_disconnected):
                pass
        except ClientGone:
            return JSONResponse({}, status_code=499)
        out = batch.outputs[0]
        choices = []
        for s in out.samples:
            content, calls, reason = final_text(s.text or "", s.finish_reason, req.sampling.stop, req.parse_tools,
                                                req.parallel_tool_calls)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": s.sample_index, "message": message, "finish_reason": reason,
                            "logprobs": chat_logprobs(backend.token_strings(s.completion_ids), s.logprobs,
                                                      backend.top_strings(s.top_logprobs)) if req.logprobs else None,
                            **_record_fields(s)})
        n_out = sum(len(s.completion_ids) for s in out.samples)
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage(len(prompt), n_out),
                "system_fingerprint": None, "prompt_token_ids": prompt,
                "policy_version": _versions_top(batch.outputs, backend)}

    async def chat_stream(request: Request, batch: Batch, req: Any, prompt: list[int], head: dict) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        n = req.sampling.n
        texts = [TextStream(backend.decode, req.sampling.stop, req.parse_tools, req.parallel_tool_calls)
                 for _ in range(n)]
        completion_tokens = 0
        try:
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                            "finish_reason": None} for i in range(n)], "prompt_token_ids": prompt})
            async for kind, _, ev in batch.events(request.is_disconnected):
                if kind != "chunk":
                    continue
                i, ids = ev.sample_index, list(ev.token_ids)
                completion_tokens += len(ids)
                delta: dict[str, Any] = {}
                text = texts[i].push(ids)
                reason = None
                if ev.finish_reason is not None:
                    rest, calls, reason = texts[i].finish(ev.finish_reason)
                    text += rest
                    if calls:
                        delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)]
                if text:
                    delta["content"] = text
                yield sse({**head, "choices": [{
                    "index": i, "delta": delta, "finish_reason": reason,
                    "logprobs": chat_logprobs(backend.token_strings(ids), list(ev.logprobs),
                                              backend.top_strings(ev.top_logprobs)) if req.logprobs else None,
                    "token_ids": ids, "token_logprobs": list(ev.logprobs), "policy_versions": list(ev.versions)}]})
            if req.sampling.include_usage:
                yield sse({**head, "choices": [], "usage": usage(len(prompt), completion_tokens),
                           "policy_version": _versions_top(batch.outputs, backend)})
            yield "data: [DONE]\n\n"
        except ClientGone:
            return
        except APIError as e:  # the status line is sent: the error is the stream's last event
            yield sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            if not batch.finished:
                batch.abort()

    # -- completions ------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        return await completions_call(request, None)

    async def completions_call(request: Request, session: Session | None):
        req = parse_completion(await read_json(request), backend.model_name, backend.vocab_size,
                               backend.max_top_logprobs)
        prompts = [backend.encode_prompt(p) for p in req.prompts]
        budgets = [backend.budget(len(p), req.sampling.max_tokens, "prompt") for p in prompts]
        sp = backend.sampling_params(req.sampling, min(budgets), req.top_logprobs)
        batch = backend.submit(prompts, sp, req.sampling.stream, "cmpl", metadata=call_meta(session, len(prompts)))
        head = {"id": new_id("cmpl"), "created": now(), "model": backend.model_name, "object": "text_completion"}
        prompt_texts = [p if isinstance(p, str) else backend.decode(p) for p in req.prompts]
        n = req.sampling.n
        if req.sampling.stream:
            return StreamingResponse(completion_stream(request, batch, req, prompts, prompt_texts, head),
                                     media_type="text/event-stream")
        try:
            async for _ in batch.events(request.is_disconnected):
                pass
        except ClientGone:
            return JSONResponse({}, status_code=499)
        choices = []
        for p, out in enumerate(batch.outputs):
            for s in out.samples:
                text, _, reason = final_text(s.text or "", s.finish_reason, req.sampling.stop, False)
                lp = None
                if req.logprobs:
                    toks = backend.token_strings(s.completion_ids)
                    lp = completion_logprobs(toks, list(s.logprobs), tops=backend.top_strings(s.top_logprobs)
                                             if req.top_logprobs else None)
                choices.append({"index": p * n + s.sample_index, "text": (prompt_texts[p] if req.echo else "") + text,
                                "logprobs": lp, "finish_reason": reason, "prompt_token_ids": prompts[p],
                                **_record_fields(s)})
        n_out = sum(len(s.completion_ids) for o in batch.outputs for s in o.samples)
        return {**head, "choices": choices, "usage": usage(sum(len(p) for p in prompts), n_out),
                "system_fingerprint": None, "policy_version": _versions_top(batch.outputs, backend)}

    async def completion_stream(request: Request, batch: Batch, req: Any, prompts: list, prompt_texts: list[str],
                                head: dict) -> AsyncIterator[str]:
        n = req.sampling.n
        texts = {}
        completion_tokens = 0
        try:
            for p in range(len(prompts)):
                for k in range(n):
                    texts[p, k] = TextStream(backend.decode, req.sampling.stop, False)
                    if req.echo:
                        yield sse({**head, "choices": [{"index": p * n + k, "text": prompt_texts[p], "logprobs": None,
                                                        "finish_reason": None, "prompt_token_ids": prompts[p]}]})
            async for kind, p, ev in batch.events(request.is_disconnected):
                if kind != "chunk":
                    continue
                ids = list(ev.token_ids)
                completion_tokens += len(ids)
                st = texts[p, ev.sample_index]
                text, reason = st.push(ids), None
                if ev.finish_reason is not None:
                    rest, _, reason = st.finish(ev.finish_reason)
                    text += rest
                lp = completion_logprobs(backend.token_strings(ids), list(ev.logprobs), tops=backend.top_strings(
                    ev.top_logprobs) if req.top_logprobs else None) if req.logprobs else None
                yield sse({**head, "choices": [{"index": p * n + ev.sample_index, "text": text, "logprobs": lp,
                                                "finish_reason": reason, "token_ids": ids,
                                                "token_logprobs": list(ev.logprobs),
                                                "policy_versions": list(ev.versions)}]})
            if req.sampling.include_usage:
                yield sse({**head, "choices": [], "usage": usage(sum(len(q) for q in prompts), completion_tokens),
                           "policy_version": _versions_top(batch.outputs, backend)})
            yield "data: [DONE]\n\n"
        except ClientGone:
            return
        except APIError as e:
            yield sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            if not batch.finished:
                batch.abort()

    if sessions is not None:
        add_session_routes(app, sessions, check_key, read_json, chat_call, completions_call, models)
    return app


def call_meta(session: Session | None, requests: int) -> dict | None:
    """The generator requests' metadata that files a call (``requests`` prompts) under its session, in submission
    order."""
    return None if session is None else {"session": session.id, "seq": session.next_seq(requests)}


def add_session_routes(app: Any, sessions: SessionStore, check_key: Any, read_json: Any, chat_call: Any,
                       completions_call: Any, models: Any) -> None:
    """The agent-session routes (``serve/sessions.py``): ``/sessions/{id}/v1/...`` (an OpenAI base URL per
    episode, every call recorded), ``POST /v1/sessions`` (online agents claim an offered episode: its id, base
    URL and dataset row; 429 when none is offered), ``POST /v1/sessions/{id}/reward`` (``{"reward": x}``, ends
    the episode for training), ``GET /v1/sessions/{id}`` (what has been recorded)."""
    from fastapi import Request

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def session_chat(sid: str, request: Request):
        check_key(request)
        return await chat_call(request, sessions.get(sid))

    @app.post("/sessions/{sid}/v1/completions")
    async def session_completions(sid: str, request: Request):
        check_key(request)
        return await completions_call(request, sessions.get(sid))

    @app.get("/sessions/{sid}/v1/models")
    async def session_models(sid: str, request: Request):
        check_key(request)
        sessions.get(sid)
        return await models(request)

    @app.post("/v1/sessions")
    async def claim(request: Request):
        check_key(request)
        s = sessions.claim()
        base = str(request.base_url).rstrip("/")
        return {"session_id": s.id, "base_url": f"{base}/sessions/{s.id}/v1", "row": s.row}

    @app.post("/v1/sessions/{sid}/reward")
    async def reward(sid: str, request: Request):
        check_key(request)
        body = await read_json(request)
        if not isinstance(body, dict) or "reward" not in body:
            raise APIError(400, "reward: the body must be a JSON object with a 'reward' number", param="reward")
        s = sessions.set_reward(sid, body["reward"])
        return {"session_id": s.id, "reward": s.reward, "calls": len(s.calls)}

    @app.get("/v1/sessions/{sid}")
    async def session_info(sid: str, request: Request):
        check_key(request)
        s = sessions.get(sid)
        calls = s.ordered_calls()
        return {"session_id": s.id, "calls": len(calls), "aborted_calls": s.aborted_calls,
                "completion_tokens": sum(len(c.completion_ids) for c in calls),
                "policy_versions": sorted({v for c in calls for v in c.versions})}
