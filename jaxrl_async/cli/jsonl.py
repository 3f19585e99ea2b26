"""JSONL input rows shared by the CLIs (`score`, `generate`): row numbering and per-row errors.

Row numbers are 1-based line numbers of the file (blank lines count, and are skipped): `row 2` is line 2.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator


class BadRowError(ValueError):
    """An input row that cannot be used; the message starts with `row N:` (N = line number, from 1)."""


def iter_json_rows(lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    """Yield (line number counted from 1, decoded object) for every non-blank line.

    A line that is not valid JSON yields a BadRowError naming the row in place of the object (raise it
    with `check_row`); iteration can continue afterwards.
    """
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield i, BadRowError(f"row {i}: invalid JSON ({e.msg} at column {e.colno})")
            continue
        yield i, obj


def check_row(row: int, obj: Any) -> Any:
    """Raise the BadRowError that `iter_json_rows` yielded in place of an object."""
    if isinstance(obj, BadRowError):
        raise obj
    return obj


def bad_rows_error(path: str, errors: list[str]) -> str:
    """One line for the bad rows of a file: the first one in full, and how many there are in all."""
    if not errors:
        raise ValueError("bad_rows_error: no errors")
    more = ""
    if len(errors) > 1:
        rows = [e.split(":", 1)[0].removeprefix("row ") for e in errors]
        shown = ", ".join(rows[:10]) + (", ..." if len(rows) > 10 else "")
        more = f" ({len(errors)} bad rows in all: rows {shown})"
    return f"{path}: {errors[0]}{more}"
