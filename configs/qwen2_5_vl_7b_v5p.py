"""Qwen2.5-VL-7B visual RL on a TPU v5p-64 slice (32 chips: 16 generate as 4 replicas x tensor 4, 16 train with
FSDP 16), the slice our other 8B-class v5p configs use (``configs/qwen3_8b_long_v5p.py``, ``qwen3_8b_lora_v5p.py``).
Model, image budget and recipe as ``configs/qwen2_5_vl_7b.py``::

    python -m jaxrl_async.cli.plan_vl --config configs/qwen2_5_vl_7b_v5p.py --compile-for target
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("_qwen2_5_vl_7b", os.path.join(os.path.dirname(__file__),
                                                                               "qwen2_5_vl_7b.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

IMAGE_BUDGET = _base.IMAGE_BUDGET


def get_config():
    return _base.vl_run_config("v5p-64", max_concurrent_decodes=256, tokens_per_micro=16 * 8192,
                               name="qwen2_5_vl_7b_rl_v5p")
