"""Tools: Qwen tool-call parsing, argument checks, error texts, calculator safety, sandboxed Python, rendering."""
import dataclasses
import json
import os
import time

import pytest

from jaxrl_async.rollout.tools import (
    QWEN_CHAT_FORMAT, CalculatorError, CalculatorTool, ChatFormat, PythonTool, ToolCall, ToolError,
    execute_tool_call, format_sandbox_result, parse_tool_calls, render_tool_responses, safe_arithmetic, tool_schema,
    tools_system_prompt, truncate_middle, validate_arguments,
)


def block(obj_text):
    return f"<tool_call>\n{obj_text}\n</tool_call>"


# -- parsing --------------------------------------------------------------------------------------
def test_parse_single_well_formed_call():
    text = "Let me compute.\n" + block('{"name": "calculator", "arguments": {"expression": "6*7"}}')
    (call,) = parse_tool_calls(text)
    assert call.ok and call.name == "calculator" and call.arguments == {"expression": "6*7"}
    assert json.loads(call.raw) == {"name": "calculator", "arguments": {"expression": "6*7"}}


def test_parse_multiple_calls_in_order_and_string_arguments():
    text = (block('{"name": "a", "arguments": {"x": 1}}') + "\n"
            + block('{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}') + "\n"  # arguments JSON-encoded as a string
            + block('{"name": "c"}'))  # no arguments
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("a", {"x": 1}, None), ("b", {"y": [1, 2]}, None),
                                                              ("c", {}, None)]


@pytest.mark.parametrize("body, error, name", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"', "invalid JSON", None),  # missing brace
    ("{'name': 'calculator'}", "invalid JSON", None),  # python quoting
    ('["calculator"]', "must hold a JSON object, got list", None),
    ('{"arguments": {}}', 'non-empty string "name"', None),
    ('{"name": "calc", "arguments": [1, 2]}', "must be a JSON object, got list", "calc"),
    ('{"name": "calc", "arguments": "not json"}', "is a string that is not JSON", "calc"),
])
def test_parse_malformed_gives_error_not_exception(body, error, name):
    good = block('{"name": "ok", "arguments": {}}')
    calls = parse_tool_calls(good + block(body))
    assert len(calls) == 2 and calls[0].ok
    assert not calls[1].ok and error in calls[1].error and calls[1].name == name


def test_parse_no_call_and_unterminated():
    assert parse_tool_calls("The answer is \\boxed{42}.") == []
    assert parse_tool_calls("") == []
    calls = parse_tool_calls(block('{"name": "a"}') + ' then <tool_call>\n{"name": "b", "argu')
    assert calls[0].ok and not calls[1].ok and "unterminated" in calls[1].error


# -- execution and argument checks ----------------------------------------------------------------
class Echo:
    name = "echo"
    description = "echo"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
                  "required": ["text"]}

    def __call__(self, text, times=1):
        if text == "fail":
            raise ToolError("asked to fail")
        if text == "crash":
            raise KeyError("boom")
        return text * times


@pytest.mark.parametrize("call, expected", [
    (ToolCall("echo", {"text": "ab", "times": 2}, ""), "abab"),
    (ToolCall(None, {}, "", "invalid JSON in <tool_call>: x"), "Error: invalid JSON in <tool_call>: x"),
    (ToolCall("nope", {}, ""), "Error: unknown tool 'nope'; available tools: ['echo']"),
    (ToolCall("echo", {}, ""), "Error: tool 'echo': missing required argument 'text'"),
    (ToolCall("echo", {"text": "a", "x": 1}, ""), "Error: tool 'echo': unknown argument(s) ['x']; expected ['text', 'times']"),
    (ToolCall("echo", {"text": "a", "times": "2"}, ""), "Error: tool 'echo': argument 'times' must be of type integer, got str"),
    (ToolCall("echo", {"text": "a", "times": True}, ""),
     "Error: tool 'echo': argument 'times' must be of type integer, got bool"),
    (ToolCall("echo", {"text": "fail"}, ""), "Error: asked to fail"),
    (ToolCall("echo", {"text": "crash"}, ""), "Error: tool 'echo' failed: KeyError: 'boom'"),
])
def test_execute_tool_call_never_raises(call, expected):
    res = execute_tool_call(call, {"echo": Echo()})
    assert res.text == expected and res.ok == (not expected.startswith("Error"))


def test_execute_truncates_long_output():
    res = execute_tool_call(ToolCall("echo", {"text": "x", "times": 10_000}, ""), {"echo": Echo()}, max_chars=200)
    assert len(res.text) <= 200 and "characters omitted" in res.text and res.text.startswith("xxx")


