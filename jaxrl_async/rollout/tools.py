"""Tools for agent workflows: Qwen's tool-call format, the ``Tool`` protocol, built-in tools, rendering.

Wire format (Qwen2.5 / Qwen3 chat templates, Hermes style). The model writes, inside its turn::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}
    </tool_call><|im_end|>

(several ``<tool_call>`` blocks may follow each other). The environment answers in one *user* turn
holding one ``<tool_response>`` block per call, in call order, then re-opens the assistant turn::

    \\n<|im_start|>user\\n<tool_response>\\n27\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

which is exactly what the Qwen templates render for consecutive ``role="tool"`` messages
(:class:`ChatFormat` holds these strings; change them for other templates).

Nothing here raises on model output: :func:`parse_tool_calls` turns malformed blocks (bad JSON, no
name, non-object arguments, an unterminated ``<tool_call>``) into :class:`ToolCall` objects with
``error`` set, and :func:`execute_tool_call` turns every failure (parse error, unknown tool, bad
arguments, a tool that raises or times out) into an ``"Error: ..."`` text that is fed back to the
model as the tool response, so the model can learn to repair its calls.

Writing a tool: any object with ``name``, ``description``, ``parameters`` (JSON schema of the
arguments object) and ``__call__(**arguments) -> str`` (raise :class:`ToolError` for a message
the model should see)::

    class Lookup:
        name = "lookup"
        description = "Look up a word in the dictionary."
        parameters = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}

        def __call__(self, word: str) -> str:
            return DICTIONARY.get(word) or "not found"
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import re
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

__all__ = [
    "ToolCall", "ToolResult", "ToolError", "Tool", "parse_tool_calls", "tool_schema", "tools_system_prompt",
    "validate_arguments", "execute_tool_call", "truncate_middle", "render_tool_responses", "ChatFormat",
    "QWEN_CHAT_FORMAT", "PythonTool", "format_sandbox_result", "CalculatorTool", "CalculatorError",
    "safe_arithmetic",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block of a model turn.

    ``name``/``arguments`` are set when the block parsed; otherwise ``error`` says why not (the text
    the model gets back) and ``name`` may still be set (e.g. arguments of the wrong type).
    """

    name: str | None
    arguments: dict[str, Any]
    raw: str  # the block's text between the tags
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _parse_block(raw: str) -> ToolCall:
    body = raw.strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, raw, f"invalid JSON in <tool_call>: {e.msg} (line {e.lineno}, column {e.colno})")
    if not isinstance(obj, dict):
        return ToolCall(None, {}, raw, f"<tool_call> must hold a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall(None, {}, raw, '<tool_call> object needs a non-empty string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, raw, f'"arguments" of {name!r} is a string that is not JSON: {e.msg}')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, {}, raw, f'"arguments" of {name!r} must be a JSON object, got {type(args).__name__}')
    return ToolCall(name.strip(), args, raw)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """All ``<tool_call>...</tool_call>`` blocks of ``text`` in order (never raises).

    A trailing ``<tool_call>`` without its closing tag (a turn cut by the length limit) yields one
    call with ``error="unterminated <tool_call> ..."``. Text without the open tag yields ``[]``.
    """
    calls = [_parse_block(m.group(1)) for m in _TOOL_CALL_RE.finditer(text)]
    last_close = text.rfind(TOOL_CALL_CLOSE)
    tail_start = last_close + len(TOOL_CALL_CLOSE) if last_close >= 0 else 0
    tail_open = text.find(TOOL_CALL_OPEN, tail_start)
    if tail_open >= 0:
        raw = text[tail_open + len(TOOL_CALL_OPEN):]
        calls.append(ToolCall(None, {}, raw, "unterminated <tool_call> (missing </tool_call>)"))
    return calls


# ---------------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------------
class ToolError(Exception):
    """Raised by a tool for a failure the model should read (the message becomes the response)."""


@runtime_checkable
class Tool(Protocol):
    """A tool the model can call: ``name``, ``description``, ``parameters`` (JSON schema of the
    arguments object) and ``__call__(**arguments) -> str``."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, **arguments: Any) -> str: ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI/Qwen function description of ``tool`` (what ``apply_chat_template(tools=...)`` takes):
    ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)}}


def tools_system_prompt(tools: Sequence[Tool], preamble: str = "You are a helpful assistant.") -> str:
    """System-message text announcing ``tools`` in the wording of the Qwen2.5 chat template, for chat
    templates that ignore ``apply_chat_template(tools=...)``."""
    lines = "".join("\n" + json.dumps(tool_schema(t), ensure_ascii=False) for t in tools)
    return (f"{preamble}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def validate_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """The first problem of ``arguments`` against the top level of a JSON ``schema`` (required
    properties, unknown properties unless ``additionalProperties`` is true, the declared ``type`` of
    each property), or None. Nested schemas are left to the tool."""
    props: Mapping[str, Any] = schema.get("properties", {}) or {}
    for req in schema.get("required", []) or []:
        if req not in arguments:
            return f"missing required argument {req!r}"
    if not schema.get("additionalProperties", False):
        unknown = sorted(k for k in arguments if k not in props)
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        want = (props.get(key) or {}).get("type")
        if want is None:
            continue
        kinds = [want] if isinstance(want, str) else list(want)
        if not any(_JSON_TYPES.get(k, lambda v: True)(value) for k in kinds):
            return f"argument {key!r} must be of type {'|'.join(kinds)}, got {type(value).__name__}"
    return None


def truncate_middle(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters, else its head and tail around a marker
    ``"...[N characters omitted]..."`` (the total stays within ``max_chars`` when that is >= 64)."""
    if len(text) <= max_chars:
        return text
    marker = "\n...[{} characters omitted]...\n"
    keep = max(max_chars - len(marker.format(len(text))), 0)
    head, tail = keep - keep // 2, keep // 2
    return text[:head] + marker.format(len(text) - head - tail) + (text[len(text) - tail:] if tail else "")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """Outcome of one call: ``text`` is what the model reads (``"Error: ..."`` when ``ok`` is False)."""

    name: str | None
    text: str
    ok: bool


def execute_tool_call(call: ToolCall, tools: Mapping[str, Tool], max_chars: int = 4000) -> ToolResult:
    """Run ``call`` against ``tools`` (name -> tool); never raises for anything the call or the tool does.

    Failures become ``"Error: <why>"`` texts (parse error, unknown tool, schema mismatch, ToolError
    message, any other exception with its type). Output longer than ``max_chars`` is cut in the middle.
    """
    if not call.ok:
        return ToolResult(call.name, f"Error: {call.error}", False)
    tool = tools.get(call.name or "")
    if tool is None:
        return ToolResult(call.name, f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}", False)
    problem = validate_arguments(tool.parameters, call.arguments)
    if problem is not None:
        return ToolResult(call.name, f"Error: tool {call.name!r}: {problem}", False)
    try:
        out = tool(**call.arguments)
    except ToolError as e:
        return ToolResult(call.name, truncate_middle(f"Error: {e}", max_chars), False)
    except Exception as e:  # noqa: BLE001 - a tool must never kill the episode
        return ToolResult(call.name, truncate_middle(f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}",
                                                     max_chars), False)
    return ToolResult(call.name, truncate_middle(out if isinstance(out, str) else str(out), max_chars), True)


