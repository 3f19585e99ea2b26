"""Built-in row formats: map one raw row (a JSON object / Parquet row) to (prompt, answer, metadata).

Each format reads *canonical* field names; ``fields`` (canonical -> file column) renames them, e.g.
``{"question": "problem"}``. Columns that a format does not consume are kept in ``metadata``.

===========  ==========================================  =============================================
format       canonical fields (required / optional)       answer
===========  ==========================================  =============================================
``gsm8k``    question, answer / id                        the number after the last ``####`` in answer,
                                                          commas removed ("1,200" -> "1200")
``math``     prompt, and answer or solutions / id          ``answer`` if present, else the content of the
             (AReaL-boba: prompt, solutions, query_id)      last ``\\boxed{}`` of ``solutions[0]`` (or the
                                                          whole string when it has none)
``generic``  prompt, answer / id                          ``str(answer)`` (str, int or float)
``code``     prompt, tests / id                           normalised tests dict (below)
===========  ==========================================  =============================================

Code tests (a dict, or a JSON string holding one): stdin/stdout ``{"inputs": [str], "outputs": [str]}``
or call-based ``{"fn_name": str, "inputs": [[args...]], "outputs": [value]}``; ``inputs`` and ``outputs``
are non-empty lists of equal length. Normalised to ``{"kind": "stdio"|"call", "inputs", "outputs"}`` plus
``"fn_name"`` for call-based.

A row that does not fit raises :class:`RowError` (the reader adds file and line).

Detection (``format="auto"`` of the CLIs, :func:`detect_format`): from the columns of the first rows.
``question`` + ``answer`` holding ``####`` is gsm8k; ``prompt`` + ``tests`` is code; ``prompt`` +
``solutions`` is math; ``prompt`` + ``answer`` (no ``solutions``) is generic (which reads such a row
exactly as math does). A row that fits two formats, or rows that fit different formats, are ambiguous:
pass the format explicitly.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

FORMATS = ("gsm8k", "math", "generic", "code")
AUTO = "auto"


class RowError(ValueError):
    """A row does not match its format (message names the field)."""


class FormatDetectionError(ValueError):
    """The format cannot be told from the columns (no row fits one, or the rows are ambiguous)."""


@dataclasses.dataclass(frozen=True)
class ParsedRow:
    prompt: str
    answer: Any
    id: str | None
    metadata: dict[str, Any]


def _col(fields: Mapping[str, str], name: str) -> str:
    return fields.get(name, name)


def _get(row: Mapping[str, Any], fields: Mapping[str, str], name: str, *, required: bool = True) -> Any:
    col = _col(fields, name)
    if col not in row or row[col] is None:
        if required:
            alias = f" (file column {col!r})" if col != name else ""
            raise RowError(f"missing field {name!r}{alias}; row has columns {sorted(row)}")
        return None
    return row[col]


def _nonempty_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"field {name!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"field {name!r} is empty")
    return value


def _scalar_answer(value: Any, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(f"field {name!r} must be a string or number, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise RowError(f"field {name!r} is empty")
    return text


def _row_id(row: Mapping[str, Any], fields: Mapping[str, str], default_col: str = "id") -> str | None:
    value = _get(row, fields, default_col, required=False)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(f"field 'id' must be a string or integer, got {type(value).__name__}")
    return str(value)


def _extras(row: Mapping[str, Any], used: set[str]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in used}


_NUMBER_RE = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")


def gsm8k_final_answer(answer_text: str) -> str:
    """The final answer of a GSM8K solution: text after the last ``####``, stripped, commas removed.

    >>> gsm8k_final_answer("48/2 = <<48/2=24>>24 ...\\n#### 1,072")
    '1072'
    """
    if "####" not in answer_text:
        raise RowError("gsm8k field 'answer' has no '#### <number>' final-answer marker")
    final = answer_text.rsplit("####", 1)[1].strip().replace(",", "")
    if final.endswith(".") and _NUMBER_RE.match(final[:-1]):
        final = final[:-1]
    if not _NUMBER_RE.match(final):
        raise RowError(f"gsm8k final answer after '####' is not a number: {final!r}")
    return final


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (brace-balanced) in text, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def parse_gsm8k(row: Mapping[str, Any], fields: Mapping[str, str]) -> ParsedRow:
    question = _nonempty_str(_get(row, fields, "question"), "question")
    solution = _nonempty_str(_get(row, fields, "answer"), "answer")
    used = {_col(fields, "question"), _col(fields, "answer"), _col(fields, "id")}
    meta = _extras(row, used)
    meta["solution"] = solution
    return ParsedRow(question, gsm8k_final_answer(solution), _row_id(row, fields), meta)


def parse_math(row: Mapping[str, Any], fields: Mapping[str, str]) -> ParsedRow:
    prompt = _nonempty_str(_get(row, fields, "prompt"), "prompt")
    answer = _get(row, fields, "answer", required=False)
    solutions = _get(row, fields, "solutions", required=False)
    if solutions is not None:
        if hasattr(solutions, "tolist"):  # numpy array from parquet
            solutions = solutions.tolist()
        if not isinstance(solutions, list) or not solutions or not all(isinstance(s, str) for s in solutions):
            raise RowError("field 'solutions' must be a non-empty list of strings")
    if answer is None and solutions is None:
        raise RowError(f"math row needs field 'answer' or 'solutions'; row has columns {sorted(row)}")
    if answer is not None:
        answer = _scalar_answer(answer, "answer")
    else:
        boxed = last_boxed_content(solutions[0])
        answer = (boxed if boxed is not None else solutions[0]).strip()
        if not answer:
            raise RowError("field 'solutions[0]' has an empty answer")
    row_id = _row_id(row, fields)
    id_col = _col(fields, "id")
    if row_id is None and "query_id" in row and "id" not in fields:  # AReaL-boba naming
        row_id = _row_id(row, {"id": "query_id"})
        id_col = "query_id"
    used = {_col(fields, "prompt"), _col(fields, "answer"), _col(fields, "solutions"), id_col}
    meta = _extras(row, used)
    if solutions is not None:
        meta["solutions"] = solutions
    return ParsedRow(prompt, answer, row_id, meta)


def parse_generic(row: Mapping[str, Any], fields: Mapping[str, str]) -> ParsedRow:
    prompt = _nonempty_str(_get(row, fields, "prompt"), "prompt")
    answer = _scalar_answer(_get(row, fields, "answer"), "answer")
    used = {_col(fields, "prompt"), _col(fields, "answer"), _col(fields, "id")}
    return ParsedRow(prompt, answer, _row_id(row, fields), _extras(row, used))


def normalize_code_tests(tests: Any) -> dict[str, Any]:
    """Validates and normalises a code-test spec (see module docstring)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise RowError(f"field 'tests' is a string but not valid JSON: {e}") from None
    if not isinstance(tests, dict):
        raise RowError(f"field 'tests' must be an object with 'inputs' and 'outputs', got {type(tests).__name__}")
    inputs, outputs, fn_name = tests.get("inputs"), tests.get("outputs"), tests.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise RowError("field 'tests' needs list-valued 'inputs' and 'outputs'")
    if not inputs or len(inputs) != len(outputs):
        raise RowError(f"field 'tests' needs non-empty 'inputs'/'outputs' of equal length, got {len(inputs)} and {len(outputs)}")
    if fn_name is None:
        if not all(isinstance(x, str) for x in inputs + outputs):
            raise RowError("stdin/stdout tests need string 'inputs' and 'outputs' (or give 'fn_name' for call-based)")
        return {"kind": "stdio", "inputs": inputs, "outputs": outputs}
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise RowError(f"field 'tests.fn_name' must be a Python identifier, got {fn_name!r}")
    if not all(isinstance(x, list) for x in inputs):
        raise RowError("call-based tests need each 'inputs' entry to be a list of arguments")
    return {"kind": "call", "fn_name": fn_name, "inputs": inputs, "outputs": outputs}


