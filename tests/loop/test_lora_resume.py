"""LoRA runs resume exactly: at eta = 0, a run resumed from its step-2 checkpoint reaches the adapters, their
AdamW state and the (frozen) base of the uninterrupted run at step 4, bit for bit; the checkpoints hold the
adapters' optimizer state only and the base does not move."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from test_fault_tolerance import START_TIMEOUT_S, Attempt, _assert_bitwise_equal_runs, _committed, _final_state

LORA = ["model.lora.rank=4", "model.lora.alpha=8.0"]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache_lora"))


def test_lora_eta0_resume_after_crash_is_bitwise_identical(tmp_path, jax_cache):
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    args = LORA + ["rollout.max_head_offpolicyness=0", "trainer.total_steps=4", "checkpoint.every_steps=2",
                   "checkpoint.keep_last=3"]
    a = Attempt(whole, args, jax_cache, "whole")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    assert _committed(whole) == [2, 4]
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("4", "summary.json"))
    a = Attempt(resumed, args, jax_cache, "resumed")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    _assert_bitwise_equal_runs(whole, resumed, 4, 2)
    final, mid = dict(_final_state(whole, 4)), dict(_final_state(whole, 2))
    adapters = [k for k in final if k.startswith("['params']") and "_lora_" in k]
    base = [k for k in final if k.startswith("['params']") and "_lora_" not in k]
    assert len(adapters) == 14 and base
    assert all(np.array_equal(final[k], mid[k]) for k in base)  # frozen
    assert any(not np.array_equal(final[k], mid[k]) for k in adapters)  # trained
    opt = [k for k in final if k.startswith("['opt_state']") and final[k].ndim > 0]
    assert opt and all("_lora_" in k for k in opt)  # AdamW moments of the adapters only
