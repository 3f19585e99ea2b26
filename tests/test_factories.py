"""`trainer.factory` / `generator.factory`: the trainer and engine that both the run (`loop.RLRun`) and the planner build
carry the run config's settings (temperature, chunk, minibatches, loss, packing; engine sizes, page
size, generator weights in the compute dtype, pool size from the config unless given)."""
import os

import jax

from jaxrl_async.generator.factory import generator_model_config, run_engine
from jaxrl_async.trainer.factory import build_trainer, trainer_config
from jaxrl_async.config import apply_overrides, load_config_file
from jaxrl_async.sharding import make_mesh

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu.py")


def _cfg(*overrides):
    return apply_overrides(load_config_file(TINY), list(overrides))


def _model_cfg(cfg):
    return cfg.model.model_config(vocab_size=cfg.model.vocab_size or 64)


def test_trainer_carries_the_run_config():
    cfg = _cfg("rollout.sampling.temperature=0.7", "trainer.logprob_chunk=96", "trainer.ppo_n_minibatches=2",
               "trainer.proximal=loglinear")
    tc = trainer_config(cfg)
    assert (tc.temperature, tc.logprob_chunk, tc.ppo_n_minibatches, tc.proximal) == (0.7, 96, 2, "loglinear")
    assert tc.optimizer == cfg.trainer.optimizer_config()
    assert trainer_config(_cfg("rollout.sampling.temperature=0.0")).temperature == 1.0  # greedy: plain log-probs
    mesh = make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    model_cfg = _model_cfg(cfg).replace(param_dtype="bfloat16")
    trainer = build_trainer(cfg, model_cfg, mesh)
    assert trainer.mesh is mesh and trainer.model_cfg.param_dtype == "float32"  # fp32 master weights
    assert trainer.loss_cfg == cfg.trainer.loss and trainer.cfg.packing.row_multiple % 2 == 0


def test_engine_carries_the_run_config():
    cfg = _cfg("rollout.engine.num_pages=40", "rollout.engine.page_size=8")
    model_cfg = _model_cfg(cfg).replace(dtype="bfloat16", param_dtype="float32")
    assert generator_model_config(model_cfg).param_dtype == "bfloat16"
    e = cfg.rollout.engine
    engine = run_engine(cfg, model_cfg, make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1]))
    assert engine.cfg == generator_model_config(model_cfg)
    assert (engine.max_concurrent_decodes, engine.max_sequence_length, engine.page_size, engine.num_pages) == (
        e.max_concurrent_decodes, e.max_sequence_length, 8, 40)
    assert engine.max_prefill_length == (e.max_prefill_length or e.max_sequence_length - 1)
    planned = run_engine(cfg, model_cfg, engine.mesh, num_pages=64, check_fit=False)  # the planner's full reservation
    assert planned.num_pages == 64


# -- the one-shot engine and its sizing errors (issue 30) -------------------------------------------------------
def test_for_prompts_sizes_a_one_shot_job():
    from jaxrl_async.generator.factory import PACK_PROMPTS, for_prompts

    model_cfg = _model_cfg(_cfg())
    e = for_prompts([5, 12, 30], 40, model_cfg, max_concurrent=32, samples_per_prompt=2)
    assert e.max_sequence_length == 70 and e.max_concurrent_decodes == 6  # never more slots than the job uses
    assert e.prefill_buckets == (64,) and e.max_prefill_length == 64 and e.max_prefill_pack == PACK_PROMPTS
    assert for_prompts([5], 40, model_cfg, max_concurrent=2, samples_per_prompt=4).max_concurrent_decodes == 4
    long = for_prompts([5], 10_000, model_cfg, max_concurrent=4)
    assert long.max_sequence_length == model_cfg.max_position_embeddings  # at most the model's positions
    assert for_prompts([5], 8, model_cfg, max_concurrent=4, max_prompt=20).max_sequence_length == 28


