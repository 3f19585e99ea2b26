"""Code reward: run the completion's program against test cases, each in its own sandbox.

``reward = passed / total`` (``mode="fraction"``) or ``1.0 if passed == total else 0.0``
(``mode="all_or_nothing"``, which stops scheduling tests after the first failure).

Test cases (``metadata[tests_key]``, or the ``answer`` when that key is absent; a JSON string of any
of these forms is accepted too):

* stdin/stdout: ``{"inputs": [...], "outputs": [...]}`` (APPS/LiveCodeBench) or a list of
  ``{"stdin": s, "stdout": s}``.  The program runs as ``main.py`` with ``s`` on stdin; its stdout is
  compared per ``stdout_match``: ``"exact"``; ``"lines"`` (trailing whitespace of each line and
  trailing blank lines ignored); ``"tokens"`` (whitespace-split tokens equal).
* call-based: ``{"fn_name": f, "inputs": [[args...], ...], "outputs": [expected, ...]}`` or list
  items ``{"fn_name": f, "args": [...], "expected": v}``.  A harness imports the program as module
  ``solution``, calls ``f(*args)`` (or ``Solution().f(*args)``, LeetCode style), JSON-encodes the
  result and prints it after a per-run random marker; the *parent* compares it to ``expected``
  (lists == tuples, floats within ``float_tol``, bools only equal bools).  Comparing outside the
  untrusted process defeats results whose ``__eq__`` always returns True.
* assert strings: items ``{"assert": "assert f(2) == 4"}`` (any statements: ``def check(candidate):
  ...`` then ``check(f)`` works too).  The test runs in a *different process* from the program, so
  the program can neither read the test (its expected values) nor patch the code that runs it: the
  harness (``main.py``) reads the marker and the test from stdin, makes itself non-dumpable (so
  ``/proc/<pid>/mem``, ``environ``, ``fd`` are closed to the same uid; ``ptrace`` is denied by the
  sandbox's seccomp filter anyway) and only then starts the program's process (``_runner.py`` importing
  ``solution.py``, stdout sent to stderr, no inherited descriptor but its two request/answer pipes).
  The test runs in a namespace the program cannot touch (issue 27: a wrong program that also defined
  ``abs``, ``all``, ``len`` or a fake ``math`` used to pass tests using those names): builtins are a copy
  of the harness's own, taken before anything else was imported; a name of a standard-library module
  is that module, imported by the harness; the program contributes only the names under test: the
  item's ``entry_point`` (a name or a list; these may shadow a builtin) and, without one, every other
  name the test uses and does not bind itself.  Modules among those are imported again by name in the
  harness (never from the work dir, which the program can write).  Patching ``builtins`` or a module
  (``math.isclose = ...``) in the program changes only the program's process.  Values the program
  contributes: data values are copied over by value
  (a tagged JSON of builtin types: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
  ``bytes``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, ``range``), functions, classes and
  other objects become proxies whose calls, attribute reads, ``len``, iteration, indexing, ``str``,
  ``repr`` and truth value are answered by the program's process, again by value.  So ``==`` in a test
  compares builtin values in the harness (an object whose ``__eq__`` always returns True stays a proxy,
  and a proxy equals only itself); exceptions come back by name (``ValueError`` raised in the program
  is a ``ValueError`` in the test).  Modules the program imported are imported by the harness from the
  read-only interpreter path.  Passing = the harness reaches the end and prints the marker.
* The call-based harness runs in the program's process (one interpreter start instead of two): the
  program could find its marker by introspecting the harness's frames, but the expected value never
  enters the sandbox (it is compared in the parent), so printing the marker with a value of its choice
  gains nothing over returning that value.

Tests of all concurrent calls share one thread pool of ``max_concurrency`` threads, so at most that
many sandboxes run at once per :class:`CodeReward`.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import re
import secrets
import threading
from typing import Any, Literal, Sequence

from jaxrl_async.rewards.sandbox import Sandbox, SandboxConfig, SandboxResult

__all__ = [
    "TestCase",
    "TestOutcome",
    "CodeScore",
    "CodeRewardConfig",
    "CodeReward",
    "parse_tests",
    "extract_code",
    "stdout_matches",
    "values_equal",
]

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_SOLUTION = "solution.py"
_RUNNER = "_runner.py"


@dataclasses.dataclass(frozen=True)
class TestCase:
    """One test; ``kind`` is ``"stdio"``, ``"call"`` or ``"assert"``."""

    __test__ = False  # not a pytest class

    kind: str
    stdin: str = ""
    stdout: str = ""
    fn_name: str = ""
    args: tuple = ()
    expected: Any = None
    assert_src: str = ""


@dataclasses.dataclass(frozen=True)
class TestOutcome:
    __test__ = False

    passed: bool
    reason: str  # "passed", "wrong_answer", "runtime_error", "timeout", "killed:<why>", "sandbox_error"
    result: SandboxResult | None = None


@dataclasses.dataclass(frozen=True)
class CodeScore:
    reward: float
    passed: int
    total: int
    outcomes: tuple[TestOutcome, ...] = ()
    error: str | None = None


# ------------------------------------------------------------------------------------- parsing
def parse_tests(spec: Any) -> list[TestCase]:
    """Normalize the accepted test formats (module docstring) into :class:`TestCase` s.

    Raises ``ValueError`` naming the offending item for malformed specs.
    """
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"code tests: not valid JSON: {exc}") from exc
    if isinstance(spec, dict):
        if "inputs" not in spec or "outputs" not in spec:
            raise ValueError(f"code tests dict needs 'inputs' and 'outputs', got keys {sorted(spec)}")
        inputs, outputs = spec["inputs"], spec["outputs"]
        if len(inputs) != len(outputs):
            raise ValueError(f"code tests: {len(inputs)} inputs but {len(outputs)} outputs")
        fn_name = spec.get("fn_name")
        if fn_name:
            return [TestCase("call", fn_name=str(fn_name), args=tuple(_as_args(a, i)), expected=o)
                    for i, (a, o) in enumerate(zip(inputs, outputs))]
        return [TestCase("stdio", stdin=_as_text(a, i, "inputs"), stdout=_as_text(o, i, "outputs"))
                for i, (a, o) in enumerate(zip(inputs, outputs))]
    if isinstance(spec, (list, tuple)):
        return [_parse_item(item, i) for i, item in enumerate(spec)]
    raise ValueError(f"code tests must be a dict, a list or a JSON string, got {type(spec).__name__}")


def _as_args(a: Any, i: int) -> list:
    if not isinstance(a, (list, tuple)):
        raise ValueError(f"code test {i}: call-based inputs must be a list of arguments, got {type(a).__name__}")
    return list(a)


def _as_text(x: Any, i: int, field: str) -> str:
    if isinstance(x, list):  # some datasets store lines
        x = "\n".join(map(str, x))
    if not isinstance(x, str):
        raise ValueError(f"code test {i}: {field} must be a string, got {type(x).__name__}")
    return x


def _parse_item(item: Any, i: int) -> TestCase:
    if isinstance(item, TestCase):
        return item
    if not isinstance(item, dict):
        raise ValueError(f"code test {i}: expected a dict, got {type(item).__name__}")
    if "assert" in item:
        names = item.get("entry_point", item.get("fn_name", ""))
        if isinstance(names, (list, tuple)):
            names = ",".join(map(str, names))
        return TestCase("assert", fn_name=str(names or ""), assert_src=str(item["assert"]))
    if "fn_name" in item:
        if "args" not in item or "expected" not in item:
            raise ValueError(f"code test {i}: call-based test needs 'args' and 'expected'")
        return TestCase("call", fn_name=str(item["fn_name"]), args=tuple(_as_args(item["args"], i)),
                        expected=item["expected"])
    if "stdin" in item or "stdout" in item or "input" in item or "output" in item:
        return TestCase("stdio", stdin=_as_text(item.get("stdin", item.get("input", "")), i, "stdin"),
                        stdout=_as_text(item.get("stdout", item.get("output", "")), i, "stdout"))
    raise ValueError(f"code test {i}: unrecognized keys {sorted(item)}")


def extract_code(completion: str, mode: Literal["last_block", "last_block_or_raw", "raw"] = "last_block") -> str | None:
    """The last fenced code block (````python``, ````py``, ````python3`` or unlabeled), or the raw text."""
    if mode == "raw":
        return completion
    blocks = [body for lang, body in _FENCE_RE.findall(completion) if lang.lower() in ("", "python", "py", "python3")]
    if blocks:
        return blocks[-1]
    return completion if mode == "last_block_or_raw" else None


# ------------------------------------------------------------------------------------- comparison
def stdout_matches(actual: str, expected: str, mode: Literal["exact", "lines", "tokens"] = "lines") -> bool:
    if mode == "exact":
        return actual == expected
    if mode == "tokens":
        return actual.split() == expected.split()

    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(actual) == norm(expected)


def values_equal(actual: Any, expected: Any, float_tol: float = 1e-6) -> bool:
    """JSON-value equality: lists ≡ tuples, |a − e| ≤ tol·max(1, |e|) for floats, bools only match bools."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return isinstance(actual, bool) and isinstance(expected, bool) and actual == expected
    if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(actual, int) and isinstance(expected, int):
            return actual == expected
        if math.isnan(actual) or math.isnan(expected):
            return math.isnan(actual) and math.isnan(expected)
        return abs(actual - expected) <= float_tol * max(1.0, abs(expected))
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(values_equal(a, e, float_tol) for a, e in zip(actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(values_equal(actual[k], expected[k], float_tol) for k in actual)
    return type(actual) is type(expected) and actual == expected


# ------------------------------------------------------------------------------------- harnesses
_CALL_HARNESS = r'''
import json, sys
def _harness():
    marker = sys.stdin.readline().strip()
    case = json.loads(sys.stdin.readline())
    out = sys.stdout
    import importlib.util
    spec = importlib.util.spec_from_file_location("solution", "solution.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = mod
    spec.loader.exec_module(mod)
    fn = getattr(mod, case["fn_name"], None)
    if fn is None and hasattr(mod, "Solution"):
        fn = getattr(mod.Solution(), case["fn_name"])
    if fn is None:
        raise NameError("function %r not defined" % case["fn_name"])
    payload = json.dumps(fn(*case["args"]))
    out.flush()
    sys.__stdout__.write("\n" + marker + payload + "\n")
    sys.__stdout__.flush()
_harness()
'''


# Assert tests: the harness (trusted, main.py) and the program's process (_runner.py + solution.py)
# exchange one JSON line per request/answer; values use the tagged encoding below on both sides.
_CODEC = r'''
import base64 as _b64
import importlib as _importlib
import types as _types


class Remote:
    "A proxy for an object living in the program's process (identity equality only)."
    __slots__ = ("_h", "_link")

    def __init__(self, h, link):
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_link", link)

    def __call__(self, *args, **kwargs):
        return self._link("call", self._h, args=[enc(a) for a in args],
                          kwargs=[[k, enc(v)] for k, v in kwargs.items()])

    def __getattr__(self, name):
        return self._link("getattr", self._h, name=name)

    def __len__(self):
        return self._link("len", self._h)

    def __iter__(self):
        return iter(self._link("list", self._h))

    def __getitem__(self, key):
        return self._link("getitem", self._h, key=enc(key))

    def __bool__(self):
        return self._link("bool", self._h) is True

    def __str__(self):
        return self._link("str", self._h)

    def __repr__(self):
        return self._link("repr", self._h)

    def __eq__(self, other):
        return isinstance(other, Remote) and other._h == self._h

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(("Remote", self._h))


def enc(v, handle=None):
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return ["L", [enc(x, handle) for x in v]]
    if t is tuple:
        return ["T", [enc(x, handle) for x in v]]
    if t is dict:
        return ["D", [[enc(k, handle), enc(x, handle)] for k, x in v.items()]]
    if t is set:
        return ["S", [enc(x, handle) for x in v]]
    if t is frozenset:
        return ["F", [enc(x, handle) for x in v]]
    if t is bytes:
        return ["B", _b64.b64encode(v).decode()]
    if t is complex:
        return ["C", v.real, v.imag]
    if t is range:
        return ["R", v.start, v.stop, v.step]
    if t is Remote:
        return ["H", v._h]
    if t is _types.ModuleType:
        return ["M", v.__name__]
    if handle is not None:
        return ["H", handle(v)]
    raise TypeError("a %s cannot be passed to the program's process" % t.__name__)


def _clean_import(name):
    "Import ``name`` in this process, never from the work dir / tmpfs (which the program can write)."
    import importlib.util as _util
    import os as _os
    if name not in __import__("sys").modules:
        spec = _util.find_spec(name)
        origin = _os.path.realpath(spec.origin) if spec is not None and spec.origin else ""
        if spec is None or any(origin.startswith(d) for d in ("/tmp/", "/var/tmp/", "/dev/shm/", _os.getcwd() + "/")):
            raise ImportError("module %r not importable from the interpreter path" % name)
    return _importlib.import_module(name)


def dec(v, remote=None):
    if not isinstance(v, list):
        if v is None or type(v) in (bool, int, float, str):
            return v
        raise ValueError("bad value")
    tag = v[0]
    if tag == "L":
        return [dec(x, remote) for x in v[1]]
    if tag == "T":
        return tuple(dec(x, remote) for x in v[1])
    if tag == "D":
        return {dec(k, remote): dec(x, remote) for k, x in v[1]}
    if tag == "S":
        return {dec(x, remote) for x in v[1]}
    if tag == "F":
        return frozenset(dec(x, remote) for x in v[1])
    if tag == "B":
        return _b64.b64decode(v[1])
    if tag == "C":
        return complex(float(v[1]), float(v[2]))
    if tag == "R":
        return range(int(v[1]), int(v[2]), int(v[3]))
    if tag == "H":
        return remote(int(v[1]))
    if tag == "M":  # a module the program imported: the same one from the (read-only) interpreter path
        return _clean_import(str(v[1]))
    raise ValueError("bad tag")
'''

_ASSERT_HARNESS = r'''
import builtins, sys
_CLEAN_BUILTINS = dict(builtins.__dict__)  # before anything else ran in this process
sys.path[:] = [p for p in sys.path if p not in ("", ".") and not p.startswith(("/tmp", "/var/tmp", "/dev/shm"))]
import ctypes, json, os, subprocess
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the program's process (same uid) cannot read us
marker = sys.stdin.readline().strip()
case = json.loads(sys.stdin.readline())
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the test's pipe is never inherited
''' + _CODEC + r'''
import builtins

req_r, req_w = os.pipe()
ans_r, ans_w = os.pipe()
child = subprocess.Popen([sys.executable, "-I", "_runner.py", str(req_r), str(ans_w)], stdin=subprocess.DEVNULL,
                         stdout=2, pass_fds=(req_r, ans_w), close_fds=True)
os.close(req_r)
os.close(ans_w)
to_prog = os.fdopen(req_w, "w")
from_prog = os.fdopen(ans_r, "r")


def link(op, h=None, raw=False, **kw):
    to_prog.write(json.dumps(dict(kw, op=op, h=h)) + "\n")
    to_prog.flush()
    line = from_prog.readline()
    if not line:
        raise RuntimeError("the program's process ended")
    answer = json.loads(line)
    if "exc" in answer:
        name, msg = str(answer["exc"][0]), str(answer["exc"][1])
        exc = getattr(builtins, name, None)
        if not (isinstance(exc, type) and issubclass(exc, Exception)):
            exc = RuntimeError
        raise exc(msg)
    return answer["ok"] if raw else dec(answer["ok"], lambda h: Remote(h, link))


def code_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


test = compile(case["assert_src"], "<test>", "exec")
namespace = {"__name__": "__test__", "__builtins__": _CLEAN_BUILTINS}
entry = [n for n in case.get("fn_name", "").split(",") if n]
stdlib = set(getattr(sys, "stdlib_module_names", ()))
if case.get("legacy_names"):  # tests only (the control): every name the test uses from the program
    wanted = sorted(code_names(test))
else:
    wanted = sorted(n for n in code_names(test) if n in entry or (n not in _CLEAN_BUILTINS and n not in stdlib))
    for n in sorted(code_names(test) - set(entry)):
        if n in stdlib and n not in _CLEAN_BUILTINS:
            try:
                namespace[n] = _clean_import(n)
            except ImportError:
                pass
for name, value in link("names", raw=True, names=wanted):
    try:
        got = dec(value, lambda h: Remote(h, link))
    except ImportError:
        continue
    if entry and name not in entry and not isinstance(got, _types.ModuleType):
        continue  # with an entry point the program contributes only it (and modules, imported here)
    namespace[str(name)] = got
exec(test, namespace)
sys.stdout.write("\n" + marker + "true\n")
sys.stdout.flush()
to_prog.close()
child.kill()
'''

_ASSERT_RUNNER = r'''
import json, os, sys
rq = os.fdopen(int(sys.argv[1]), "r")
aw = os.fdopen(int(sys.argv[2]), "w")
''' + _CODEC + r'''
objects = []


def handle(obj):
    objects.append(obj)
    return len(objects) - 1


def answer(**kw):
    aw.write(json.dumps(kw) + "\n")
    aw.flush()


import importlib.util
spec = importlib.util.spec_from_file_location("solution", "solution.py")
mod = importlib.util.module_from_spec(spec)
sys.modules["solution"] = mod
spec.loader.exec_module(mod)
while True:
    line = rq.readline()
    if not line:
        break
    req = json.loads(line)
    op = req["op"]
    try:
        obj = objects[req["h"]] if req["h"] is not None else None
        unwrap = lambda v: dec(v, lambda h: objects[h])
        if op == "names":
            answer(ok=[[n, enc(mod.__dict__[n], handle)] for n in req["names"] if n in mod.__dict__])
            continue
        if op == "call":
            result = obj(*[unwrap(a) for a in req["args"]], **{k: unwrap(v) for k, v in req["kwargs"]})
        elif op == "getattr":
            result = getattr(obj, req["name"])
        elif op == "len":
            result = len(obj)
        elif op == "list":
            result = list(obj)
        elif op == "getitem":
            result = obj[unwrap(req["key"])]
        elif op == "bool":
            result = bool(obj)
        elif op == "str":
            result = str(obj)
        elif op == "repr":
            result = repr(obj)
        else:
            raise ValueError("unknown op")
        answer(ok=enc(result, handle))
    except Exception as exc:
        answer(exc=[type(exc).__name__, str(exc)[:1000]])
'''


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig:
    """Attributes:
      mode: ``"fraction"`` (passed/total) or ``"all_or_nothing"``.
      max_concurrency: sandboxes running at once (shared by all concurrent calls).
      sandbox: limits of each test run.
      stdout_match: ``"exact"``, ``"lines"`` or ``"tokens"`` (stdin/stdout tests).
      float_tol: relative tolerance for floats in call-based results.
      code_extraction: ``"last_block"``, ``"last_block_or_raw"`` or ``"raw"``.
      max_tests: use only the first ``max_tests`` cases (``None``: all).
      tests_key: metadata key holding the tests (falls back to ``answer``).
      no_code_reward: reward when no code could be extracted or the tests are malformed.
    """

    mode: Literal["fraction", "all_or_nothing"] = "fraction"
    max_concurrency: int = 2
    sandbox: SandboxConfig = dataclasses.field(
        default_factory=lambda: SandboxConfig(wall_timeout_s=6.0, cpu_time_s=4.0, max_output_bytes=1 << 20))
    stdout_match: Literal["exact", "lines", "tokens"] = "lines"
    float_tol: float = 1e-6
    code_extraction: Literal["last_block", "last_block_or_raw", "raw"] = "last_block"
    max_tests: int | None = None
    tests_key: str = "tests"
    no_code_reward: float = 0.0

    def __post_init__(self):
        if self.mode not in ("fraction", "all_or_nothing"):
            raise ValueError(f"CodeRewardConfig.mode must be fraction|all_or_nothing, got {self.mode!r}")
        if self.max_concurrency < 1:
            raise ValueError(f"CodeRewardConfig.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.stdout_match not in ("exact", "lines", "tokens"):
            raise ValueError(f"CodeRewardConfig.stdout_match must be exact|lines|tokens, got {self.stdout_match!r}")


class CodeReward:
    """``fn(prompt, completion, answer, **metadata) -> float``; see the module docstring."""

    def __init__(self, config: CodeRewardConfig | None = None, sandbox: Sandbox | None = None):
        self.config = config or CodeRewardConfig()
        self.sandbox = sandbox or Sandbox(self.config.sandbox)
        self._executor = cf.ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="code-reward")
        self._lock = threading.Lock()
        self._counters = dict(calls=0, no_code=0, invalid_tests=0, tests_run=0, tests_passed=0, timeouts=0,
                              sandbox_errors=0)
        # Tests only (the control of the name-shadowing attack): resolve every name an assert test uses
        # from the program's module, as the first pass did.
        self._legacy_test_names = False

    def __call__(self, prompt: str, completion: str, answer: Any, **metadata: Any) -> float:
        return self.score(completion, metadata.get(self.config.tests_key, answer)).reward

    def score(self, completion: str, tests: Any) -> CodeScore:
        cfg = self.config
        self._bump("calls")
        try:
            cases = parse_tests(tests)
        except ValueError as exc:
            self._bump("invalid_tests")
            return CodeScore(cfg.no_code_reward, 0, 0, error=str(exc))
        if cfg.max_tests is not None:
            cases = cases[:cfg.max_tests]
        if not cases:
            self._bump("invalid_tests")
            return CodeScore(cfg.no_code_reward, 0, 0, error="no test cases")
        code = extract_code(completion, cfg.code_extraction)
        if code is None or not code.strip():
            self._bump("no_code")
            return CodeScore(cfg.no_code_reward, 0, len(cases), error="no code block in completion")
        outcomes = self._run_all(code, cases)
        passed = sum(o.passed for o in outcomes)
        if cfg.mode == "fraction":
            reward = passed / len(cases)
        else:
            reward = 1.0 if passed == len(cases) else 0.0
        return CodeScore(reward, passed, len(cases), tuple(outcomes))

    def run_test(self, code: str, case: TestCase) -> TestOutcome:
        """Run one test case in a fresh sandbox."""
        if case.kind == "stdio":
            res = self.sandbox.run(code, stdin=case.stdin)
            return self._judge(res, lambda out: stdout_matches(out, case.stdout, self.config.stdout_match))
        marker = "@@jaxrl-result-" + secrets.token_hex(16) + "@@"
        payload = {"kind": case.kind, "fn_name": case.fn_name, "args": list(case.args), "assert_src": case.assert_src}
        if self._legacy_test_names:
            payload["legacy_names"] = True
        if case.kind == "assert":  # the test must not run in the program's process (module docstring)
            main, files = _ASSERT_HARNESS, {_SOLUTION: code, _RUNNER: _ASSERT_RUNNER}
        else:
            main, files = _CALL_HARNESS, {_SOLUTION: code}
        res = self.sandbox.run(main, stdin=marker + "\n" + json.dumps(payload) + "\n", files=files)

        def check(out: str) -> bool:
            lines = [ln for ln in out.split("\n") if ln.startswith(marker)]
            if not lines:
                return False
            try:
                value = json.loads(lines[-1][len(marker):])
            except ValueError:
                return False
            if case.kind == "assert":
                return value is True
            return values_equal(value, case.expected, self.config.float_tol)

        return self._judge(res, check)

    def stats(self) -> dict[str, int]:
        """``calls``, ``no_code``, ``invalid_tests``, ``tests_run``, ``tests_passed``, ``timeouts``,
        ``sandbox_errors``."""
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "CodeReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internals
    def _judge(self, res: SandboxResult, check) -> TestOutcome:
        self._bump("tests_run")
        if res.killed_reason == "setup_error":
            self._bump("sandbox_errors")
            return TestOutcome(False, "sandbox_error", res)
        if res.timed_out:
            self._bump("timeouts")
            return TestOutcome(False, "timeout", res)
        if res.killed_reason is not None:
            return TestOutcome(False, f"killed:{res.killed_reason}", res)
        if res.returncode != 0:
            return TestOutcome(False, "runtime_error", res)
        if not check(res.stdout):
            return TestOutcome(False, "wrong_answer", res)
        self._bump("tests_passed")
        return TestOutcome(True, "passed", res)

    def _run_test_safe(self, code: str, case: TestCase) -> TestOutcome:
        try:
            return self.run_test(code, case)
        except Exception:  # noqa: BLE001 - e.g. fd exhaustion in the parent; never kill the caller
            self._bump("sandbox_errors")
            return TestOutcome(False, "sandbox_error")

    def _run_all(self, code: str, cases: Sequence[TestCase]) -> list[TestOutcome]:
        futures = [self._executor.submit(self._run_test_safe, code, c) for c in cases]
        if self.config.mode == "all_or_nothing":
            for fut in cf.as_completed(futures):
                if not fut.result().passed:
                    for other in futures:
                        other.cancel()  # not-yet-started tests are skipped
                    break
        skipped = TestOutcome(False, "skipped")
        return [skipped if f.cancelled() else f.result() for f in futures]

    def _bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n
