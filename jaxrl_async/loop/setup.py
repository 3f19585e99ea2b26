"""The run's setup, before any role starts: devices and meshes, tokenizer and data, the model and its
initial parameters. ``RunSetup`` is everything the services and the loop need from it (one object,
built in this order by ``RLRun.setup``; nothing else reads half-built state)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any, Callable

import jax

from jaxrl_async.config import ConfigError, RunConfig, resolve_device_split
from jaxrl_async.config import resolve_shape

log = logging.getLogger("jaxrl_async")

__all__ = ["Placement", "RunSetup", "build_workflow", "local_placement", "load_tokenizer_and_data", "load_model",
           "sft_examples", "image_processor", "is_vl_run"]


@dataclasses.dataclass
class Placement:
    """Where the roles run in this process: the trainer mesh, and the generator mesh when the generator
    is local (None when it runs in other processes)."""

    trainer_mesh: Any
    gen_mesh: Any = None
    gen_ids: tuple[int, ...] = ()
    trainer_ids: tuple[int, ...] = ()
    colocated: bool = False


@dataclasses.dataclass
class RunSetup:
    cfg: RunConfig
    run_dir: str
    placement: Placement
    tokenizer: Any
    tokenizer_dir: str
    train_ds: Any
    eval_records: list
    model_cfg: Any
    init_params: Any  # host arrays, or on the trainer's shardings when read from model.path; freed once used
    base_ref: dict | None  # LoRA on an unchanged model.path: checkpoints hold the adapters and refer to it
    eos_ids: list[int]

    @property
    def trainer_mesh(self) -> Any:
        return self.placement.trainer_mesh

    @property
    def gen_mesh(self) -> Any:
        return self.placement.gen_mesh


def local_placement(cfg: RunConfig, say: Callable[[str], None]) -> Placement:
    """Both meshes on this process's devices (``mesh.*``; colocated when they share devices)."""
    from jaxrl_async.sharding.mesh import make_mesh

    m = cfg.mesh
    devs = jax.devices()
    gen_ids, trainer_ids = resolve_device_split(m, len(devs))
    colocated = set(gen_ids) & set(trainer_ids) != set()
    g_shape = resolve_shape(m.generator.shape, len(gen_ids), "mesh.generator.shape")
    t_shape = resolve_shape(m.trainer.shape, len(trainer_ids), "mesh.trainer.shape")
    gen_mesh = make_mesh(g_shape, m.generator.axis_names, devices=[devs[i] for i in gen_ids])
    trainer_mesh = make_mesh(t_shape, m.trainer.axis_names, devices=[devs[i] for i in trainer_ids])
    say(f"devices: {len(devs)} x {devs[0].platform}; generator mesh {dict(gen_mesh.shape)} on {list(gen_ids)}, "
        f"trainer mesh {dict(trainer_mesh.shape)} on {list(trainer_ids)}" + (" (colocated: time-shared)" if colocated else ""))
    return Placement(trainer_mesh, gen_mesh, tuple(gen_ids), tuple(trainer_ids), colocated)


def attention_choice(cfg: RunConfig, model_cfg: Any, trainer_mesh: Any) -> dict[str, str]:
    """What ``model.attention`` resolves to on the trainer's platform, per packing row bucket (logged and
    recorded in ``config.json``)."""
    from jaxrl_async.kernels.attention import resolve_attention

    platform = trainer_mesh.devices.flat[0].platform
    impl = model_cfg.attention
    choice = {str(T): resolve_attention(impl, T, platform) for T in cfg.trainer.packing.row_len_buckets}
    log.info(f"attention: model.attention={impl} on {platform}: "
             + ", ".join(f"{name} for {T}-token rows" for T, name in choice.items()))
    return choice


