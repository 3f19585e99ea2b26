"""Semantic validation of a ``RunConfig`` (combinations, the device split, meshes): ``validate``."""

from __future__ import annotations

import json
import math
import os

from jaxrl_async.config.overrides import component_error, check_types
from jaxrl_async.config.resume import check_resume
from jaxrl_async.config.sections import (
    ConfigError,
    MeshAxesConfig,
    MeshConfig,
    RunConfig,
)


# =============================================================================================
# Semantic validation
# =============================================================================================
def resolve_device_split(mesh: MeshConfig, num_devices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(generator device indices, trainer device indices) for ``num_devices`` devices.

    One device or ``colocate``: both get all devices (time-sharing). Explicit ``devices`` win;
    otherwise the generator takes the first ``num_generator_devices`` (default
    ``round(N · generator_fraction)`` clamped to [1, N − 1]) and the trainer the rest.
    """
    all_ids = tuple(range(num_devices))
    g, t = mesh.generator.devices, mesh.trainer.devices
    if num_devices == 1 or mesh.colocate:
        return (g or all_ids), (t or all_ids)
    if g is not None and t is not None:
        return g, t
    if mesh.num_generator_devices is not None:
        n_gen = mesh.num_generator_devices
    else:
        n_gen = max(1, min(num_devices - 1, round(num_devices * mesh.generator_fraction)))
    if g is not None:
        return g, tuple(i for i in all_ids if i not in g)
    if t is not None:
        rest = tuple(i for i in all_ids if i not in t)
        return rest, t
    return all_ids[:n_gen], all_ids[n_gen:]


def resolve_shape(shape: tuple[int, ...], n: int, field: str) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ConfigError(field, f"at most one -1 allowed, got {shape}")
    if any(s == 0 or s < -1 for s in shape):
        raise ConfigError(field, f"sizes must be positive or -1, got {shape}")
    fixed = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if n % fixed:
            raise ConfigError(field, f"{shape} does not fit its {n} devices ({n} is not divisible by {fixed})")
        return tuple(n // fixed if s == -1 else s for s in shape)
    if fixed != n:
        raise ConfigError(field, f"{shape} needs {fixed} devices but its share has {n}")
    return shape


def trainer_data_parallel_size(cfg: RunConfig, num_devices: int) -> int:
    """Product of the trainer mesh axes that shard the batch (``data``, ``fsdp``, ``expert``)."""
    _, tr = resolve_device_split(cfg.mesh, num_devices)
    shape = resolve_shape(cfg.mesh.trainer.shape, len(tr), "mesh.trainer.shape")
    return math.prod(s for s, a in zip(shape, cfg.mesh.trainer.axis_names) if a in ("data", "fsdp", "expert"))


def _require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)


def validate(cfg: RunConfig, num_devices: int | None = None) -> RunConfig:
    """Types, then every cross-field rule; raises ConfigError naming the field. Returns ``cfg``.

    ``num_devices`` None: ``jax.device_count()`` (initialises the backend; compiles nothing).
    """
    if not isinstance(cfg, RunConfig):
        raise ConfigError("", f"expected a RunConfig, got {type(cfg).__name__}")
    check_types(cfg)
    _require(bool(cfg.name) and "/" not in cfg.name, "name", f"must be a non-empty name without '/', got {cfg.name!r}")
    _require(cfg.max_wall_time_s is None or cfg.max_wall_time_s > 0, "max_wall_time_s",
             f"must be > 0 or None, got {cfg.max_wall_time_s}")
    _rollout_rules(cfg)
    _trainer_rules(cfg)
    _model_rules(cfg)
    _data_rules(cfg)
    _eval_checkpoint_rules(cfg)
    _logging_rules(cfg)
    _import_rules(cfg)
    _validate_mesh(cfg, num_devices)
    check_resume(cfg)
    return cfg


def _import_rules(cfg: RunConfig) -> None:
    """Every import string of the config resolves now (``--dry-run`` included), not after the model is loaded and
    compiled: ``rollout.reward`` (``module:function``, callable) and ``rollout.workflow`` (``module:Class``, a
    ``RolloutWorkflow`` subclass; agents are workflows). Built-in names are checked in ``_rollout_rules``."""
    from jaxrl_async.rewards.registry import BUILTIN_REWARDS, RewardLoadError, load_reward_fn

    ro = cfg.rollout
    if ro.reward not in BUILTIN_REWARDS:
        try:
            load_reward_fn(ro.reward)
        except RewardLoadError as e:
            raise ConfigError("rollout.reward", str(e)) from None
    if ro.workflow == "openai_agent":
        import importlib.util

        missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
        _require(not missing, "rollout.workflow",
                 f"openai_agent needs {', '.join(missing)}: pip install 'jaxrl_async[agent]'")
        _require(ro.agent is not None, "rollout.agent",
                 "rollout.workflow=openai_agent needs rollout.agent=package.module:function (or online)")
        if ro.agent != "online":
            from jaxrl_async.rollout.openai_agent import agent_function

            try:
                agent_function(ro.agent)
            except ValueError as e:
                raise ConfigError("rollout.agent", str(e)) from None
    elif ro.workflow != "rlvr":
        from jaxrl_async.rollout.workflow import workflow_class

        try:
            workflow_class(ro.workflow)
        except ValueError as e:
            raise ConfigError("rollout.workflow", str(e)) from None


def _rollout_rules(cfg: RunConfig) -> None:
    """``rollout`` (incl. sampling and the engine) and what the engine bounds."""
    ro, sa, en = cfg.rollout, cfg.rollout.sampling, cfg.rollout.engine
    _require(ro.max_head_offpolicyness >= 0, "rollout.max_head_offpolicyness",
             f"must be >= 0, got {ro.max_head_offpolicyness}")
    _require(ro.n_samples >= 1, "rollout.n_samples", f"must be >= 1, got {ro.n_samples}")
    _require(ro.max_concurrent_rollouts is None or ro.max_concurrent_rollouts >= 1, "rollout.max_concurrent_rollouts",
             f"must be >= 1 or None, got {ro.max_concurrent_rollouts}")
    _require(ro.reward_workers >= 1, "rollout.reward_workers", f"must be >= 1, got {ro.reward_workers}")
    _require(ro.group_timeout_s is None or ro.group_timeout_s > 0, "rollout.group_timeout_s",
             f"must be > 0 or None, got {ro.group_timeout_s}")
    _require(ro.max_consecutive_failures >= 1, "rollout.max_consecutive_failures",
             f"must be >= 1, got {ro.max_consecutive_failures}")
    _require(ro.workflow in ("rlvr", "openai_agent") or ":" in ro.workflow, "rollout.workflow",
             f"must be 'rlvr', 'openai_agent' or 'package.module:Class', got {ro.workflow!r}")
    _require(ro.agent is None or ro.workflow == "openai_agent", "rollout.agent",
             f"is for rollout.workflow=openai_agent (the workflow is {ro.workflow!r})")
    _require(0.0 <= ro.agent_turn_discount <= 1.0, "rollout.agent_turn_discount",
             f"must be in [0, 1], got {ro.agent_turn_discount}")
    _require(0 <= ro.agent_port <= 65535, "rollout.agent_port", f"must be in [0, 65535], got {ro.agent_port}")
    if ro.workflow == "openai_agent":
        from jaxrl_async.serve.endpoint import is_loopback

        _require(is_loopback(ro.agent_host) or bool(ro.agent_api_key), "rollout.agent_api_key",
                 f"rollout.agent_host={ro.agent_host!r} is not a loopback address: set an API key")
    from jaxrl_async.rewards.registry import BUILTIN_REWARDS

    _require(ro.reward in BUILTIN_REWARDS or ":" in ro.reward, "rollout.reward",
             f"must be one of {sorted(BUILTIN_REWARDS)} or 'package.module:function', got {ro.reward!r}")
    _require(sa.temperature >= 0, "rollout.sampling.temperature", f"must be >= 0, got {sa.temperature}")
    _require(sa.top_k >= 0, "rollout.sampling.top_k", f"must be >= 0, got {sa.top_k}")
    _require(0 < sa.top_p <= 1, "rollout.sampling.top_p", f"must be in (0, 1], got {sa.top_p}")
    _require(sa.max_new_tokens >= 1, "rollout.sampling.max_new_tokens", f"must be >= 1, got {sa.max_new_tokens}")
    _require(en.max_concurrent_decodes >= ro.n_samples, "rollout.engine.max_concurrent_decodes",
             f"must be >= rollout.n_samples={ro.n_samples} (a group's samples decode together), "
             f"got {en.max_concurrent_decodes}")
    _require(en.page_size >= 1, "rollout.engine.page_size", f"must be >= 1, got {en.page_size}")
    _require(en.num_pages is None or en.num_pages >= 1, "rollout.engine.num_pages", f"must be >= 1 or None, got {en.num_pages}")
    _require(0 < en.cache_memory_fraction <= 1, "rollout.engine.cache_memory_fraction",
             f"must be in (0, 1], got {en.cache_memory_fraction}")
    prefill = en.max_prefill_length if en.max_prefill_length is not None else en.max_sequence_length - 1
    _require(en.max_sequence_length >= 2, "rollout.engine.max_sequence_length", f"must be >= 2, got {en.max_sequence_length}")
    _require(1 <= prefill < en.max_sequence_length, "rollout.engine.max_prefill_length",
             f"must be in [1, max_sequence_length) = [1, {en.max_sequence_length}), got {prefill}")
    _require(en.max_prefill_pack >= 1, "rollout.engine.max_prefill_pack", f"must be >= 1, got {en.max_prefill_pack}")
    _require(1 <= en.decode_steps <= en.page_size, "rollout.engine.decode_steps",
             f"must be in [1, rollout.engine.page_size={en.page_size}] (a dispatch maps at most one new KV page per "
             f"slot), got {en.decode_steps}")
    _require(en.max_top_logprobs >= 0, "rollout.engine.max_top_logprobs", f"must be >= 0, got {en.max_top_logprobs}")
    if en.prefill_buckets is not None:
        b = sorted(set(en.prefill_buckets))
        _require(bool(b) and b[0] >= 1, "rollout.engine.prefill_buckets", f"must be positive ints, got {en.prefill_buckets}")
        _require(b[-1] == prefill, "rollout.engine.prefill_buckets",
                 f"the largest bucket {b[-1]} must equal the max prefill length {prefill} "
                 f"(rollout.engine.max_prefill_length)")
    if cfg.data.max_prompt_len is not None:
        _require(cfg.data.max_prompt_len <= prefill, "data.max_prompt_len",
                 f"{cfg.data.max_prompt_len} exceeds the engine's max prefill length {prefill}")
    if cfg.model.path is None:
        _require(en.max_sequence_length <= cfg.model.max_position_embeddings, "rollout.engine.max_sequence_length",
                 f"{en.max_sequence_length} exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}")


def _trainer_rules(cfg: RunConfig) -> None:
    """``trainer`` (incl. loss, advantage, packing, the SFT warm start)."""
    ro, tr, sa, en = cfg.rollout, cfg.trainer, cfg.rollout.sampling, cfg.rollout.engine
    _require(tr.batch_size >= 1, "trainer.batch_size", f"must be >= 1, got {tr.batch_size}")
    _require(tr.total_steps >= 1, "trainer.total_steps", f"must be >= 1, got {tr.total_steps}")
    _require(tr.ppo_n_minibatches >= 1, "trainer.ppo_n_minibatches", f"must be >= 1, got {tr.ppo_n_minibatches}")
    n_seq = tr.batch_size * ro.n_samples
    _require(n_seq % tr.ppo_n_minibatches == 0, "trainer.ppo_n_minibatches",
             f"trainer.batch_size * rollout.n_samples = {n_seq} sequences do not split into {tr.ppo_n_minibatches} minibatches")
    _require(tr.logprob_chunk >= 1, "trainer.logprob_chunk", f"must be >= 1, got {tr.logprob_chunk}")
    _require(tr.max_grad_norm is None or tr.max_grad_norm > 0, "trainer.max_grad_norm",
             f"must be > 0 or None, got {tr.max_grad_norm}")
    _require(tr.sft.steps >= 0, "trainer.sft.steps", f"must be >= 0, got {tr.sft.steps}")
    _require(tr.sft.batch_size >= 1, "trainer.sft.batch_size", f"must be >= 1, got {tr.sft.batch_size}")
    try:
        tr.optimizer_config()
    except ValueError as e:  # OptimizerConfig.<field>: ... — the same field names as the trainer section
        msg = str(e).replace("OptimizerConfig.", "", 1)
        raise component_error("trainer", tr, msg) from None
    for name, sub in (("trainer.loss", tr.loss), ("trainer.advantage", tr.advantage)):
        try:
            sub.validate()
        except ValueError as e:
            raise component_error(name, sub, str(e)) from None
    if tr.advantage.overlong_penalty and tr.advantage.max_new_tokens is not None:
        _require(tr.advantage.max_new_tokens == sa.max_new_tokens, "trainer.advantage.max_new_tokens",
                 f"{tr.advantage.max_new_tokens} != rollout.sampling.max_new_tokens={sa.max_new_tokens}")
    _require(tr.router_aux_loss_coef is None or (math.isfinite(tr.router_aux_loss_coef) and tr.router_aux_loss_coef >= 0),
             "trainer.router_aux_loss_coef", f"must be a finite float >= 0 or None, got {tr.router_aux_loss_coef}")
    _require(not tr.routing_replay or ro.record_routing, "trainer.routing_replay",
             "needs rollout.record_routing = true (the generator's recorded experts)")
    _require(not tr.freeze_vision or cfg.model.path is not None or cfg.model.model_type == "qwen2_5_vl",
             "trainer.freeze_vision", "needs a vision-language policy (model.path = a Qwen2.5-VL checkpoint, or "
             "model.model_type=qwen2_5_vl); this model has no vision tower")
    _require(tr.advantage.kl_coef == 0, "trainer.advantage.kl_coef",
             f"must be 0: a KL penalty needs a reference policy, which jaxrl_async does not keep yet (AReaL's "
             f"math recipes use 0), got {tr.advantage.kl_coef}")
    longest = max(tr.packing.row_len_buckets)
    _require(longest >= en.max_sequence_length, "trainer.packing.row_len_buckets",
             f"largest bucket {longest} is shorter than rollout.engine.max_sequence_length={en.max_sequence_length}: "
             f"a trajectory of up to {en.max_sequence_length} tokens could not be packed; add a bucket >= "
             f"{en.max_sequence_length}")
    if tr.sft.steps > 0:
        _require(0 <= tr.sft.warmup_steps < tr.sft.steps, "trainer.sft.warmup_steps",
                 f"must be in [0, trainer.sft.steps={tr.sft.steps}), got {tr.sft.warmup_steps}")
        _require(tr.sft.lr > 0 and math.isfinite(tr.sft.lr), "trainer.sft.lr", f"must be > 0, got {tr.sft.lr}")


def _model_rules(cfg: RunConfig) -> None:
    """``model``."""
    ro, tr = cfg.rollout, cfg.trainer
    # issue 31 item 3: a setting that would do nothing is refused, not ignored
    _require(cfg.model.param_dtype == "float32", "model.param_dtype",
             f"{cfg.model.param_dtype} would be ignored: the trainer keeps float32 master weights and Adam state, the "
             "generator holds model.dtype; a LoRA run's frozen base takes model.lora.base_dtype")
    _require(cfg.model.vocab_size is None or cfg.model.vocab_size >= 1, "model.vocab_size",
             f"must be >= 1 or None, got {cfg.model.vocab_size}")
    if cfg.model.path is not None:
        _require(os.path.isfile(os.path.join(cfg.model.path, "config.json")), "model.path",
                 f"{cfg.model.path!r} has no config.json")
    else:
        try:
            vl = cfg.model.model_type == "qwen2_5_vl"
            ids = dict(image_token_id=4, video_token_id=5, vision_start_token_id=6, vision_end_token_id=7) if vl else None
            cfg.model.model_config(vocab_size=8, vision_token_ids=ids)
        except ValueError as e:  # ModelConfig.<field>: ...
            msg = str(e).replace("ModelConfig.", "", 1)
            raise component_error("model", cfg.model, msg) from None
    if cfg.model.model_type == "qwen2_5_vl" or cfg.model.path is not None:
        _vl_rules(cfg)
    if ro.record_routing or tr.routing_replay:
        field = "rollout.record_routing" if ro.record_routing else "trainer.routing_replay"
        _require(_is_moe(cfg), field, "needs a mixture-of-experts model (qwen3_moe, num_experts > 0)")
    if cfg.model.tokenizer_path is not None:
        _require(os.path.isdir(cfg.model.tokenizer_path), "model.tokenizer_path",
                 f"{cfg.model.tokenizer_path!r} is not a directory")


def _vl_rules(cfg: RunConfig) -> None:
    """What a vision-language policy (Qwen2.5-VL) cannot do yet: refused at validation, not after the warm start."""
    if not cfg.model.is_vision_language():  # an unreadable config.json: model.path's own rule names the problem
        return
    what = "a vision-language policy (Qwen2.5-VL)"
    _require(cfg.model.lora.rank == 0, "model.lora.rank", f"LoRA is not wired for {what} yet; use full fine-tuning")
    _require(cfg.rollout.workflow != "openai_agent", "rollout.workflow",
             f"openai_agent does not carry images through the agent endpoint yet: {what} needs rlvr or a workflow that "
             "submits the prompt's images")


def _data_rules(cfg: RunConfig) -> None:
    """``data``."""
    vl = cfg.model.model_type == "qwen2_5_vl" if cfg.model.path is None else None  # a checkpoint: known at load
    if cfg.data.task == "visual_arithmetic":
        _require(vl is not False, "data.task", "visual_arithmetic shows the problems as images: it needs a "
                 "vision-language policy (model.model_type=qwen2_5_vl, or a Qwen2.5-VL checkpoint in model.path)")
    if vl and cfg.model.tokenizer_path is None:
        _require(cfg.data.tokenizer_kind == "arithmetic_vl", "data.tokenizer_kind",
                 f"{cfg.data.tokenizer_kind!r} has no vision tokens: a random-init qwen2_5_vl policy with the run's own "
                 "tokenizer needs data.tokenizer_kind=arithmetic_vl (or model.tokenizer_path)")
    for name in ("image_min_pixels", "image_max_pixels"):
        v = getattr(cfg.data, name)
        _require(v is None or v >= 1, f"data.{name}", f"must be >= 1 or None, got {v}")
    if cfg.data.image_min_pixels is not None and cfg.data.image_max_pixels is not None:
        _require(cfg.data.image_min_pixels <= cfg.data.image_max_pixels, "data.image_min_pixels",
                 f"{cfg.data.image_min_pixels} > data.image_max_pixels={cfg.data.image_max_pixels}")
    if cfg.data.task == "dataset":
        _require(cfg.data.train_path is not None, "data.train_path", "must be set when data.task='dataset'")
        for name in ("train_path", "eval_path"):
            p = getattr(cfg.data, name)
            _require(p is None or os.path.isfile(p), f"data.{name}", f"file {p!r} does not exist")
    _require(cfg.data.max_prompt_len is None or cfg.data.max_prompt_len >= 1, "data.max_prompt_len",
             f"must be >= 1 or None, got {cfg.data.max_prompt_len}")


def _eval_checkpoint_rules(cfg: RunConfig) -> None:
    """``eval``, ``checkpoint``."""
    ev = cfg.eval
    _require(ev.every_steps >= 0, "eval.every_steps", f"must be >= 0 (0 = never), got {ev.every_steps}")
    _require(ev.temperature >= 0, "eval.temperature", f"must be >= 0, got {ev.temperature}")
    _require(ev.max_items is None or ev.max_items >= 1, "eval.max_items", f"must be >= 1 or None, got {ev.max_items}")
    _require(ev.max_new_tokens is None or ev.max_new_tokens >= 1, "eval.max_new_tokens",
             f"must be >= 1 or None, got {ev.max_new_tokens}")
    ck = cfg.checkpoint
    _require(ck.every_steps is None or ck.every_steps >= 1, "checkpoint.every_steps",
             f"must be >= 1 or None, got {ck.every_steps}")
    _require(ck.every_seconds is None or ck.every_seconds > 0, "checkpoint.every_seconds",
             f"must be > 0 or None, got {ck.every_seconds}")
    _require(ck.keep_last >= 1, "checkpoint.keep_last", f"must be >= 1, got {ck.keep_last}")


# W&B refuses these characters in project and entity names (and names over 128 characters)
_WANDB_NAME_FORBIDDEN = "/\\#?%:"
WANDB_INSTALL = "pip install 'jaxrl_async[wandb]'"


def _logging_rules(cfg: RunConfig) -> None:
    """``logging``; with ``logging.wandb`` the ``wandb`` package imports now (not after the model is compiled)
    and the W&B names are ones W&B accepts."""
    lg = cfg.logging
    _require(lg.log_every >= 1, "logging.log_every", f"must be >= 1, got {lg.log_every}")
    for field in ("wandb_project", "wandb_entity"):
        v = getattr(lg, field)
        _require(v is None or (0 < len(v) <= 128 and not any(ch in v for ch in _WANDB_NAME_FORBIDDEN)),
                 f"logging.{field}", f"must be None or 1-128 characters without any of {_WANDB_NAME_FORBIDDEN}, "
                 f"got {v!r}")
    _require(lg.wandb_run_name is None or bool(lg.wandb_run_name.strip()), "logging.wandb_run_name",
             f"must be None or a non-empty name, got {lg.wandb_run_name!r}")
    _require(all(0 < len(t) <= 64 for t in lg.wandb_tags), "logging.wandb_tags",
             f"tags must be 1-64 characters, got {lg.wandb_tags}")
    if lg.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError as e:
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError("logging.wandb", f"needs the wandb package ({why}); install it with: {WANDB_INSTALL}") \
                from None
        _require(lg.wandb_project is not None or not any(ch in cfg.name for ch in _WANDB_NAME_FORBIDDEN),
                 "logging.wandb_project", f"None takes the run's name {cfg.name!r}, which W&B refuses as a project "
                 f"(it has one of {_WANDB_NAME_FORBIDDEN}): set logging.wandb_project")


def _validate_mesh(cfg: RunConfig, num_devices: int | None) -> None:
    m = cfg.mesh
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    _require(0 < m.generator_fraction < 1, "mesh.generator_fraction", f"must be in (0, 1), got {m.generator_fraction}")
    _require(m.cpu_devices is None or m.cpu_devices >= 1, "mesh.cpu_devices", f"must be >= 1 or None, got {m.cpu_devices}")
    _require(m.layout != "auto", "mesh.layout", "'auto' is resolved when a run starts (`python -m jaxrl_async.main` "
             "fits it to the machine: jaxrl_async.config.machine.fit_to_machine); call fit_to_machine(cfg) before "
             "validating a config built in Python")
    if m.layout is not None:
        from jaxrl_async.config.layouts import LAYOUTS

        _require(m.layout in LAYOUTS, "mesh.layout", f"unknown layout {m.layout!r}; known: auto, {', '.join(LAYOUTS)}")
        need = LAYOUTS[m.layout].num_devices
        _require(num_devices == need, "mesh.layout",
                 f"layout {m.layout!r} is for {need} devices, this process has {num_devices} (plan it on simulated "
                 f"devices with `python -m jaxrl_async.plan --config FILE`, set mesh.layout=auto to fit the mesh to "
                 f"this machine, or mesh.layout=None and mesh shapes for {num_devices} devices)")
    if m.num_generator_devices is not None and num_devices > 1 and not m.colocate:
        _require(1 <= m.num_generator_devices < num_devices, "mesh.num_generator_devices",
                 f"must be in [1, {num_devices - 1}] with {num_devices} devices, got {m.num_generator_devices}")
    for role in ("generator", "trainer"):
        ax: MeshAxesConfig = getattr(m, role)
        _require(len(ax.shape) == len(ax.axis_names) >= 1, f"mesh.{role}.shape",
                 f"{ax.shape} and axis_names {ax.axis_names} must be non-empty and of equal length")
        _require(len(set(ax.axis_names)) == len(ax.axis_names), f"mesh.{role}.axis_names",
                 f"duplicate axis names in {ax.axis_names}")
        if ax.devices is not None:
            bad = [d for d in ax.devices if not 0 <= d < num_devices]
            _require(not bad and len(set(ax.devices)) == len(ax.devices) and ax.devices, f"mesh.{role}.devices",
                     f"must be distinct indices in [0, {num_devices}), got {ax.devices}")
    allowed = {"generator": {"data", "tensor", "expert"}, "trainer": {"data", "fsdp", "tensor", "context", "expert"}}
    for role, names in allowed.items():
        extra = set(getattr(m, role).axis_names) - names
        _require(not extra, f"mesh.{role}.axis_names", f"unknown axes {sorted(extra)}; the {role} uses {sorted(names)}")
    gen, trn = resolve_device_split(m, num_devices)
    shared = num_devices == 1 or m.colocate
    if not shared:
        overlap = set(gen) & set(trn)
        _require(not overlap, "mesh.trainer.devices", f"devices {sorted(overlap)} are also generator devices "
                 "(set mesh.colocate=true to time-share)")
        _require(len(gen) >= 1, "mesh.generator.devices", "the generator has no device")
        _require(len(trn) >= 1, "mesh.trainer.devices", "the trainer has no device")
    gshape = resolve_shape(m.generator.shape, len(gen), "mesh.generator.shape")
    en = cfg.rollout.engine
    gdata = gshape[m.generator.axis_names.index("data")] if "data" in m.generator.axis_names else 1
    if gdata > 1 and en.max_concurrent_decodes % gdata == 0 and en.num_pages is not None:
        _require(en.num_pages % gdata == 0, "rollout.engine.num_pages",
                 f"{en.num_pages} pages do not split over the generator's {gdata} data replicas (each owns an "
                 f"equal range of the KV pool): use a multiple of {gdata}")
    tshape = resolve_shape(m.trainer.shape, len(trn), "mesh.trainer.shape")
    for role, shape in (("generator", gshape), ("trainer", tshape)):
        names = getattr(m, role).axis_names
        if "expert" in names and shape[names.index("expert")] > 1:
            ep = shape[names.index("expert")]
            experts = _num_experts(cfg)
            _require(experts > 0, f"mesh.{role}.axis_names",
                     "an 'expert' axis of size > 1 needs a mixture-of-experts model (qwen3_moe, num_experts > 0)")
            _require(experts % ep == 0, f"mesh.{role}.shape",
                     f"the expert axis ({ep} shards) must divide the model's {experts} experts")
    if "context" in m.trainer.axis_names:
        cp = tshape[m.trainer.axis_names.index("context")]
        bad = [b for b in cfg.trainer.packing.row_len_buckets if b % cp]
        _require(not bad, "trainer.packing.row_len_buckets",
                 f"rows are split over the trainer's context axis ({cp} shards): every row length must be a "
                 f"multiple of {cp}, got {bad}")
    dp = trainer_data_parallel_size(cfg, num_devices)
    per_mb = cfg.trainer.batch_size * cfg.rollout.n_samples // cfg.trainer.ppo_n_minibatches
    _require(per_mb % dp == 0, "trainer.batch_size",
             f"a minibatch of {per_mb} sequences (batch_size {cfg.trainer.batch_size} x n_samples "
             f"{cfg.rollout.n_samples} / ppo_n_minibatches {cfg.trainer.ppo_n_minibatches}) does not split over "
             f"the trainer's {dp} data-parallel shards")


def _is_moe(cfg: RunConfig) -> bool:
    """Whether the run's model is a mixture of experts (its config.json, or the model section)."""
    return _num_experts(cfg) > 0


def _num_experts(cfg: RunConfig) -> int:
    """The run's model's number of experts (its config.json, or the model section); 0 for a dense model."""
    if cfg.model.path is not None:
        with open(os.path.join(cfg.model.path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        return int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    return int(cfg.model.model_config(vocab_size=8).num_experts or 0)
