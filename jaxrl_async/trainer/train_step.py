"""Sharded, micro-batched train step on the trainer mesh (fsdp x tensor).

One optimizer step per minibatch (AReaL `ppo_update`):

    g = sum_k grad L_k(theta),   L_k = sum_{tokens of micro-batch k} m_t l_t / N

where N is the GLOBAL normaliser of the minibatch (the number of loss tokens over all its
micro-batches and data-parallel shards for the token-mean aggregation, computed on the host),
so sum_k L_k is exactly the full-minibatch loss and g its gradient: accumulation over k
micro-batches equals the full-batch gradient, whatever the split. The micro-batches are the
leading axis of a packed minibatch `[n_micro, rows, row_len]`; one jitted step runs them under
`lax.scan` (fp32 gradient accumulator sharded like the parameters), then applies one optax
update (clip_by_global_norm + AdamW, `optimizer.py`).

* Parameters and optimizer state are fp32 master copies sharded by
  `model_shardings(cfg, mesh, "trainer")`; the compute dtype is `ModelConfig.dtype` (bf16 casts
  happen inside the model). Micro-batch rows are sharded over the batch axes (data, fsdp), so the
  gradient is reduced over data-parallel shards by GSPMD: the global normaliser makes that sum
  the global token mean (as AReaL's loss scale local_weight / all-reduced total_weight).
* The jitted functions are traced under the trainer's activation rules
  (`sharding/activations.py`): inside the model the activations stay split over the batch axes
  and the FSDP weights are all-gathered per layer (FSDP proper); the vocabulary projection is
  vocabulary-parallel over tensor x fsdp.
* The state is donated: the step updates parameters and Adam moments in place.
* Non-finite guard, without host sync: if the loss or the gradient global norm is not finite,
  `params' = where(ok, new, old)` and likewise for the optimizer state, the step counter only
  advances on applied updates and `n_skipped` counts the others; `metrics["skipped"]` is 1.
* Proximal log-probs: `compute_logprobs` (jitted forward, no grad) with the current weights
  before any update of the batch ("recompute", AReaL's default), or the log-linear
  approximation from per-token versions inside the loss ("loglinear", no extra forward), or the
  values carried by the trajectories ("given").
* Shapes are bucketed by packing; the step compiles once per (row_len, n_micro) bucket, never
  per content (`Trainer.n_compilations` counts traces).
* LoRA (`ModelConfig.lora`, `models/lora.py`): the parameters hold the frozen base and the adapters;
  the gradient is taken with respect to the adapters only (no base gradient or accumulator exists),
  AdamW state exists only for them, and the base passes through the step unchanged. The base is stored
  in `lora.base_dtype` (float32 or bfloat16), the adapters in float32.
* Mixture of experts (`models/moe.py`): the policy pass computes router statistics over the real tokens of
  each micro-batch (expert load per layer, router entropy, and where the batch carries the generator's
  recorded routing, the tokens whose trainer top-k differs from it) and adds `router_aux_loss_coef` times
  the load-balancing loss (transformers' Qwen3-MoE formula, per micro-batch, token-weighted over the
  minibatch). `routing_replay` (rollout routing replay, R3: Ma et al. 2025, arXiv 2510.11370) routes every
  token with a recording to the generator's experts in the proximal and the policy passes, the gates
  recomputed from the trainer's router over those experts (`moe.routing(expert_ids=...)`).
* Vision-language models (a `qwen2_5_vl.VLConfig`; `vl_batch.py`): minibatches whose trajectories carry images
  pack M-RoPE positions, placeholder->feature indices and per-micro-batch pixels + vision layout; their
  micro-batches run the vision tower, scatter the features into the embeddings and run the decoder with M-RoPE
  positions (policy and proximal passes alike). Text-only minibatches take the text path (same programs as a
  text model). `freeze_vision`: the tower is not trained (features under stop_gradient, no gradient, optimizer
  state or update for the ``vision`` subtree: it passes through every step bit for bit); else it trains with
  the decoder (the default, as veRL / AReaL train the whole Qwen2.5-VL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_async.models import lora
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.moe import aux_loss as moe_aux_loss, routing_scope
from jaxrl_async.models.qwen2_5_vl import is_vl
from jaxrl_async.models.transformer import Params, sequence_logprobs
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import activation_sharding, make_mesh
from jaxrl_async.sharding.activations import traced_with_activation_rules
from jaxrl_async.sharding.rules import spec_axes_size
from jaxrl_async.trainer.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from jaxrl_async.trainer.packing import (
    DEVICE_FIELDS, PackedBatch, PackedMinibatch, PackingConfig, PackingError, TrainSequence, pack, split_minibatches,
)
from jaxrl_async.trainer.vl_batch import vl_sequence_logprobs

logger = logging.getLogger(__name__)

__all__ = ["TrainStepConfig", "TrainState", "Trainer", "LossFn", "accumulate_gradients", "batch_sharding"]

# loss_fn(logprobs, proximal_logprobs, behaviour_logprobs, advantages, loss_mask, *, seq_ids, num_seqs,
#         normaliser, entropy) -> (loss scalar, stats dict of scalars); arrays are [rows, row_len].
LossFn = Callable[..., tuple[jax.Array, Mapping[str, jax.Array]]]
# normaliser_fn(n_loss_tokens, n_loss_seqs) -> float: the global denominator of the minibatch loss.
NormaliserFn = Callable[[int, int], float]

PROXIMAL_MODES = ("recompute", "loglinear", "given")


@dataclasses.dataclass(frozen=True)
class TrainStepConfig:
    """Train-step configuration.

    ppo_n_minibatches: optimizer steps per batch (token-balanced split of the trajectories).
    proximal: "recompute" (forward with the current weights before the batch's first update),
        "loglinear" (log pi_prox ~ log pi_behav + alpha (log pi_theta - log pi_behav) from the
        per-token versions, no extra forward) or "given" (trajectories carry proximal_logprobs).
    temperature: log-probs of logits / temperature (must match the generator's sampling temperature).
    logprob_chunk: positions per chunk of the vocabulary projection in `sequence_logprobs`, over all
        rows of a micro-batch (chunk // rows consecutive positions of every row).
    routing_replay: (MoE) rollout routing replay: the proximal and policy passes route each token to the
        experts the generator recorded for it (trajectories' `routing`; unrecorded tokens route freely).
    router_aux_loss_coef: (MoE) weight of the load-balancing loss added to the objective (0: reported only).
    freeze_vision: (vision-language models) keep the vision tower fixed: its features are constants of the loss
        and the ``vision`` parameters get no gradient, no optimizer state and no update. False (default): the
        tower trains with the decoder.
    """

    optimizer: OptimizerConfig = OptimizerConfig()
    packing: PackingConfig = PackingConfig()
    ppo_n_minibatches: int = 1
    proximal: str = "recompute"
    temperature: float = 1.0
    logprob_chunk: int = 2048
    routing_replay: bool = False
    router_aux_loss_coef: float = 0.0
    freeze_vision: bool = False

    def __post_init__(self):
        if self.ppo_n_minibatches < 1:
            raise ValueError(f"TrainStepConfig.ppo_n_minibatches: must be >= 1, got {self.ppo_n_minibatches}")
        if self.proximal not in PROXIMAL_MODES:
            raise ValueError(f"TrainStepConfig.proximal: must be one of {PROXIMAL_MODES}, got {self.proximal!r}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"TrainStepConfig.temperature: must be a positive finite float, got {self.temperature}")
        if self.logprob_chunk < 1:
            raise ValueError(f"TrainStepConfig.logprob_chunk: must be >= 1, got {self.logprob_chunk}")
        if not (self.router_aux_loss_coef >= 0 and math.isfinite(self.router_aux_loss_coef)):
            raise ValueError(f"TrainStepConfig.router_aux_loss_coef: must be a finite float >= 0, got "
                             f"{self.router_aux_loss_coef}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """params: fp32 master weights (LoRA: frozen base + fp32 adapters); opt_state: of the trainable
    parameters (LoRA: the adapters); step: applied optimizer updates; n_skipped: non-finite steps skipped."""

    params: Params
    opt_state: Any
    step: jax.Array
    n_skipped: jax.Array


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[n_micro, rows, row_len] arrays: rows over the trainer's batch axes (data, fsdp)."""
    return activation_sharding(mesh, "trainer", None, "batch", "length")


def batch_axis_size(mesh: Mesh) -> int:
    return spec_axes_size(mesh, batch_sharding(mesh).spec[1])


def text_config(model_cfg: Any) -> ModelConfig:
    """The decoder's `ModelConfig` (a VL model's ``text``)."""
    return model_cfg.text if is_vl(model_cfg) else model_cfg


def micro_logprobs(params: Params, model_cfg: Any, mb: PackedBatch, temperature: float, chunk: int,
                   freeze_vision: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log-probs, entropies) [rows, row_len] of one micro-batch: with images (`mb.vision`), the VL forward
    (`vl_batch.vl_sequence_logprobs`), else the text one (`transformer.sequence_logprobs`, 1-D positions)."""
    if mb.vision is not None:
        return vl_sequence_logprobs(params, model_cfg, mb, temperature, chunk, freeze_vision)
    return sequence_logprobs(params, text_config(model_cfg), mb.tokens, mb.segment_ids, mb.positions, temperature,
                             chunk)


def micro_batch_loss(params: Params, mb: PackedBatch, normaliser: jax.Array, policy_version: jax.Array, *,
                     model_cfg: Any, loss_fn: LossFn, num_seqs: int, proximal: str, temperature: float,
                     chunk: int, routing_replay: bool = False, aux_coef: float = 0.0,
                     route_tokens: jax.Array | None = None,
                     freeze_vision: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of one micro-batch [rows, row_len], already divided by the GLOBAL normaliser. MoE models: plus
    `aux_coef` x the micro-batch's load-balancing loss x its share of the minibatch's `route_tokens` (real
    tokens), and the router statistics (`moe_*` stats, see `_moe_metrics`). `model_cfg`: a `ModelConfig` or a
    `qwen2_5_vl.VLConfig` (micro-batches with images: `micro_logprobs`)."""
    moe_stats = None
    if text_config(model_cfg).num_experts:
        with routing_scope(**_scope_kw(mb, routing_replay), stats_mask=mb.segment_ids != 0) as scope:
            lp, ent = micro_logprobs(params, model_cfg, mb, temperature, chunk, freeze_vision)
        moe_stats = scope.result
    else:
        lp, ent = micro_logprobs(params, model_cfg, mb, temperature, chunk, freeze_vision)
    if proximal == "loglinear":
        from jaxrl_async.rl.advantages import loglinear_proximal_logprobs

        prox = loglinear_proximal_logprobs(mb.behaviour_logprobs, jax.lax.stop_gradient(lp), mb.versions,
                                           policy_version)
        prox = jnp.where(mb.loss_mask > 0, prox, 0.0)
    else:
        prox = mb.proximal_logprobs
    loss, stats = loss_fn(lp, prox, mb.behaviour_logprobs, mb.advantages, mb.loss_mask, seq_ids=mb.seq_ids,
                          num_seqs=num_seqs, normaliser=normaliser, entropy=ent)
    stats = dict(stats)
    if moe_stats is not None:
        aux = moe_aux_loss(moe_stats)
        # the micro-batch's share of the minibatch's real tokens (None: this micro-batch is the whole minibatch)
        share = 1.0 if route_tokens is None else moe_stats["tokens"][0] / route_tokens
        if aux_coef > 0:
            loss = loss + aux_coef * aux * share
        sg = jax.lax.stop_gradient
        stats.update(moe_aux_sum=sg(aux * share), moe_count_sum=sg(moe_stats["count"]),
                     moe_tokens_sum=sg(moe_stats["tokens"]), moe_entropy_sum=sg(moe_stats["entropy_sum"].sum()))
        if "mismatch" in moe_stats:
            stats.update(moe_mismatch_sum=moe_stats["mismatch"].sum(), moe_recorded_sum=moe_stats["recorded"].sum())
    return loss, stats


def _scope_kw(mb: PackedBatch, replay: bool) -> dict[str, Any]:
    """`moe.routing_scope` arguments of a micro-batch: its recorded experts [L, rows, row_len, k] (if any), replayed
    when `replay`."""
    if mb.routing is None:
        return {}
    return {"expert_ids": jnp.moveaxis(mb.routing, 2, 0), "replay": replay}


def _moe_metrics(stats: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """Combined `moe_*` stats -> metrics (the raw sums removed): ``moe/load_max``/``moe/load_min`` (largest and
    smallest fraction of the routed (token, choice) pairs that one expert got, over all layers; 1/X = balanced)
    and per layer ``moe/load_max/layer{l}``/``moe/load_min/layer{l}``, ``moe/load`` [L, X] (the histogram),
    ``moe/router_entropy`` (mean over tokens and layers, nats), ``moe/aux_loss`` (the load-balancing loss before
    its coefficient), ``moe/topk_mismatch_frac`` (recorded tokens whose trainer top-k set differs from the
    generator's; measured with or without replay) and ``moe/recorded_tokens``."""
    if "moe_count_sum" not in stats:
        return stats
    out = dict(stats)
    count, tokens = out.pop("moe_count_sum"), out.pop("moe_tokens_sum")
    load = count / jnp.maximum(tokens[:, None] * k, 1.0)  # [L, X]
    out["moe/load"] = load
    out["moe/load_max"], out["moe/load_min"] = load.max(), load.min()
    for l in range(load.shape[0]):
        out[f"moe/load_max/layer{l}"], out[f"moe/load_min/layer{l}"] = load[l].max(), load[l].min()
    out["moe/router_entropy"] = out.pop("moe_entropy_sum") / jnp.maximum(tokens.sum(), 1.0)
    out["moe/aux_loss"] = out.pop("moe_aux_sum")
    if "moe_mismatch_sum" in out:
        rec = out.pop("moe_recorded_sum")
        out["moe/topk_mismatch_frac"] = out.pop("moe_mismatch_sum") / jnp.maximum(rec, 1.0)
        out["moe/recorded_tokens"] = rec
    return out


def _combine_stats(stats: Mapping[str, jax.Array], weights: jax.Array) -> dict[str, jax.Array]:
    """Per-micro-batch stats [n_micro] -> minibatch values (`jaxrl_async.rl.losses` convention).

    `X_sum`, `n_tokens`, `n_seqs`, `loss` add up; `X_max` combine by max; a mean `X` with an
    `X_sum` partner is recomputed as X_sum / max(n_tokens, 1) (exact, as `combine_stats`). Any
    other key (custom loss functions) is averaged with the micro-batches' loss-token counts as
    weights; empty (padding) micro-batches never contribute.
    """
    valid = weights > 0
    out: dict[str, jax.Array] = {}
    for k, v in stats.items():
        v = jnp.asarray(v, jnp.float32)
        ok = valid.reshape(valid.shape + (1,) * (v.ndim - 1))  # vector stats ([n_micro, ...]) sum elementwise
        if k.endswith("_max"):
            out[k] = jnp.max(jnp.where(ok, v, -jnp.inf))
        elif k.endswith("_sum") or k in ("n_tokens", "n_seqs", "loss"):
            out[k] = jnp.sum(jnp.where(ok, v, 0.0), axis=0)
    n_tokens = out.get("n_tokens", weights.sum())
    for k, v in stats.items():
        if k in out:
            continue
        if k + "_sum" in out:
            out[k] = out[k + "_sum"] / jnp.maximum(n_tokens, 1.0)
        else:
            v = jnp.asarray(v, jnp.float32)
            out[k] = jnp.sum(jnp.where(valid, v, 0.0) * weights) / jnp.maximum(weights.sum(), 1.0)
    return out


def accumulate_gradients(params: Params, batch: PackedBatch, normaliser: jax.Array, policy_version: jax.Array,
                         *, grad_shardings: Any = None, frozen: Params | None = None,
                         dropout: tuple[jax.Array, float] | None = None, join: Callable | None = None,
                         **loss_kw) -> tuple[Params, jax.Array, dict[str, jax.Array]]:
    """(sum_k grad L_k, sum_k L_k, combined stats) over the leading micro-batch axis (lax.scan).

    A micro-batch without loss tokens (the empty micro-batches that round the count up to a bucket)
    skips its forward and backward (``lax.cond``; the predicate is a global reduction, so every
    device of the mesh takes the same branch) and contributes zeros.

    `loss_kw` are the keyword arguments of `micro_batch_loss`. The accumulator is fp32 and, when
    `grad_shardings` is given, constrained to the parameter shardings at every micro-batch.
    `frozen`: parameters the loss also reads but that get no gradient (LoRA: `params` are the adapters,
    `frozen` the base; a frozen vision tower: ``{"vision": ...}``); `join(params, frozen)` (default `lora.join`)
    puts them together inside the loss. `dropout`: (key, rate) of LoRA dropout; micro-batch k draws its masks
    from fold_in(key, k).
    """
    if text_config(loss_kw["model_cfg"]).num_experts:  # the aux loss's token weights: real tokens of the minibatch
        loss_kw = dict(loss_kw, route_tokens=jnp.maximum((batch.segment_ids != 0).sum(), 1).astype(jnp.float32))
    loss = functools.partial(micro_batch_loss, **loss_kw)
    if frozen is not None:
        join = lora.join if join is None else join
        loss = (lambda f: lambda p, *a: f(join(p, frozen), *a))(loss)
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def constrain(g):
        return g if grad_shardings is None else jax.lax.with_sharding_constraint(g, grad_shardings)

    def run(mb, k):
        key = None if dropout is None else jax.random.fold_in(dropout[0], k)
        with lora.dropout_key(key, 0.0 if dropout is None else dropout[1]):
            (loss, stats), g = grad_fn(params, mb, normaliser, policy_version)
        return loss, stats, g

    def skip(mb, k):  # an empty (bucket padding) micro-batch: no forward/backward at all
        shapes = jax.eval_shape(run, mb, k)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def body(carry, xs):
        mb, k = xs
        g_acc, loss_acc = carry
        weight = mb.loss_mask.sum()
        loss, stats, g = jax.lax.cond(weight > 0, run, skip, mb, k)
        g_acc = constrain(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g))
        return (g_acc, loss_acc + loss), (stats, weight)

    zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    n_micro = jax.tree.leaves(batch)[0].shape[0]
    (grads, loss), (stats, weights) = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)),
                                                   (batch, jnp.arange(n_micro, dtype=jnp.int32)))
    return grads, loss, _combine_stats(stats, weights)


def _where_tree(ok: jax.Array, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class Trainer:
    """Owns the jitted step, the mesh and shardings. Stateless w.r.t. the TrainState (passed in/out).

    Typical use (one RL step, version v of the policy):

        trainer = Trainer(model_cfg, TrainStepConfig(...), mesh=make_mesh({"fsdp": 4, "tensor": 2}),
                          loss_fn=functools.partial(policy_loss, cfg=loss_cfg),
                          normaliser_fn=None)  # None: implied by loss_cfg.aggregation
        state = trainer.init_state(params)
        state, metrics = trainer.train_batch(state, trajectories, policy_version=v)

    `loss_fn` / `normaliser_fn` default to `jaxrl_async.rl.losses.policy_loss` with `loss_cfg`
    and the normaliser that `loss_cfg`'s aggregation implies (see `default_normaliser_fn`).
    `model_cfg` may be a `qwen2_5_vl.VLConfig` (trajectories with images; see the module doc).
    """

    def __init__(self, model_cfg: Any, cfg: TrainStepConfig = TrainStepConfig(), mesh: Mesh | None = None, *,
                 loss_fn: LossFn | None = None, loss_cfg: Any = None, normaliser_fn: NormaliserFn | None = None):
        if model_cfg.param_dtype != "float32":
            model_cfg = model_cfg.replace(param_dtype="float32")  # fp32 master weights
        text = text_config(model_cfg)
        if cfg.routing_replay and not text.num_experts:
            raise ValueError("TrainStepConfig.routing_replay: needs a mixture-of-experts model (num_experts > 0)")
        self.vl = is_vl(model_cfg)
        if cfg.freeze_vision and not self.vl:
            raise ValueError("TrainStepConfig.freeze_vision: needs a vision-language model (a qwen2_5_vl.VLConfig), "
                             f"got a {text.model_type} text model")
        if self.vl and text.lora is not None:
            raise ValueError("ModelConfig.lora: LoRA on a vision-language model is not supported yet")
        self.freeze_vision = bool(cfg.freeze_vision)
        self.model_cfg = model_cfg
        self.lora = text.lora  # LoRA: only the adapters train
        if mesh is None:
            mesh = make_mesh({"fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
        self.mesh = mesh
        dp = batch_axis_size(mesh)
        pk = cfg.packing
        if pk.row_multiple % dp:
            pk = dataclasses.replace(pk, row_multiple=pk.row_multiple * dp // math.gcd(pk.row_multiple, dp))
        self.cfg = dataclasses.replace(cfg, packing=pk)
        if loss_fn is None:
            from jaxrl_async.rl.losses import PolicyLossConfig, policy_loss

            loss_cfg = PolicyLossConfig() if loss_cfg is None else loss_cfg
            loss_fn = functools.partial(policy_loss, cfg=loss_cfg)
        self.loss_fn = loss_fn
        self.loss_cfg = loss_cfg
        self.normaliser_fn = normaliser_fn or default_normaliser_fn(loss_cfg)
        # the LR schedule steps once per RL step: ppo_n_minibatches optimizer updates make one (AReaL)
        opt = dataclasses.replace(self.cfg.optimizer, updates_per_step=self.cfg.ppo_n_minibatches)
        self.tx = make_optimizer(opt)
        self.lr_schedule = learning_rate_schedule(opt)
        self.param_shardings = model_shardings(model_cfg, mesh, "trainer")
        self.param_dtypes = _storage_dtypes(model_cfg)
        self.trainable_shardings = self._trainable(self.param_shardings)
        self.batch_sharding = batch_sharding(mesh)
        self.replicated = NamedSharding(mesh, P())
        self.state_shardings = self._state_shardings()
        self._traces = {"step": 0, "logprobs": 0}
        # one jitted step per static num_seqs (i.e. per row_len bucket); minibatches with images have their own
        # (their vision inputs are replicated: another in_shardings tree)
        self._jit_steps: dict[Any, Any] = {}
        self._jit_logprobs_by: dict[Any, Any] = {}
        self._jit_logprobs = self._logprobs_fn(None)
        self._jit_grads = jax.jit(self._traced(self._grads_impl), static_argnames=("num_seqs",))

    def _traced(self, fn):
        """`fn` traced under the trainer's activation sharding rules: the model keeps its activations
        split over the batch axes (data, fsdp) and all-gathers the FSDP weights per layer, instead of
        GSPMD propagating the weights' `embed` sharding into them (every device then ran the whole
        global batch; see `sharding/activations.py`)."""
        return traced_with_activation_rules(fn, self.mesh, "trainer")

    # -- state ---------------------------------------------------------------------------
    def _trainable(self, params):
        """The subtree the optimizer updates: everything, the LoRA adapters, or all but a frozen vision tower."""
        return self._split(params)[0]

    def _state_shardings(self) -> TrainState:
        abstract = jax.eval_shape(self.tx.init, self._trainable(jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), _param_structs(self.model_cfg))))
        opt_sh = optax.tree_utils.tree_map_params(
            self.tx, lambda _, sh: sh, abstract, self.trainable_shardings,
            transform_non_params=lambda _: self.replicated)
        return TrainState(params=self.param_shardings, opt_state=opt_sh, step=self.replicated,
                          n_skipped=self.replicated)

    def init_state(self, params: Params) -> TrainState:
        """fp32 copy of `params` placed on the trainer shardings, fresh AdamW state (LoRA: the base in
        `lora.base_dtype`, fp32 adapters, AdamW state of the adapters only)."""
        params = jax.tree.map(lambda x, dt: jnp.asarray(x, dt), params, self.param_dtypes)
        params = jax.device_put(params, self.param_shardings)

        def init(p):
            return TrainState(params=p, opt_state=self.tx.init(self._trainable(p)), step=jnp.zeros((), jnp.int32),
                              n_skipped=jnp.zeros((), jnp.int32))

        return jax.jit(init, in_shardings=(self.param_shardings,), out_shardings=self.state_shardings)(params)

    # -- batches -------------------------------------------------------------------------
    def pack(self, trajectories: Sequence[TrainSequence], indices: Sequence[int] | None = None) -> PackedMinibatch:
        return pack(trajectories, self.cfg.packing, indices, self.model_cfg)

    def batch_shardings(self, b: PackedBatch) -> Any:
        """The shardings of batch `b` (a prefix tree): its [n_micro, rows, ...] arrays split over the batch axes;
        with images, the per-micro-batch vision inputs replicated (every device runs its micro-batch's tower)."""
        if b.vision is None:
            return self.batch_sharding
        rows = self.batch_sharding
        return b.replace(**{f: rows for f in DEVICE_FIELDS}, routing=None if b.routing is None else rows,
                         mrope_positions=rows, image_index=rows,
                         vision=jax.tree.map(lambda _: self.replicated, b.vision))

    def put_batch(self, packed: PackedMinibatch | PackedBatch) -> PackedBatch:
        """Host arrays -> device arrays on the batch sharding (shape-checked per field)."""
        b = packed.batch if isinstance(packed, PackedMinibatch) else packed
        _check_batch_shapes(b)
        return jax.device_put(b, self.batch_shardings(b))

    @staticmethod
    def _layout_key(b: PackedBatch) -> Any:
        """None for text batches (one program per shape, as always); the tree layout of a batch with images."""
        return None if b.vision is None else ("vl", b.routing is not None)

    # -- proximal log-probs ----------------------------------------------------------------
    def _logprobs_impl(self, params, batch):
        self._traces["logprobs"] += 1

        def one(mb):
            # routing replay: the proximal pass routes like the policy pass, by the recorded experts
            replay = self.cfg.routing_replay and mb.routing is not None
            with routing_scope(**_scope_kw(mb, True)) if replay else contextlib.nullcontext():
                return micro_logprobs(params, self.model_cfg, mb, self.cfg.temperature, self.cfg.logprob_chunk)

        def skip(mb):  # bucket padding: no forward
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, mb))

        return jax.lax.map(lambda mb: jax.lax.cond((mb.segment_ids != 0).any(), one, skip, mb), batch)

    def _logprobs_fn(self, batch: PackedBatch | None):
        key = None if batch is None else self._layout_key(batch)
        fn = self._jit_logprobs_by.get(key)
        if fn is None:
            fn = jax.jit(self._traced(self._logprobs_impl),
                         in_shardings=(self.param_shardings,
                                       self.batch_sharding if batch is None else self.batch_shardings(batch)),
                         out_shardings=(self.batch_sharding, self.batch_sharding))
            self._jit_logprobs_by[key] = fn
        return fn

    def compute_logprobs(self, params: Params, batch: PackedBatch) -> tuple[jax.Array, jax.Array]:
        """(log-probs, entropies) [n_micro, rows, row_len] of the batch under `params` (no grad)."""
        return self._logprobs_fn(batch)(params, batch)

    def with_recomputed_proximal(self, params: Params, batch: PackedBatch) -> PackedBatch:
        """The batch with proximal_logprobs = log pi_theta(current params), 0 off the loss mask."""
        lp, _ = self.compute_logprobs(params, batch)
        return batch.replace(proximal_logprobs=jnp.where(batch.loss_mask > 0, lp, 0.0))

    # -- the step --------------------------------------------------------------------------
    def _loss_kw(self, num_seqs: int) -> dict[str, Any]:
        return dict(model_cfg=self.model_cfg, loss_fn=self.loss_fn, num_seqs=num_seqs, proximal=self.cfg.proximal,
                    temperature=self.cfg.temperature, chunk=self.cfg.logprob_chunk,
                    routing_replay=self.cfg.routing_replay, aux_coef=self.cfg.router_aux_loss_coef,
                    freeze_vision=self.freeze_vision)

    def _split(self, params):
        """(trainable, frozen): (params, None), LoRA's (adapters, base) or, with a frozen vision tower,
        (everything else, {"vision": tower})."""
        if self.lora is not None:
            return lora.split(params)
        if self.freeze_vision:
            return {k: v for k, v in params.items() if k != "vision"}, {"vision": params["vision"]}
        return params, None

    def _join(self, train, frozen):
        """Inverse of `_split`."""
        if frozen is None:
            return train
        return lora.join(train, frozen) if self.lora is not None else {**train, **frozen}

    def _grads_impl(self, params, batch, normaliser, policy_version, *, num_seqs):
        train, frozen = self._split(params)
        return accumulate_gradients(train, batch, normaliser, policy_version, frozen=frozen, join=self._join,
                                    **self._loss_kw(num_seqs))

    def gradients(self, params: Params, packed: PackedMinibatch, batch: PackedBatch | None = None,
                  policy_version: int = 0) -> tuple[Params, jax.Array, dict[str, jax.Array]]:
        """The accumulated gradient (of the trainable parameters: LoRA's adapters), loss and stats the
        step would use (diagnostics and tests)."""
        batch = self.put_batch(packed) if batch is None else batch
        norm = jnp.float32(self.normaliser_fn(packed.n_loss_tokens, packed.n_loss_seqs))
        return self._jit_grads(params, batch, norm, jnp.int32(policy_version), num_seqs=packed.num_seqs)

    def _step_impl(self, state: TrainState, batch: PackedBatch, normaliser, policy_version, *, num_seqs):
        self._traces["step"] += 1
        train, frozen = self._split(state.params)
        dropout = None
        if self.lora is not None and self.lora.dropout > 0:  # masks from the update count: resume-exact
            dropout = (jax.random.fold_in(jax.random.key(0), state.step), self.lora.dropout)
        grads, loss, stats = accumulate_gradients(train, batch, normaliser, policy_version, frozen=frozen,
                                                  grad_shardings=self.trainable_shardings, dropout=dropout,
                                                  join=self._join, **self._loss_kw(num_seqs))
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = self.tx.update(grads, state.opt_state, train)
        new_train = _where_tree(ok, optax.apply_updates(train, updates), train)
        new_state = TrainState(params=self._join(new_train, frozen),
                               opt_state=_where_tree(ok, new_opt, state.opt_state),
                               step=state.step + ok.astype(jnp.int32),
                               n_skipped=state.n_skipped + (~ok).astype(jnp.int32))
        stats = _moe_metrics(stats, text_config(self.model_cfg).num_experts_per_tok)
        metrics = {**stats, "loss": loss, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32),
                   "lr": jnp.asarray(self.lr_schedule(state.step), jnp.float32)}
        return new_state, metrics

    def _step_fn(self, num_seqs: int, batch: PackedBatch | None = None):
        layout = None if batch is None else self._layout_key(batch)
        key = num_seqs if layout is None else (num_seqs, layout)
        fn = self._jit_steps.get(key)
        if fn is None:
            bsh = self.batch_sharding if layout is None else self.batch_shardings(batch)  # type: ignore[arg-type]
            fn = jax.jit(self._traced(functools.partial(self._step_impl, num_seqs=num_seqs)), donate_argnums=(0,),
                         in_shardings=(self.state_shardings, bsh, self.replicated, self.replicated),
                         out_shardings=(self.state_shardings, self.replicated))
            self._jit_steps[key] = fn
        return fn

    def step(self, state: TrainState, packed: PackedMinibatch, batch: PackedBatch | None = None,
             policy_version: int = 0) -> tuple[TrainState, dict[str, Any]]:
        """One optimizer update on one packed minibatch. `state` is donated (do not reuse it).

        `batch` is the device batch (e.g. with recomputed proximal log-probs); default
        `put_batch(packed)` (proximal = trajectories' values, or behaviour as placeholder).
        Returns (new state, metrics): device scalars loss, grad_norm, skipped (0/1), lr (of this
        update), the combined loss stats (`policy_loss` keys: n_tokens, clip_frac, behave_weight_max,
        ...), and host ints tokens (all real tokens), loss_tokens, sequences, n_micro, n_real_micro,
        row_len.
        """
        batch = self.put_batch(packed) if batch is None else batch
        if batch.tokens.shape != packed.batch.shape:
            raise PackingError(f"device batch shape {batch.tokens.shape} does not match the packed minibatch "
                               f"{packed.batch.shape}")
        norm = float(self.normaliser_fn(packed.n_loss_tokens, packed.n_loss_seqs))
        if not (norm > 0 and math.isfinite(norm)):
            raise PackingError(f"loss normaliser must be positive and finite, got {norm} "
                               f"(n_loss_tokens={packed.n_loss_tokens}, n_seqs={packed.n_seqs})")
        state, metrics = self._step_fn(packed.num_seqs, batch)(state, batch, jnp.float32(norm),
                                                               jnp.int32(policy_version))
        metrics.update(tokens=packed.n_tokens, loss_tokens=packed.n_loss_tokens, sequences=packed.n_seqs,
                       n_micro=packed.n_micro, n_real_micro=packed.n_real_micro, row_len=packed.row_len)
        if packed.image_stats is not None:
            metrics.update(image_metrics(packed.image_stats))
        return state, metrics

    def train_batch(self, state: TrainState, trajectories: Sequence[TrainSequence], policy_version: int = 0
                    ) -> tuple[TrainState, list[dict[str, Any]]]:
        """`ppo_n_minibatches` optimizer steps over one batch of trajectories (AReaL ppo_update).

        With proximal="recompute", pi_prox of every minibatch is computed with the weights before
        the first update of the batch (AReaL: forward with theta_k before any update), and each
        minibatch's metrics carry `behave_prox_abs_max` = max |log pi_prox - log pi_behav| over its
        loss tokens (the off-policyness the generator actually produced).
        """
        unrouted = sum(t.routing is None for t in trajectories) if self.cfg.routing_replay else 0
        if unrouted:  # replay cannot apply to them: counted per step and logged
            logger.warning("routing_replay: %d of %d trajectories carry no recorded routing and route by the "
                           "trainer's own top-k", unrouted, len(trajectories))
        groups = split_minibatches(trajectories, self.cfg.ppo_n_minibatches)
        # pixels this step decodes are dropped once on the device (the cache of an object that arrived decoded,
        # e.g. by an in-process generator, is left as found)
        fresh = {id(t.images): t.images for t in trajectories
                 if t.images is not None and t.images.__dict__.get("_pixels") is None}
        packed = [self.pack([trajectories[i] for i in g], g) for g in groups]
        if self.cfg.proximal == "given":
            for p in packed:
                if not p.has_proximal:
                    raise PackingError("TrainStepConfig.proximal='given' but some trajectories of minibatch "
                                       f"{p.indices[:8]} have no proximal_logprobs")
        batches = [self.put_batch(p) for p in packed]
        for obj in fresh.values():
            obj.drop_pixels()
        gaps = [None] * len(batches)
        if self.cfg.proximal == "recompute":
            batches = [self.with_recomputed_proximal(state.params, b) for b in batches]
            gaps = [_behave_prox_abs_max(b) for b in batches]
        metrics = []
        for p, b, gap in zip(packed, batches, gaps):
            state, m = self.step(state, p, b, policy_version)
            if gap is not None:
                m["behave_prox_abs_max"] = gap
            if self.cfg.routing_replay:
                m["moe/unrouted_trajectories"] = unrouted
            metrics.append(m)
        return state, metrics

    @property
    def n_compilations(self) -> dict[str, int]:
        """Traces of the step and of compute_logprobs (one per distinct bucket shape: row length, micro-batch count
        and, with images, patch count)."""
        return dict(self._traces)