def load_tokenizer_and_data(cfg: RunConfig, run_dir: str, say: Callable[[str], None]) -> tuple[Any, str, Any, list]:
    """(tokenizer, its directory, train dataset, held-out records)."""
    from transformers import AutoTokenizer

    from jaxrl_async.data.tokenizer import chat_template_wanted, has_tokenizer_files
    from jaxrl_async.data import build_tokenizer, load_prompt_dataset, write_arithmetic_dataset
    from jaxrl_async.data.recipe import run_recipe

    c = cfg
    tok_dir = c.model.tokenizer_path or c.model.path
    if tok_dir is None:
        tok_dir = os.path.join(run_dir, "tokenizer_src")
        if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
            build_tokenizer(tok_dir, kind=c.data.tokenizer_kind)
    if not has_tokenizer_files(tok_dir):  # AutoTokenizer would invent an empty one (EOS id 0)
        field = "model.tokenizer_path" if c.model.tokenizer_path else "model.path"
        raise ConfigError(field, f"{tok_dir} has no tokenizer files (tokenizer.json / tokenizer_config.json / "
                                 "vocabulary); set model.tokenizer_path to a directory that has them")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    # as generate / evaluate / score: a tokenizer without a chat template means raw text, with a one-line note
    templated = chat_template_wanted("main", tokenizer, tok_dir, c.data.apply_chat_template)
    if c.data.task == "arithmetic":
        paths = write_arithmetic_dataset(os.path.join(run_dir, "data"), c.data.arithmetic)
        train_path, eval_path = paths["train"], paths["eval"]
    elif c.data.task == "visual_arithmetic":
        from jaxrl_async.data.visual_arithmetic import write_visual_arithmetic_dataset

        paths = write_visual_arithmetic_dataset(os.path.join(run_dir, "data"), c.data.arithmetic, c.data.visual)
        train_path, eval_path = paths["train"], paths["eval"]
    else:
        train_path, eval_path = c.data.train_path, c.data.eval_path
    # the run's prompt recipe (data/recipe.py): what its exports record, so `evaluate` on them prompts the same way
    recipe = run_recipe(c).prompt
    common = dict(apply_chat_template=templated, skip_bad_rows=c.data.skip_bad_rows)
    processor = image_processor(c)
    if processor is not None and tok_dir == os.path.join(run_dir, "tokenizer_src"):
        # the run's own tokenizer: its image processor settings travel with it (checkpoints, exports)
        import json

        with open(os.path.join(tok_dir, "preprocessor_config.json"), "w") as f:
            json.dump(processor.to_hf(), f, indent=2)
    if processor is not None:  # a vision-language policy: rows may carry images (data/images.py)
        from jaxrl_async.data.images import load_vl_prompt_dataset, vl_tokens_of

        vl_tokens = vl_tokens_of(tokenizer)
        load_prompt_dataset = lambda dc, tok: load_vl_prompt_dataset(dc, tok, processor, vl_tokens)  # noqa: E731
        say(f"images: {processor.min_pixels}..{processor.max_pixels} pixels, patch {processor.patch_size}, "
            f"merge {processor.merge_size}")
    train_ds = load_prompt_dataset(recipe.dataset_config(train_path, **common), tokenizer)
    if len(train_ds) == 0:
        st = train_ds.stats
        if st.too_long:
            raise ConfigError("data.max_prompt_len", f"all {st.too_long} prompts of {train_path} are longer than "
                              f"{c.data.max_prompt_len} tokens (the longest has {st.max_prompt_tokens}); raise "
                              "data.max_prompt_len and rollout.engine.max_prefill_length / max_sequence_length")
        raise ConfigError("data.train_path", f"{train_path} has no usable prompt ({st.rows_read} rows read, "
                                             f"{st.bad_rows} bad)")
    eval_records: list = []
    if eval_path is not None:
        eval_records = load_prompt_dataset(recipe.dataset_config(eval_path, **common), tokenizer).records
        if c.eval.max_items is not None:
            eval_records = eval_records[: c.eval.max_items]
    say(f"data: {len(train_ds)} train prompts ({train_path}), {len(eval_records)} held-out")
    return tokenizer, tok_dir, train_ds, eval_records


def is_vl_run(cfg: RunConfig) -> bool:
    """The policy is a vision-language model (``ModelConfigSection.is_vision_language``)."""
    return cfg.model.is_vision_language()


def image_processor(cfg: RunConfig) -> Any:
    """The run's image processor (``data.image_*_pixels``, the checkpoint's ``preprocessor_config.json``, or
    Qwen2.5-VL's defaults scaled to the tower's patch), or None when the policy is text-only."""
    if not is_vl_run(cfg):
        return None
    from jaxrl_async.data.images import image_processor_for

    d, kw = cfg.data, {}
    if d.image_min_pixels is not None:
        kw["min_pixels"] = d.image_min_pixels
    if d.image_max_pixels is not None:
        kw["max_pixels"] = d.image_max_pixels
    if cfg.model.path is not None:
        from jaxrl_async.models.hf_io import config_from_hf

        return image_processor_for(config_from_hf(cfg.model.path).vision, cfg.model.path, **kw)
    return image_processor_for(cfg.model.vision, **kw)


