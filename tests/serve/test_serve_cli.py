"""`python -m jaxrl_async.serve`'s command line (one-line errors, exit 2) and the pure pieces of the protocol."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from serve_helpers import free_port, make_model_dir

from jaxrl_async.cli import serve
from jaxrl_async.serve.backend import TextStream, partial_suffix
from jaxrl_async.serve.protocol import parse_tool_calls


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("serve: error: "), err
    for n in needles:
        assert n in err[0], err
    return err[0]


def test_non_loopback_host_needs_an_api_key(capsys, monkeypatch):
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    assert serve.main(["--model", "nowhere", "--host", "0.0.0.0"]) == 2
    one_line_error(capsys, "--host 0.0.0.0", "--api-key")
    assert serve.is_loopback("127.0.0.1") and serve.is_loopback("::1") and serve.is_loopback("localhost")
    assert not serve.is_loopback("0.0.0.0") and not serve.is_loopback("example.com")


def test_missing_extra_and_bad_model_dir(capsys, monkeypatch, tmp_path):
    assert serve.main(["--model", str(tmp_path / "none")]) == 2
    one_line_error(capsys, "--model", "not found")
    real = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda m: None if m == "fastapi" else real(m))
    assert serve.main(["--model", str(tmp_path)]) == 2
    one_line_error(capsys, "fastapi", "pip install 'jaxrl_async[serve]'")


def test_tool_call_parser():
    content, calls = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                                      '<tool_call>{"name": "mul", "arguments": {"x": "é"}}</tool_call>')
    assert content == "Let me add." and [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert calls[0]["function"]["arguments"] == '{"a": 1}' and calls[1]["function"]["arguments"] == '{"x": "é"}'
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')[1][0]["function"]["name"] == "f"  # unclosed
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name
    assert parse_tool_calls("plain") == ("plain", [])


def test_text_stream_holds_back_stop_and_tool_prefixes():
    assert partial_suffix("abc<to", ["<tool_call>"]) == 3 and partial_suffix("abc", ["xy"]) == 0
    chars = list("hello STOP world")
    s = TextStream(lambda ids: "".join(ids), ["STOP"], False)
    out = "".join(s.push([c]) for c in chars)
    assert out == "hello " and s.finish("stop") == ("", [], "stop")
    s = TextStream(lambda ids: "".join(ids), [], True)
    out = "".join(s.push([c]) for c in 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    rest, calls, reason = s.finish("stop")
    assert out == "ok " and rest == "" and calls[0]["function"]["name"] == "f" and reason == "tool_calls"
    s = TextStream(lambda ids: "".join(ids), ["STOP"], False)
    assert s.push(list("ST")) == "" and s.finish("length") == ("ST", [], "length")  # not a stop after all


@pytest.mark.slow
def test_the_command_serves_the_openai_client(tmp_path):
    """The real command in a process of its own: it starts, answers the openai client, stops on SIGINT."""
    import openai

    d = make_model_dir(str(tmp_path / "m"))
    port = free_port()
    env = dict(os.environ, JAXRL_ASYNC_COMPILE_CACHE="off")
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl_async.serve", "--model", d, "--port", str(port),
                             "--max-concurrent", "2", "--max-model-len", "64", "--api-key", "k", "--no-warmup"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=120)
        deadline = time.monotonic() + 180
        while True:
            try:
                assert c.models.list().data[0].id == "m"
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.5)
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_max_top_logprobs_flag(capsys):
    assert serve.build_parser().parse_args(["--model", "m"]).max_top_logprobs == 20
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", "nowhere", "--max-top-logprobs", "21"])
    assert e.value.code == 2 and "--max-top-logprobs must be in [0, 20], got 21" in capsys.readouterr().err
