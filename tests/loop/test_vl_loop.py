"""A vision-language policy through the whole loop (issue 29): the visual arithmetic task (problems shown only as
images) on a random-init Qwen2.5-VL-shaped policy, prompts with images from the data set through the generator
(vision tower at prefill, M-RoPE decode) and the trainer (the same images in the proximal recompute and the loss).

At eta = 0 the generator's behaviour log-probs equal the trainer's (fp32, within 1e-5: the images reached both
the same way), and a run SIGKILLed once its step-2 checkpoint is committed (while it trains step 3) and started
again reaches the uninterrupted run's parameters and optimizer state bit for bit, with the same image rows in the
same batches (the data ledger)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_fault_tolerance import START_TIMEOUT_S, Attempt, _assert_bitwise_equal_runs, _committed, _final_state

from jaxrl_async.data.ledger import read_data_ledger

VL = ["model.model_type=qwen2_5_vl", "data.task=visual_arithmetic", "data.tokenizer_kind=arithmetic_vl",
      "data.max_prompt_len=56", "rollout.engine.max_prefill_length=64", "rollout.engine.max_sequence_length=72",
      "trainer.packing.row_len_buckets=[128]",
      "model.vision.hidden_size=16", "model.vision.intermediate_size=32", "model.vision.num_heads=1"]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache_vl"))


def test_vl_eta0_on_policy_and_resume_after_sigkill_is_bitwise_identical(tmp_path, jax_cache):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    args = VL + ["rollout.max_head_offpolicyness=0", "trainer.total_steps=4", "checkpoint.every_steps=2",
                 "checkpoint.keep_last=3"]
    a = Attempt(whole, args, jax_cache, "whole")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    assert _committed(whole) == [2, 4]
    a = Attempt(killed, args, jax_cache, "killed")
    a.wait_for(lambda: os.path.isdir(os.path.join(killed, "checkpoints")) and 2 in _committed(killed),
               "the step-2 checkpoint", START_TIMEOUT_S, poll_s=0.02)
    a.kill9()
    assert 4 not in _committed(killed)  # killed before the end
    a = Attempt(killed, args, jax_cache, "resumed")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    resumed = killed
    assert [r["step"] for r in read_data_ledger(resumed).resumes] == [2]
    _assert_bitwise_equal_runs(whole, resumed, 4, 2)
    final, mid = dict(_final_state(whole, 4)), dict(_final_state(whole, 2))
    vision = [k for k in final if k.startswith("['params']['vision']")]
    assert vision, "the checkpoint holds the vision tower"
    rows = [json.loads(line) for line in open(os.path.join(whole, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # on-policy with images: the generator's behaviour log-probs are the trainer's proximal ones
    assert max(r["train/behave_prox_abs_max"] for r in rows) <= 1e-5, rows
    # the prompts were images: every trained prompt's row has one
    data = [json.loads(line) for line in open(os.path.join(whole, "data", "train.jsonl"))]
    assert all(len(d["images"]) == 1 for d in data)
    assert any(not np.array_equal(final[k], mid[k]) for k in final if k.startswith("['params']"))
