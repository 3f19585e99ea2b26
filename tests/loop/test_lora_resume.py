"""LoRA runs resume exactly: at eta = 0, a run resumed from its step-2 checkpoint reaches the adapters, their
AdamW state and the (frozen) base of the uninterrupted run at step 4, bit for bit; the checkpoints hold the
adapters' optimizer state only and the base does not move."""
from __future__ import annotations


import numpy as np
import pytest
from lora_checks import assert_adapter_only_training  # tests
from test_fault_tolerance import _assert_bitwise_equal_runs, _final_state, run_whole_and_resumed_after_crash

LORA = ["model.lora.rank=4", "model.lora.alpha=8.0"]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache_lora"))


@pytest.mark.slow
def test_lora_eta0_resume_after_crash_is_bitwise_identical(tmp_path, jax_cache):
    """Slow (~29 s): its properties are in the default suite: the same LoRA run (tiny config, rank 4, eta 0,
    checkpoints at 2 and 4) resumed from its step-2 copy bit for bit, with the base frozen, the adapters trained
    and adapter-only AdamW state in the checkpoint, in
    tests/distributed/test_multiprocess_lora.py::test_generator_process_lora_unmerged_parity_push_bytes_and_resume
    (generator in its own process); the colocated main's bitwise eta-0 resume in
    tests/loop/test_fault_tolerance.py::test_eta0_resume_after_crash_is_bitwise_identical, its LoRA checkpoint
    resume in tests/loop/test_lora_base_ref.py."""
    whole, resumed = run_whole_and_resumed_after_crash(tmp_path, jax_cache, LORA)
    _assert_bitwise_equal_runs(whole, resumed, 4, 2)
    assert_adapter_only_training(dict(_final_state(whole, 4)), dict(_final_state(whole, 2)))


MOE_LORA = [*LORA, "model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
            "model.moe_intermediate_size=32"]


@pytest.mark.slow
def test_moe_expert_lora_eta0_resume_after_crash_is_bitwise_identical(tmp_path, jax_cache):
    """The same with a mixture of experts whose adapters include every expert's gate/up/down."""
    whole, resumed = run_whole_and_resumed_after_crash(tmp_path, jax_cache, MOE_LORA)
    _assert_bitwise_equal_runs(whole, resumed, 4, 2)
    final, mid = dict(_final_state(whole, 4)), dict(_final_state(whole, 2))
    experts = [k for k in final if k.startswith("['params']") and "moe_" in k and "_lora_" in k]
    assert len(experts) == 4  # moe_gate_up_lora_a/b, moe_down_lora_a/b
    assert any(not np.array_equal(final[k], mid[k]) for k in experts)  # the expert adapters trained
    base = [k for k in final if k.startswith("['params']") and "_lora_" not in k]
    assert base and all(np.array_equal(final[k], mid[k]) for k in base)  # frozen
