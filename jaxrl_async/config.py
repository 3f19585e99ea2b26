"""Run configuration: typed nested frozen dataclasses, config files, command-line overrides, validation.

A config file is a Python file that defines ``get_config() -> RunConfig`` (or a ``CONFIG`` object)::

    # configs/my_run.py
    from jaxrl_async.config import RunConfig, RolloutConfig, TrainerConfig
    def get_config():
        return RunConfig(name="my_run", rollout=RolloutConfig(max_head_offpolicyness=4),
                         trainer=TrainerConfig(batch_size=16, lr=1e-6))

Any field can then be overridden on the command line with dotted keys, converted to the field's
type (bool, int, float, str, tuples, Optional, Literal)::

    python -m jaxrl_async.main --config configs/my_run.py trainer.lr=1e-6 rollout.max_head_offpolicyness=4 \
        rollout.sampling.stop_strings='("</answer>",)' trainer.loss.behaviour_weight.upper=3 model.path=None

A wrong key, a wrong type or an impossible combination (a mesh that does not match the device
count, a batch that does not split over the data-parallel shards, η < 0, ...) raises
:class:`ConfigError` naming the field — before anything is compiled:
``config error: rollout.max_head_offpolicyness: must be >= 0, got -1``.

Sections: ``model``, ``data``, ``rollout`` (incl. ``sampling`` and ``engine``), ``trainer`` (incl. the
policy ``loss`` = ``rl.losses.PolicyLossConfig``, ``advantage`` = ``rl.advantages.AdvantageConfig``,
``packing`` = ``trainer.packing.PackingConfig``, ``sft`` warm start), ``mesh`` (generator and trainer
meshes), ``eval``, ``checkpoint``, ``logging``. The resolved config is printed and saved as
``config.json`` in the run directory (``save_config``; ``load_config_json`` reads it back).

Device split (``mesh``): with one device (or ``mesh.colocate=True``) the generator and the trainer share
the same devices and the loop time-shares them. Otherwise the generator gets
``mesh.num_generator_devices`` devices, default ``round(N · mesh.generator_fraction)`` (AReaL's 3/4),
and the trainer the rest; ``mesh.generator.devices`` / ``mesh.trainer.devices`` name devices explicitly.
A mesh shape may contain one ``-1`` (the remaining devices of its share).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import sys
import types
import typing
from typing import Any, Literal, Mapping, Sequence

from jaxrl_async.data.arithmetic import ArithmeticConfig
from jaxrl_async.rl.advantages import AdvantageConfig
from jaxrl_async.rl.losses import BehaviourWeightConfig, PolicyLossConfig
from jaxrl_async.trainer.packing import PackingConfig

__all__ = [
    "ConfigError", "ModelConfigSection", "DataConfig", "SamplingConfig", "EngineConfig", "RolloutConfig", "SFTConfig",
    "TrainerConfig", "MeshAxesConfig", "MeshConfig", "EvalConfig", "CheckpointSection", "LoggingConfig", "RunConfig",
    "PolicyLossConfig", "BehaviourWeightConfig", "AdvantageConfig", "PackingConfig", "ArithmeticConfig",
    "apply_overrides", "parse_value", "check_types", "validate", "resolve_device_split", "load_config_file",
    "to_dict", "from_dict", "format_config", "save_config", "load_config_json", "parse_command_line",
    "trainer_data_parallel_size",
]


class ConfigError(ValueError):
    """An invalid configuration; ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str):
        self.field, self.reason = field, message
        super().__init__(f"config error: {field}: {message}" if field else f"config error: {message}")