# ---------------------------------------------------------------------------------------------
# Rendering (token-in/token-out: the workflow encodes these strings once and appends the ids)
# ---------------------------------------------------------------------------------------------
def render_tool_responses(texts: Sequence[str], fmt: "ChatFormat | None" = None) -> str:
    """Content of the user turn that answers a model turn's tool calls (Qwen: one
    ``<tool_response>\\n...\\n</tool_response>`` per call, joined by newlines)."""
    fmt = fmt or QWEN_CHAT_FORMAT
    return fmt.tool_response_joiner.join(fmt.tool_response.format(content=t) for t in texts)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """The text the environment inserts between two model turns (defaults: Qwen2.5/Qwen3 ChatML).

    ``observation(content, closed)`` = (``end_of_turn`` unless the model's turn already ended with it)
    + ``turn_separator`` + ``user_turn.format(content)`` + ``generation_prompt``. For Qwen3 with
    thinking disabled use ``generation_prompt="<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n"``.
    """

    end_of_turn: str = "<|im_end|>"
    turn_separator: str = "\n"
    user_turn: str = "<|im_start|>user\n{content}<|im_end|>\n"
    generation_prompt: str = "<|im_start|>assistant\n"
    tool_response: str = "<tool_response>\n{content}\n</tool_response>"
    tool_response_joiner: str = "\n"

    def observation(self, content: str, closed: bool) -> str:
        return ("" if closed else self.end_of_turn) + self.turn_separator + self.user_turn.format(content=content) \
            + self.generation_prompt


