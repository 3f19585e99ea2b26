"""The embedded default (what `python -m jaxrl_async.main` runs without --config), as a config file.

    python -m jaxrl_async.main --config configs/tiny_cpu.py trainer.total_steps=100 rollout.max_head_offpolicyness=4
"""
from jaxrl_async.config.default import get_config  # noqa: F401