def load_model(cfg: RunConfig, tokenizer: Any, trainer_mesh: Any) -> tuple[Any, Any, dict | None, list[int]]:
    """(model config, initial parameters, LoRA base reference, EOS ids)."""
    from jaxrl_async.data.tokenizer import stop_token_ids
    from jaxrl_async.checkpoint.lora_base import base_reference
    from jaxrl_async.loop.state import initial_params

    c, tok = cfg, tokenizer
    if c.model.path is not None:
        model_cfg, params = initial_params(c, mesh=trainer_mesh)
    else:
        vl_ids = None
        if c.model.model_type == "qwen2_5_vl":
            from jaxrl_async.data.images import vl_token_ids

            vl_ids = vl_token_ids(tok)
        model_cfg = c.model.model_config(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, vision_token_ids=vl_ids)
        _, params = initial_params(c, model_cfg)
    if model_cfg.vocab_size < len(tok):
        raise ValueError(f"model.path: vocabulary {model_cfg.vocab_size} is smaller than the tokenizer's {len(tok)}")
    eos_ids = stop_token_ids(model_cfg, tok, model_dir=c.model.path)
    if not eos_ids:
        raise ValueError("model/tokenizer define no EOS token: generation could never stop before max_new_tokens")
    return model_cfg, params, base_reference(c, model_cfg), eos_ids


def dry_run_model_config(cfg: RunConfig) -> Any:
    """The run's model config without loading anything but ``config.json`` (for ``--dry-run``'s estimates): the
    checkpoint's at ``model.path``, else the random-init architecture with ``model.vocab_size`` (or the size of the
    local tokenizer's vocabulary order, 512, when the run builds its own tokenizer)."""
    return cfg.model.model_config(cfg.model.vocab_size or 512)


def sft_examples(setup: RunSetup) -> list[Any]:
    """The warm start's examples: every train prompt with its gold completion (+ EOS)."""
    from jaxrl_async.trainer.sft import SFTExample

    tok, ex = setup.tokenizer, []
    for r in setup.train_ds.records:
        comp = (r.metadata or {}).get("completion")
        if comp is None:
            raise ValueError(f"trainer.sft.steps > 0 needs gold completions: row {r.metadata.get('source')} of the "
                             "train data has no 'completion' column")
        ids = tok.encode(comp + (tok.eos_token or ""), add_special_tokens=False)
        images = r.image_inputs() if hasattr(r, "image_inputs") else None  # a VL prompt's images
        ex.append(SFTExample(prompt_ids=list(r.prompt_ids), completion_ids=ids, images=images))
    return ex


def build_workflow(spec: str, reward_fn: Any, tokenizer: Any, rollout: Any = None, eos_ids: Any = (),
                   say: Any = None, system_prompt: str | None = None) -> Any:
    """``rollout.workflow``: ``rlvr``, ``openai_agent`` (``rollout.agent*`` from ``rollout``, the config section) or
    ``module:Class`` (a ``RolloutWorkflow`` subclass, given the tokenizer and the reward function when its
    constructor takes them)."""
    from jaxrl_async.rollout.workflow import RLVRWorkflow, workflow_class

    if spec == "rlvr":
        return RLVRWorkflow(reward_fn, tokenizer)
    if spec == "openai_agent":
        from jaxrl_async.rollout.openai_agent import OpenAIAgentWorkflow

        ro = rollout
        return OpenAIAgentWorkflow(ro.agent, tokenizer, reward_fn, samples=ro.agent_samples,
                                   turn_discount=ro.agent_turn_discount, host=ro.agent_host, port=ro.agent_port,
                                   api_key=ro.agent_api_key, eos_ids=eos_ids, say=say,
                                   default_max_tokens=ro.sampling.max_new_tokens, system_prompt=system_prompt)
    try:
        cls = workflow_class(spec)
    except ValueError as e:
        raise ValueError(f"rollout.workflow: {e}") from e
    params = inspect.signature(cls).parameters
    kw = {k: v for k, v in (("tokenizer", tokenizer), ("reward_fn", reward_fn)) if k in params}
    return cls(**kw)
