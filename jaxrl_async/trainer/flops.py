"""Model FLOPs of a training step, counted as MaxText does (`calculate_tflops_training_per_device`).

For B rows of S tokens (D hidden, F mlp, H query heads, K kv heads, E head dim, V vocab, L layers):

    ffn        = 2 B S D F * 2 (gate, up) + 2 B S F D (down)           = 6 B S D F
                 (MoE: 6 B S D F_moe k + 2 B S D X: k routed experts and the router, in the sparse
                 layers; the dense SwiGLU in the dense ones)
    qkv        = 2 B S D (H + 2K) E
    projection = 2 B S H E D                                             (attention output)
    embedding  = 2 B S D V                                               (output projection; the input
                                                                          lookup is a gather, not counted)
    attention  = 4 B S^2 H E / 2                                         (QK^T and PV, halved for causality)

    learnable  = 3 * (ffn summed over layers + (qkv + projection) * L + embedding)          (forward 1x + backward 2x)
    attention  = 3 * attention * L
    total      = learnable + attention

Recomputation (remat) is not counted: these are *model* FLOPs (MFU), not hardware FLOPs.
Packed rows count attention over the full row length S, as MaxText does for its packed batches.
"""

from __future__ import annotations

from jaxrl_async.models.config import ModelConfig

__all__ = ["train_step_flops", "forward_flops"]


def _per_token_terms(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    D, F, H, K, E, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    n_sparse = len(cfg.sparse_layer_ids)
    # mixture of experts: the k routed experts' SwiGLUs and the router (active FLOPs) in its sparse layers,
    # the dense SwiGLU in its dense layers (`mlp_only_layers` / `decoder_sparse_step`)
    ffn = 6.0 * D * F * (cfg.num_layers - n_sparse)
    ffn += (6.0 * D * cfg.moe_intermediate_size * cfg.num_experts_per_tok + 2.0 * D * cfg.num_experts) * n_sparse
    qkv = 2.0 * D * (H + 2 * K) * E
    proj = 2.0 * H * E * D
    emb = 2.0 * D * V
    learnable = ffn + (qkv + proj) * cfg.num_layers + emb
    attention = 4.0 * seq_len * H * E / 2 * cfg.num_layers
    return learnable, attention


def train_step_flops(cfg: ModelConfig, n_rows: int, seq_len: int) -> dict[str, float]:
    """Model FLOPs of forward + backward over n_rows rows of seq_len tokens (see module doc)."""
    learnable, attention = _per_token_terms(cfg, seq_len)
    tokens = float(n_rows) * seq_len
    out = {"learnable": 3.0 * learnable * tokens, "attention": 3.0 * attention * tokens}
    out["total"] = out["learnable"] + out["attention"]
    return out


def forward_flops(cfg: ModelConfig, n_rows: int, seq_len: int) -> float:
    """Model FLOPs of one forward pass (e.g. the proximal log-prob recompute): a third of a train step."""
    return train_step_flops(cfg, n_rows, seq_len)["total"] / 3.0
