"""The configuration of a run: typed sections, their flags, and the rules that hold them together.

`load_config(argv)` reads the YAML file given with `--config` and the command line into a `MilesConfig`
(one dataclass per section), derives the values that depend on other flags and refuses, in one
`ConfigError`, every combination that cannot run. The names below are the package's public surface.
"""

from miles.config.checks import finalize
from miles.config.fields import FIELDS, ConfigError, FieldSpec, closest_flag
from miles.config.load import build_parser, load_config, parse_cli, save_config
from miles.config.ranges import NUMBER_RANGES, in_range, ranged
from miles.config.rules.batch import derive_num_rollout
from miles.config.rules.lora_sft import is_sft
from miles.config.rules.modes import NOT_IMPLEMENTED, check_modes
from miles.config.rules.opd import DEFAULT_TEACHER, parse_teacher_urls
from miles.config.rules.values import ENUM_CHOICES, engine_memory_tags
from miles.config.sections import (
    EMBEDDED_KV_CACHE_DTYPES,
    EMBEDDED_MAX_RUNNING_REQUESTS,
    FIELD_SECTIONS,
    GPU_AUTO_DTYPE,
    SECTIONS,
    AlgoConfig,
    AsyncConfig,
    DataConfig,
    EngineConfig,
    EvalConfig,
    LoggingConfig,
    MilesConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RuntimeConfig,
    TrainConfig,
    WeightsConfig,
    engine_dtype,
)

__all__ = [
    "DEFAULT_TEACHER",
    "EMBEDDED_KV_CACHE_DTYPES",
    "EMBEDDED_MAX_RUNNING_REQUESTS",
    "ENUM_CHOICES",
    "FIELDS",
    "FIELD_SECTIONS",
    "GPU_AUTO_DTYPE",
    "NOT_IMPLEMENTED",
    "NUMBER_RANGES",
    "SECTIONS",
    "AlgoConfig",
    "AsyncConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "FieldSpec",
    "LoggingConfig",
    "MilesConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RuntimeConfig",
    "TrainConfig",
    "WeightsConfig",
    "build_parser",
    "check_modes",
    "closest_flag",
    "derive_num_rollout",
    "engine_dtype",
    "engine_memory_tags",
    "finalize",
    "in_range",
    "is_sft",
    "load_config",
    "parse_cli",
    "parse_teacher_urls",
    "ranged",
    "save_config",
]