def test_validate_arguments_additional_properties_and_union_types():
    schema = {"properties": {"v": {"type": ["number", "null"]}}, "additionalProperties": True}
    assert validate_arguments(schema, {"v": None, "other": 1}) is None
    assert validate_arguments(schema, {"v": 1.5}) is None
    assert "must be of type number|null" in validate_arguments(schema, {"v": "1"})


def test_truncate_middle():
    s = "".join(chr(97 + i % 26) for i in range(1000))
    assert truncate_middle(s, 1000) == s
    out = truncate_middle(s, 100)
    assert len(out) <= 100 and out.startswith(s[:20]) and out.endswith(s[-20:])
    n_omitted = int(out.split("...[")[1].split(" ")[0])
    assert n_omitted == 1000 - (len(out) - len(f"\n...[{n_omitted} characters omitted]...\n"))


# -- calculator -------------------------------------------------------------------------------------
@pytest.mark.parametrize("expr, expected", [
    ("3 * (4 + 5)", "27"), ("10 / 4", "2.5"), ("10 / 2", "5"), ("2 ** 10", "1024"), ("0.1 + 0.2", "0.3"),
    ("7 // 2", "3"), ("-7 % 3", "2"), ("-(2 - 5)", "3"), ("sqrt(16)", "4"), ("factorial(5)", "120"),
    ("round(2.675, 2)", "2.67"),  # binary float: 2.675 is 2.67499999...
    ("max(3, 9, 4) - min(3, 9, 4)", "6"), ("gcd(84, 36)", "12"), ("2 ** -2", "0.25"), ("1e3 + 1", "1001"),
    ("12345678901234567890 * 10", "123456789012345678900"), ("1 / 3", "0.333333333333"),
    ("2 * pi", "6.28318530718"), ("log10(1000)", "3"),
])
def test_calculator_values(expr, expected):
    assert CalculatorTool()(expression=expr) == expected


@pytest.mark.parametrize("expr, error", [
    ("__import__('os').system('touch /tmp/jaxrl_calc_pwned')", "unsupported syntax: call of Attribute"),
    ("__import__('os')", "unknown function '__import__'"),
    ("().__class__.__bases__[0].__subclasses__()", "unsupported syntax: call of Attribute"),
    ("().__class__", "unsupported syntax: Attribute"),
    ("open('/etc/passwd')", "unknown function 'open'"),
    ("eval('1+1')", "unknown function 'eval'"),
    ("(lambda: 1)()", "unsupported syntax: call of Lambda"),
    ("[x for x in range(10)]", "unsupported syntax: ListComp"),
    ("'a' * 10", "only numbers"),
    ("x + 1", "unknown name 'x'"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("math.sqrt(4)", "unsupported syntax: call of Attribute"),
    ("sqrt(x=4)", "positional arguments only"),
    ("9 ** 9 ** 9", "result too large"),
    ("10 ** 100000", "result too large"),
    ("(10 ** 1000) * (10 ** 1000)", "result too large"),
    ("factorial(100000)", "argument too large"),
    ("2.0 ** 100000", "overflow"),
    ("1e308 * 10", "not a finite real number"),
    ("1 / 0", "division by zero"),
    ("sqrt(-1)", "math error"),
    ("2 ^ 3", "use '**' for powers"),
    ("1 +", "invalid expression"),
    ("(" * 240 + "1" + ")" * 240, "too many nested parentheses"),
    ("1" * 600, "longer than 500"),
])
def test_calculator_refuses_attacks_and_errors(expr, error):
    t0 = time.monotonic()
    with pytest.raises(CalculatorError) as e:
        CalculatorTool()(expression=expr)
    assert error in str(e.value), str(e.value)
    assert time.monotonic() - t0 < 0.5  # bounds are checked before big computations
    res = execute_tool_call(ToolCall("calculator", {"expression": expr}, ""), {"calculator": CalculatorTool()})
    assert not res.ok and res.text.startswith("Error: ") and error in res.text
    assert not os.path.exists("/tmp/jaxrl_calc_pwned")


def test_safe_arithmetic_returns_numbers():
    assert safe_arithmetic("2**100") == 2 ** 100 and isinstance(safe_arithmetic("7/2"), float)
    assert safe_arithmetic("-" * 499 + "1") == -1  # deep but legal nesting within the length limit


# -- rendering --------------------------------------------------------------------------------------
def test_tool_responses_render_like_qwen_template():
    # Qwen2.5/Qwen3 templates render consecutive role="tool" messages as ONE user turn:
    # '<|im_start|>user' + ('\n<tool_response>\n' + content + '\n</tool_response>')* + '<|im_end|>\n'
    content = render_tool_responses(["42", "Error: division by zero"])
    assert content == "<tool_response>\n42\n</tool_response>\n<tool_response>\nError: division by zero\n</tool_response>"
    closed = QWEN_CHAT_FORMAT.observation(content, closed=True)
    assert closed == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n"
                      "Error: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # a turn cut by the length limit is closed by the environment first
    assert QWEN_CHAT_FORMAT.observation("hi", closed=False) == \
        "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    qwen3_no_think = ChatFormat(generation_prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3_no_think.observation("x", True).endswith("assistant\n<think>\n\n</think>\n\n")


def test_tool_schema_and_system_prompt():
    calc = CalculatorTool()
    schema = tool_schema(calc)
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    text = tools_system_prompt([calc, Echo()])
    lines = text.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(ln)["function"]["name"] for ln in lines] == ["calculator", "echo"]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text