def test_reusable_one_shot_geometry_follows_the_settings_not_the_job():
    """`reusable=True` (the generate CLI): jobs of other sizes and prompt lengths within one power-of-two bucket get
    the same engine (so one job's compiled programs serve the next), slots = max_concurrent."""
    from jaxrl_async.generator.factory import PACK_ROW_TOKENS, for_prompts

    model_cfg = _model_cfg(_cfg())
    a = for_prompts([5, 12, 30], 40, model_cfg, max_concurrent=32, samples_per_prompt=2, reusable=True)
    b = for_prompts([17] * 50, 40, model_cfg, max_concurrent=32, samples_per_prompt=2, reusable=True)
    assert a == b
    assert a.max_concurrent_decodes == 32 and a.max_sequence_length == 32 + 40
    assert a.prefill_buckets == (min(PACK_ROW_TOKENS, 71),)
    assert for_prompts([5], 40, model_cfg, max_concurrent=2, samples_per_prompt=4,
                       reusable=True).max_concurrent_decodes == 4  # at least one request's samples
    assert for_prompts([33], 40, model_cfg, max_concurrent=4, reusable=True).max_sequence_length == 64 + 40
    assert for_prompts([5], 8, model_cfg, max_concurrent=4, max_prompt=20, reusable=True).max_sequence_length == 28
    top = model_cfg.max_position_embeddings
    near = for_prompts([top - 10], 40, model_cfg, max_concurrent=4, reusable=True)  # the bucket would pass the end
    assert near.max_sequence_length == top and near.max_prefill_length >= top - 10


def _limit(monkeypatch, limit):
    from jaxrl_async.generator import kv_cache

    monkeypatch.setattr(kv_cache, "device_memory", lambda devices: (limit, 0, "host RAM"))


def test_a_pool_that_cannot_hold_one_sequence_names_the_callers_fields(monkeypatch):
    import pytest

    from jaxrl_async.generator.factory import CLI_FLAGS, CONFIG_FIELDS, EngineConfig, EngineSizingError, build_engine

    from jaxrl_async.generator import kv_cache

    model_cfg = _model_cfg(_cfg())
    e = EngineConfig(max_concurrent_decodes=4, max_sequence_length=128, max_prefill_length=64)
    _limit(monkeypatch, 1 << 40)
    ok = build_engine(e, model_cfg).sizing
    # room for 2 pages after the weights and the workspace; one 128-token sequence needs 8 pages of 16
    _limit(monkeypatch, ok.param_bytes + ok.packed_weight_bytes + int((ok.workspace_bytes + 2.5 * ok.page_bytes) / 0.9))
    for fields in (CLI_FLAGS, CONFIG_FIELDS):
        with pytest.raises(EngineSizingError) as info:
            build_engine(e, model_cfg, fields=fields)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("the KV cache does not fit"), msg
        assert f"needs {kv_cache.pages_for(128, 16)} pages and 2 fit: lower {fields.max_sequence_length} so that a " \
               f"sequence has at most 32 tokens" in msg, msg
    _limit(monkeypatch, ok.param_bytes // 2)  # not even the weights
    with pytest.raises(EngineSizingError, match="the weights alone do not fit.*use a smaller model or dtype"):
        build_engine(e, model_cfg)


def test_an_explicit_pool_too_large_gets_the_largest_values_that_fit(monkeypatch):
    import pytest

    from jaxrl_async.generator import kv_cache
    from jaxrl_async.generator.factory import CLI_FLAGS, CONFIG_FIELDS, EngineConfig, EngineSizingError, build_engine

    model_cfg = _model_cfg(_cfg())
    _limit(monkeypatch, 1 << 40)
    e = EngineConfig(max_concurrent_decodes=8, max_sequence_length=128, max_prefill_length=64)
    auto = build_engine(e, model_cfg)  # plenty of memory: a full reservation
    per_seq = kv_cache.pages_for(128, e.page_size)
    assert auto.num_pages == 8 * per_seq and auto.sizing.source == "host RAM"
    # now room for about 3 sequences, and 1000 pages asked
    budget = 3 * per_seq * auto.cache_spec.page_bytes() + 5
    _limit(monkeypatch, auto.sizing.param_bytes + auto.sizing.packed_weight_bytes + auto.sizing.workspace_bytes + budget)
    for fields in (CLI_FLAGS, CONFIG_FIELDS):
        with pytest.raises(EngineSizingError) as info:
            build_engine(EngineConfig(max_concurrent_decodes=8, max_sequence_length=128, max_prefill_length=64,
                                      num_pages=1000), model_cfg, fields=fields)
        msg = str(info.value)
        assert f"{fields.num_pages} <= {3 * per_seq}" in msg and f"{fields.max_concurrent} <= 3" in msg, msg
