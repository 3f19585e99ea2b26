"""Agent frameworks against ``serve``: the OpenAI Agents SDK (an ``Agent`` with a ``function_tool``, ``Runner.run`` and
``Runner.run_streamed`` on an ``OpenAIChatCompletionsModel``) and LangChain's ``ChatOpenAI`` (``bind_tools``, a
``ToolMessage`` follow-up, streaming), end to end over HTTP.

A random tiny model does not call tools, so the tool-calling tests run the server on a scripted engine that plays a
tool-using model from the prompt the server rendered: asked "What is A+B?" with the ``add`` tool it writes
``<tool_call>{"name": "add", "arguments": {"a": A, "b": B}}</tool_call>``; once a tool result is the last turn it
answers "The sum is RESULT" (the result as the template rendered it). Everything else (the client's request
bodies, the server's parsing of the call into ``tool_calls``, the client running the tool and sending the ``tool``
message back, the template rendering it) is the real code. LangChain's ``invoke`` and ``stream`` also run on the
real tiny Qwen3 (greedy: text and token ids agree with the server's record). The plain ``openai`` SDK (sync,
streaming, tools, errors) is covered by ``test_serve_scripted.py`` and ``test_serve_model.py``."""
from __future__ import annotations

import asyncio
import re

import pytest
from serve_helpers import make_model_dir, running_server, script_backend

QUESTION = re.compile(r"What is (\d+)\+(\d+)\?")


def calculator_script(tok):
    """The scripted model: a tool call for the question of the last user turn, the answer after a tool result."""
    def script(prompt, k, sp):
        text = tok.decode(prompt)
        last = text.rsplit("<|", 2)[-2]  # the last turn before the final "<|assistant|>"
        if last.startswith("tool|>"):
            out = f"The sum is {last[len('tool|>'):]}"
        elif "<|tools|>" in text and "add;" in text and QUESTION.search(last):
            a, b = QUESTION.search(last).groups()
            out = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
        else:
            out = "no tool"
        return tok(out, add_special_tokens=False)["input_ids"] + [2]
    return script


def chat_bodies(bodies):
    return [b for b in bodies if isinstance(b, dict) and "messages" in b]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_agents_sdk_runs_a_function_tool(tok, stream):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    ran = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    bodies, records = [], []
    with script_backend(tok, calculator_script(tok)) as backend, running_server(backend, bodies=bodies) as url:
        backend.recorders.append(records.append)
        model = OpenAIChatCompletionsModel(model="tiny", openai_client=AsyncOpenAI(base_url=url, api_key="none",
                                                                                   max_retries=0, timeout=30))
        agent = Agent(name="calculator", instructions="Add with the add tool.", tools=[add], model=model,
                      model_settings=ModelSettings(temperature=0, max_tokens=200, parallel_tool_calls=False,
                                                   metadata={"run": "test"}, include_usage=True))
        config = RunConfig(tracing_disabled=True)  # no trace export (it would go to api.openai.com)

        async def run():
            if not stream:
                return await Runner.run(agent, "What is 2+3?", run_config=config)
            result = Runner.run_streamed(agent, "What is 2+3?", run_config=config)
            async for _ in result.stream_events():
                pass
            return result

        result = asyncio.run(run())
    assert ran == [(2, 3)]  # the SDK ran the tool on the arguments the server parsed
    assert result.final_output == "The sum is 5"
    first, second = chat_bodies(bodies)
    assert first["tools"][0]["function"]["name"] == "add" and first["parallel_tool_calls"] is False
    assert bool(first.get("stream")) == stream and second["messages"][0] == {"role": "system",
                                                                          "content": "Add with the add tool."}
    call, reply = second["messages"][-2:]
    assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == "add"
    assert reply == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "5"}
    # what the model saw: its call rendered back as it wrote it, then the tool's result
    rendered = tok.decode(records[1].prompt_ids)
    assert rendered.endswith('<|assistant|><tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
                             "<|tool|>5<|assistant|>")


