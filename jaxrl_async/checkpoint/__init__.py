"""Checkpointing (Orbax), exact resume, and failure-handling helpers for the RL loop.

See `manager.py` for the run-directory layout and commit protocol, `codec.py` for how loop
state and buffered trajectories are encoded, `failures.py` for signals and non-finite steps,
and `jaxrl_async.cli.export` for the Hugging Face export CLI.

The names are imported lazily: `from jaxrl_async.checkpoint import SignalHandler` (standard library
only) does not import Orbax/JAX, so `main` can install its signal handler before anything heavy.
"""
from __future__ import annotations

import importlib
from typing import Any

_CODEC = ("from_jsonable", "pack_records", "rng_from_json", "rng_to_json", "to_jsonable", "unpack_records")
_FAILURES = ("NonFiniteTracker", "SignalHandler", "StopRequested", "TrainingDivergedError", "all_finite",
             "handle_signals")
_MANAGER = ("HOST", "CheckpointConfig", "CheckpointCorruptError", "CheckpointError", "CheckpointIncompatibleError",
            "CheckpointNotFoundError", "Checkpointer", "Restored", "SaveStats", "TrainMeta", "abstract_like",
            "copy_tokenizer_once", "model_config_from_json", "model_config_to_json")
_WHERE = {**{n: "codec" for n in _CODEC}, **{n: "failures" for n in _FAILURES}, **{n: "manager" for n in _MANAGER}}

__all__ = [*_MANAGER, *_CODEC, *_FAILURES]


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