def parse_code(row: Mapping[str, Any], fields: Mapping[str, str]) -> ParsedRow:
    prompt = _nonempty_str(_get(row, fields, "prompt"), "prompt")
    tests = normalize_code_tests(_get(row, fields, "tests"))
    used = {_col(fields, "prompt"), _col(fields, "tests"), _col(fields, "id")}
    return ParsedRow(prompt, tests, _row_id(row, fields), _extras(row, used))


PARSERS: dict[str, Callable[[Mapping[str, Any], Mapping[str, str]], ParsedRow]] = {
    "gsm8k": parse_gsm8k,
    "math": parse_math,
    "generic": parse_generic,
    "code": parse_code,
}


def parse_row(row: Any, fmt: str, fields: Mapping[str, str] | None = None) -> ParsedRow:
    """Parses one raw row with format ``fmt``; raises RowError on mismatch, ValueError on unknown format."""
    if fmt not in PARSERS:
        raise ValueError(f"unknown dataset format {fmt!r}; expected one of {FORMATS}")
    if not isinstance(row, Mapping):
        raise RowError(f"row must be a JSON object, got {type(row).__name__}")
    return PARSERS[fmt](row, fields or {})


def row_formats(row: Any) -> set[str]:
    """The formats whose identifying columns the raw row has (see the module docstring); empty for a
    row that fits none (or is not an object)."""
    if not isinstance(row, Mapping):
        return set()
    cols = {k for k, v in row.items() if v is not None}
    out = set()
    answer = row.get("answer")
    if {"question", "answer"} <= cols and isinstance(answer, str) and "####" in answer:
        out.add("gsm8k")
    if "prompt" in cols:
        if "tests" in cols:
            out.add("code")
        if "solutions" in cols:
            out.add("math")
        elif "answer" in cols:
            out.add("generic")
    return out


def detect_format(rows: list[tuple[str, Any]]) -> tuple[str, str]:
    """(format, explanation) from ``rows`` = [(where, raw row)] (the first rows of a dataset, ``where``
    naming each, e.g. ``data.jsonl: row 3``). Rows that fit no format are left to the parser (it reports
    them); raises FormatDetectionError when no row fits one, a row fits several, or rows disagree."""
    seen: dict[str, str] = {}  # format -> first row that has it
    for where, row in rows:
        fits = row_formats(row)
        if len(fits) > 1:
            raise FormatDetectionError(f"{where}: the columns {sorted(row)} fit the formats {sorted(fits)}; "
                                       "pass --format")
        for f in fits:
            seen.setdefault(f, where)
    if not seen:
        cols = sorted(rows[0][1]) if rows and isinstance(rows[0][1], Mapping) else []
        where = rows[0][0] if rows else "the data"
        raise FormatDetectionError(f"{where}: cannot tell the format from the columns {cols} (gsm8k: question + "
                                   "answer with '####'; math: prompt + solutions; generic: prompt + answer; "
                                   "code: prompt + tests); pass --format")
    if len(seen) > 1:
        a, b = list(seen)[:2]  # in row order
        raise FormatDetectionError(f"ambiguous format: {seen[a]} looks like {a} but {seen[b]} looks like {b}; "
                                   "pass --format")
    fmt = next(iter(seen))
    n = sum(1 for _, r in rows if fmt in row_formats(r))
    return fmt, f"detected from the columns of {n} of the first {len(rows)} rows"
