"""The server's HTTP behaviour on a scripted engine (no model, nothing to compile): every field of the OpenAI
requests, the error shape, 401/429/504, streaming, tool calls, stop strings, and aborts on disconnect."""
from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import running_server, script_backend, wait_until

TOOL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def text_script(tok, texts):
    """Sample k emits texts[k % len(texts)] then EOS (id 2)."""
    def script(prompt, k, sp):
        return tok(texts[k % len(texts)], add_special_tokens=False)["input_ids"] + [2]
    return script


def error_of(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if param:
        assert param in err["message"]
    return err["message"]


def chat(url, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return httpx.post(f"{url}/chat/completions", json={"model": "tiny", **body}, timeout=30)


def sse_events(r: httpx.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_models_chat_record_fields_and_n(tok):
    with script_backend(tok, text_script(tok, ["one", "two", "three"])) as b, running_server(b) as url:
        m = httpx.get(f"{url}/models").json()
        assert m["data"][0]["id"] == "tiny" and m["object"] == "list"
        records = []
        b.recorders.append(records.append)
        r = chat(url, n=3, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        body = r.json()
        assert r.status_code == 200, body
        assert [c["message"]["content"] for c in body["choices"]] == ["one", "two", "three"]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["finish_reason"] == "stop" and c["logprobs"] is None for c in body["choices"])
        prompt = tok("<|system|>be brief<|user|>hi<|assistant|>", add_special_tokens=False)["input_ids"]
        assert body["prompt_token_ids"] == prompt
        c0 = body["choices"][0]
        assert c0["token_ids"] == tok("one", add_special_tokens=False)["input_ids"] + [2]
        assert c0["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
        assert c0["policy_versions"] == [0] * 4 and body["policy_version"] == 0
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4 + 4 + 6, "total_tokens": len(prompt) + 14}
        assert len(records) == 1 and records[0].prompt_ids == prompt and records[0].endpoint == "chat"
        assert [s.completion_ids for s in records[0].samples] == [c["token_ids"] for c in body["choices"]]
        # max_tokens / max_completion_tokens: finish_reason length
        r = chat(url, max_tokens=2).json()
        assert r["choices"][0]["message"]["content"] == "on" and r["choices"][0]["finish_reason"] == "length"
        r = chat(url, max_tokens=1, max_completion_tokens=2).json()
        assert r["choices"][0]["message"]["content"] == "on"
        assert b.in_flight == 0


def test_logprobs_and_top_logprobs(tok):
    with script_backend(tok, text_script(tok, ["ab"])) as b, running_server(b) as url:
        c = chat(url, logprobs=True).json()["choices"][0]
        content = c["logprobs"]["content"]
        assert [e["token"] for e in content] == ["a", "b", "</s>"]
        assert [e["logprob"] for e in content] == c["token_logprobs"]
        assert content[0]["bytes"] == [97] and content[0]["top_logprobs"] == []
        assert chat(url, logprobs=True, top_logprobs=0).status_code == 200
        # this engine computes no alternatives (max_top_logprobs 0): the limit is named
        msg = error_of(chat(url, logprobs=True, top_logprobs=2), 400, "top_logprobs")
        assert "at most 0 on this server (serve's --max-top-logprobs; in an RL run rollout.engine.max_top_logprobs), " \
               "got 2" in msg
        assert "needs logprobs" in error_of(chat(url, top_logprobs=2), 400, "top_logprobs")
        assert "must be in [0, 20]" in error_of(chat(url, logprobs=True, top_logprobs=21), 400, "top_logprobs")


def test_stop_strings(tok):
    with script_backend(tok, text_script(tok, ["hello STOP world"])) as b, running_server(b) as url:
        c = chat(url, stop="STOP").json()["choices"][0]
        assert c["message"]["content"] == "hello " and c["finish_reason"] == "stop"
        assert tok.decode(c["token_ids"]).startswith("hello STOP")  # the tokens keep the stop string
        c = chat(url, stop=["xyz", "lo S"]).json()["choices"][0]
        assert c["message"]["content"] == "hel"
        r = chat(url, stop=["STOP"], stream=True)
        events = sse_events(r)
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        assert text == "hello " and events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        error_of(chat(url, stop=[""]), 400, "stop")
        error_of(chat(url, stop=5), 400, "stop")


def test_stream_chunks_and_usage(tok):
    with script_backend(tok, text_script(tok, ["abc", "xy"])) as b, running_server(b) as url:
        r = chat(url, n=2, stream=True, stream_options={"include_usage": True}, logprobs=True)
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        first, usage = events[0], events[-2]
        assert first["object"] == "chat.completion.chunk" and first["prompt_token_ids"]
        assert {c["delta"]["role"] for c in first["choices"]} == {"assistant"}
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4 + 3
        by_choice = {0: "", 1: ""}
        ids = {0: [], 1: []}
        for e in events[1:-2]:
            for c in e["choices"]:
                by_choice[c["index"]] += c["delta"].get("content", "")
                ids[c["index"]] += c["token_ids"]
                assert len(c["logprobs"]["content"]) == len(c["token_ids"])
        assert by_choice == {0: "abc", 1: "xy"}
        assert ids[0] == tok("abc", add_special_tokens=False)["input_ids"] + [2]
        # no usage chunk without include_usage; stream_options without stream is refused
        events = sse_events(chat(url, stream=True))
        assert all("usage" not in e for e in events[:-1])
        error_of(chat(url, stream_options={"include_usage": True}), 400, "stream_options")


def test_tool_calls_parsed(tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with script_backend(tok, text_script(tok, [TOOL_TEXT])) as b, running_server(b) as url:
        body = chat(url, tools=tools).json()
        c = body["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        call = c["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
        # the tools are in the prompt the template built
        assert tok.decode(body["prompt_token_ids"]).startswith("<|tools|>add;")
        # tool_choice none: the text stays content
        c = chat(url, tools=tools, tool_choice="none").json()["choices"][0]
        assert c["message"]["content"] == TOOL_TEXT and c["finish_reason"] == "stop"
        # a conversation with an assistant tool call and a tool result renders the call as the model wrote it
        msgs = [{"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None, "tool_calls": [dict(call)]},
                {"role": "tool", "tool_call_id": call["id"], "content": "3"}]
        body = chat(url, tools=tools, messages=msgs).json()
        assert TOOL_TEXT in tok.decode(body["prompt_token_ids"])
        # streamed: the call arrives as a tool_calls delta, no <tool_call> text leaks into the content
        events = sse_events(chat(url, tools=tools, stream=True))
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        deltas = [tc for e in events[:-1] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
        assert content == "" and len(deltas) == 1 and deltas[0]["function"]["name"] == "add"
        assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
        error_of(chat(url, tools=tools, tool_choice="required"), 400, "tool_choice")
        error_of(chat(url, tools=[{"type": "function", "function": {}}]), 400, "tools[0].function.name")


def test_fields_agent_frameworks_send(tok):
    """The fields of the OpenAI API that clients such as the Agents SDK and LangChain send: harmless ones are
    accepted and ignored, parallel_tool_calls false keeps the first call (as vLLM), refusal parts of an assistant
    message are its text, and fields whose semantics this server lacks are a 400 naming them."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    two = TOOL_TEXT + TOOL_TEXT.replace('"a": 1', '"a": 5')
    with script_backend(tok, text_script(tok, [two])) as b, running_server(b) as url:
        ok = dict(store=False, metadata={"k": "v"}, user="u1", service_tier="auto", prompt_cache_key="p",
                  reasoning_effort="low", verbosity="low", prediction={"type": "content", "content": "x"},
                  response_format={"type": "text"}, modalities=["text"], stream_options=None, logprobs=None,
                  top_logprobs=None, max_completion_tokens=200, n=1)
        r = chat(url, tools=tools, tool_choice="auto", **ok)
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"])["a"] for c in calls] == [1, 5]  # parallel_tool_calls: true
        c = chat(url, tools=tools, parallel_tool_calls=False).json()["choices"][0]
        assert len(c["message"]["tool_calls"]) == 1 and c["finish_reason"] == "tool_calls"
        assert json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
        assert tok.decode(c["token_ids"]).count("<tool_call>") == 2  # the tokens keep what the model wrote
        events = sse_events(chat(url, tools=tools, parallel_tool_calls=False, stream=True))
        deltas = [tc for e in events[:-1] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
        assert len(deltas) == 1 and deltas[0]["index"] == 0
        assert chat(url, parallel_tool_calls=False).status_code == 200  # without tools: accepted (as vLLM)
        error_of(chat(url, tools=tools, parallel_tool_calls="no"), 400, "parallel_tool_calls")
        # an assistant turn the model refused: its refusal part is its text; a user's refusal part is refused
        msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": "y"}]
        assert "<|assistant|>no<|user|>y" in tok.decode(chat(url, messages=msgs).json()["prompt_token_ids"])
        error_of(chat(url, messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]), 400,
                 "messages[0].content[0]")
        # semantics this server does not have
        error_of(chat(url, functions=[{"name": "add", "parameters": {}}]), 400, "functions")
        error_of(chat(url, function_call="auto"), 400, "function_call")
        error_of(chat(url, modalities=["text", "audio"]), 400, "modalities")
        error_of(chat(url, audio={"voice": "alloy", "format": "wav"}), 400, "audio")
        error_of(chat(url, response_format={"type": "json_object"}), 400, "response_format")
        error_of(chat(url, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}), 400,
                 "response_format")
        error_of(chat(url, tools=tools, tool_choice={"type": "function", "function": {"name": "add"}}), 400,
                 "tool_choice")


def test_openai_sdk_against_the_server(tok):
    """The openai client (sync, streaming, tools) parses every response."""
    import openai

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with script_backend(tok, text_script(tok, [TOOL_TEXT])) as b, running_server(b, api_key="k") as url:
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+2?"}], tools=tools)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.name == "add"
        assert r.model_extra["prompt_token_ids"] and r.choices[0].model_extra["token_ids"]
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+2?"}],
                                                tools=tools, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == len(r.choices[0].model_extra["token_ids"])
        assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
        assert e.value.body["param"] == "model"


def test_completions_text_ids_echo_logprobs(tok):
    with script_backend(tok, text_script(tok, ["xyz"])) as b, running_server(b) as url:
        def post(**body):
            return httpx.post(f"{url}/completions", json={"model": "tiny", **body}, timeout=30)

        body = post(prompt="ab", echo=True).json()
        c = body["choices"][0]
        assert body["object"] == "text_completion" and c["text"] == "abxyz" and c["finish_reason"] == "stop"
        assert c["prompt_token_ids"] == tok("ab")["input_ids"] and c["token_ids"][-1] == 2
        body = post(prompt=[[5, 6], [7]], n=2, max_tokens=2, logprobs=0).json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["prompt_token_ids"] for c in body["choices"]] == [[5, 6], [5, 6], [7], [7]]
        lp = body["choices"][0]["logprobs"]
        assert lp["tokens"] == ["x", "y"] and lp["token_logprobs"] == pytest.approx([-0.1, -0.2]) and lp["text_offset"] == [0, 1]
        assert body["choices"][0]["finish_reason"] == "length"
        events = sse_events(httpx.post(f"{url}/completions", json={"prompt": [5], "stream": True, "echo": True,
                                                                     "stream_options": {"include_usage": True}}))
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == tok.decode([5]) + "xyz"
        assert events[-2]["usage"]["prompt_tokens"] == 1
        assert "at most 0 on this server" in error_of(post(prompt="ab", logprobs=2), 400, "logprobs")
        error_of(post(prompt="ab", echo=True, logprobs=0), 400, "echo")
        error_of(post(prompt=[]), 400, "prompt")
        error_of(post(prompt=[1000]), 400, "prompt")
        error_of(post(prompt="a" * 3000), 400, "prompt")


def test_errors_name_their_field(tok):
    with script_backend(tok, text_script(tok, ["a"])) as b, running_server(b) as url:
        assert "does not exist" in error_of(chat(url, model="gpt-4"), 400, "model")
        error_of(chat(url, n=0), 400, "n")
        error_of(chat(url, n="2"), 400, "n")
        error_of(chat(url, temperature=-1), 400, "temperature")
        error_of(chat(url, temperature=3), 400, "temperature")
        error_of(chat(url, top_p=0), 400, "top_p")
        error_of(chat(url, max_tokens=0), 400, "max_tokens")
        error_of(chat(url, max_tokens=5000), 400, "max_tokens")
        error_of(chat(url, seed="x"), 400, "seed")
        error_of(chat(url, presence_penalty=0.5), 400, "presence_penalty")
        error_of(chat(url, messages=[]), 400, "messages")
        error_of(chat(url, messages="hi"), 400, "messages")
        error_of(chat(url, messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role")
        error_of(chat(url, messages=[{"role": "user", "content": None}]), 400, "messages[0].content")
        error_of(chat(url, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
                 "messages[0].content[0]")
        msg = error_of(chat(url, messages=[{"role": "user", "content": "a" * 3000}]), 400, "messages")
        assert "context" in msg
        r = httpx.post(f"{url}/chat/completions", content=b"{not json", timeout=10)
        error_of(r, 400, None)
        assert httpx.get(f"{url}/nope").json()["error"]["code"] == "404"
        # text parts are joined; the developer role is the system role
        r = chat(url, messages=[{"role": "developer", "content": "s"},
                                {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}])
        assert tok.decode(r.json()["prompt_token_ids"]) == "<|system|>s<|user|>hi<|assistant|>"


def test_api_key(tok):
    with script_backend(tok, text_script(tok, ["a"])) as b, running_server(b, api_key="secret") as url:
        r = httpx.get(f"{url}/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(f"{url}/models", headers={"Authorization": "Bearer secret"}).status_code == 200
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200  # no key for the health check


def test_queue_full_429_and_timeout_504(tok):
    long = ["z" * 1500]
    with script_backend(tok, text_script(tok, long), num_slots=1, step_latency_s=0.01, max_queue=1,
                        request_timeout_s=1.0) as b, running_server(b) as url:
        with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
            with c1.stream("POST", f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                   "stream": True, "n": 2}):
                assert wait_until(lambda: b.in_flight == 2)
                r = c2.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert wait_until(lambda: b.in_flight == 0)
        r = chat(url)  # 1500 tokens at 10 ms a step: past the 1 s deadline
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert wait_until(lambda: b.in_flight == 0 and b.generator.stats().live_slots == 0)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_request(tok, stream):
    with script_backend(tok, text_script(tok, ["z" * 1500]), num_slots=2, step_latency_s=0.01) as b, \
            running_server(b) as url:
        records = []
        b.recorders.append(records.append)
        body = {"messages": [{"role": "user", "content": "x"}], "stream": stream}
        with httpx.Client(timeout=0.5) as c:
            if stream:
                with c.stream("POST", f"{url}/chat/completions", json=body) as r:
                    next(r.iter_lines())
            else:
                with pytest.raises(httpx.ReadTimeout):
                    c.post(f"{url}/chat/completions", json=body)
        assert wait_until(lambda: len(records) == 1, timeout=10)
        assert records[0].samples[0].finish_reason == "abort" and len(records[0].samples[0].completion_ids) < 1500
        assert wait_until(lambda: b.in_flight == 0 and b.generator.stats().live_slots == 0)
