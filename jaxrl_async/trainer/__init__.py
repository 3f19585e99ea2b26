"""Trainer: sequence packing, the sharded micro-batched train step, the optimizer, model FLOPs."""
from jaxrl_async.trainer.flops import forward_flops, train_step_flops
from jaxrl_async.trainer.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from jaxrl_async.trainer.packing import (
    PackedBatch, PackedMinibatch, PackingConfig, PackingError, TrainSequence, pack, split_minibatches, unpack,
    validate_trajectory,
)
from jaxrl_async.trainer.train_step import (
    Trainer, TrainStepConfig, TrainState, accumulate_gradients, batch_sharding, default_normaliser_fn,
)

__all__ = [
    "forward_flops", "train_step_flops", "OptimizerConfig", "learning_rate_schedule", "make_optimizer",
    "PackedBatch", "PackedMinibatch", "PackingConfig", "PackingError", "TrainSequence", "pack", "split_minibatches",
    "unpack", "validate_trajectory", "Trainer", "TrainStepConfig", "TrainState", "accumulate_gradients",
    "batch_sharding", "default_normaliser_fn",
]
