"""The run's ``Trainer``, built from a ``RunConfig`` in one place.

``loop.RLRun`` (the run) and ``plan`` (its memory plan) must compile the *same* programs: a plan of a trainer
that the run does not build is worth nothing. Both therefore construct it here, from the run config, a model
config and a mesh (the engine's counterpart is ``generator.factory.run_engine``); nothing else about the run
(data, tokenizer, checkpoints) is needed, so the planner can build it from abstract shapes on simulated devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy: `plan` sets the device count before JAX starts
    from jax.sharding import Mesh

    from jaxrl_async.config import RunConfig
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig

__all__ = ["trainer_config", "build_trainer", "router_aux_loss_coef"]


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
                           routing_replay=tr.routing_replay, freeze_vision=tr.freeze_vision,
                           router_aux_loss_coef=router_aux_loss_coef(run_cfg, model_cfg))


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
