"""`python -m jaxrl_async.export`: checkpoint of a sharded run -> Hugging Face directory whose logits
match ours in transformers (fp32), bf16 export, tokenizer copy, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer, TrainMeta
from jaxrl_async.cli.export import export_checkpoint, main
from jaxrl_async.config import DataConfig, RunConfig, to_dict
from jaxrl_async.data.datasets import BOXED_INSTRUCTION
from jaxrl_async.models import apply, load_hf
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import make_mesh
from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer
from jaxrl_async.testing import subprocess_xla_flags

RUN_CONFIG = to_dict(RunConfig(data=DataConfig(task="dataset", format="math", prompt_suffix=BOXED_INSTRUCTION)))
TOKENS = np.array([[1, 17, 42, 99, 3, 250, 7, 64], [1, 5, 5, 200, 31, 8, 2, 0]], np.int32)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run dir with checkpoints at steps 1 and 2 of a tiny untied Qwen3, saved on an fsdp=4 x tensor=2 mesh."""
    root = tmp_path_factory.mktemp("export")
    hf_dir = make_tiny_hf_model(str(root / "hf"), "qwen3_untied", seed=3)
    tok_dir = make_tiny_tokenizer(str(root / "tok"))
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    cfg, params = load_hf(hf_dir, shardings=lambda c: model_shardings(c, mesh, "trainer"))
    step2 = jax.tree.map(lambda x: x * 1.01 + 0.001, params)  # a "trained" step with different values
    run_dir = str(root / "run")
    with Checkpointer(run_dir, CheckpointConfig(keep_last=3), model_config=cfg, tokenizer_dir=tok_dir) as ck:
        ck.save({"params": params}, TrainMeta(step=1, policy_version=1))
        # step 2 carries the run's config, as the loop saves it (step 1: a checkpoint without one)
        ck.save({"params": step2}, TrainMeta(step=2, policy_version=2, config=RUN_CONFIG))
    return run_dir, cfg, {1: params, 2: step2}, tok_dir


def _hf_logits(out_dir, dtype="float32"):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=getattr(torch, dtype))
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


def test_cli_export_matches_our_logits_in_transformers(run, tmp_path):
    run_dir, cfg, params, tok_dir = run
    out = str(tmp_path / "hf_out")
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags(1), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "jaxrl_async.export", "--run-dir", run_dir, "--out", out],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported step 2 of {run_dir}" in proc.stdout and "tokenizer" in proc.stdout
    assert "Given directory is read only" not in proc.stderr, proc.stderr  # orbax's absl notice is silenced
    for f in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, f)), f
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)
    ours = np.asarray(jax.jit(apply, static_argnums=1)(params[2], cfg, TOKENS))
    theirs = _hf_logits(out)
    err = float(np.max(np.abs(ours - theirs)))
    print(f"max |logit diff| exported step 2 vs ours (fp32): {err:.2e}")
    assert err <= 1e-5
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hi")["input_ids"] == transformers.AutoTokenizer.from_pretrained(tok_dir)("hi")["input_ids"]


def test_export_writes_the_runs_prompt_recipe(run, tmp_path, capsys):
    """The recipe of the config saved with the exported step (issue 31 item 6), which `evaluate` reads."""
    from jaxrl_async.data.recipe import find_run_recipe, run_recipe

    run_dir = run[0]
    out = tmp_path / "hf"
    assert main(["--run-dir", run_dir, "--out", str(out)]) == 0
    assert "config.json, generation_config.json, jaxrl_async_run.json, tokenizer" in capsys.readouterr().out
    rc, path = find_run_recipe(str(out))
    assert path == str(out / "jaxrl_async_run.json") and rc == run_recipe(RUN_CONFIG, run_dir=run_dir, step=2)
    assert (rc.prompt.format, rc.prompt.prompt_suffix) == ("math", BOXED_INSTRUCTION)


