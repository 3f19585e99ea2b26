"""A model's parameter shardings: the sharding rules (``sharding/``, data) applied to the model's logical
parameter axes (``models.transformer``). Here, not in ``sharding/``, so that ``sharding/`` imports nothing
from ``models/``."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jaxrl_async.models.transformer import logical_axes, param_shapes
from jaxrl_async.sharding.rules import Rules, tree_shardings

__all__ = ["model_shardings"]


def model_shardings(cfg: Any, mesh: Mesh, rules: Rules | str) -> Any:
    """NamedShardings of a model's parameters on ``mesh`` under ``rules`` (``"trainer"`` / ``"generator"``); a
    vision-language config (`qwen2_5_vl.VLConfig`) adds its vision tower's."""
    from jaxrl_async.models import qwen2_5_vl

    if qwen2_5_vl.is_vl(cfg):
        return tree_shardings(qwen2_5_vl.param_shapes(cfg), qwen2_5_vl.logical_axes(cfg), rules, mesh)
    return tree_shardings(param_shapes(cfg), logical_axes(cfg), rules, mesh)
