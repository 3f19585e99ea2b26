"""The run configuration's sections: typed, nested, frozen dataclasses (see ``jaxrl_async.config``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, Sequence

from jaxrl_async.data.arithmetic import ArithmeticConfig
from jaxrl_async.data.visual_arithmetic import VisualArithmeticConfig
from jaxrl_async.generator.factory import EngineConfig
from jaxrl_async.rl.advantages import AdvantageConfig
from jaxrl_async.rl.losses import PolicyLossConfig
from jaxrl_async.trainer.packing import PackingConfig


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
class VisionSection:
    """The vision tower of a random-init ``model_type="qwen2_5_vl"`` policy (``models.vision.VisionConfig``'s fields
    by name; ``out_hidden_size`` is the language model's ``hidden_size``). Defaults: a tiny tower for CPU runs
    (4-pixel patches, 2 x 2 merging, windows of 2 x 2 merge units, block 1 attending to the whole image). A
    checkpoint (``model.path``) carries its own."""

    depth: int = 2
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2
    patch_size: int = 4
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 16
    fullatt_block_indexes: tuple[int, ...] = (1,)

    def vision_config(self, out_hidden_size: int):
        from jaxrl_async.models.vision import VisionConfig

        return VisionConfig(**dataclasses.asdict(self), out_hidden_size=out_hidden_size)


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
    # qwen2_5_vl: a vision-language policy (Qwen2.5-VL: a qwen2 decoder with M-RoPE + the tower of `vision`)
    model_type: Literal["qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_5_vl"] = "qwen3"
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
    # training/scoring/prefill attention (kernels/attention.py): auto = splash on TPU, gpu_flash on GPU,
    # elsewhere blockwise from 512 tokens per row (xla below)
    attention: Literal["auto", "xla", "blockwise", "splash", "gpu_flash"] = "auto"
    attention_block: int = 512
    # grouped matmul of mixture-of-experts layers (models/moe.py): auto = megablox on TPU, tiled on GPU,
    # elsewhere ragged (jax.lax.ragged_dot)
    moe_kernel: Literal["auto", "ragged", "tiled", "megablox"] = "auto"
    init_seed: int = 0
    lora: LoraSection = LoraSection()
    # mixture of experts (model_type qwen3_moe, random init; a checkpoint's config.json carries its own)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # qwen2_5_vl (random init): M-RoPE's temporal/height/width frequency sections (() = head_dim/2 split as
    # Qwen2.5-VL's 16/24/24 of 64) and the vision tower
    mrope_section: tuple[int, ...] = ()
    vision: VisionSection = VisionSection()

    def is_vision_language(self) -> bool:
        """The policy is a vision-language model: ``model_type=qwen2_5_vl`` at random init, or a Qwen2.5-VL
        checkpoint at ``path`` (its ``config.json``'s ``model_type``; False when it cannot be read: loading the model,
        or validation's ``model.path`` rule, names that problem)."""
        if self.path is None:
            return self.model_type == "qwen2_5_vl"
        import json

        try:
            with open(os.path.join(self.path, "config.json")) as f:
                return json.load(f).get("model_type") == "qwen2_5_vl"
        except (OSError, ValueError):
            return False

    def numerics(self) -> dict[str, Any]:
        return dict(dtype=self.dtype, param_dtype=self.param_dtype, remat=self.remat, scan_layers=self.scan_layers,
                    attention=self.attention, attention_block=self.attention_block, moe_kernel=self.moe_kernel)

    def model_config(self, vocab_size: int, *, bos_token_id: int | None = None, eos_token_id: Any = None,
                     pad_token_id: int | None = None, vision_token_ids: dict[str, int] | None = None):
        """``models.ModelConfig`` of the architecture (``path`` unset) or of the checkpoint; a
        ``qwen2_5_vl.VLConfig`` for Qwen2.5-VL (random init: ``vision_token_ids``, the tokenizer's ids of
        ``image_token_id`` / ``video_token_id`` / ``vision_start_token_id`` / ``vision_end_token_id``)."""
        from jaxrl_async.models.config import ModelConfig

        if self.path is not None:
            from jaxrl_async.models.hf_io import config_from_hf

            return config_from_hf(self.path, **self.numerics()).replace(lora=self.lora.spec())
        # the section's architecture fields ARE ModelConfig's (same names, checked by tests/config/test_rules.py);
        # what the section does not carry follows from the model type and the tokenizer
        shared = {f.name for f in dataclasses.fields(ModelConfig)} & {f.name for f in dataclasses.fields(self)}
        kw = {name: getattr(self, name) for name in shared}
        kw.update(lora=self.lora.spec(), vocab_size=self.vocab_size if self.vocab_size is not None else vocab_size,
                  qkv_bias=self.model_type in ("qwen2", "qwen2_5_vl"), qk_norm=self.model_type in ("qwen3", "qwen3_moe"),
                  bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        if self.model_type != "qwen2_5_vl":
            return ModelConfig(**kw)
        from jaxrl_async.models.qwen2_5_vl import VLConfig

        half = self.head_dim // 2
        section = self.mrope_section or (half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8)
        text = ModelConfig(**dict(kw, model_type="qwen2", mrope_section=tuple(section)))
        if not vision_token_ids:
            raise ValueError("model.model_type=qwen2_5_vl: the tokenizer has no vision tokens (<|image_pad|>, "
                             "<|vision_start|>, ...); use data.tokenizer_kind=arithmetic_vl or a Qwen2.5-VL tokenizer")
        return VLConfig(text=text, vision=self.vision.vision_config(self.hidden_size), **vision_token_ids)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompts. ``task="arithmetic"`` generates the synthetic task (``arithmetic``) into the run
    directory; ``task="visual_arithmetic"`` the same problems shown as images (``visual_arithmetic``: a
    vision-language policy has to read them); ``task="dataset"`` reads ``train_path``/``eval_path``
    (JSONL/Parquet) in ``format`` (rows with an ``images`` column need a vision-language policy: data/images.py).

    ``image_min_pixels`` / ``image_max_pixels``: the image processor's resize bounds (None: the checkpoint's
    ``preprocessor_config.json``, else Qwen2.5-VL's defaults scaled to the tower's patch: 4 and 1280 merge units)."""

    task: Literal["arithmetic", "dataset", "visual_arithmetic"] = "arithmetic"
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    visual: VisualArithmeticConfig = VisualArithmeticConfig()
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    train_path: str | None = None
    eval_path: str | None = None
    format: Literal["gsm8k", "math", "generic", "code"] = "gsm8k"
    max_prompt_len: int | None = 256
    apply_chat_template: bool = True
    system_prompt: str | None = None
    prompt_suffix: str = ""
    skip_bad_rows: bool = False
    shuffle: bool = True
    tokenizer_kind: Literal["arithmetic", "bpe", "arithmetic_vl"] = "arithmetic"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Generation sampling (``n`` and ``seed`` are set per group from ``rollout.n_samples`` and ``seed``)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()

    def params(self, *, n: int = 1, seed: int = 0, stop_token_ids: Sequence[int] = (), **overrides):
        from jaxrl_async.generator.engine_api import SamplingParams

        kw = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                  max_new_tokens=self.max_new_tokens, stop_token_ids=tuple(int(t) for t in stop_token_ids),
                  stop_strings=self.stop_strings, seed=seed, n=n)
        kw.update(overrides)
        return SamplingParams(**kw)


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
    * ``workflow``: ``"rlvr"``, ``"openai_agent"`` (agents written with any OpenAI client, ``rollout/openai_agent.py``)
      or ``"package.module:Class"`` (a ``RolloutWorkflow`` subclass).
    * ``agent`` (``openai_agent``): ``"package.module:function"``, ``fn(client, row)`` with an OpenAI client of the
      run's agent endpoint, or ``"online"`` (agents in other processes claim episodes over HTTP).
    * ``agent_samples``: ``"per_turn"`` (one sample per model call, reward discounted back by
      ``agent_turn_discount``) or ``"stitched"`` (one per conversation where the calls' tokens extend each other).
    * ``agent_host`` / ``agent_port`` / ``agent_api_key``: the agent endpoint's address (port 0: any free port) and
      key (default: a random one; a non-loopback host needs one).
    * ``reward``: built-in (``math``, ``gsm8k``, ``code``) or ``"package.module:function"``.
    * ``filter_zero_signal_groups``: DAPO dynamic sampling (reject groups whose rewards are all equal).
    * ``group_timeout_s``: wall-clock cap per group (aborted and rejected, reason ``timeout``).
    * ``record_routing``: (MoE models) the generator records the experts every token was routed to in each
      layer; they travel with the trajectory to the trainer (``trainer.routing_replay``, router metrics).
    """

    mode: Literal["async", "sync"] = "async"
    max_head_offpolicyness: int = 2
    max_concurrent_rollouts: int | None = None
    n_samples: int = 4
    kv_update_policy: Literal["keep_kv", "recompute_kv"] = "recompute_kv"
    sampling: SamplingConfig = SamplingConfig()
    engine: EngineConfig = EngineConfig()
    workflow: str = "rlvr"
    agent: str | None = None
    agent_samples: Literal["per_turn", "stitched"] = "per_turn"
    agent_turn_discount: float = 1.0
    agent_host: str = "127.0.0.1"
    agent_port: int = 0
    agent_api_key: str | None = None
    reward: str = "math"
    reward_workers: int = 2
    filter_zero_signal_groups: bool = False
    allow_partial_groups: bool = False
    group_timeout_s: float | None = 600.0
    max_consecutive_failures: int = 50
    record_routing: bool = False

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
    ``proximal``: ``recompute`` (AReaL default: forward with θ_k before the update), ``loglinear``.
    MoE: ``routing_replay`` (rollout routing replay, R3: the trainer routes every token to the experts the
    generator recorded, ``rollout.record_routing``); ``router_aux_loss_coef`` (load-balancing loss weight;
    None: the model's HF ``router_aux_loss_coef``). Vision-language policies (Qwen2.5-VL): ``freeze_vision``
    keeps the vision tower fixed (no gradient, optimizer state or update; false, the default, trains it with the
    decoder, as veRL and AReaL do)."""

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
    routing_replay: bool = False
    router_aux_loss_coef: float | None = None
    freeze_vision: bool = False
    loss: PolicyLossConfig = PolicyLossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    packing: PackingConfig = PackingConfig(tokens_per_micro=4096)
    sft: SFTConfig = SFTConfig()

    def optimizer_config(self):
        """``trainer.optimizer.OptimizerConfig`` of this section: the fields of the same names (the section is
        flat, as users write ``trainer.lr``; tests/config/test_rules.py checks the names), the schedule stepped
        once per RL step (``updates_per_step`` = ``ppo_n_minibatches``)."""
        from jaxrl_async.trainer.optimizer import OptimizerConfig

        shared = {f.name for f in dataclasses.fields(OptimizerConfig)} & {f.name for f in dataclasses.fields(self)}
        return OptimizerConfig(**{name: getattr(self, name) for name in shared},
                               updates_per_step=self.ppo_n_minibatches)


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
    ``jaxrl_async.cli.main`` before JAX starts; None: JAX's default of one). Ignored on accelerators.
    ``layout``: the named hardware layout (``jaxrl_async.config.layouts``: target device kind, device count)
    these fields were taken from; the run must then have exactly its device count, and
    ``jaxrl_async.plan.planner`` budgets memory against its device kind. ``"auto"`` (and a GPU/TPU layout on a
    CPU-only machine): ``main`` fits the mesh, and the settings that belong to the machine, to the machine it
    runs on (``jaxrl_async.config.machine``)."""

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
    written to ``RUN/config.json``; ``main --print-config`` prints it once).

    Weights & Biases (``wandb``: needs ``pip install 'jaxrl_async[wandb]'``; ``loop/wandb_logger.py``): every
    scalar of ``metrics.jsonl``/TensorBoard goes to a W&B run at the same step, with the resolved config
    (``RUN/config.json``) as the run's config and its files under ``RUN/wandb/``. ``wandb_project`` None: the
    run's ``name``; ``wandb_run_name`` None: the run directory's name; ``wandb_entity`` None: W&B's default
    (``WANDB_ENTITY`` or the account's). ``wandb_mode``: ``"online"`` (needs ``wandb login`` or
    ``WANDB_API_KEY``) or ``"offline"`` (no network; upload later with ``wandb sync RUN/wandb/offline-run-*``).
    The W&B run id is kept in ``RUN/wandb_id``: a resumed run continues the same W&B run.
    """

    tensorboard: bool = True
    progress: bool = True
    log_every: int = 1
    print_config: bool = False
    wandb: bool = False
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_run_name: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"
    wandb_tags: tuple[str, ...] = ()


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
