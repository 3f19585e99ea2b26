"""The RL run's state in and out of checkpoints: initial parameters, the checkpointer, the training
state as checkpoint items, and the finished-but-unconsumed groups (saved bit-exactly, restored into the
staleness buffer on resume). Used by ``loop`` and mirrored by the processes of a trainer group."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import jax

from jaxrl_async.checkpoint.lora_base import check_base_reference
from jaxrl_async.config import RunConfig
from jaxrl_async.data.ledger import DataLedger

log = logging.getLogger("jaxrl_async")

__all__ = ["initial_params", "build_checkpointer", "restore_train_state", "restore_buffered_groups"]


def initial_params(cfg: RunConfig, model_cfg: Any = None, *, mesh: Any = None) -> tuple[Any, Any]:
    """(model config, parameters) the run starts from.

    ``model.path``: the Hugging Face weights read straight onto the trainer's parameter shardings of
    ``mesh`` (every process of a trainer group reads only the slices its devices hold: no full host
    copy anywhere); without ``mesh``, host numpy. Otherwise ``model_cfg`` initialised from
    ``model.init_seed`` (fp32) as host numpy, the same values on every process.
    """
    from jaxrl_async.models.hf_io import load_hf
    from jaxrl_async.models.transformer import init_params
    from jaxrl_async.models.shardings import model_shardings

    spec = cfg.model.lora.spec()  # LoRA: the base as without it, + fresh adapters (model.lora.init_seed)
    if cfg.model.path is not None:
        shardings = (lambda m: model_shardings(m, mesh, "trainer")) if mesh is not None else None
        model_cfg, params = load_hf(cfg.model.path, shardings, **cfg.model.numerics())
        if spec is not None:
            model_cfg = model_cfg.replace(lora=spec)
            params = _with_adapters(params, model_cfg, cfg.model.lora.init_seed, mesh)
        return model_cfg, params if mesh is not None else jax.device_get(params)
    base_cfg = model_cfg.replace(param_dtype="float32", lora=None)
    from jaxrl_async.models import qwen2_5_vl

    init = qwen2_5_vl.init_params if qwen2_5_vl.is_vl(base_cfg) else init_params
    params = init(base_cfg, jax.random.key(cfg.model.init_seed))
    if spec is not None:
        model_cfg = model_cfg.replace(lora=spec)
        params = _with_adapters(params, model_cfg, cfg.model.lora.init_seed, None)
    return model_cfg, jax.device_get(params)


def _with_adapters(base: Any, model_cfg: Any, seed: int, mesh: Any) -> Any:
    from jaxrl_async.models import lora
    from jaxrl_async.models import transformer
    from jaxrl_async.models.shardings import model_shardings

    adapters = transformer.init_adapters(model_cfg, jax.random.key(seed))
    if mesh is not None:  # each process places its own slices of the (identical) host values: no collective
        # (a device_put onto a mesh spanning processes checks equality across them, a collective the other
        # processes of a trainer group would not be running at this point)
        host = jax.device_get(adapters)
        adapters = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]), host,
                                lora.split(model_shardings(model_cfg, mesh, "trainer"))[0])
    return lora.join(adapters, base)


def build_checkpointer(cfg: RunConfig, run_dir: str, model_cfg: Any, tokenizer_dir: str | None) -> Any:
    from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer

    ck = cfg.checkpoint
    return Checkpointer(run_dir, CheckpointConfig(every_steps=ck.every_steps, every_seconds=ck.every_seconds,
                                                  keep_last=ck.keep_last, async_save=ck.async_save),
                        model_config=model_cfg.replace(param_dtype="float32"), tokenizer_dir=tokenizer_dir)


def restore_train_state(ckpt: Any, trainer: Any, params: Any, base_ref: Mapping[str, Any] | None = None) -> Any:
    """``ckpt.restore`` (newest usable step, fallback) of the training state onto ``trainer``'s
    shardings; ``params`` only gives the shapes. ``base_ref`` (LoRA on an unchanged ``model.path``): the
    checkpoint holds the adapters only; its base reference must match ``base_ref`` and the base of
    ``params`` (read from that path) is put back next to the restored adapters."""
    from jaxrl_async.checkpoint import abstract_like

    abstract = abstract_like(jax.eval_shape(trainer.init_state, params), trainer.state_shardings)
    r = ckpt.restore(targets=state_items(abstract, base_ref), fallback=True)
    if base_ref is not None:
        from jaxrl_async.models import lora

        check_base_reference((r.meta.extra or {}).get("lora_base"), ckpt.step_dir(r.step), current=base_ref)
        _, base_sh = lora.split(trainer.param_shardings)
        _, base_dt = lora.split(trainer.param_dtypes)
        base = jax.jit(lambda b: jax.tree.map(lambda x, dt: x.astype(dt), b, base_dt),
                       out_shardings=base_sh)(lora.split(params)[1])
        r.arrays["params"] = lora.join(r.arrays["params"], base)
    return r


def restore_buffered_groups(saved: Sequence[Mapping[str, Any]], staleness: Any, ledger: DataLedger, version: int,
                            eta: int, batch_size: int, unusable: str | None = None) -> dict[str, int]:
    """Put the finished groups of a checkpoint back into the staleness buffer (reused, not regenerated).

    The restored groups keep their admission versions, so earliest-deadline-first consumes them before
    any group admitted after the resume, in (admission version, head version, draw) order: the j-th
    kept group is trained at version ``version + j // batch_size``. A group is kept only if its lag
    then is <= eta; otherwise (e.g. the run resumes with a smaller eta, or more groups are that old
    than one batch holds) it is dropped with reason ``stale_on_restore`` and its prompt replayed, i.e.
    regenerated with fresh weights. So staleness stays bounded after a resume (the regression of
    AReaL issue #1388) and no StalenessViolation can come from a restored group. ``unusable`` (a reason,
    e.g. ``group_size_changed`` when ``rollout.n_samples`` changed since the checkpoint): every group is
    dropped with it and its prompt replayed. Every decision is an event of the data ledger (``restore`` /
    ``drop``).
    """
    from jaxrl_async.rollout.staleness import StalenessViolation

    kept = dropped = 0
    order = sorted(saved, key=lambda r: (int(r["admit_version"]), int(r["head_version"]), int(r["draw"])))
    for rec in order:
        draw, m, h = int(rec["draw"]), int(rec["admit_version"]), int(rec["head_version"])
        trained_at = version + kept // batch_size
        info = dict(admit_version=m, head_version=h, lag=version - h, lag_when_trained=trained_at - h)
        item = ledger.replay_item(draw)
        reason = None
        if item is None:
            reason = "not_outstanding"  # inconsistent checkpoint: the ledger does not hold its item
        elif unusable is not None:
            reason = unusable
        elif trained_at - h > eta:
            reason = "stale_on_restore"
        else:
            try:
                ticket = staleness.restore_buffered(group_from_record(rec, item), m, h)
            except (ValueError, KeyError, TypeError, StalenessViolation) as e:
                reason = f"invalid:{type(e).__name__}"
                log.warning("checkpointed group of draw %d not reused: %s", draw, e)
            else:
                ledger.restore(ticket, draw, **info)
                kept += 1
        if reason is not None:
            ledger.drop_restored(draw, reason, eta=eta, **info)
            dropped += 1
    return {"restored_groups": kept, "dropped_groups": dropped}


def _jsonable(value: Any) -> Any:
    """``value`` if the checkpoint codec can store it, else its repr (custom workflows may put
    anything in trajectory metadata; a checkpoint must not fail because of it)."""
    from jaxrl_async.checkpoint import pack_records

    try:
        pack_records(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def group_record(g: Any, draw: int) -> dict[str, Any]:
    """A buffered group (``ConsumedGroup`` of a ``TrajectoryGroup``) as a checkpoint record; the
    arrays go to the checkpoint's numeric pools bit-exactly, the prompt item stays in the ledger."""
    group = g.item
    return {"draw": int(draw), "admit_version": int(g.ticket.admit_version), "head_version": int(g.head_version),
            "group_id": int(group.group_id), "metadata": {k: _jsonable(v) for k, v in group.metadata.items()},
            "trajectories": [{"tokens": t.tokens, "loss_mask": t.loss_mask, "logprobs": t.logprobs,
                              "versions": t.versions, "reward": float(t.reward), "prompt_len": int(t.prompt_len),
                              "metadata": {k: _jsonable(v) for k, v in t.metadata.items()},
                              **({} if t.routing is None else {"routing": t.routing}),
                              # the prompt's images are the item's (in the ledger): a flag, not the bytes again
                              **({} if getattr(t, "images", None) is None else {"images": True})}
                             for t in group.trajectories]}


