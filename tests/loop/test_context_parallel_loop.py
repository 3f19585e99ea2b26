"""The RL loop with a context-parallel trainer: rows split over `mesh.trainer` axis `context` (fsdp 1 x
context 2), blockwise attention on query chunks. The run trains, and at eta = 0 the trainer's log-probs of
the generator's samples (proximal pass on the split rows) equal the behaviour log-probs (fp32)."""

from __future__ import annotations

import json
import os

from jaxrl_async.loop import RLRun
from test_rl_loop import tiny_run_config


def test_rl_loop_with_a_context_parallel_trainer(tmp_path, monkeypatch):
    from jaxrl_async.kernels import attention_pallas as attention_kernels

    calls = []
    real = attention_kernels.context_parallel_attention
    monkeypatch.setattr(attention_kernels, "context_parallel_attention",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    cfg = tiny_run_config(tmp_path / "run", eta=0, steps=3, **{
        "mesh.trainer.shape": "[1,2]", "mesh.trainer.axis_names": "fsdp,context", "model.attention": "blockwise",
        "model.attention_block": 16})
    res = RLRun(cfg).run()
    assert res.steps == 3 and res.version == 3
    assert calls and set(calls) == {"blockwise"}  # the trainer's attention ran on query chunks
    with open(os.path.join(res.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if "train/loss" in line]
    assert len(rows) == 3
    for r in rows:
        assert abs(r["train/behave_kl"]) < 1e-6, r["train/behave_kl"]  # generator == trainer log-probs