QWEN_CHAT_FORMAT = ChatFormat()


# ---------------------------------------------------------------------------------------------
# Python (sandboxed)
# ---------------------------------------------------------------------------------------------
def format_sandbox_result(res: Any, max_chars: int, timeout_s: float) -> str:
    """Text of a :class:`~jaxrl_async.rewards.sandbox.SandboxResult` for the model: stdout, then
    stderr (tracebacks), then one line for a limit that was hit; each stream cut to ``max_chars // 2``."""
    if res.setup_error is not None or res.killed_reason == "setup_error":
        return f"Error: the sandbox could not run the code: {res.setup_error}"
    half = max(max_chars // 2, 1)
    parts = []
    if res.stdout:
        parts.append(truncate_middle(res.stdout.rstrip("\n"), half) + (" [output truncated]" if res.stdout_truncated else ""))
    if res.stderr:
        parts.append(truncate_middle(res.stderr.rstrip("\n"), half) + (" [output truncated]" if res.stderr_truncated else ""))
    reason = res.killed_reason
    if res.timed_out or reason == "wall_timeout":
        parts.append(f"Error: execution timed out after {timeout_s:g} s")
    elif reason == "cpu_limit":
        parts.append("Error: CPU time limit exceeded")
    elif reason == "output_limit":
        parts.append("Error: output limit exceeded, program stopped")
    elif reason == "signal" or (res.returncode is not None and res.returncode < 0):
        parts.append(f"Error: killed by signal {-(res.returncode or 0)}")
    elif res.returncode not in (0, None) and not res.stderr:
        parts.append(f"Error: exit code {res.returncode}")
    if not parts:
        return "(no output; use print() to show results)"
    return "\n".join(parts)


class PythonTool:
    """Runs Python code in the project's :class:`~jaxrl_async.rewards.sandbox.Sandbox` (fresh process
    per call, no state kept between calls) and returns its output as text (see :func:`format_sandbox_result`).

    Args:
      sandbox: a Sandbox to share; default: one built from ``config`` (raises SandboxUnavailableError
        at construction if this machine cannot isolate, unless the config opts out).
      timeout_s: wall-clock limit per call.
      max_output_chars: characters of output returned to the model.
    """

    name = "python"
    description = ("Run a self-contained Python 3 program and return what it prints (stdout, then stderr). "
                   "Variables are not kept between calls; use print() to see results.")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "Python source code"}},
                  "required": ["code"]}

    def __init__(self, sandbox: Any = None, *, config: Any = None, timeout_s: float = 5.0,
                 max_output_chars: int = 2000):
        if timeout_s <= 0 or max_output_chars < 1:
            raise ValueError(f"PythonTool needs timeout_s > 0 and max_output_chars >= 1, got {timeout_s}, {max_output_chars}")
        if sandbox is None:
            from jaxrl_async.rewards.sandbox import Sandbox, SandboxConfig

            sandbox = Sandbox(config or SandboxConfig(wall_timeout_s=timeout_s, cpu_time_s=timeout_s,
                                                      memory_bytes=512 << 20, max_output_bytes=64 << 10))
        self.sandbox, self.timeout_s, self.max_output_chars = sandbox, float(timeout_s), int(max_output_chars)

    def __call__(self, code: str) -> str:
        res = self.sandbox.run(code, wall_timeout_s=self.timeout_s)
        return format_sandbox_result(res, self.max_output_chars, self.timeout_s)