# =============================================================================================
# Sections
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class LoraSection:
    """LoRA adapters (``models/lora.py``): ``rank`` 0 trains all weights; ``rank`` > 0 freezes the base
    and trains adapters ``W + (alpha / rank) A B`` on the ``targets`` projections (q, k, v, o, gate, up,
    down), A initialised as PEFT (Kaiming-uniform), B = 0. ``base_dtype``: storage of the frozen base in
    the trainer (adapters and their Adam state are float32). ``decode``: the generator applies the
    adapters ``unmerged`` (low-rank matmuls next to the base weights, loaded once) or ``merged`` into a
    generator-side copy of the weights at every push. ``dropout``: on the adapters' input in training steps
    (PEFT's lora_dropout; 0 = off)."""

    rank: int = 0
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    dropout: float = 0.0
    base_dtype: Literal["float32", "bfloat16"] = "float32"
    decode: Literal["unmerged", "merged"] = "unmerged"
    init_seed: int = 1

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"rank: must be an int >= 0 (0: no LoRA), got {self.rank!r}")
        if self.rank > 0:
            self.spec()

    def spec(self):
        """``models.lora.LoraSpec`` (None when rank is 0); its ValueError names the field."""
        if self.rank == 0:
            return None
        from jaxrl_async.models.lora import LoraSpec

        try:
            return LoraSpec(rank=self.rank, alpha=float(self.alpha), targets=tuple(self.targets),
                            dropout=float(self.dropout), base_dtype=self.base_dtype, decode=self.decode)
        except ValueError as e:  # "ModelConfig.lora.field: ..." -> "field: ..."
            raise ValueError(str(e).removeprefix("ModelConfig.lora.")) from None


