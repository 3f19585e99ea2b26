"""Checkpointing (Orbax), exact resume, and failure-handling helpers for the RL loop.

See `manager.py` for the run-directory layout and commit protocol, `codec.py` for how loop
state and buffered trajectories are encoded, `failures.py` for signals and non-finite steps,
and `jaxrl_async.export` for the Hugging Face export CLI.
"""
from jaxrl_async.checkpoint.codec import (
    from_jsonable, pack_records, rng_from_json, rng_to_json, to_jsonable, unpack_records,
)
from jaxrl_async.checkpoint.failures import NonFiniteTracker, SignalHandler, TrainingDivergedError, all_finite
from jaxrl_async.checkpoint.manager import (
    HOST, CheckpointConfig, CheckpointCorruptError, CheckpointError, CheckpointIncompatibleError,
    CheckpointNotFoundError, Checkpointer, Restored, SaveStats, TrainMeta, abstract_like, copy_tokenizer_once,
    model_config_from_json, model_config_to_json,
)

__all__ = [
    "HOST", "CheckpointConfig", "CheckpointCorruptError", "CheckpointError", "CheckpointIncompatibleError",
    "CheckpointNotFoundError", "Checkpointer", "Restored", "SaveStats", "TrainMeta", "abstract_like",
    "copy_tokenizer_once", "model_config_from_json", "model_config_to_json",
    "from_jsonable", "pack_records", "rng_from_json", "rng_to_json", "to_jsonable", "unpack_records",
    "NonFiniteTracker", "SignalHandler", "TrainingDivergedError", "all_finite",
]