@jax.jit
def _behave_prox_abs_max(b: PackedBatch) -> jax.Array:
    """max over loss tokens of |log pi_prox - log pi_behav| (0 = on-policy, e.g. eta = 0 in fp32)."""
    return jnp.max(jnp.where(b.loss_mask > 0, jnp.abs(b.proximal_logprobs - b.behaviour_logprobs), 0.0))


def image_metrics(stats: Mapping[str, int]) -> dict[str, int]:
    """`PackedMinibatch.image_stats` -> the step's ``images/*`` metrics: ``images/count`` and ``images/sets``
    (distinct images and image sets of the minibatch), ``images/encoded_bytes`` (what the trajectories carried:
    the encoded files + grids of its distinct `ImageInputs`), ``images/decoded_bytes`` (their float32 patches,
    decoded once per object), ``images/device_bytes`` (the vision inputs put on the device: pixels with bucket
    padding, layout, M-RoPE positions, feature indices), ``images/device_pixel_bytes`` (of which pixels),
    ``images/patches_max`` (the patch bucket)."""
    return {"images/count": stats["images"], "images/sets": stats["image_sets"],
            "images/encoded_bytes": stats["encoded_bytes"], "images/decoded_bytes": stats["decoded_bytes"],
            "images/device_bytes": stats["device_bytes"], "images/device_pixel_bytes": stats["pixel_bytes"],
            "images/patches_max": stats["patches"]}