# ---------------------------------------------------------------------------------------------
# Calculator (ast walk, no eval)
# ---------------------------------------------------------------------------------------------
class CalculatorError(ToolError):
    """An expression the calculator refuses or cannot evaluate."""


MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096  # |integer results| < 2**4096 (about 1233 digits)
MAX_FACTORIAL = 300

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _factorial(n: Any) -> int:
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if not isinstance(n, int) or n < 0:
        raise CalculatorError("factorial() needs a non-negative integer")
    if n > MAX_FACTORIAL:
        raise CalculatorError(f"factorial() argument too large (max {MAX_FACTORIAL})")
    return math.factorial(n)


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "exp": math.exp,
    "log": math.log, "log2": math.log2, "log10": math.log10, "sin": math.sin, "cos": math.cos, "tan": math.tan,
    "asin": math.asin, "acos": math.acos, "atan": math.atan, "min": min, "max": max, "gcd": math.gcd,
    "factorial": _factorial,
}


def _check_int(v: Any) -> Any:
    if isinstance(v, int) and v.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    return v


def _binop(op: type, a: Any, b: Any) -> Any:
    if op is ast.Pow:
        if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and \
                (abs(a).bit_length() - 1) * b > MAX_INT_BITS:
            raise CalculatorError("result too large")
    elif op is ast.Mult and isinstance(a, int) and isinstance(b, int) and \
            a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
        raise CalculatorError("result too large")
    return _check_int(_BINOPS[op](a, b))


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"unsupported constant {node.value!r}: only numbers")
        return _check_int(node.value)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("'^' is not supported; use '**' for powers")
        if type(node.op) not in _BINOPS:
            raise CalculatorError(f"unsupported operator {type(node.op).__name__}")
        return _binop(type(node.op), _eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY:
            raise CalculatorError(f"unsupported operator {type(node.op).__name__}")
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name):
        if node.id not in _CONSTANTS:
            raise CalculatorError(f"unknown name {node.id!r}; constants: {sorted(_CONSTANTS)}")
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):
            raise CalculatorError(f"unsupported syntax: call of {type(node.func).__name__}")
        if node.func.id not in _FUNCTIONS:
            raise CalculatorError(f"unknown function {node.func.id!r}; functions: {sorted(_FUNCTIONS)}")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise CalculatorError("functions take positional arguments only")
        return _check_int(_FUNCTIONS[node.func.id](*[_eval(a) for a in node.args]))
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def safe_arithmetic(expression: str) -> int | float:
    """Value of an arithmetic expression: numbers, ``+ - * / // % **``, parentheses, unary signs, the
    constants ``pi``, ``e`` and the functions of ``_FUNCTIONS``; anything else (names, attributes,
    subscripts, strings, lambdas, comprehensions, ...) raises :class:`CalculatorError`. The expression
    is parsed with ``ast.parse(mode="eval")`` and walked; nothing is ever executed. Integer results are
    bounded by ``2**MAX_INT_BITS`` (checked before the big multiplication/power is computed)."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"invalid expression: {e.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalculatorError("invalid expression: too deeply nested") from None
    try:
        return _eval(tree)
    except CalculatorError:
        raise
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("overflow: result too large") from None
    except RecursionError:
        raise CalculatorError("expression too deeply nested") from None
    except (ValueError, TypeError) as e:
        raise CalculatorError(f"math error: {e}") from None


def format_number(value: int | float) -> str:
    """Integers exactly; floats with 12 significant digits (``0.1 + 0.2`` -> ``0.3``), integral floats
    without a fraction (``10 / 2`` -> ``5``)."""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, complex) or not math.isfinite(value):
        raise CalculatorError(f"result is not a finite real number: {value}")
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


class CalculatorTool:
    """Safe arithmetic (see :func:`safe_arithmetic`); returns the value as text or raises CalculatorError."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression, e.g. '3 * (4 + 5) / 2' or 'sqrt(2) ** 2'. Supports "
                   "+ - * / // % **, parentheses, pi, e and the functions " + ", ".join(sorted(_FUNCTIONS)) + ".")
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "the expression to evaluate"}},
                  "required": ["expression"]}

    def __call__(self, expression: str) -> str:
        return format_number(safe_arithmetic(expression))
