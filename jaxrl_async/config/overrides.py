"""Config values from strings and files: type conversion (``parse_value``), type checks (``check_types``)
and dotted command-line overrides (``apply_overrides``)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any, Literal, Mapping, Sequence

from jaxrl_async.config.sections import ConfigError

# =============================================================================================
# Types: conversion of command-line strings and checking of config-file values
# =============================================================================================
_NONE = ("none", "null")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return True, args[0] if len(args) == 1 else typing.Union[tuple(args)]
    return False, tp


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def parse_value(text: str, tp: Any, field: str = "") -> Any:
    """Convert a command-line string to the field type ``tp`` (raises ConfigError naming ``field``)."""
    optional, inner = is_optional(tp)
    s = text.strip()
    if optional and s.lower() in _NONE:
        return None
    tp = inner
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        raise ConfigError(field, f"is a section ({tp.__name__}); set its fields, e.g. {field}.<name>=...")
    if origin is Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if s == str(c) or (isinstance(c, str) and _unquote(s) == c):
                return c
        raise ConfigError(field, f"must be one of {list(choices)}, got {s!r}")
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return parse_value(s, arg, field)
            except ConfigError as e:
                errors.append(e.reason)
        raise ConfigError(field, f"cannot parse {s!r} as {_type_name(tp)} ({'; '.join(errors)})")
    if tp is bool:
        if s.lower() in _TRUE:
            return True
        if s.lower() in _FALSE:
            return False
        raise ConfigError(field, f"expected a bool (true/false), got {s!r}")
    if tp is int:
        try:
            return int(s.replace("_", ""))
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                f = math.nan
            if math.isfinite(f) and f == int(f):
                return int(f)
            raise ConfigError(field, f"expected an int, got {s!r}") from None
    if tp is float:
        try:
            return float(s.replace("_", ""))
        except ValueError:
            raise ConfigError(field, f"expected a float, got {s!r}") from None
    if tp is str:
        return _unquote(s)
    if origin is tuple:
        args = typing.get_args(tp)
        items = _split_sequence(s, field)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(str(x), args[0], f"{field}[{i}]") for i, x in enumerate(items))
        if len(items) != len(args):
            raise ConfigError(field, f"expected {len(args)} values, got {len(items)} in {s!r}")
        return tuple(parse_value(str(x), a, f"{field}[{i}]") for i, (x, a) in enumerate(zip(items, args)))
    if origin in (dict, Mapping) or tp in (dict, Mapping) or origin is typing.Mapping:
        try:
            v = json.loads(s)
        except json.JSONDecodeError:
            try:
                v = ast.literal_eval(s)
            except (ValueError, SyntaxError):
                raise ConfigError(field, f"expected a JSON object, got {s!r}") from None
        if not isinstance(v, dict):
            raise ConfigError(field, f"expected a JSON object, got {s!r}")
        return v
    raise ConfigError(field, f"fields of type {_type_name(tp)} cannot be set from the command line")


def _unquote(s: str) -> str:
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    return s


def _split_sequence(s: str, field: str) -> list[Any]:
    """'(1, 2)', '[1,2]', '1,2', '()' or a single value → list of elements (strings or literals)."""
    if s in ("", "()", "[]"):
        return []
    if s[0] in "([":
        try:
            v = ast.literal_eval(s)
        except (ValueError, SyntaxError):
            raise ConfigError(field, f"cannot parse {s!r} as a sequence") from None
        if not isinstance(v, (tuple, list)):
            v = [v]
        return [x if isinstance(x, str) else repr(x) for x in v]
    return [p.strip() for p in s.split(",") if p.strip() != ""]


def _check_value(value: Any, tp: Any, field: str) -> None:
    """Raise ConfigError if ``value`` does not have type ``tp`` (ints are accepted for floats)."""
    optional, inner = is_optional(tp)
    if value is None:
        if optional:
            return
        raise ConfigError(field, f"must not be None (type {_type_name(tp)})")
    tp = inner
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, tp):
            raise ConfigError(field, f"expected a {tp.__name__}, got {type(value).__name__}")
        check_types(value, field)
        return
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(field, f"must be one of {list(typing.get_args(tp))}, got {value!r}")
        return
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                _check_value(value, arg, field)
                return
            except ConfigError:
                pass
        raise ConfigError(field, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
    elif origin is tuple:
        if not isinstance(value, tuple):
            raise ConfigError(field, f"expected a tuple, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            for i, v in enumerate(value):
                _check_value(v, args[0], f"{field}[{i}]")
        else:
            if len(value) != len(args):
                raise ConfigError(field, f"expected {len(args)} values, got {len(value)}")
            for i, (v, a) in enumerate(zip(value, args)):
                _check_value(v, a, f"{field}[{i}]")
        return
    elif origin in (dict, Mapping) or tp in (dict, Mapping) or origin is typing.Mapping:
        ok = isinstance(value, Mapping)
    else:
        ok = True  # types we do not check (Any, callables)
    if not ok:
        raise ConfigError(field, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def check_types(cfg: Any, prefix: str = "") -> None:
    """Check every field of the dataclass tree ``cfg`` against its annotation."""
    for f in dataclasses.fields(cfg):
        name = f"{prefix}{f.name}" if not prefix else f"{prefix}.{f.name}"
        _check_value(getattr(cfg, f.name), field_hints(type(cfg))[f.name], name)


# =============================================================================================
# Overrides
# =============================================================================================
def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError("", f"override {text!r} must look like section.field=value")
    return key.strip(), value


def component_error(prefix: str, obj: Any, message: str) -> ConfigError:
    """A reused component config's ValueError as a ConfigError naming the full field path.

    Component messages start with ``field``, ``Class.field`` or ``sub.field`` (e.g. ``"eps_clip must
    be >= 0"``, ``"OptimizerConfig.lr: ..."``, ``"behaviour_weight.upper must be > 1"``).
    """
    head = message.split(" ", 1)[0].rstrip(":")
    parts = head.split(".")
    if len(parts) > 1 and parts[0] in (type(obj).__name__, prefix.rsplit(".", 1)[-1]):
        parts = parts[1:]
    node, ok = obj, bool(parts)
    for part in parts:
        if dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}:
            node = getattr(node, part)
        else:
            ok = False
            break
    if ok:
        rest = message[len(head):].lstrip(": ").lstrip()
        return ConfigError(".".join(filter(None, [prefix, *parts])), rest)
    return ConfigError(prefix or "<root>", message)


def _rebuild(obj: Any, changes: Mapping[str, Any], prefix: str) -> Any:
    kw = {}
    for name, change in changes.items():
        path = f"{prefix}.{name}" if prefix else name
        kw[name] = _rebuild(getattr(obj, name), change, path) if isinstance(change, dict) else change
    try:
        return dataclasses.replace(obj, **kw)
    except (ValueError, TypeError) as e:  # a reused component config validated itself
        raise component_error(prefix, obj, str(e)) from None


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """Apply ``["a.b=1", ...]`` to the dataclass tree ``cfg`` (later overrides win).

    All changes of one section are applied in one ``dataclasses.replace`` (so a pair such as
    ``trainer.schedule=cosine trainer.total_steps=100`` is validated together).
    """
    changes: dict[str, Any] = {}
    for text in overrides:
        key, raw = _split_override(text)
        parts = key.split(".")
        obj, node = cfg, changes
        for depth, part in enumerate(parts):
            path = ".".join(parts[: depth + 1])
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(".".join(parts[:depth]), f"is not a section; cannot set {key!r}")
            names = [f.name for f in dataclasses.fields(obj)]
            if part not in names:
                close = difflib.get_close_matches(part, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; fields: {', '.join(names)}"
                raise ConfigError(path, f"unknown field{hint}")
            if depth == len(parts) - 1:
                node[part] = parse_value(raw, field_hints(type(obj))[part], path)
            else:
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise ConfigError(path, "is set as a value and as a section")
                node = child
                obj = getattr(obj, part)
                if obj is None:
                    raise ConfigError(path, "is None; cannot set a field inside it")
    return _rebuild(cfg, changes, "")
