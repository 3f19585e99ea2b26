"""Run config: typed overrides, field-named errors, device split, config files, JSON round trip."""
import dataclasses
import json
from typing import Literal, Optional

import pytest

from jaxrl_async.config import (
    ConfigError, MeshAxesConfig, MeshConfig, RolloutConfig, RunConfig, TrainerConfig, apply_overrides, from_dict,
    load_config_file, load_config_json, parse_command_line, parse_value, resolve_device_split, save_config, to_dict,
    trainer_data_parallel_size, validate,
)
from jaxrl_async.rl.losses import PolicyLossConfig


def err(fn, *a, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*a, **kw)
    return str(e.value)


@pytest.mark.parametrize("text, tp, expected", [
    ("true", bool, True), ("Off", bool, False), ("0", bool, False),
    ("1_000", int, 1000), ("1e3", int, 1000), ("-3", int, -3),
    ("1e-6", float, 1e-6), ("2", float, 2.0),
    ("'a b'", str, "a b"), ("plain", str, "plain"),
    ("1,2,3", tuple[int, ...], (1, 2, 3)), ("(4, -1)", tuple[int, ...], (4, -1)), ("()", tuple[int, ...], ()),
    ('("</a>", "x")', tuple[str, ...], ("</a>", "x")), ("fsdp,tensor", tuple[str, ...], ("fsdp", "tensor")),
    ("None", Optional[int], None), ("null", int | None, None), ("7", int | None, 7),
    ("sync", Literal["async", "sync"], "sync"), ("3,4", tuple[int, int], (3, 4)),
])
def test_parse_value(text, tp, expected):
    out = parse_value(text, tp, "f")
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize("text, tp, match", [
    ("maybe", bool, "expected a bool"), ("1.5", int, "expected an int"), ("x", float, "expected a float"),
    ("fast", Literal["async", "sync"], r"must be one of \['async', 'sync'\]"), ("None", int, "expected an int"),
    ("1,2,3", tuple[int, int], "expected 2 values"),
])
def test_parse_value_errors(text, tp, match):
    assert "config error: f" in err(parse_value, text, tp, "f")
    with pytest.raises(ConfigError, match=match):
        parse_value(text, tp, "f")


