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

# Layout: sections.py (the dataclasses), overrides.py (string -> typed value, type checks, dotted overrides),
# validation.py (combinations, the device split), files.py (config files, config.json, the command line).
from jaxrl_async.config.files import (  # noqa: F401
    format_config, from_dict, load_config_file, load_config_json, parse_command_line, peek_config, save_config,
    to_dict,
)
from jaxrl_async.config.overrides import apply_overrides, check_types, parse_value  # noqa: F401
from jaxrl_async.config.sections import (  # noqa: F401
    AdvantageConfig, ArithmeticConfig, CheckpointSection, ConfigError, DataConfig, EngineConfig, EvalConfig,
    LoggingConfig, LoraSection, MeshAxesConfig, MeshConfig, ModelConfigSection, PackingConfig, PolicyLossConfig,
    VisionSection, VisualArithmeticConfig, RolloutConfig, RunConfig, SamplingConfig, SFTConfig, TrainerConfig,
)
from jaxrl_async.config.validation import (  # noqa: F401
    resolve_shape, resolve_device_split, trainer_data_parallel_size, validate,
)
from jaxrl_async.rl.losses import BehaviourWeightConfig  # noqa: F401

__all__ = [
    "ConfigError", "LoraSection", "ModelConfigSection", "VisionSection", "VisualArithmeticConfig", "DataConfig",
    "SamplingConfig", "EngineConfig",
    "RolloutConfig", "SFTConfig", "TrainerConfig", "MeshAxesConfig", "MeshConfig", "EvalConfig", "CheckpointSection",
    "LoggingConfig", "RunConfig",
    "PolicyLossConfig", "BehaviourWeightConfig", "AdvantageConfig", "PackingConfig", "ArithmeticConfig",
    "apply_overrides", "parse_value", "check_types", "validate", "resolve_device_split", "load_config_file",
    "to_dict", "from_dict", "format_config", "save_config", "load_config_json", "parse_command_line", "peek_config",
    "trainer_data_parallel_size",
]
