"""Config files (``get_config()`` / ``CONFIG``), ``config.json`` serialisation, printing and the command line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import types
import typing
from typing import Any, Mapping, Sequence

from jaxrl_async.config.overrides import field_hints, is_optional, apply_overrides
from jaxrl_async.config.sections import ConfigError, RunConfig
from jaxrl_async.config.validation import validate


# =============================================================================================
# Files, serialisation, command line
# =============================================================================================
def load_config_file(path: str | os.PathLike) -> RunConfig:
    """Execute a Python config file and return its ``get_config()`` (or ``CONFIG``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError("--config", f"file {path!r} does not exist")
    name = f"_jaxrl_async_config_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError("--config", f"{path}: {type(e).__name__}: {e}") from e
    if hasattr(module, "get_config"):
        cfg = module.get_config()
    elif hasattr(module, "CONFIG"):
        cfg = module.CONFIG
    else:
        raise ConfigError("--config", f"{path} defines neither get_config() nor CONFIG")
    if not isinstance(cfg, RunConfig):
        raise ConfigError("--config", f"{path}: expected a RunConfig, got {type(cfg).__name__}")
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict (tuples stay tuples; ``json.dumps`` writes them as lists)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Inverse of ``to_dict`` (lists become tuples); unknown keys raise ConfigError."""
    hints = field_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in data.items():
        path = f"{prefix}.{k}" if prefix else k
        if k not in names:
            raise ConfigError(path, "unknown field")
        kw[k] = _from_json(v, hints[k], path)
    try:
        return cls(**kw)
    except (ValueError, TypeError) as e:
        raise ConfigError(prefix or "<root>", f"{cls.__name__}: {e}") from None


def _from_json(v: Any, tp: Any, path: str) -> Any:
    optional, inner = is_optional(tp)
    if v is None:
        return None
    if dataclasses.is_dataclass(inner) and isinstance(v, Mapping):
        return from_dict(inner, v, path)
    if typing.get_origin(inner) is tuple and isinstance(v, list):
        args = typing.get_args(inner)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(x, args[0], path) for x in v)
        return tuple(_from_json(x, a, path) for x, a in zip(v, args))
    if typing.get_origin(inner) in (typing.Union, types.UnionType) and isinstance(v, list):
        return tuple(v)
    return v


def format_config(cfg: Any, prefix: str = "") -> str:
    """One ``dotted.key = value`` line per leaf field."""
    lines = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(v):
            lines.append(format_config(v, key))
        else:
            lines.append(f"{key} = {v!r}")
    return "\n".join(lines)


CONFIG_FILE = "config.json"


def save_config(cfg: RunConfig, run_dir: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> str:
    """Write ``config.json`` (the resolved config, plus ``extra`` under ``"_resolved"``)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(os.fspath(run_dir), CONFIG_FILE)
    data = to_dict(cfg)
    if extra:
        data["_resolved"] = dict(extra)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
    os.replace(tmp, path)
    return path


def load_config_json(path: str | os.PathLike) -> RunConfig:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_FILE)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.pop("_resolved", None)
    return from_dict(RunConfig, data)


def parse_command_line(argv: Sequence[str], default_config: RunConfig | None = None,
                       num_devices: int | None = None, fit_machine: bool = False) -> tuple[RunConfig, dict[str, Any]]:
    """``[--config FILE] [--print-config] [--dry-run] key=value ...`` → (validated config, flags).

    Without ``--config`` the ``default_config`` is used (``RunConfig()`` if None). ``fit_machine``: first fit
    the mesh to this machine (``config.machine``: ``mesh.layout=auto``, accelerator layouts on a CPU); the
    lines saying what changed are ``flags["machine"]``.
    """
    path, overrides, flags = None, [], {"print_config": False, "dry_run": False}
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError("--config", "needs a file path")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--print-config":
            flags["print_config"] = True
        elif arg == "--dry-run":
            flags["dry_run"] = True
        elif arg.startswith("-"):
            raise ConfigError("", f"unknown option {arg!r} (options: --config FILE, --print-config, --dry-run)")
        else:
            overrides.append(arg)
    cfg = load_config_file(path) if path is not None else (default_config or RunConfig())
    cfg = apply_overrides(cfg, overrides)
    flags["machine"] = []
    if fit_machine:
        from jaxrl_async.config.machine import fit_to_machine

        cfg, flags["machine"] = fit_to_machine(cfg)
    return validate(cfg, num_devices), flags


def peek_config(argv: Sequence[str]) -> RunConfig:
    """The config of a ``main`` command line (``--config FILE`` or the embedded default, then the overrides)
    WITHOUT validation (which initialises JAX's backend): read before JAX starts (simulated CPU devices, the
    multi-process launcher's roles)."""
    from jaxrl_async.config.default import get_config

    path, overrides, it = None, [], iter(argv)
    for a in it:
        if a == "--config":
            path = next(it, None)
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif not a.startswith("-"):
            overrides.append(a)
    cfg = load_config_file(path) if path is not None else get_config()
    return apply_overrides(cfg, overrides)
