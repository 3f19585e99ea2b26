"""Models: the Qwen3 / Qwen2 / Llama decoder family, Qwen2.5-VL (`qwen2_5_vl.py`, `vision.py`), their HF mappings,
import and export."""
from jaxrl_async.models.config import PRESETS, ModelConfig, UnsupportedModelError, preset
from jaxrl_async.models.hf_io import CheckpointMismatchError, load_hf, save_hf
from jaxrl_async.models.transformer import (
    apply, forward, init_params, logical_axes, param_shapes, sequence_logprobs,
)

__all__ = [
    "PRESETS", "ModelConfig", "UnsupportedModelError", "preset", "CheckpointMismatchError", "load_hf", "save_hf",
    "Transformer", "apply", "forward", "init_params", "logical_axes", "param_shapes", "sequence_logprobs",
]


def __getattr__(name: str):
    if name == "Transformer":  # imports flax (`nnx_module.py`): only when asked for
        from jaxrl_async.models.nnx_module import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