@dataclasses.dataclass(frozen=True)
class ModelConfigSection:
    """The policy. ``path``: a Hugging Face checkpoint directory (config.json + safetensors); None
    initialises the architecture below at random (vocabulary size taken from the tokenizer).

    ``tokenizer_path``: HF tokenizer directory (default: ``path``; with neither, the run builds a
    local tokenizer of kind ``data.tokenizer_kind`` in the run directory).

    ``vocab_size``: embedding rows of the random-init architecture (None: the tokenizer's size); set
    it to plan a published architecture without its checkpoint (``python -m jaxrl_async.plan``).
    """

    path: str | None = None
    tokenizer_path: str | None = None
    model_type: Literal["qwen3", "qwen2", "llama", "qwen3_moe"] = "qwen3"
    vocab_size: int | None = None
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    remat: Literal["none", "full", "minimal", "dots", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
                   "save_out_proj", "minimal_offloaded", "qkv_proj_offloaded"] = "none"  # models/remat.py
    scan_layers: bool = True
    # training/scoring/prefill attention (models/attention.py): auto = splash on TPU, gpu_flash on GPU,
    # elsewhere blockwise from 512 tokens per row (xla below)
    attention: Literal["auto", "xla", "blockwise", "splash", "gpu_flash"] = "auto"
    attention_block: int = 512
    init_seed: int = 0
    lora: LoraSection = LoraSection()
    # mixture of experts (model_type qwen3_moe, random init; a checkpoint's config.json carries its own)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def numerics(self) -> dict[str, Any]:
        return dict(dtype=self.dtype, param_dtype=self.param_dtype, remat=self.remat, scan_layers=self.scan_layers,
                    attention=self.attention, attention_block=self.attention_block)

    def model_config(self, vocab_size: int, *, bos_token_id: int | None = None, eos_token_id: Any = None,
                     pad_token_id: int | None = None):
        """``models.ModelConfig`` of the architecture (``path`` unset) or of the checkpoint."""
        from jaxrl_async.models.config import ModelConfig

        if self.path is not None:
            return ModelConfig.from_hf(self.path, **self.numerics()).replace(lora=self.lora.spec())
        return ModelConfig(lora=self.lora.spec(),
            model_type=self.model_type, vocab_size=self.vocab_size if self.vocab_size is not None else vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
            qkv_bias=self.model_type == "qwen2", qk_norm=self.model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob, **self.numerics())


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompts. ``task="arithmetic"`` generates the synthetic task (``arithmetic``) into the run
    directory; ``task="dataset"`` reads ``train_path``/``eval_path`` (JSONL/Parquet) in ``format``."""

    task: Literal["arithmetic", "dataset"] = "arithmetic"
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    train_path: str | None = None
    eval_path: str | None = None
    format: Literal["gsm8k", "math", "generic", "code"] = "gsm8k"
    max_prompt_len: int | None = 256
    apply_chat_template: bool = True
    system_prompt: str | None = None
    prompt_suffix: str = ""
    skip_bad_rows: bool = False
    shuffle: bool = True
    tokenizer_kind: Literal["arithmetic", "bpe"] = "arithmetic"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Generation sampling (``n`` and ``seed`` are set per group from ``rollout.n_samples`` and ``seed``)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()

    def params(self, *, n: int = 1, seed: int = 0, stop_token_ids: Sequence[int] = (), **overrides):
        from jaxrl_async.rollout.engine_api import SamplingParams

        kw = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                  max_new_tokens=self.max_new_tokens, stop_token_ids=tuple(int(t) for t in stop_token_ids),
                  stop_strings=self.stop_strings, seed=seed, n=n)
        kw.update(overrides)
        return SamplingParams(**kw)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The paged generation engine (``rollout.engine.PagedEngine``)."""

    max_concurrent_decodes: int = 32
    max_sequence_length: int = 512
    max_prefill_length: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    cache_memory_fraction: float = 0.9
    max_prefills_per_step: int | None = None


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Asynchronous rollout.

    * ``mode``: ``"async"`` (AReaL: generation and training overlap, bounded by η) or ``"sync"`` (the
      classic synchronous system: generate a batch, wait for the longest sequence, train; effective η = 0).
    * ``max_head_offpolicyness`` η ≥ 0: a trained group's first token is at most η versions old.
    * ``max_concurrent_rollouts``: prompt groups in flight at most (None: (η + 1) · trainer.batch_size).
    * ``n_samples``: samples per prompt (GRPO group size).
    * ``kv_update_policy``: what in-flight sequences do on a weight update (``recompute_kv`` = AReaL's
      re-prefill under the new weights; ``keep_kv`` = PipelineRL, continue on the old cache).
    * ``workflow``: ``"rlvr"`` or ``"package.module:Class"`` (a ``RolloutWorkflow`` subclass).
    * ``reward``: built-in (``math``, ``gsm8k``, ``code``) or ``"package.module:function"``.
    * ``filter_zero_signal_groups``: DAPO dynamic sampling (reject groups whose rewards are all equal).
    * ``group_timeout_s``: wall-clock cap per group (aborted and rejected, reason ``timeout``).
    """

    mode: Literal["async", "sync"] = "async"
    max_head_offpolicyness: int = 2
    max_concurrent_rollouts: int | None = None
    n_samples: int = 4
    kv_update_policy: Literal["keep_kv", "recompute_kv"] = "recompute_kv"
    sampling: SamplingConfig = SamplingConfig()
    engine: EngineConfig = EngineConfig()
    workflow: str = "rlvr"
    reward: str = "math"
    reward_workers: int = 2
    filter_zero_signal_groups: bool = False
    allow_partial_groups: bool = False
    group_timeout_s: float | None = 600.0
    max_consecutive_failures: int = 50

    @property
    def effective_max_head_offpolicyness(self) -> int:
        return 0 if self.mode == "sync" else self.max_head_offpolicyness

    def effective_max_concurrent(self, batch_size: int) -> int:
        """Sync: exactly one batch in flight. Async: the configured cap or (η + 1)·B."""
        if self.mode == "sync":
            return batch_size
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        return (self.max_head_offpolicyness + 1) * batch_size


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Optional supervised warm start before RL (on the task's gold completions); steps=0: off."""

    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The policy update. ``batch_size`` = B prompt groups per step (B · n_samples sequences);
    ``ppo_n_minibatches`` optimizer steps per batch; optimizer fields as ``trainer.optimizer.OptimizerConfig``;
    ``proximal``: ``recompute`` (AReaL default: forward with θ_k before the update), ``loglinear``."""

    batch_size: int = 8
    total_steps: int = 100
    ppo_n_minibatches: int = 1
    proximal: Literal["recompute", "loglinear"] = "recompute"
    lr: float = 1e-6
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    logprob_chunk: int = 2048
    loss: PolicyLossConfig = PolicyLossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    packing: PackingConfig = PackingConfig(tokens_per_micro=4096)
    sft: SFTConfig = SFTConfig()

    def optimizer_config(self):
        from jaxrl_async.trainer.optimizer import OptimizerConfig

        return OptimizerConfig(lr=self.lr, schedule=self.schedule, warmup_steps=self.warmup_steps,
                               total_steps=self.total_steps, min_lr_ratio=self.min_lr_ratio, b1=self.b1, b2=self.b2,
                               eps=self.eps, weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm)


@dataclasses.dataclass(frozen=True)
class MeshAxesConfig:
    """One mesh: ``shape`` (one entry may be -1), ``axis_names``, optional explicit ``devices`` (indices
    into ``jax.devices()``; None = the share given by the split)."""

    shape: tuple[int, ...] = (-1,)
    axis_names: tuple[str, ...] = ("fsdp",)
    devices: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Generator and trainer meshes (see the module docstring for the split). ``cpu_devices``: on a
    CPU-only machine, the number of simulated CPU devices (``jax_num_cpu_devices``, set by
    ``jaxrl_async.main`` before JAX starts; None: JAX's default of one). Ignored on accelerators.
    ``layout``: the named hardware layout (``jaxrl_async.layouts``: target device kind, device count)
    these fields were taken from; the run must then have exactly its device count, and
    ``jaxrl_async.plan`` budgets memory against its device kind."""

    generator: MeshAxesConfig = MeshAxesConfig(shape=(1, -1), axis_names=("data", "tensor"))
    trainer: MeshAxesConfig = MeshAxesConfig(shape=(-1,), axis_names=("fsdp",))
    generator_fraction: float = 0.75
    num_generator_devices: int | None = None
    colocate: bool = False
    cpu_devices: int | None = None
    layout: str | None = None


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: every ``every_steps`` steps (0: never) and at the start/end; greedy by default."""

    every_steps: int = 10
    at_start: bool = True
    at_end: bool = True
    max_items: int | None = None
    temperature: float = 0.0
    max_new_tokens: int | None = None  # None: rollout.sampling.max_new_tokens


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Checkpoint hooks (``checkpoint.manager``): Orbax saves of model + optimizer + loop state.

    ``every_steps`` / ``every_seconds``: periodic saves of the RL state (asynchronous: the step blocks
    only for the device-to-host copy); ``every_seconds`` also paces the saves of an SFT warm start
    (``RUN/warm_start``). A stop signal always saves. ``resume``: ``"auto"`` (resume from the run
    directory's latest checkpoint if any), ``"never"``, ``"must"`` (fail if there is none).
    ``export_hf``: write a Hugging Face export at the end.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    keep_last: int = 3
    async_save: bool = True
    save_at_end: bool = True
    resume: Literal["auto", "never", "must"] = "auto"
    export_hf: bool = True


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Console and files. ``print_config``: print the resolved config at the start (it is always
    written to ``RUN/config.json``; ``main --print-config`` prints it once)."""

    tensorboard: bool = True
    progress: bool = True
    log_every: int = 1
    print_config: bool = False


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run. ``run_dir`` None: ``runs/<name>``. ``max_wall_time_s``: stop (and save) after it."""

    name: str = "run"
    run_dir: str | None = None
    seed: int = 0
    max_wall_time_s: float | None = None
    model: ModelConfigSection = ModelConfigSection()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    mesh: MeshConfig = MeshConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingConfig = LoggingConfig()

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir if self.run_dir is not None else os.path.join("runs", self.name)


# =============================================================================================
# Types: conversion of command-line strings and checking of config-file values
# =============================================================================================
_NONE = ("none", "null")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return True, args[0] if len(args) == 1 else typing.Union[tuple(args)]
    return False, tp


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def parse_value(text: str, tp: Any, field: str = "") -> Any:
    """Convert a command-line string to the field type ``tp`` (raises ConfigError naming ``field``)."""
    optional, inner = _is_optional(tp)
    s = text.strip()
    if optional and s.lower() in _NONE:
        return None
    tp = inner
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        raise ConfigError(field, f"is a section ({tp.__name__}); set its fields, e.g. {field}.<name>=...")
    if origin is Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if s == str(c) or (isinstance(c, str) and _unquote(s) == c):
                return c
        raise ConfigError(field, f"must be one of {list(choices)}, got {s!r}")
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return parse_value(s, arg, field)
            except ConfigError as e:
                errors.append(e.reason)
        raise ConfigError(field, f"cannot parse {s!r} as {_type_name(tp)} ({'; '.join(errors)})")
    if tp is bool:
        if s.lower() in _TRUE:
            return True
        if s.lower() in _FALSE:
            return False
        raise ConfigError(field, f"expected a bool (true/false), got {s!r}")
    if tp is int:
        try:
            return int(s.replace("_", ""))
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                f = math.nan
            if math.isfinite(f) and f == int(f):
                return int(f)
            raise ConfigError(field, f"expected an int, got {s!r}") from None
    if tp is float:
        try:
            return float(s.replace("_", ""))
        except ValueError:
            raise ConfigError(field, f"expected a float, got {s!r}") from None
    if tp is str:
        return _unquote(s)
    if origin is tuple:
        args = typing.get_args(tp)
        items = _split_sequence(s, field)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(str(x), args[0], f"{field}[{i}]") for i, x in enumerate(items))
        if len(items) != len(args):
            raise ConfigError(field, f"expected {len(args)} values, got {len(items)} in {s!r}")
        return tuple(parse_value(str(x), a, f"{field}[{i}]") for i, (x, a) in enumerate(zip(items, args)))
    if origin in (dict, Mapping) or tp in (dict, Mapping) or origin is typing.Mapping:
        try:
            v = json.loads(s)
        except json.JSONDecodeError:
            try:
                v = ast.literal_eval(s)
            except (ValueError, SyntaxError):
                raise ConfigError(field, f"expected a JSON object, got {s!r}") from None
        if not isinstance(v, dict):
            raise ConfigError(field, f"expected a JSON object, got {s!r}")
        return v
    raise ConfigError(field, f"fields of type {_type_name(tp)} cannot be set from the command line")


def _unquote(s: str) -> str:
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    return s


def _split_sequence(s: str, field: str) -> list[Any]:
    """'(1, 2)', '[1,2]', '1,2', '()' or a single value → list of elements (strings or literals)."""
    if s in ("", "()", "[]"):
        return []
    if s[0] in "([":
        try:
            v = ast.literal_eval(s)
        except (ValueError, SyntaxError):
            raise ConfigError(field, f"cannot parse {s!r} as a sequence") from None
        if not isinstance(v, (tuple, list)):
            v = [v]
        return [x if isinstance(x, str) else repr(x) for x in v]
    return [p.strip() for p in s.split(",") if p.strip() != ""]


def _check_value(value: Any, tp: Any, field: str) -> None:
    """Raise ConfigError if ``value`` does not have type ``tp`` (ints are accepted for floats)."""
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return
        raise ConfigError(field, f"must not be None (type {_type_name(tp)})")
    tp = inner
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, tp):
            raise ConfigError(field, f"expected a {tp.__name__}, got {type(value).__name__}")
        check_types(value, field)
        return
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(field, f"must be one of {list(typing.get_args(tp))}, got {value!r}")
        return
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                _check_value(value, arg, field)
                return
            except ConfigError:
                pass
        raise ConfigError(field, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
    elif origin is tuple:
        if not isinstance(value, tuple):
            raise ConfigError(field, f"expected a tuple, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            for i, v in enumerate(value):
                _check_value(v, args[0], f"{field}[{i}]")
        else:
            if len(value) != len(args):
                raise ConfigError(field, f"expected {len(args)} values, got {len(value)}")
            for i, (v, a) in enumerate(zip(value, args)):
                _check_value(v, a, f"{field}[{i}]")
        return
    elif origin in (dict, Mapping) or tp in (dict, Mapping) or origin is typing.Mapping:
        ok = isinstance(value, Mapping)
    else:
        ok = True  # types we do not check (Any, callables)
    if not ok:
        raise ConfigError(field, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def check_types(cfg: Any, prefix: str = "") -> None:
    """Check every field of the dataclass tree ``cfg`` against its annotation."""
    for f in dataclasses.fields(cfg):
        _check_value(getattr(cfg, f.name), _hints(type(cfg))[f.name], f"{prefix}{f.name}" if not prefix else f"{prefix}.{f.name}")


# =============================================================================================
# Overrides
# =============================================================================================
def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError("", f"override {text!r} must look like section.field=value")
    return key.strip(), value


def _component_error(prefix: str, obj: Any, message: str) -> ConfigError:
    """A reused component config's ValueError as a ConfigError naming the full field path.

    Component messages start with ``field``, ``Class.field`` or ``sub.field`` (e.g. ``"eps_clip must
    be >= 0"``, ``"OptimizerConfig.lr: ..."``, ``"behaviour_weight.upper must be > 1"``).
    """
    head = message.split(" ", 1)[0].rstrip(":")
    parts = head.split(".")
    if len(parts) > 1 and parts[0] in (type(obj).__name__, prefix.rsplit(".", 1)[-1]):
        parts = parts[1:]
    node, ok = obj, bool(parts)
    for part in parts:
        if dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}:
            node = getattr(node, part)
        else:
            ok = False
            break
    if ok:
        rest = message[len(head):].lstrip(": ").lstrip()
        return ConfigError(".".join(filter(None, [prefix, *parts])), rest)
    return ConfigError(prefix or "<root>", message)


def _rebuild(obj: Any, changes: Mapping[str, Any], prefix: str) -> Any:
    kw = {}
    for name, change in changes.items():
        path = f"{prefix}.{name}" if prefix else name
        kw[name] = _rebuild(getattr(obj, name), change, path) if isinstance(change, dict) else change
    try:
        return dataclasses.replace(obj, **kw)
    except (ValueError, TypeError) as e:  # a reused component config validated itself
        raise _component_error(prefix, obj, str(e)) from None


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """Apply ``["a.b=1", ...]`` to the dataclass tree ``cfg`` (later overrides win).

    All changes of one section are applied in one ``dataclasses.replace`` (so a pair such as
    ``trainer.schedule=cosine trainer.total_steps=100`` is validated together).
    """
    changes: dict[str, Any] = {}
    for text in overrides:
        key, raw = _split_override(text)
        parts = key.split(".")
        obj, node = cfg, changes
        for depth, part in enumerate(parts):
            path = ".".join(parts[: depth + 1])
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(".".join(parts[:depth]), f"is not a section; cannot set {key!r}")
            names = [f.name for f in dataclasses.fields(obj)]
            if part not in names:
                close = difflib.get_close_matches(part, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; fields: {', '.join(names)}"
                raise ConfigError(path, f"unknown field{hint}")
            if depth == len(parts) - 1:
                node[part] = parse_value(raw, _hints(type(obj))[part], path)
            else:
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise ConfigError(path, "is set as a value and as a section")
                node = child
                obj = getattr(obj, part)
                if obj is None:
                    raise ConfigError(path, "is None; cannot set a field inside it")
    return _rebuild(cfg, changes, "")


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


def _resolve_shape(shape: tuple[int, ...], n: int, field: str) -> tuple[int, ...]:
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
    """Product of the trainer mesh axes that shard the batch (``data``, ``fsdp``)."""
    _, tr = resolve_device_split(cfg.mesh, num_devices)
    shape = _resolve_shape(cfg.mesh.trainer.shape, len(tr), "mesh.trainer.shape")
    return math.prod(s for s, a in zip(shape, cfg.mesh.trainer.axis_names) if a in ("data", "fsdp"))


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
    ro, tr, sa, en, ev = cfg.rollout, cfg.trainer, cfg.rollout.sampling, cfg.rollout.engine, cfg.eval
    _require(bool(cfg.name) and "/" not in cfg.name, "name", f"must be a non-empty name without '/', got {cfg.name!r}")
    _require(cfg.max_wall_time_s is None or cfg.max_wall_time_s > 0, "max_wall_time_s",
             f"must be > 0 or None, got {cfg.max_wall_time_s}")
    # rollout
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
    _require(ro.workflow == "rlvr" or ":" in ro.workflow, "rollout.workflow",
             f"must be 'rlvr' or 'package.module:Class', got {ro.workflow!r}")
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
    if cfg.data.max_prompt_len is not None:
        _require(cfg.data.max_prompt_len <= prefill, "data.max_prompt_len",
                 f"{cfg.data.max_prompt_len} exceeds the engine's max prefill length {prefill}")
    if cfg.model.path is None:
        _require(en.max_sequence_length <= cfg.model.max_position_embeddings, "rollout.engine.max_sequence_length",
                 f"{en.max_sequence_length} exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}")
    # trainer
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
        raise _component_error("trainer", tr, msg) from None
    for name, sub in (("trainer.loss", tr.loss), ("trainer.advantage", tr.advantage)):
        try:
            sub.validate()
        except ValueError as e:
            raise _component_error(name, sub, str(e)) from None
    if tr.advantage.overlong_penalty and tr.advantage.max_new_tokens is not None:
        _require(tr.advantage.max_new_tokens == sa.max_new_tokens, "trainer.advantage.max_new_tokens",
                 f"{tr.advantage.max_new_tokens} != rollout.sampling.max_new_tokens={sa.max_new_tokens}")
    # model
    _require(cfg.model.vocab_size is None or cfg.model.vocab_size >= 1, "model.vocab_size",
             f"must be >= 1 or None, got {cfg.model.vocab_size}")
    if cfg.model.path is not None:
        _require(os.path.isfile(os.path.join(cfg.model.path, "config.json")), "model.path",
                 f"{cfg.model.path!r} has no config.json")
    else:
        try:
            cfg.model.model_config(vocab_size=8)
        except ValueError as e:  # ModelConfig.<field>: ...
            msg = str(e).replace("ModelConfig.", "", 1)
            raise _component_error("model", cfg.model, msg) from None
    if cfg.model.tokenizer_path is not None:
        _require(os.path.isdir(cfg.model.tokenizer_path), "model.tokenizer_path",
                 f"{cfg.model.tokenizer_path!r} is not a directory")
    # data
    if cfg.data.task == "dataset":
        _require(cfg.data.train_path is not None, "data.train_path", "must be set when data.task='dataset'")
        for name in ("train_path", "eval_path"):
            p = getattr(cfg.data, name)
            _require(p is None or os.path.isfile(p), f"data.{name}", f"file {p!r} does not exist")
    _require(cfg.data.max_prompt_len is None or cfg.data.max_prompt_len >= 1, "data.max_prompt_len",
             f"must be >= 1 or None, got {cfg.data.max_prompt_len}")
    # eval / checkpoint / logging
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
    _require(cfg.logging.log_every >= 1, "logging.log_every", f"must be >= 1, got {cfg.logging.log_every}")
    _validate_mesh(cfg, num_devices)
    return cfg


def _validate_mesh(cfg: RunConfig, num_devices: int | None) -> None:
    m = cfg.mesh
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    _require(0 < m.generator_fraction < 1, "mesh.generator_fraction", f"must be in (0, 1), got {m.generator_fraction}")
    _require(m.cpu_devices is None or m.cpu_devices >= 1, "mesh.cpu_devices", f"must be >= 1 or None, got {m.cpu_devices}")
    if m.layout is not None:
        from jaxrl_async.layouts import LAYOUTS

        _require(m.layout in LAYOUTS, "mesh.layout", f"unknown layout {m.layout!r}; known: {', '.join(LAYOUTS)}")
        need = LAYOUTS[m.layout].num_devices
        _require(num_devices == need, "mesh.layout",
                 f"layout {m.layout!r} is for {need} devices, this process has {num_devices} (plan it on simulated "
                 f"devices with `python -m jaxrl_async.plan --config FILE`, or set mesh.layout=None and mesh shapes "
                 f"for {num_devices} devices)")
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
    allowed = {"generator": {"data", "tensor"}, "trainer": {"data", "fsdp", "tensor", "context"}}
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
    _resolve_shape(m.generator.shape, len(gen), "mesh.generator.shape")
    tshape = _resolve_shape(m.trainer.shape, len(trn), "mesh.trainer.shape")
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


# =============================================================================================
# Files, serialisation, command line
# =============================================================================================
def load_config_file(path: str | os.PathLike) -> RunConfig:
    """Execute a Python config file and return its ``get_config()`` (or ``CONFIG``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError("--config", f"file {path!r} does not exist")
    name = f"_jaxrl_async_config_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError("--config", f"{path}: {type(e).__name__}: {e}") from e
    if hasattr(module, "get_config"):
        cfg = module.get_config()
    elif hasattr(module, "CONFIG"):
        cfg = module.CONFIG
    else:
        raise ConfigError("--config", f"{path} defines neither get_config() nor CONFIG")
    if not isinstance(cfg, RunConfig):
        raise ConfigError("--config", f"{path}: expected a RunConfig, got {type(cfg).__name__}")
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict (tuples stay tuples; ``json.dumps`` writes them as lists)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Inverse of ``to_dict`` (lists become tuples); unknown keys raise ConfigError."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in data.items():
        path = f"{prefix}.{k}" if prefix else k
        if k not in names:
            raise ConfigError(path, "unknown field")
        kw[k] = _from_json(v, hints[k], path)
    try:
        return cls(**kw)
    except (ValueError, TypeError) as e:
        raise ConfigError(prefix or "<root>", f"{cls.__name__}: {e}") from None


def _from_json(v: Any, tp: Any, path: str) -> Any:
    optional, inner = _is_optional(tp)
    if v is None:
        return None
    if dataclasses.is_dataclass(inner) and isinstance(v, Mapping):
        return from_dict(inner, v, path)
    if typing.get_origin(inner) is tuple and isinstance(v, list):
        args = typing.get_args(inner)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(x, args[0], path) for x in v)
        return tuple(_from_json(x, a, path) for x, a in zip(v, args))
    if typing.get_origin(inner) in (typing.Union, types.UnionType) and isinstance(v, list):
        return tuple(v)
    return v


def format_config(cfg: Any, prefix: str = "") -> str:
    """One ``dotted.key = value`` line per leaf field."""
    lines = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(v):
            lines.append(format_config(v, key))
        else:
            lines.append(f"{key} = {v!r}")
    return "\n".join(lines)


CONFIG_FILE = "config.json"


def save_config(cfg: RunConfig, run_dir: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> str:
    """Write ``config.json`` (the resolved config, plus ``extra`` under ``"_resolved"``)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(os.fspath(run_dir), CONFIG_FILE)
    data = to_dict(cfg)
    if extra:
        data["_resolved"] = dict(extra)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
    os.replace(tmp, path)
    return path


def load_config_json(path: str | os.PathLike) -> RunConfig:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_FILE)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.pop("_resolved", None)
    return from_dict(RunConfig, data)


def parse_command_line(argv: Sequence[str], default_config: RunConfig | None = None,
                       num_devices: int | None = None) -> tuple[RunConfig, dict[str, bool]]:
    """``[--config FILE] [--print-config] [--dry-run] key=value ...`` → (validated config, flags).

    Without ``--config`` the ``default_config`` is used (``RunConfig()`` if None).
    """
    path, overrides, flags = None, [], {"print_config": False, "dry_run": False}
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError("--config", "needs a file path")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--print-config":
            flags["print_config"] = True
        elif arg == "--dry-run":
            flags["dry_run"] = True
        elif arg.startswith("-"):
            raise ConfigError("", f"unknown option {arg!r} (options: --config FILE, --print-config, --dry-run)")
        else:
            overrides.append(arg)
    cfg = load_config_file(path) if path is not None else (default_config or RunConfig())
    cfg = apply_overrides(cfg, overrides)
    return validate(cfg, num_devices), flags
