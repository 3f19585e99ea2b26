"""A vision-language policy through the whole loop (issue 29): the visual arithmetic task (problems shown only as
images) on a random-init Qwen2.5-VL-shaped policy, prompts with images from the data set through the generator
(vision tower at prefill, M-RoPE decode) and the trainer (the same images in the proximal recompute and the loss).

At eta = 0 the generator's behaviour log-probs equal the trainer's (fp32, within 1e-5: the images reached both
the same way), and a run resumed from its step-2 checkpoint after a crash reaches the uninterrupted run's
parameters and optimizer state bit for bit, with the same image rows in the same batches (the data ledger)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_fault_tolerance import _assert_bitwise_equal_runs, _final_state, run_whole_and_resumed_after_crash

from jaxrl_async.data.ledger import read_data_ledger

VL = ["model.model_type=qwen2_5_vl", "data.task=visual_arithmetic", "data.tokenizer_kind=arithmetic_vl",
      "data.max_prompt_len=48", "rollout.engine.max_prefill_length=48", "rollout.engine.max_sequence_length=64",
      "model.vision.hidden_size=16", "model.vision.intermediate_size=32", "model.vision.num_heads=1"]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache_vl"))


def test_vl_eta0_on_policy_and_resume_after_crash_is_bitwise_identical(tmp_path, jax_cache):
    whole, resumed = run_whole_and_resumed_after_crash(tmp_path, jax_cache, VL)
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
