"""Config rules that run before anything is built (issue 24, Found 2-3): each case used to validate and then
crash (or silently misbehave) after compile and warm start. The one-line exit-2 CLI side of each is in
tests/test_cli_errors.py (``main-*`` cases); here the rules themselves and the LR schedule."""
import math

import pytest

from jaxrl_async.config import ConfigError, apply_overrides, to_dict, validate
from jaxrl_async.config.resume import changed_fields, check_resume
from jaxrl_async.config.default import get_config


def _cfg(tmp_path, *overrides):
    return apply_overrides(get_config(), [f"run_dir={tmp_path / 'run'}", *overrides])


@pytest.mark.parametrize("overrides, field", [
    (["trainer.advantage.kl_coef=0.1"], "trainer.advantage.kl_coef"),
    (["rollout.engine.max_sequence_length=256", "rollout.sampling.max_new_tokens=192",
      "model.max_position_embeddings=256"], "trainer.packing.row_len_buckets"),
    (["trainer.sft.steps=5"], "trainer.sft.warmup_steps"),
    (["trainer.sft.steps=20", "trainer.sft.lr=0.0"], "trainer.sft.lr"),
    (["rollout.engine.max_top_logprobs=-1"], "rollout.engine.max_top_logprobs"),
])
def test_refused_before_anything_is_built(tmp_path, overrides, field):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(tmp_path, *overrides), num_devices=1)
    assert e.value.field == field, str(e.value)
    assert "\n" not in str(e.value)


def test_fixed_cases_validate(tmp_path):
    # the same settings, made consistent, pass: a bucket as long as the engine; a warm-up shorter than the SFT run
    validate(_cfg(tmp_path, "rollout.engine.max_sequence_length=256", "rollout.sampling.max_new_tokens=192",
                  "model.max_position_embeddings=256", "trainer.packing.row_len_buckets=(64,128,256)"), num_devices=1)
    validate(_cfg(tmp_path, "trainer.sft.steps=5", "trainer.sft.warmup_steps=2"), num_devices=1)


def _fake_checkpoint(run_dir, step, config):
    import json
    import os

    d = os.path.join(run_dir, "checkpoints", str(step))
    os.makedirs(os.path.join(d, "meta"))
    with open(os.path.join(d, "meta", "metadata"), "w") as f:
        json.dump({"config": config}, f)
    open(os.path.join(d, "commit_success.txt"), "w").close()


def test_resume_never_on_a_used_directory_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "checkpoint.resume=never")
    check_resume(cfg)  # an empty directory is fine
    _fake_checkpoint(str(tmp_path / "run"), 3, to_dict(cfg))
    with pytest.raises(ConfigError, match=r"checkpoint\.resume: 'never', but .* holds committed checkpoints \(steps \[3\]\)"):
        check_resume(cfg)


def test_resume_refuses_changes_that_redefine_the_saved_state_and_lists_the_others(tmp_path):
    cfg = _cfg(tmp_path)
    _fake_checkpoint(str(tmp_path / "run"), 2, to_dict(cfg))
    check_resume(apply_overrides(cfg, ["trainer.total_steps=300", "rollout.max_head_offpolicyness=4",
                                       "rollout.n_samples=4"]))  # allowed
    assert changed_fields(to_dict(cfg), apply_overrides(cfg, ["trainer.total_steps=300", "rollout.n_samples=4"])) == {
        "rollout.n_samples": (8, 4), "trainer.total_steps": (150, 300)}
    for over, field in (["model.hidden_size=128", "model.hidden_size"], ["seed=3", "seed"],
                        ["data.arithmetic.num_train=10", "data.arithmetic.num_train"]):
        with pytest.raises(ConfigError) as e:
            check_resume(apply_overrides(cfg, [over]))
        assert e.value.field == field and "differs from the checkpoint this run resumes" in str(e.value)


