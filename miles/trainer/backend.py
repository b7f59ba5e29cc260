"""Trainer backend protocol and the registry keyed by `--train-backend`.

The trainer worker process initialises torch.distributed and then drives one backend through
this protocol; every method is called on every rank (the collective ones in the same order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from miles.config_sections import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig
from miles.rollout.train_data import TrainBatch

logger = logging.getLogger(__name__)


@runtime_checkable
class TrainBackend(Protocol):
    weight_version: int  # bumped by the caller after each weight push

    def setup(self) -> None:
        """Load the HF dir (model.hf_checkpoint), build optimizer + LR schedule (+ ref / critic when needed)."""

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> tuple[np.ndarray, np.ndarray]:
        """Per-token log-probs and entropy of the response tokens (float32 [sum(response_lengths)])."""

    def train(self, batch: TrainBatch, rollout_id: int) -> dict[str, float]:
        """One RL step on this rank's shard: num_steps_per_rollout optimizer steps; returns metrics."""

    def named_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: full tensors with HF names, same order on every rank."""

    def save(self, path: str, extra_state: dict) -> None: ...

    def load(self, path: str) -> dict: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def export_hf(self, path: str) -> None: ...


_REGISTRY: dict[str, type] = {}
_BUILTIN_MODULES = {"fsdp": "miles.trainer.fsdp"}
T = TypeVar("T", bound=type)


def register_backend(name: str) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"train backend {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return deco


def available_backends() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def create_backend(
    name: str, *, model: ModelConfig, train: TrainConfig, algo: AlgoConfig, rollout: RolloutConfig
) -> TrainBackend:
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        import importlib

        importlib.import_module(_BUILTIN_MODULES[name])  # registers itself on import
    if name not in _REGISTRY:
        raise ValueError(f"--train-backend={name!r} is not registered; available: {available_backends()}")
    return _REGISTRY[name](model=model, train=train, algo=algo, rollout=rollout)