# -- sandbox result formatting (no sandbox needed) ----------------------------------------------------
@dataclasses.dataclass
class FakeResult:
    returncode: int | None = 0
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    killed_reason: str | None = None
    setup_error: str | None = None


@pytest.mark.parametrize("res, expected", [
    (FakeResult(stdout="42\n"), "42"),
    (FakeResult(), "(no output; use print() to show results)"),
    (FakeResult(returncode=1, stderr="Traceback\nZeroDivisionError: division by zero\n"),
     "Traceback\nZeroDivisionError: division by zero"),
    (FakeResult(returncode=3), "Error: exit code 3"),
    (FakeResult(returncode=-9, stdout="partial\n", timed_out=True, killed_reason="wall_timeout"),
     "partial\nError: execution timed out after 2 s"),
    (FakeResult(returncode=-24, killed_reason="cpu_limit"), "Error: CPU time limit exceeded"),
    (FakeResult(returncode=-9, stdout="x" * 10, stdout_truncated=True, killed_reason="output_limit"),
     "xxxxxxxxxx [output truncated]\nError: output limit exceeded, program stopped"),
    (FakeResult(returncode=None, killed_reason="setup_error", setup_error="no uid"),
     "Error: the sandbox could not run the code: no uid"),
])
def test_format_sandbox_result(res, expected):
    assert format_sandbox_result(res, 100, 2.0) == expected


def test_format_sandbox_result_truncates_each_stream():
    out = format_sandbox_result(FakeResult(returncode=1, stdout="a" * 500, stderr="b" * 500), 100, 1.0)
    head, tail = out.split("\n...[", 1)[0], out.rsplit("]...\n", 1)[1]
    assert len(out) <= 100 + 1 and head.startswith("a") and tail.endswith("b")


# -- sandboxed python ---------------------------------------------------------------------------------
def _sandbox_or_skip():
    from jaxrl_async.rewards.sandbox import probe_isolation

    probe = probe_isolation()
    if not (probe["namespaces"] and probe["net"] and probe["root"]):
        pytest.skip(f"PythonTool needs the full sandbox (root + namespaces), unavailable here: {probe}")


@pytest.fixture(scope="module")
def python_tool():
    _sandbox_or_skip()
    return PythonTool(timeout_s=1.0, max_output_chars=300)


def test_python_tool_runs_code_in_sandbox(python_tool):
    assert python_tool(code="print(sum(range(10)))") == "45"
    assert python_tool(code="import os; print(os.getuid() != 0, os.getcwd())") == "True /tmp/work"
    err = python_tool(code="x = 1\nprint('before')\n1/0")
    assert err.startswith("before\nTraceback") and err.endswith("ZeroDivisionError: division by zero")
    assert python_tool(code="x = 5") == "(no output; use print() to show results)"


def test_python_tool_timeout_and_output_limits(python_tool):
    t0 = time.monotonic()
    out = python_tool(code="import time\nprint('start', flush=True)\nwhile True: time.sleep(0.01)")
    assert out.startswith("start") and out.endswith("Error: execution timed out after 1 s"), out
    assert time.monotonic() - t0 < 5
    big = python_tool(code="print('y' * 100000)")
    assert len(big) <= 300 + 40 and "characters omitted" in big
    res = execute_tool_call(ToolCall("python", {"code": "import sys; sys.exit(4)"}, ""), {"python": python_tool})
    assert res.text == "Error: exit code 4"
