"""Typed configuration sections, one module each, and `MilesConfig`, which holds one of each.

Field names are Miles' flag names with dashes turned into underscores (`--rollout-batch-size`
-> `rollout_batch_size`). Each component takes only the section it needs. The key of a section in
`SECTIONS` is its YAML section and its help group in `miles train --help` (`async_` is `async`).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from miles.config.sections.algo import AlgoConfig
from miles.config.sections.async_ import AsyncConfig
from miles.config.sections.data import DataConfig
from miles.config.sections.engine import EMBEDDED_KV_CACHE_DTYPES, EMBEDDED_MAX_RUNNING_REQUESTS, EngineConfig
from miles.config.sections.eval import EvalConfig
from miles.config.sections.logs import LoggingConfig
from miles.config.sections.model import ENGINE_DTYPES, GPU_AUTO_DTYPE, ModelConfig, engine_dtype
from miles.config.sections.reward import RewardConfig
from miles.config.sections.rollout import RolloutConfig
from miles.config.sections.runtime import RuntimeConfig
from miles.config.sections.train import TrainConfig
from miles.config.sections.weights import WeightsConfig

__all__ = [
    "EMBEDDED_KV_CACHE_DTYPES",
    "EMBEDDED_MAX_RUNNING_REQUESTS",
    "ENGINE_DTYPES",
    "GPU_AUTO_DTYPE",
    "engine_dtype",
]

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "algo": AlgoConfig,
    "train": TrainConfig,
    "weights": WeightsConfig,
    "engine": EngineConfig,
    "eval": EvalConfig,
    "async_": AsyncConfig,
    "runtime": RuntimeConfig,
    "logging": LoggingConfig,
}
# field name -> its section (names are unique across sections; `miles.config.fields` checks it)
FIELD_SECTIONS: dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
# Fields never written out (config.yaml, --dry-run, logs): the engines' API key.
SECRET_FIELDS = frozenset(f.name for cls in SECTIONS.values() for f in fields(cls) if f.metadata.get("secret"))


@dataclass
class MilesConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks (GPUs): --actor-num-nodes x --actor-num-gpus-per-node."""
        return self.train.actor_num_nodes * self.train.actor_num_gpus_per_node

    @property
    def model_parallel_size(self) -> int:
        """Trainer ranks per data-parallel replica: TP x PP x CP under megatron, 1 under FSDP."""
        t = self.train
        if t.train_backend != "megatron":
            return 1
        return t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: trainer ranks / (TP x PP x CP)."""
        return max(1, self.trainer_world_size // self.model_parallel_size)

    def dp_rank_of(self, rank: int) -> int:
        """The data-parallel replica of trainer rank `rank` in megatron-core's rank order (TP fastest,
        then CP, then DP, then PP)."""
        t = self.train
        inner = self.model_parallel_size // (t.pipeline_model_parallel_size if t.train_backend == "megatron" else 1)
        return (rank // inner) % self.dp_size

    def get(self, name: str) -> Any:
        return getattr(getattr(self, FIELD_SECTIONS[name]), name)

    def set(self, name: str, value: Any) -> None:
        setattr(getattr(self, FIELD_SECTIONS[name]), name, value)

    def flat(self) -> argparse.Namespace:
        """A snapshot with every field at top level, for plug-ins written against Miles' `args`."""
        return argparse.Namespace(**{name: self.get(name) for name in FIELD_SECTIONS})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested by section (YAML-ready; `load_config(["--config", f])` reads it back).

        Secret fields (`SECRET_FIELDS`) are written as None: a run read back from its config.yaml makes a
        fresh API key, and one given by the user must be given again.
        """
        out = {section.rstrip("_"): asdict(getattr(self, section)) for section in SECTIONS}
        for values in out.values():
            for name in SECRET_FIELDS.intersection(values):
                values[name] = None
        return out
