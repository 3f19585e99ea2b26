"""`plan` of a LoRA run on a mixture of experts with expert adapters (the embedded default's shape turned into a
tiny Qwen3-MoE): the adapters counted X times per layer (one A shared by gate/up, B per half, down's pair, plus
attention), the trainer holding the frozen base + fp32 adapters + AdamW of the adapters only, and the push
carrying the adapters only; every figure against a hand calculation from the architecture numbers."""
import dataclasses

import pytest

from jaxrl_async.config import LoraSection
from jaxrl_async.config.default import get_config
from jaxrl_async.plan.planner import format_plan, make_plan


@pytest.mark.slow  # compiles the four programs (~40 s on a shared 2-core CPU); the count itself is also checked in
# tests/models/test_moe_lora.py from param_shapes, which plan reads
def test_plan_counts_expert_adapters_x_times_per_layer():
    cfg = get_config()
    lora = LoraSection(rank=4, alpha=8.0, targets=("q", "v", "gate", "up", "down"))
    model = dataclasses.replace(cfg.model, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, vocab_size=256, lora=lora)
    cfg = dataclasses.replace(cfg, model=model)
    r = make_plan(cfg, num_devices=2, target="h100", compile_for="cpu")
    m = cfg.model
    D, L, H, K, E, X, F, rk = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.num_experts,
                               m.moe_intermediate_size, lora.rank)
    attention = rk * ((D + H * E) + (D + K * E))
    experts = X * rk * ((D + 2 * F) + (F + D))  # gate_up: A [D, r] + B [r, 2F]; down: A [F, r] + B [r, D]
    adapters = L * (attention + experts)
    assert r["lora"]["adapter_params"] == adapters
    assert r["lora"]["targets"] == ["q", "v", "gate", "up", "down"]
    P = r["model"]["params"]
    t, w = r["trainer"], r["weight_push"]
    assert abs(t["params_bytes"] - 4 * (P + adapters)) <= 0.01 * 4 * (P + adapters)  # fp32 base + adapters
    assert abs(t["optimizer_state_bytes"] - 2 * 4 * adapters) <= 0.02 * 8 * adapters  # Adam of the adapters only
    assert abs(w["new_weights_bytes_per_generator_device"] - 4 * adapters) <= 0.02 * 4 * adapters  # adapters only
    assert "LoRA: rank 4" in format_plan(r)
