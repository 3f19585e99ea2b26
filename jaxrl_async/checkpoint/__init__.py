"""Checkpointing (Orbax), exact resume, and failure-handling helpers for the RL loop.

See `manager.py` for the run-directory layout and commit protocol, `codec.py` for how loop
state and buffered trajectories are encoded, `failures.py` for signals and non-finite steps,
and `jaxrl_async.cli.export` for the Hugging Face export CLI.

The names are imported lazily: `from jaxrl_async.checkpoint import SignalHandler` (standard library
only) does not import Orbax/JAX, so `main` can install its signal handler before anything heavy.
"""
from __future__ import annotations

from jaxrl_async.lazy_exports import lazy_exports as _lazy_exports

__getattr__, __dir__, __all__ = _lazy_exports(__name__, globals(), {
    "manager": ("HOST", "CheckpointConfig", "CheckpointCorruptError", "CheckpointError",
                "CheckpointIncompatibleError", "CheckpointNotFoundError", "Checkpointer", "Restored", "SaveStats",
                "TrainMeta", "abstract_like", "copy_tokenizer_once", "model_config_from_json",
                "model_config_to_json"),
    "codec": ("from_jsonable", "pack_records", "rng_from_json", "rng_to_json", "to_jsonable", "unpack_records"),
    "failures": ("NonFiniteTracker", "SignalHandler", "StopRequested", "TrainingDivergedError", "all_finite",
                 "handle_signals"),
})
