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
import torch.distributed as dist

from miles.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig
from miles.rollout.train_data import TrainBatch

logger = logging.getLogger(__name__)


class MicroBatchLoss(Protocol):
    """The RL step's loss of one micro-batch, given the backend's outputs for it.

    `sample_idx` are the micro-batch's samples in the optimizer step's batch; `out` is the
    per-response-token log-probs (actor) or values (critic) in TrainBatch order, with grad;
    `entropy` is the per-token entropy when asked for, else None. Returns the scalar loss to
    backpropagate and its metric parts (detached scalars summed over micro-batches and ranks).
    """

    def __call__(
        self, sample_idx: list[int], out: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@runtime_checkable
class TrainBackend(Protocol):
    """What the trainer worker and the RL step (`train_loop.run_rl_step`) use of a backend.

    Reductions in the RL step run over `dp_group`: each data-parallel replica (however many
    tensor / pipeline ranks it spans) holds one shard of the batch and counts once.
    """

    weight_version: int  # bumped by the caller after each weight push
    algo: AlgoConfig
    rollout: RolloutConfig
    train_cfg: TrainConfig
    device: torch.device
    dp_size: int
    dp_group: dist.ProcessGroup | None  # None: the default (world) group

    def setup(self) -> None:
        """Load the HF dir (model.hf_checkpoint), build optimizer + LR schedule (+ ref / critic when needed)."""

    @property
    def has_ref(self) -> bool:
        """A frozen reference model exists (a KL term is on)."""

    @property
    def has_critic(self) -> bool:
        """A trainable critic exists (PPO)."""

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> tuple[np.ndarray, np.ndarray]:
        """Per-token log-probs and entropy of the response tokens (float32 [sum(response_lengths)])."""

    def compute_values(self, batch: TrainBatch) -> np.ndarray:
        """Critic values of the response tokens (float32 [sum(response_lengths)])."""

    def forward_backward(
        self, step_batch: TrainBatch, loss_fn: MicroBatchLoss, *, critic: bool, entropy: str
    ) -> dict[str, torch.Tensor]:
        """Forward and backward over the micro-batches of one optimizer step (gradients accumulate).

        `entropy` is one of forward.ENTROPY_MODES. Returns this replica's sums of the loss parts,
        the same keys on every rank of the replica.
        """

    def clip_grad_norm(self, *, critic: bool) -> float:
        """Global gradient norm over all ranks, clipping to `--clip-grad` in place (0: no clipping)."""

    def optimizer_step(self, *, critic: bool) -> None:
        """Apply the update, zero the gradients, step the LR schedule."""

    def zero_grad(self, *, critic: bool) -> None:
        """Drop the accumulated gradients without an update."""

    def current_lr(self) -> float:
        """The actor's learning rate for the next optimizer step."""

    def train(self, batch: TrainBatch, rollout_id: int) -> dict[str, float]:
        """One RL step on this rank's shard: num_steps_per_rollout optimizer steps; returns metrics."""

    def named_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: full tensors with HF names, same order on every rank."""

    def save(self, path: str, extra_state: dict) -> None: ...

    def load(self, path: str) -> dict: ...

    def finish_saves(self) -> None:
        """Collective: a checkpoint still being written in the background is complete (or its failure raised)."""

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def export_hf(self, path: str) -> None: ...

    def peak_mem_gb(self) -> float: ...

    def now(self) -> float:
        """A wall-clock reading after the device's queued work finished."""


_REGISTRY: dict[str, type] = {}
_BUILTIN_MODULES = {"fsdp": "miles.trainer.fsdp", "megatron": "miles.trainer.megatron"}
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
