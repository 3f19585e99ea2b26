"""The run's trainer and generator engine, built from a `RunConfig` in one place.

`loop.RLRun` (the run) and `plan` (its memory plan) must compile the *same* programs: a plan of a
trainer or engine that the run does not build is worth nothing. Both therefore construct them
here, from the run config, a model config and a mesh; nothing else about the run (data,
tokenizer, checkpoints) is needed, so the planner can build them from abstract shapes on
simulated devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy: `plan` sets the device count before JAX starts
    from jax.sharding import Mesh

    from jaxrl_async.config import EngineConfig, RunConfig
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.rollout.engine import PagedEngine
    from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig

__all__ = ["trainer_config", "build_trainer", "generator_model_config", "build_engine"]


def trainer_config(run_cfg: "RunConfig", model_cfg: "ModelConfig | None" = None) -> "TrainStepConfig":
    """The train-step configuration of `run_cfg.trainer`. Log-probs are taken at the sampling
    temperature, so that pi_theta and the generator's behaviour log-probs are of the same
    distribution (temperature 0, greedy, uses 1). MoE: `trainer.router_aux_loss_coef` None takes the
    model's (the HF config's `router_aux_loss_coef`, `model_cfg`)."""
    from jaxrl_async.trainer.train_step import TrainStepConfig

    tr = run_cfg.trainer
    temp = run_cfg.rollout.sampling.temperature
    return TrainStepConfig(optimizer=tr.optimizer_config(), packing=tr.packing, ppo_n_minibatches=tr.ppo_n_minibatches,
                         proximal=tr.proximal, temperature=temp if temp > 0 else 1.0, logprob_chunk=tr.logprob_chunk,
                         routing_replay=tr.routing_replay, router_aux_loss_coef=router_aux_loss_coef(run_cfg, model_cfg))


def router_aux_loss_coef(run_cfg: "RunConfig", model_cfg: "ModelConfig | None") -> float:
    """The load-balancing loss weight of the run: `trainer.router_aux_loss_coef`, or None there: the model's."""
    coef = run_cfg.trainer.router_aux_loss_coef
    if coef is None:
        coef = model_cfg.router_aux_loss_coef if model_cfg is not None and model_cfg.num_experts else 0.0
    return float(coef)


def build_trainer(run_cfg: "RunConfig", model_cfg: "ModelConfig", mesh: "Mesh") -> "Trainer":
    """The run's `Trainer` on the trainer mesh (fp32 master weights whatever `model_cfg.param_dtype`)."""
    from jaxrl_async.trainer.train_step import Trainer

    return Trainer(model_cfg, trainer_config(run_cfg, model_cfg), mesh, loss_cfg=run_cfg.trainer.loss)


def generator_model_config(model_cfg: "ModelConfig") -> "ModelConfig":
    """The generator holds its weights in the compute dtype (the trainer pushes them cast). LoRA with
    ``decode="merged"``: the engine's model has no adapters (it decodes merged weights)."""
    gen = model_cfg.replace(param_dtype=model_cfg.dtype)
    if gen.lora is not None and gen.lora.decode == "merged":
        gen = gen.replace(lora=None)
    return gen


def build_engine(run_cfg: "RunConfig", model_cfg: "ModelConfig", mesh: "Mesh", *,
                 num_pages: int | None = None) -> "PagedEngine":
    """The run's `PagedEngine` on the generator mesh for `model_cfg` (the run's model config;
    the engine gets `generator_model_config` of it).

    num_pages: KV pool size; default `rollout.engine.num_pages` (None there: sized from the free
    device memory). The planner passes the full reservation explicitly.
    """
    gen_cfg = generator_model_config(model_cfg)
    if gen_cfg.lora is not None and run_cfg.model.lora.decode == "merged":
        gen_cfg = gen_cfg.replace(lora=None)  # LoRA merged into the generator's weights at each push
    return engine_from_section(run_cfg.rollout.engine, gen_cfg, mesh, num_pages=num_pages,
                               record_routing=run_cfg.rollout.record_routing)


def engine_from_section(e: "EngineConfig", gen_model_cfg: "ModelConfig", mesh: "Mesh", *,
                        num_pages: int | None = None, record_routing: bool = False) -> "PagedEngine":
    """A `PagedEngine` from the `rollout.engine` config section and the generator's model config
    (`generator_model_config`); also what a generator process builds from the controller's spec."""
    from jaxrl_async.rollout.engine import PagedEngine

    return PagedEngine(gen_model_cfg, mesh, max_concurrent_decodes=e.max_concurrent_decodes,
                       max_sequence_length=e.max_sequence_length, max_prefill_length=e.max_prefill_length,
                       page_size=e.page_size, num_pages=e.num_pages if num_pages is None else num_pages,
                       cache_memory_fraction=e.cache_memory_fraction, reserve_weight_push=True,  # RL: pushes arrive
                       record_routing=record_routing, compact_decode=e.compact_decode)
