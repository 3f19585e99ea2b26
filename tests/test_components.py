"""`jaxrl_async.components`: the trainer and engine that both the run (`loop.RLRun`) and the planner build
carry the run config's settings (temperature, chunk, minibatches, loss, packing; engine sizes, page
size, generator weights in the compute dtype, pool size from the config unless given)."""
import os

import jax

from jaxrl_async.components import build_engine, build_trainer, generator_model_config, trainer_config
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
    engine = build_engine(cfg, model_cfg, make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1]))
    assert engine.cfg == generator_model_config(model_cfg)
    assert (engine.max_concurrent_decodes, engine.max_sequence_length, engine.page_size, engine.num_pages) == (
        e.max_concurrent_decodes, e.max_sequence_length, 8, 40)
    assert engine.max_prefill_length == (e.max_prefill_length or e.max_sequence_length - 1)
    planned = build_engine(cfg, model_cfg, engine.mesh, num_pages=64)  # the planner's full reservation
    assert planned.num_pages == 64
