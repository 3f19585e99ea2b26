"""JSONL input rows shared by the CLIs (`score`, `generate`): row numbering and per-row errors."""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator


class BadRowError(ValueError):
    """An input row that cannot be used; the message starts with `row N:`."""


def iter_json_rows(lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    """Yield (row number, decoded object) for every non-blank line (rows count from 0, blank lines too).

    Raises BadRowError naming the row when a line is not valid JSON; iteration can continue afterwards.
    """
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield i, BadRowError(f"row {i}: invalid JSON ({e.msg})")
            continue
        yield i, obj


def check_row(row: int, obj: Any) -> Any:
    """Raise the BadRowError that `iter_json_rows` yielded in place of an object."""
    if isinstance(obj, BadRowError):
        raise obj
    return obj
