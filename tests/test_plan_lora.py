"""`plan` of a LoRA run (configs/qwen3_8b_lora.py on one H100): the trainer holds the frozen bf16 base plus
fp32 adapters, AdamW state only for the adapters, and a weight push moves only the adapters; every figure
against a hand calculation from the architecture numbers."""
import os

from jaxrl_async.config import load_config_file
from jaxrl_async.plan.planner import format_plan, make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def close(value, expected, rel=0.02):
    return abs(value - expected) <= rel * expected


def test_plan_of_the_qwen3_8b_lora_recipe_on_one_h100():
    cfg = load_config_file(os.path.join(ROOT, "configs", "qwen3_8b_lora.py"))
    r = make_plan(cfg, num_devices=1, target="h100", compile_for="cpu")
    m, lo = cfg.model, cfg.model.lora
    D, L, H, K, E, F, rk = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                            m.intermediate_size, lo.rank)
    adapters = L * rk * ((D + H * E) + 2 * (D + K * E) + (H * E + D) + 2 * (D + F) + (F + D))
    P = r["model"]["params"]
    assert r["lora"]["adapter_params"] == adapters and lo.base_dtype == "bfloat16"
    t, g, w = r["trainer"], r["generator"], r["weight_push"]
    assert close(t["params_bytes"], 2 * P + 4 * adapters)  # bf16 frozen base + fp32 adapters
    assert close(t["optimizer_state_bytes"], 2 * 4 * adapters)  # Adam mu + nu of the adapters only
    assert close(w["new_weights_bytes_per_generator_device"], 2 * adapters)  # the push: bf16 adapters only
    assert close(g["params_bytes"], 2 * (P + adapters))  # the generator's base (loaded once) + adapters
    assert g["incoming_weights_bytes"] < 0.02 * g["params_bytes"]
    text = format_plan(r)
    assert "LoRA: rank 32" in text and "AdamW, adapters only" in text


def test_lora_tpu_recipe_validates_on_its_slice():
    from jaxrl_async.config import validate

    cfg = load_config_file(os.path.join(ROOT, "configs", "qwen3_8b_lora_v5p.py"))
    validate(cfg, 4)
    assert cfg.model.lora.rank == 32 and cfg.model.lora.base_dtype == "bfloat16" and cfg.mesh.trainer.shape == (2,)