def _areal_lr(k, *, lr, warmup, total, min_ratio, schedule):
    """AReaL's per-RL-step schedule (its scheduler steps once per ppo_update): linear warm-up over `warmup` steps,
    then constant, or cosine to min_ratio * lr at `total` steps."""
    if k < warmup:
        return lr * k / warmup
    if schedule == "constant":
        return lr
    p = min(max((k - warmup) / (total - warmup), 0.0), 1.0)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_lr_schedule_advances_once_per_rl_step(tmp_path, schedule):
    """With 4 minibatch updates per step, every update of RL step k uses AReaL's lr(k): the warm-up ends and
    the cosine reaches its floor at the configured RL steps, not 4x early."""
    from jaxrl_async.trainer.factory import trainer_config
    from jaxrl_async.trainer.optimizer import learning_rate_schedule

    T, m = 40, 4
    cfg = _cfg(tmp_path, f"trainer.schedule={schedule}", "trainer.ppo_n_minibatches=4", f"trainer.total_steps={T}",
               "trainer.warmup_steps=8", "trainer.min_lr_ratio=0.1", "trainer.lr=1e-3")
    validate(cfg, num_devices=1)
    sched = learning_rate_schedule(trainer_config(cfg).optimizer)
    for k in range(T + 2):
        want = _areal_lr(k, lr=1e-3, warmup=8, total=T, min_ratio=0.1, schedule=schedule)
        for j in range(m):
            assert math.isclose(float(sched(k * m + j)), want, rel_tol=1e-5, abs_tol=1e-12), (k, j)


def test_the_model_section_is_the_model_configs_fields_not_a_copy():
    """Issue 24 Found 6: `model.*` carries ModelConfig's own field names (plus what only a run has), and its random-init
    ModelConfig takes them by name, so a field added to one cannot silently be lost by the other."""
    import dataclasses

    from jaxrl_async.config import ModelConfigSection, apply_overrides
    from jaxrl_async.config.default import get_config
    from jaxrl_async.models.config import ModelConfig

    section_only = {"path", "tokenizer_path", "init_seed", "vision"}  # where the weights come from (lora: LoraSection -> spec)
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {f.name for f in dataclasses.fields(ModelConfigSection)} - model_fields == section_only
    for overrides in ([], ["model.model_type=qwen2", "model.hidden_size=48", "model.num_heads=6"],
                      ["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
                       "model.moe_intermediate_size=32", "model.lora.rank=2", "model.dtype=bfloat16"]):
        sec = apply_overrides(get_config(), overrides).model
        m = sec.model_config(100, eos_token_id=2)
        for f in dataclasses.fields(ModelConfigSection):
            if f.name in model_fields and f.name not in ("lora", "vocab_size"):
                assert getattr(m, f.name) == getattr(sec, f.name), f.name
        assert m.vocab_size == (sec.vocab_size or 100) and m.eos_token_id == 2
        assert m.qkv_bias == (sec.model_type == "qwen2") and m.qk_norm == (sec.model_type != "qwen2")
        assert (m.lora is None) == (sec.lora.rank == 0)


def test_the_trainer_sections_optimizer_fields_are_the_optimizers():
    """Same for `trainer.*`'s optimizer settings: OptimizerConfig's fields by name (only `decay_norms_and_biases`
    keeps the optimizer's default, and `updates_per_step` comes from `ppo_n_minibatches`)."""
    import dataclasses

    from jaxrl_async.config import TrainerConfig
    from jaxrl_async.trainer.optimizer import OptimizerConfig

    opt_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    shared = opt_fields & {f.name for f in dataclasses.fields(TrainerConfig)}
    assert opt_fields - shared == {"decay_norms_and_biases", "updates_per_step"}
    tr = TrainerConfig(lr=3e-4, schedule="cosine", warmup_steps=3, total_steps=40, min_lr_ratio=0.1, b1=0.8,
                       b2=0.9, eps=1e-6, weight_decay=0.05, max_grad_norm=0.5, ppo_n_minibatches=4)
    opt = tr.optimizer_config()
    assert all(getattr(opt, n) == getattr(tr, n) for n in shared) and opt.updates_per_step == 4
