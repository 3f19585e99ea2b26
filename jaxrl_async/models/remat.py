"""Rematerialisation policies by name (``ModelConfig.remat``), MaxText's vocabulary where it fits.

Each decoder layer runs under ``jax.checkpoint`` with the named policy; the layer tags its
projections with ``checkpoint_name`` (``query_proj``, ``key_proj``, ``value_proj``, ``out_proj``,
``mlpwi`` for gate/up, ``mlpwo`` for down) so policies can save exactly those outputs.

| name                    | kept for the backward pass (everything else is recomputed)             |
|-------------------------|------------------------------------------------------------------------|
| ``none``                | everything (no ``jax.checkpoint``): fastest, most memory                |
| ``minimal`` (= ``dots``)| every matmul output without batch dimensions (all projections)         |
| ``save_dot_except_mlpwi``| q/k/v/out projections and the MLP down projection                     |
| ``save_dot_except_mlp`` | q/k/v and out projections                                               |
| ``save_qkv_proj``       | q/k/v projections                                                       |
| ``save_out_proj``       | the attention output projection                                         |
| ``full``                | only the layer inputs: least memory, one more forward per layer         |
| ``minimal_offloaded``   | as ``minimal``, but moved to pinned host memory (device -> host -> device)|
| ``qkv_proj_offloaded``  | as ``save_qkv_proj``, offloaded to pinned host memory                   |

Offloading needs a ``pinned_host`` memory space (TPU, GPU; XLA:CPU has one too). ``plan`` reports the
policy; pick by the compiled temporaries of the train step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

QKV = ("query_proj", "key_proj", "value_proj")

REMAT_POLICIES = ("none", "full", "minimal", "dots", "save_dot_except_mlpwi", "save_dot_except_mlp",
                  "save_qkv_proj", "save_out_proj", "minimal_offloaded", "qkv_proj_offloaded")


def remat_policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of ``name`` (None = save nothing, i.e. ``full``)."""
    cp = jax.checkpoint_policies
    if name == "full":
        return None
    if name in ("minimal", "dots"):
        return cp.checkpoint_dots_with_no_batch_dims
    if name == "save_dot_except_mlpwi":
        return cp.save_only_these_names(*QKV, "out_proj", "mlpwo")
    if name == "save_dot_except_mlp":
        return cp.save_only_these_names(*QKV, "out_proj")
    if name == "save_qkv_proj":
        return cp.save_only_these_names(*QKV)
    if name == "save_out_proj":
        return cp.save_only_these_names("out_proj")
    if name == "minimal_offloaded":
        return cp.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host")
    if name == "qkv_proj_offloaded":
        return cp.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=list(QKV),
                                                    offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {name!r}")


def remat(fn: Callable, name: str) -> Callable:
    """``fn`` under the remat policy ``name`` (``none``: unchanged)."""
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=remat_policy(name))
