"""`plan` compiles the trainer's and the generator's programs for the target device kind itself
(deviceless), in the configured dtypes, and says so; the generator's decode step holds the platform's
paged-attention kernel and its KV bytes are those of that engine's pool layout."""

from __future__ import annotations

import os

import pytest

from jaxrl_async.plan import aot
from jaxrl_async.plan.planner import load_plan_config, make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "qwen3_0_6b.py")


@pytest.mark.skipif(not aot.gpu_available(), reason="needs the CUDA plugin (extra [aot-gpu])")
def test_plan_compiles_the_trainer_for_h100():
    cfg = load_plan_config(CONFIG, "h100x8", [])
    r = make_plan(cfg, num_devices=8, compile_for="target")
    assert "H100" in r["compiled_for"]["trainer"] and "deviceless" in r["compiled_for"]["trainer"]
    assert r["executables"]["train_step"]["compute_dtype"] == "bfloat16"
    assert "H100" in r["compiled_for"]["generator"] and "deviceless" in r["compiled_for"]["generator"]
    assert r["executables"]["decode_step"]["compute_dtype"] == "bfloat16"  # no longer the CPU float32 bound
    assert r["executables"]["prefill"]["compute_dtype"] == "bfloat16"
    assert r["trainer"]["train_step_transient_bytes"] > 0 and r["generator"]["decode_transient_bytes"] > 0
    cpu = make_plan(cfg, num_devices=8, compile_for="cpu")
    assert cpu["compiled_for"]["trainer"].startswith("cpu") and cpu["compiled_for"]["generator"].startswith("cpu")
    assert cpu["executables"]["decode_step"]["compute_dtype"] == "float32"
    assert cpu["trainer"]["params_bytes"] == r["trainer"]["params_bytes"]  # same layout, other compiler
    assert cpu["generator"]["kv_cache_bytes"] == r["generator"]["kv_cache_bytes"]  # same pool (bf16, k and v)


@pytest.mark.skipif(not aot.tpu_available(), reason="needs libtpu (extra [aot-tpu])")
def test_plan_compiles_the_trainer_for_a_tpu_slice():
    cfg = load_plan_config(CONFIG, "h100x8", [])
    r = make_plan(cfg, num_devices=8, target="v5p", compile_for="target")
    assert "v5:2x2x2" in r["compiled_for"]["trainer"]
    assert r["target"]["kind"] == "v5p" and r["executables"]["train_step"]["compute_dtype"] == "bfloat16"
    assert "v5:2x2x2" in r["compiled_for"]["generator"]
    assert r["executables"]["decode_step"]["compute_dtype"] == "bfloat16"
    assert r["generator"]["kv_cache_bytes"] > 0 and r["generator"]["decode_transient_bytes"] > 0