def test_langchain_bind_tools_and_a_tool_message(tok):
    import openai
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    bodies = []
    with script_backend(tok, calculator_script(tok)) as backend, running_server(backend, bodies=bodies) as url:
        chat = ChatOpenAI(model="tiny", base_url=url, api_key="none", max_retries=0, timeout=30, temperature=0)
        llm = chat.bind_tools([add], tool_choice="auto", parallel_tool_calls=False)
        question = [HumanMessage("What is 4+5?")]
        msg = llm.invoke(question)
        assert msg.content == "" and msg.response_metadata["finish_reason"] == "tool_calls"
        (call,) = msg.tool_calls
        assert call["name"] == "add" and call["args"] == {"a": 4, "b": 5} and call["id"].startswith("call_")
        result = add.invoke(call)  # a ToolMessage answering the call
        assert result.tool_call_id == call["id"] and result.content == "9"
        final = llm.invoke(question + [msg, result])
        assert final.content == "The sum is 9" and not final.tool_calls
        sent = chat_bodies(bodies)[-1]["messages"]
        assert sent[-2]["tool_calls"][0]["id"] == call["id"]
        assert sent[-1] == {"role": "tool", "tool_call_id": call["id"], "content": "9"}
        # streamed: the call comes as tool_call_chunks that aggregate to the same call
        chunks = list(llm.stream(question))
        whole = chunks[0]
        for c in chunks[1:]:
            whole = whole + c
        assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("add", {"a": 4, "b": 5})]
        assert whole.content == ""
        # a forced tool choice needs constrained decoding: the server's 400 names the field
        with pytest.raises(openai.BadRequestError) as e:
            chat.bind_tools([add], tool_choice="add").invoke(question)
        assert e.value.body["param"] == "tool_choice"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from jaxrl_async.data.tokenizer import stop_token_ids
    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.generator.orchestrator import Generator
    from jaxrl_async.models import load_hf
    from jaxrl_async.serve.backend import ServeBackend

    d = make_model_dir(str(tmp_path_factory.mktemp("tiny")))
    tok = AutoTokenizer.from_pretrained(d)
    cfg, params = load_hf(d)
    engine = build_engine(EngineConfig(max_concurrent_decodes=2, max_sequence_length=128, max_prefill_length=64,
                                       prefill_buckets=(64,), page_size=16, num_pages=32), cfg)
    with Generator(engine, engine.place_params(params), tokenizer=tok) as gen:
        backend = ServeBackend(gen, tok, model_name="tiny", vocab_size=cfg.vocab_size,
                               eos_ids=stop_token_ids(cfg, tok, d))
        with running_server(backend) as url:
            yield {"url": url, "tok": tok, "backend": backend}


def test_langchain_and_agents_sdk_on_the_real_model(served):
    """Greedy on the real tiny Qwen3: LangChain's invoke and stream give the text of the tokens the engine produced
    (the server's record), with their log-probs and usage; an Agents SDK run without tools gives the same text."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner
    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI

    tok, backend = served["tok"], served["backend"]
    records = []
    backend.recorders.append(records.append)
    try:
        llm = ChatOpenAI(model="tiny", base_url=served["url"], api_key="none", max_retries=0, timeout=60,
                         temperature=0, max_tokens=10, logprobs=True, stream_usage=True)
        msg = llm.invoke("the cat sat")
        (sample,) = records[-1].samples
        ids = list(sample.completion_ids)
        assert records[-1].prompt_ids == tok.apply_chat_template([{"role": "user", "content": "the cat sat"}],
                                                                 add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False)
        assert ids and msg.content == tok.decode(ids, skip_special_tokens=True)
        assert [e["logprob"] for e in msg.response_metadata["logprobs"]["content"]] == list(sample.logprobs)
        assert msg.usage_metadata["output_tokens"] == len(ids)
        chunks = list(llm.stream("the cat sat"))
        assert "".join(c.content for c in chunks) == msg.content
        assert list(records[-1].samples[0].completion_ids) == ids  # greedy: the same tokens
        assert sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) == len(ids)

        model = OpenAIChatCompletionsModel(model="tiny", openai_client=AsyncOpenAI(base_url=served["url"],
                                                                                   api_key="none", max_retries=0))
        agent = Agent(name="plain", model=model, model_settings=ModelSettings(temperature=0, max_tokens=10))
        result = asyncio.run(Runner.run(agent, "the cat sat", run_config=RunConfig(tracing_disabled=True)))
        assert result.final_output == msg.content and list(records[-1].samples[0].completion_ids) == ids
    finally:
        backend.recorders.remove(records.append)
