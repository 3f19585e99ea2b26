"""LoRA on a model.path base (no warm start): checkpoints hold the adapters and their AdamW state and refer to
the base (model.path, fingerprinted) instead of copying it; an eta = 0 resume reaches the uninterrupted run's
state (same data, same rollouts; within 1e-5 relative: runs that read model.path, with or without LoRA, resume
to fp32 rounding, not bit for bit: measured 2.6e-6 for the full-weight run, see NOTES); export re-reads the
base (merged weights reproduce our logits in transformers); a changed base is refused, naming model.path."""
from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest
from test_fault_tolerance import START_TIMEOUT_S, Attempt, _committed, _final_state

from jaxrl_async.checkpoint import HOST, CheckpointIncompatibleError, Checkpointer
from jaxrl_async.cli.export import export_checkpoint
from jaxrl_async.models import apply, load_hf, lora
from jaxrl_async.data.ledger import read_data_ledger
from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer

TOKENS = np.array([[1, 17, 42, 99, 3, 50, 7, 64]], np.int32)


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache_lora_ref"))


def test_lora_checkpoints_reference_model_path(tmp_path, jax_cache):
    base_dir = make_tiny_hf_model(str(tmp_path / "base"), "qwen3", seed=4)
    make_tiny_tokenizer(base_dir)
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    args = [f"model.path={base_dir}", "model.lora.rank=4", "model.lora.alpha=8.0", "rollout.max_head_offpolicyness=0",
            "trainer.total_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=3", "checkpoint.export_hf=true",
            "data.apply_chat_template=false"]
    a = Attempt(whole, args, jax_cache, "whole")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    assert _committed(whole) == [2, 4]
    r = Checkpointer(whole, read_only=True).restore(4, targets={"params": HOST, "opt_state": HOST})
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(r.arrays["params"])[0]]
    assert names and all("_lora_" in n for n in names)  # no base leaf in the checkpoint
    ref = r.meta.extra["lora_base"]
    assert ref["path"] == os.path.abspath(base_dir) and "model.safetensors" in ref["files"]
    # resumed from step 2 == uninterrupted: the same batches, on-policy, the same adapters and moments
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("4", "summary.json"))
    a = Attempt(resumed, args, jax_cache, "resumed")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    a, b, mid = _final_state(whole, 4), _final_state(resumed, 4), dict(_final_state(whole, 2))
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        assert x.shape == y.shape and np.abs(x - y).max() <= 1e-5 * max(np.abs(x).max(), 1e-12), k
    assert any(np.abs(mid[k] - x).max() > 1e-4 * np.abs(x).max() for k, x in a if k.startswith("['params']"))
    draws = [[(e["step"], e["draws"], e["lags"]) for e in read_data_ledger(d).events("consume")]
             for d in (whole, resumed)]
    assert draws[0] == draws[1] and all(lag == 0 for _, _, lags in draws[0] for lag in lags)
    # the run's export (merged, base re-read from model.path) reproduces base + adapters in transformers
    import torch
    import transformers

    cfg, base = load_hf(base_dir)
    ours = np.asarray(apply(lora.join(r.arrays["params"], base), r.model_config, TOKENS))
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(whole, "hf"), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    assert np.abs(ours - np.asarray(apply(base, cfg, TOKENS))).max() > 1e-4  # the adapters trained
    # another base at model.path: refused, naming it
    w = os.path.join(base_dir, "model.safetensors")
    data = bytearray(open(w, "rb").read())
    data[-4:] = bytes(4 - i for i in range(4))
    open(w, "wb").write(bytes(data))
    with pytest.raises(CheckpointIncompatibleError, match="model.path .* is not the base"):
        export_checkpoint(whole, str(tmp_path / "out"))