def _storage_dtypes(cfg: Any):
    """Per-leaf storage dtype in the trainer: float32, or with LoRA the base in `lora.base_dtype` and the
    adapters in float32."""
    shapes = _param_structs(cfg)
    if is_vl(cfg) or cfg.lora is None:  # (LoRA on a VL model is refused by the Trainer)
        return jax.tree.map(lambda _: jnp.dtype(jnp.float32), shapes)
    adapters, base = lora.split(shapes)
    return lora.join(jax.tree.map(lambda _: jnp.dtype(jnp.float32), adapters),
                     jax.tree.map(lambda _: jnp.dtype(cfg.lora.base_dtype), base))


def _param_structs(cfg: Any):
    if is_vl(cfg):
        from jaxrl_async.models.qwen2_5_vl import param_shapes as vl_param_shapes

        return vl_param_shapes(cfg)
    from jaxrl_async.models.transformer import param_shapes

    return param_shapes(cfg)


def _check_batch_shapes(b: PackedBatch) -> None:
    shape = np.shape(b.tokens)
    if len(shape) != 3:
        raise PackingError(f"batch field tokens must be [n_micro, rows, row_len], got shape {shape}")
    for f in DEVICE_FIELDS:
        s = np.shape(getattr(b, f))
        if s != shape:
            raise PackingError(f"batch field {f} has shape {s}, expected {shape} like tokens")
    if b.vision is None:
        return
    for f, want in (("mrope_positions", shape + (3,)), ("image_index", shape)):
        if np.shape(getattr(b, f)) != want:
            raise PackingError(f"batch field {f} has shape {np.shape(getattr(b, f))}, expected {want}")
    for f, a in b.vision.arrays().items():
        if np.shape(a)[:1] != shape[:1]:
            raise PackingError(f"batch field vision.{f} has shape {np.shape(a)}, expected n_micro={shape[0]} first")