def test_overrides_from_the_issue_and_nested_components():
    cfg = apply_overrides(RunConfig(), [
        "trainer.lr=1e-6", "rollout.max_head_offpolicyness=4", "trainer.loss.behaviour_weight.upper=3",
        "trainer.loss.eps_clip_higher=0.28", "rollout.sampling.stop_strings=('</answer>',)", "rollout.mode=sync",
        "trainer.schedule=cosine", "trainer.total_steps=50",  # validated together (cosine needs total_steps)
        "trainer.lr=2e-6",  # later wins
    ])
    assert cfg.trainer.lr == 2e-6 and cfg.rollout.max_head_offpolicyness == 4
    assert isinstance(cfg.trainer.loss, PolicyLossConfig) and cfg.trainer.loss.behaviour_weight.upper == 3.0
    assert cfg.trainer.loss.eps_high == 0.28 and cfg.rollout.sampling.stop_strings == ("</answer>",)
    assert cfg.rollout.effective_max_head_offpolicyness == 0 and cfg.rollout.effective_max_concurrent(8) == 8
    assert cfg.trainer.optimizer_config().total_steps == 50
    assert RunConfig().trainer.lr != cfg.trainer.lr  # frozen: the default is untouched


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_head_offpolicyness=-1"], "config error: rollout.max_head_offpolicyness: must be >= 0, got -1"),
    (["trainer.lrr=1"], "config error: trainer.lrr: unknown field; did you mean 'lr'?"),
    (["trainer.batch_size=abc"], "config error: trainer.batch_size: expected an int, got 'abc'"),
    (["rollout=3"], "config error: rollout: is a section (RolloutConfig)"),
    (["trainer.lr"], "must look like section.field=value"),
    (["trainer.lr.x=1"], "config error: trainer.lr: is not a section"),
    (["trainer.loss.eps_clip=-1"], "config error: trainer.loss.eps_clip: must be >= 0, got -1.0"),
    (["trainer.loss.behaviour_weight.upper=0.5"], "config error: trainer.loss.behaviour_weight.upper: must be > 1"),
    (["trainer.schedule=cosine", "trainer.total_steps=0"], "config error: trainer.total_steps: must be >= 1"),
    (["model.num_kv_heads=3"], "config error: model.num_kv_heads: 3 must divide num_heads=4"),
    (["trainer.lr=-1"], "config error: trainer.lr: must be a finite non-negative float"),
    (["mesh.trainer.shape=3"], "config error: mesh.trainer.shape: (3,) needs 3 devices but its share has 2"),
    (["mesh.generator.shape=4,-1"], "config error: mesh.generator.shape: (4, -1) does not fit its 6 devices"),
    (["mesh.trainer.axis_names=fsdp,foo", "mesh.trainer.shape=2,1"], "mesh.trainer.axis_names: unknown axes ['foo']"),
    (["mesh.trainer.shape=2,1"], "mesh.trainer.shape: (2, 1) and axis_names ('fsdp',) must be non-empty and of equal"),
    (["trainer.batch_size=1", "rollout.n_samples=1"], "trainer.batch_size: a minibatch of 1 sequences"),
    (["trainer.ppo_n_minibatches=3"], "trainer.ppo_n_minibatches: trainer.batch_size * rollout.n_samples = 32"),
    (["rollout.engine.max_concurrent_decodes=2"], "rollout.engine.max_concurrent_decodes: must be >= rollout.n_samples=4"),
    (["rollout.sampling.top_p=0"], "rollout.sampling.top_p: must be in (0, 1], got 0.0"),
    (["data.task=dataset"], "data.train_path: must be set when data.task='dataset'"),
    (["data.task=dataset", "data.train_path=/nonexistent.jsonl"], "data.train_path: file '/nonexistent.jsonl' does not exist"),
    (["model.path=/nonexistent"], "model.path: '/nonexistent' has no config.json"),
    (["rollout.reward=nope"], "rollout.reward: must be one of ['code', 'gsm8k', 'math'] or 'package.module:function'"),
    (["mesh.num_generator_devices=8"], "mesh.num_generator_devices: must be in [1, 7] with 8 devices, got 8"),
    (["mesh.generator.devices=0,1", "mesh.trainer.devices=1,2"], "mesh.trainer.devices: devices [1] are also generator"),
    (["rollout.engine.max_sequence_length=1024"],
     "rollout.engine.max_sequence_length: 1024 exceeds model.max_position_embeddings=512"),
    (["mesh.generator.shape=2,-1", "rollout.engine.num_pages=99"],
     "rollout.engine.num_pages: 99 pages do not split over the generator's 2 data replicas"),
    # expert parallelism: an `expert` axis needs an MoE model whose experts it divides
    (["mesh.trainer.axis_names=fsdp,expert", "mesh.trainer.shape=1,2"],
     "mesh.trainer.axis_names: an 'expert' axis of size > 1 needs a mixture-of-experts model"),
    (["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
      "model.moe_intermediate_size=16", "mesh.generator.axis_names=data,expert", "mesh.generator.shape=2,3"],
     "mesh.generator.shape: the expert axis (3 shards) must divide the model's 4 experts"),
])
def test_errors_name_the_field(overrides, message):
    assert message in err(lambda: validate(apply_overrides(RunConfig(), overrides), num_devices=8))


def test_expert_axes_are_accepted_and_shard_the_trainer_batch():
    moe = ["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
           "model.moe_intermediate_size=16"]
    cfg = apply_overrides(RunConfig(), moe + ["mesh.generator.axis_names=data,expert", "mesh.generator.shape=3,2",
                                              "mesh.trainer.axis_names=fsdp,expert", "mesh.trainer.shape=1,2"])
    validate(cfg, num_devices=8)
    assert trainer_data_parallel_size(cfg, 8) == 2  # the trainer's batch is split over `expert` too


def test_wrong_types_from_a_config_file_are_caught():
    bad = dataclasses.replace(RunConfig(), trainer=dataclasses.replace(TrainerConfig(), batch_size="8"))
    assert "config error: trainer.batch_size: expected int, got str '8'" in err(validate, bad, 1)
    bad = dataclasses.replace(RunConfig(), rollout=dataclasses.replace(RolloutConfig(), mode="fast"))
    assert "config error: rollout.mode: must be one of ['async', 'sync'], got 'fast'" in err(validate, bad, 1)
    bad = dataclasses.replace(RunConfig(), mesh=MeshConfig(trainer=MeshAxesConfig(shape=[2])))
    assert "config error: mesh.trainer.shape: expected a tuple" in err(validate, bad, 1)


