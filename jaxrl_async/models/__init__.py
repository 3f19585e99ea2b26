"""Models: the Qwen3 / Qwen2 / Llama decoder family, Qwen2.5-VL (`qwen2_5_vl.py`, `vision.py`), their HF mappings,
import and export."""
from jaxrl_async.lazy_exports import lazy_exports as _lazy_exports
from jaxrl_async.models.config import PRESETS, ModelConfig, UnsupportedModelError, preset
from jaxrl_async.models.hf_io import CheckpointMismatchError, load_hf, save_hf
from jaxrl_async.models.transformer import (
    apply, forward, init_params, logical_axes, param_shapes, sequence_logprobs,
)

# `Transformer` imports flax (`nnx_module.py`): only when asked for
__getattr__, __dir__, _lazy = _lazy_exports(__name__, globals(), {"nnx_module": ("Transformer",)})
__all__ = [
    "PRESETS", "ModelConfig", "UnsupportedModelError", "preset", "CheckpointMismatchError", "load_hf", "save_hf",
    *_lazy, "apply", "forward", "init_params", "logical_axes", "param_shapes", "sequence_logprobs",
]