def default_normaliser_fn(loss_cfg: Any) -> NormaliserFn:
    """Global denominator implied by `PolicyLossConfig.aggregation` (host side, exact).

    token_mean: number of loss tokens in the minibatch; seq_mean_token_mean: number of
    sequences with at least one loss token (both = the sum of `losses.aggregation_count` over
    all micro-batches and data-parallel shards); constant: ignored by the loss (1.0).
    """
    agg = "token_mean" if loss_cfg is None else getattr(loss_cfg, "aggregation", "token_mean")
    if agg == "token_mean":
        return lambda n_loss_tokens, n_loss_seqs: float(n_loss_tokens)
    if agg == "seq_mean_token_mean":
        return lambda n_loss_tokens, n_loss_seqs: float(n_loss_seqs)
    if agg == "constant":
        return lambda n_loss_tokens, n_loss_seqs: 1.0
    raise ValueError(f"unknown loss aggregation {agg!r}")


def step_metrics(minibatch_metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """One RL step's metrics from the metrics of its ``ppo_n_minibatches`` updates (host floats).

    Every minibatch counts (not the last one only): ``loss`` is their mean and ``grad_norm`` their max,
    both non-finite as soon as one minibatch's is (so the run's non-finite check sees any of them);
    ``skipped`` counts the skipped updates; per-token statistics (clip_frac, entropy, behave_*) are
    averaged with the minibatches' loss-token counts as weights; ``*_max`` take the max; ``lr`` is the
    last update's.
    """
    ms = [{k: float(v) for k, v in jax.device_get(dict(m)).items() if np.ndim(v) == 0} for m in minibatch_metrics]
    if not ms:
        raise ValueError("step_metrics: no minibatch")
    w = np.asarray([m.get("loss_tokens", 1.0) for m in ms], np.float64)
    w = w / w.sum() if w.sum() > 0 else np.full(len(ms), 1.0 / len(ms))
    out = {"loss": float(np.mean([m["loss"] for m in ms])), "grad_norm": float(np.max([m["grad_norm"] for m in ms])),
           "lr": ms[-1]["lr"], "skipped": int(sum(m.get("skipped", 0) for m in ms)), "minibatches": len(ms)}
    for k in sorted(set().union(*ms) - set(out) - {"tokens", "loss_tokens", "sequences", "n_micro", "n_real_micro",
                                                       "row_len"}):
        vals = np.asarray([m.get(k, np.nan) for m in ms], np.float64)
        if k.startswith("images/") and not k.endswith("_max"):  # bytes and counts of the step's minibatches add up
            out[k] = float(np.nansum(vals))
            continue
        out[k] = float(np.max(vals)) if k.endswith("_max") else float(np.sum(vals * w))
    return out