def test_export_older_step_and_bf16(run, tmp_path):
    run_dir, cfg, params, _ = run
    out = str(tmp_path / "bf16")
    res = export_checkpoint(run_dir, out, step=1, dtype="bfloat16")
    assert res.step == 1 and res.weight_files == ("model.safetensors",) and res.tokenizer_copied
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    header_len = int.from_bytes(open(os.path.join(out, "model.safetensors"), "rb").read(8), "little")
    header = json.loads(open(os.path.join(out, "model.safetensors"), "rb").read(8 + header_len)[8:])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    # bf16 weights of step 1: same greedy argmax as our fp32 step-1 logits on almost every position.
    ours = np.asarray(apply(params[1], cfg, TOKENS))
    theirs = _hf_logits(out, "bfloat16")
    assert np.max(np.abs(ours - theirs)) < 0.1 * np.max(np.abs(ours))
    assert np.mean(ours.argmax(-1) == theirs.argmax(-1)) >= 0.9


def test_export_errors(run, tmp_path, capsys):
    run_dir, _, _, _ = run
    assert main(["--run-dir", run_dir, "--step", "7", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no committed checkpoint at step 7" in err and "committed: [1, 2]" in err
    assert err.startswith(f"export: error: {run_dir}") and err.count("\n") == 1, err
    assert main(["--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "y")]) == 2
    assert f"export: error: --run-dir {tmp_path / 'nope'}: not found" in capsys.readouterr().err
    (tmp_path / "norun").mkdir()
    assert main(["--run-dir", str(tmp_path / "norun"), "--out", str(tmp_path / "y")]) == 2
    assert "no checkpoints/ directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--run-dir", run_dir, "--out", str(tmp_path / "z"), "--dtype", "int8"])
    assert e.value.code == 2


def test_export_refuses_to_overwrite_without_flag(run, tmp_path, capsys):
    run_dir, _, _, _ = run
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["--run-dir", run_dir, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"export: error: --out {out}: directory exists and is not empty (pass "
                                       "--overwrite to replace its model files)\n")
    assert os.listdir(out) == ["notes.txt"]
    # --overwrite replaces an earlier (sharded) export's files, keeps other files
    export_checkpoint(run_dir, str(out), step=1, max_shard_bytes=20_000)
    shards = sorted(f for f in os.listdir(out) if f.startswith("model-"))
    assert len(shards) > 1 and os.path.isfile(out / "model.safetensors.index.json")
    assert main(["--run-dir", run_dir, "--out", str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == sorted(["notes.txt", "model.safetensors", "config.json", "generation_config.json",
                                              "tokenizer.json", "tokenizer_config.json", "jaxrl_async_run.json"])
    # step 1 has no run config: no recipe, and --overwrite removed step 2's
    assert main(["--run-dir", run_dir, "--out", str(out), "--overwrite", "--step", "1"]) == 0
    assert not os.path.exists(out / "jaxrl_async_run.json")
    assert main(["--run-dir", run_dir, "--out", str(out / "notes.txt")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_export_takes_the_runs_dtype_and_refuses_peft_without_adapters(run, tmp_path, capsys):
    """Issue 31 item 8: the default weight dtype is the run's model.dtype (a bfloat16 run no longer doubles in size),
    `--lora peft` on a run without LoRA is one line (it silently wrote a full model), and the summary line names
    only files that exist."""
    run_dir, cfg, params, tok_dir = run
    bf_dir = str(tmp_path / "bf_run")
    with Checkpointer(bf_dir, CheckpointConfig(keep_last=1), model_config=cfg.replace(dtype="bfloat16"),
                      tokenizer_dir=tok_dir) as ck:
        ck.save({"params": params[1]}, TrainMeta(step=1, policy_version=1))
    out = str(tmp_path / "bf_out")
    assert main(["--run-dir", bf_dir, "--out", out]) == 0
    said = capsys.readouterr().out
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    assert "config.json" in said and "adapter_config.json" not in said
    assert main(["--run-dir", run_dir, "--out", str(tmp_path / "peft"), "--lora", "peft"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lora peft:" in err and "is not a LoRA run" in err, err
    assert not os.path.exists(tmp_path / "peft") or not os.listdir(tmp_path / "peft")