@pytest.mark.parametrize("n, mesh, gen, trn", [
    (1, MeshConfig(), (0,), (0,)),  # one device: shared (time-sharing)
    (8, MeshConfig(), tuple(range(6)), (6, 7)),  # round(8 * 3/4) = 6
    (4, MeshConfig(), (0, 1, 2), (3,)),
    (2, MeshConfig(), (0,), (1,)),
    (3, MeshConfig(generator_fraction=0.1), (0,), (1, 2)),  # clamped to >= 1
    (8, MeshConfig(num_generator_devices=2), (0, 1), tuple(range(2, 8))),
    (4, MeshConfig(colocate=True), (0, 1, 2, 3), (0, 1, 2, 3)),
    (4, MeshConfig(trainer=MeshAxesConfig(devices=(0,))), (1, 2, 3), (0,)),
])
def test_device_split(n, mesh, gen, trn):
    assert resolve_device_split(mesh, n) == (gen, trn)


def test_data_parallel_size_and_single_device_validates():
    cfg = apply_overrides(RunConfig(), ["mesh.trainer.shape=-1,2", "mesh.trainer.axis_names=fsdp,tensor",
                                        "mesh.num_generator_devices=4"])
    assert trainer_data_parallel_size(cfg, 8) == 2  # trainer: 4 devices = fsdp 2 x tensor 2
    validate(cfg, 8)
    validate(RunConfig(), 1)  # defaults are valid on one device


def test_config_file_get_config_and_CONFIG(tmp_path):
    p = tmp_path / "exp.py"
    p.write_text("from jaxrl_async.config import RunConfig, TrainerConfig\n"
                 "def get_config():\n    return RunConfig(name='exp', trainer=TrainerConfig(batch_size=4))\n")
    assert load_config_file(p).trainer.batch_size == 4
    q = tmp_path / "exp2.py"
    q.write_text("from jaxrl_async.config import RunConfig\nCONFIG = RunConfig(name='c2')\n")
    assert load_config_file(q).name == "c2"
    r = tmp_path / "bad.py"
    r.write_text("X = 1\n")
    assert "defines neither get_config() nor CONFIG" in err(load_config_file, r)
    s = tmp_path / "raises.py"
    s.write_text("raise RuntimeError('oops')\n")
    assert "RuntimeError: oops" in err(load_config_file, s)
    assert "does not exist" in err(load_config_file, tmp_path / "missing.py")

    cfg, flags = parse_command_line(["--config", str(p), "trainer.lr=3e-4", "--dry-run"], num_devices=1)
    assert (cfg.name, cfg.trainer.batch_size, cfg.trainer.lr, flags["dry_run"]) == ("exp", 4, 3e-4, True)
    assert "unknown option '--foo'" in err(parse_command_line, ["--foo"], num_devices=1)
    cfg, _ = parse_command_line(["rollout.n_samples=2"], default_config=RunConfig(name="dflt"), num_devices=1)
    assert (cfg.name, cfg.rollout.n_samples) == ("dflt", 2)


def test_json_round_trip(tmp_path):
    cfg = apply_overrides(RunConfig(), ["rollout.sampling.stop_strings=a,b", "mesh.trainer.devices=3",
                                        "trainer.loss.c_clip=3", "trainer.packing.row_len_buckets=64,128"])
    path = save_config(cfg, tmp_path, extra={"num_devices": 1})
    data = json.load(open(path))
    assert data["rollout"]["max_head_offpolicyness"] == 2 and data["_resolved"] == {"num_devices": 1}
    back = load_config_json(tmp_path)
    assert back == cfg and isinstance(back.trainer.loss, PolicyLossConfig)
    assert "config error: trainer.nope: unknown field" in err(from_dict, RunConfig, {"trainer": {"nope": 1}})
    assert to_dict(back)["trainer"]["packing"]["row_len_buckets"] == (64, 128)
