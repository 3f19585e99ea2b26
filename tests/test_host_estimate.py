"""Issue 30: `main --dry-run` on a CPU tells a user what the run needs on this machine (memory per role, a rough time
per RL step from the model's FLOPs and the matmul rate measured here) before they wait for a first step."""

from __future__ import annotations

import os
import subprocess
import sys

from jaxrl_async.config import apply_overrides
from jaxrl_async.config.default import get_config
from jaxrl_async.plan.host import GIB, format_host_estimate, host_estimate
from jaxrl_async.testing import subprocess_xla_flags
from jaxrl_async.trainer.flops import forward_flops, train_step_flops


def _model_cfg(cfg):
    return cfg.model.model_config(vocab_size=cfg.model.vocab_size or 64)


def test_the_estimate_counts_each_role_and_the_step_from_flops():
    cfg = apply_overrides(get_config(), ["rollout.engine.max_concurrent_decodes=8", "rollout.engine.max_sequence_length=128",
                                         "rollout.engine.max_prefill_length=64"])
    m = _model_cfg(cfg)
    rate, bw = 1e10, 1e10
    r = host_estimate(cfg, m, rates=(rate, bw))
    n = m.num_params()
    assert r["trainer_bytes"] == 16 * n  # fp32 weights, gradients, two Adam moments
    kv = 8 * 128 * 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
    assert r["kv_bytes"] == kv and r["generator_bytes"] == 2 * n * 4 + kv  # weights, a push's room, the pool
    seqs = cfg.trainer.batch_size * cfg.rollout.n_samples
    train = train_step_flops(m, seqs, 128)["total"] + forward_flops(m, seqs, 128)
    assert abs(r["training_s"] - train / rate) < 1e-9 and r["generation_s"] >= forward_flops(m, seqs, 128) / rate
    text = format_host_estimate(r, cores=2)
    assert "trainer ~" in text and "rough time per RL step" in text and "fits" in text
    # LoRA: only the adapters carry gradients and Adam moments
    lora = apply_overrides(cfg, ["model.lora.rank=4"])
    rl = host_estimate(lora, _model_cfg(lora), rates=(rate, bw))
    assert n * 4 < rl["trainer_bytes"] < r["trainer_bytes"]
    big = host_estimate(cfg, m.replace(hidden_size=8192, intermediate_size=30000, num_layers=80), rates=(rate, bw))
    assert big["trainer_bytes"] > 800 * GIB and "DOES NOT FIT" in format_host_estimate(big)


def test_main_dry_run_prints_the_estimate_on_a_cpu():
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags(), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "jaxrl_async.main", "--dry-run"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout  # the dry run's output, config included, is on stdout
    assert "config OK (dry run)" in out and "on this machine (CPU" in out and "rough time per RL step: " in out
    assert "trainer.total_steps = " in out and "config OK" not in proc.stderr
