"""Hugging Face <-> jaxrl_async parameter name mapping (Qwen3 / Qwen2 / Llama).

One row per tensor kind: (our path, HF name template, to_ours, to_hf). Per-layer rows use
`{i}` in the HF name and map to slice i of our stacked `layers/*` arrays (for a Qwen3-MoE model with
dense layers among the sparse ones: slice s of stack `layers` or `dense_layers` is HF layer
`cfg.layer_stacks()[stack][s]`). Shapes, with
D hidden, H heads, K kv heads, E head_dim, F intermediate, V vocab:

| ours (per layer)      | HF                                          | transform (HF -> ours)          |
|-----------------------|---------------------------------------------|---------------------------------|
| embed [V, D]          | model.embed_tokens.weight [V, D]            | identity                        |
| attn_norm [D]         | model.layers.{i}.input_layernorm.weight     | identity                        |
| q [D, H, E]           | model.layers.{i}.self_attn.q_proj.weight    | [H*E, D] -> T -> reshape        |
| k, v [D, K, E]        | ...self_attn.{k,v}_proj.weight              | [K*E, D] -> T -> reshape        |
| o [H, E, D]           | ...self_attn.o_proj.weight                  | [D, H*E] -> T -> reshape        |
| q_bias [H, E]         | ...self_attn.q_proj.bias (qwen2, bias=True) | reshape                         |
| k_bias, v_bias [K, E] | ...self_attn.{k,v}_proj.bias                | reshape                         |
| o_bias [D]            | ...self_attn.o_proj.bias (attention_bias)   | identity                        |
| q_norm, k_norm [E]    | ...self_attn.{q,k}_norm.weight (qwen3)      | identity                        |
| mlp_norm [D]          | model.layers.{i}.post_attention_layernorm   | identity                        |
| gate, up [D, F]       | ...mlp.{gate,up}_proj.weight [F, D]         | T                               |
| down [F, D]           | ...mlp.down_proj.weight [D, F]              | T                               |
| *_bias (mlp_bias)     | ...mlp.*_proj.bias                          | identity                        |
| router [D, X]         | ...mlp.gate.weight [X, D] (qwen3_moe)       | T                               |
| moe_gate, moe_up      | ...mlp.experts.{j}.{gate,up}_proj.weight    | T per expert j -> [X, D, Fm]    |
|   [X, D, Fm]          |   [Fm, D]                                   |                                 |
| moe_down [X, Fm, D]   | ...mlp.experts.{j}.down_proj.weight [D, Fm] | T per expert j                  |
| final_norm [D]        | model.norm.weight                           | identity                        |
| lm_head [D, V]        | lm_head.weight [V, D] (absent when tied)    | T                               |
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxrl_async.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Row:
    ours: tuple[str, ...]  # path in the params tree
    hf: str  # HF tensor name ({i} = layer index for per-layer rows)
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        """One HF tensor per (layer i, expert j): our array is [L, X, ...] and to_ours/to_hf map one expert."""
        return "{j}" in self.hf


def _ident(x, cfg):
    return x


def _t(x, cfg):
    return x.T


def _proj_in(n_attr):
    """[N*E, D] -> [D, N, E]."""
    def f(x, cfg):
        return x.T.reshape(cfg.hidden_size, getattr(cfg, n_attr), cfg.head_dim)
    return f


def _proj_in_hf(x, cfg):
    """[D, N, E] -> [N*E, D]."""
    return x.reshape(x.shape[0], -1).T


def _o_in(x, cfg):
    return x.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


def _o_hf(x, cfg):
    return x.reshape(-1, x.shape[-1]).T


def _bias_in(n_attr):
    def f(x, cfg):
        return x.reshape(getattr(cfg, n_attr), cfg.head_dim)
    return f


def _bias_hf(x, cfg):
    return x.reshape(-1)


def _stack_rows(cfg: ModelConfig, stack: str, sparse: bool) -> list[Row]:
    """The per-layer rows of one stack of decoder layers (``ModelConfig.layer_stacks``)."""
    L = "model.layers.{i}."
    rows = [
        Row((stack, "attn_norm"), L + "input_layernorm.weight", _ident, _ident),
        Row((stack, "mlp_norm"), L + "post_attention_layernorm.weight", _ident, _ident),
        Row((stack, "q"), L + "self_attn.q_proj.weight", _proj_in("num_heads"), _proj_in_hf),
        Row((stack, "k"), L + "self_attn.k_proj.weight", _proj_in("num_kv_heads"), _proj_in_hf),
        Row((stack, "v"), L + "self_attn.v_proj.weight", _proj_in("num_kv_heads"), _proj_in_hf),
        Row((stack, "o"), L + "self_attn.o_proj.weight", _o_in, _o_hf),
    ]
    if sparse:
        rows += [
            Row((stack, "router"), L + "mlp.gate.weight", _t, _t),
            Row((stack, "moe_gate"), L + "mlp.experts.{j}.gate_proj.weight", _t, _t),
            Row((stack, "moe_up"), L + "mlp.experts.{j}.up_proj.weight", _t, _t),
            Row((stack, "moe_down"), L + "mlp.experts.{j}.down_proj.weight", _t, _t),
        ]
    else:
        rows += [
            Row((stack, "gate"), L + "mlp.gate_proj.weight", _t, _t),
            Row((stack, "up"), L + "mlp.up_proj.weight", _t, _t),
            Row((stack, "down"), L + "mlp.down_proj.weight", _t, _t),
        ]
    if cfg.qkv_bias:
        rows += [
            Row((stack, "q_bias"), L + "self_attn.q_proj.bias", _bias_in("num_heads"), _bias_hf),
            Row((stack, "k_bias"), L + "self_attn.k_proj.bias", _bias_in("num_kv_heads"), _bias_hf),
            Row((stack, "v_bias"), L + "self_attn.v_proj.bias", _bias_in("num_kv_heads"), _bias_hf),
        ]
    if cfg.o_bias:
        rows.append(Row((stack, "o_bias"), L + "self_attn.o_proj.bias", _ident, _ident))
    if cfg.qk_norm:
        rows += [
            Row((stack, "q_norm"), L + "self_attn.q_norm.weight", _ident, _ident),
            Row((stack, "k_norm"), L + "self_attn.k_norm.weight", _ident, _ident),
        ]
    if cfg.mlp_bias and not sparse:
        rows += [
            Row((stack, "gate_bias"), L + "mlp.gate_proj.bias", _ident, _ident),
            Row((stack, "up_bias"), L + "mlp.up_proj.bias", _ident, _ident),
            Row((stack, "down_bias"), L + "mlp.down_proj.bias", _ident, _ident),
        ]
    return rows


def mapping(cfg: ModelConfig) -> list[Row]:
    """Every row; per-layer rows of stack ``ours[0]`` map slice s to HF layer ``cfg.layer_stacks()[ours[0]][s]``."""
    rows = [
        Row(("embed",), "model.embed_tokens.weight", _ident, _ident),
        Row(("final_norm",), "model.norm.weight", _ident, _ident),
    ]
    for stack in cfg.layer_stacks():
        rows += _stack_rows(cfg, stack, sparse=bool(cfg.num_experts) and stack == "layers")
    if not cfg.tie_word_embeddings:
        rows.append(Row(("lm_head",), "lm_head.weight", _t, _t))
    return rows


# HF tensors that carry no parameters of ours and may be present in older checkpoints.
IGNORED_HF = ("rotary_emb.inv_freq",)
