"""`Transformer`: a Flax NNX container of the model's parameters (each an `nnx.Param` with its logical axes) over
the pure functions of `transformer.py`. Kept apart so that code using the pure functions does not import flax."""

from __future__ import annotations

from flax import nnx

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import Params, apply, init_params, logical_axes


class Transformer(nnx.Module):
    """Flax NNX container of the parameters, each an `nnx.Param` carrying its logical axes
    (`out_sharding` metadata, read by `nnx.get_partition_spec` and by our sharding rules).

    `model(tokens, positions, segment_ids)` returns float32 logits. Hot paths should use
    `model.params()` with the pure functions of `transformer.py`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, params: Params | None = None):
        self.cfg = cfg
        if params is None:
            rngs = rngs or nnx.Rngs(0)
            params = init_params(cfg, rngs.params())
        axes = logical_axes(cfg)

        def wrap(value, ax):
            return nnx.Param(value, sharding_names=ax, eager_sharding=False)

        self.embed = wrap(params["embed"], axes["embed"])
        self.final_norm = wrap(params["final_norm"], axes["final_norm"])
        self.layers = nnx.Dict({k: wrap(params["layers"][k], axes["layers"][k]) for k in axes["layers"]})
        if "dense_layers" in axes:  # a mixture of experts' dense-MLP layers
            self.dense_layers = nnx.Dict({k: wrap(params["dense_layers"][k], axes["dense_layers"][k])
                                          for k in axes["dense_layers"]})
        if "lm_head" in axes:
            self.lm_head = wrap(params["lm_head"], axes["lm_head"])

    def params(self) -> Params:
        return nnx.state(self, nnx.Param).to_pure_dict()

    def __call__(self, tokens, positions=None, segment_ids=None):
        return apply(self.params(), self.cfg, tokens, positions, segment_ids)