def group_from_record(rec: Mapping[str, Any], item: Any) -> Any:
    """Inverse of ``group_record`` (the trajectories are re-validated by ``Trajectory``)."""
    from jaxrl_async.rollout.workflow import Trajectory, TrajectoryGroup, item_images

    images = item_images(item) if any(t.get("images") for t in rec["trajectories"]) else None
    if images is None and any(t.get("images") for t in rec["trajectories"]):
        raise ValueError("checkpointed group's trajectories had images but its prompt item has none")
    trajs = [Trajectory(tokens=t["tokens"], loss_mask=t["loss_mask"], logprobs=t["logprobs"], versions=t["versions"],
                        reward=t["reward"], prompt_len=int(t["prompt_len"]), metadata=dict(t.get("metadata") or {}),
                        routing=t.get("routing"), images=images if t.get("images") else None)
             for t in rec["trajectories"]]
    if not trajs:
        raise ValueError("checkpointed group has no trajectory")
    return TrajectoryGroup(item, trajs, int(rec.get("group_id", -1)), dict(rec.get("metadata") or {}))


def state_items(state: Any, base_ref: Any = None) -> dict[str, Any]:
    """TrainState → checkpoint items (``params`` is what export reads; with a LoRA ``base_ref``, the adapters
    only: the base is the referenced ``model.path``)."""
    params = state.params
    if base_ref is not None:
        from jaxrl_async.models import lora

        params = lora.split(params)[0]
    return {"params": params, "opt_state": state.opt_state,
            "counters": {"step": state.step, "n_skipped": state.n_skipped}}


def state_from_items(items: Mapping[str, Any]) -> Any:
    from jaxrl_async.trainer.train_step import TrainState

    return TrainState(params=items["params"], opt_state=items["opt_state"], step=items["counters"]["step"],
                      n_skipped=items["counters"]["n_skipped"])
