"""Checkpoints of the megatron backend: the shared layout (`checkpoint.py`) with `model/` written by
megatron-core's `dist_checkpointing`.

`model/` holds the actor's sharded state dict and, unless `--no-save-optim`, its distributed optimizer's
(`OPTIMIZER_CHECKPOINT_FORMAT`); rng/, meta.json and COMPLETE are written and read by `checkpoint.py`,
so a save that fails on any rank raises `CheckpointWriteError` on every rank, as FSDP's does. Saves are
synchronous (--async-save is refused for megatron). Collective: every rank calls these.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallel

from miles.trainer import checkpoint as ckpt

# megatron-core 0.19's default optimizer format ("fully_sharded_model_space") writes ShardedTensors
# with a flattened_range that its torch_dist save strategy refuses; "dp_reshardable" writes each
# buffer whole (resharding across DP only), for save and load alike
OPTIMIZER_CHECKPOINT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def sharded_state(actor: DistributedDataParallel, optimizer: Any, *, with_optim: bool, is_loading: bool) -> dict:
    """The state `dist_checkpointing` saves or loads: the actor's model and, `with_optim`, its optimizer."""
    model_sd = actor.module.sharded_state_dict()
    state = {"model": model_sd}
    if with_optim:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=OPTIMIZER_CHECKPOINT_FORMAT
        )
    return state


def save_megatron_checkpoint(
    path: str, actor: DistributedDataParallel, optimizer: Any, meta: dict[str, Any], *, save_optim: bool
) -> None:
    """The checkpoint at `path` (`iter_*`): `meta` into meta.json, the sharded state into `model/`."""

    def write_model(model_dir: str) -> None:
        os.makedirs(model_dir, exist_ok=True)
        dist_checkpointing.save(sharded_state(actor, optimizer, with_optim=save_optim, is_loading=False), model_dir)

    ckpt.save_checkpoint(path, {}, meta, save_optim=save_optim, write_model=write_model)


def load_megatron_checkpoint(path: str, actor: DistributedDataParallel, optimizer: Any) -> dict[str, Any]:
    """The checkpoint at `path` (an `iter_*` directory, or the latest complete one under a save root) into
    `actor` and `optimizer` (when it holds optimizer state); its meta.json."""
    resolved = ckpt.resolve_load_path(path)
    if resolved is None:
        raise FileNotFoundError(f"no complete checkpoint under {path!r} (looked for iter_*/{ckpt.COMPLETE_MARKER})")

    @torch.no_grad()  # the optimizer's main parameters are the fp32 model parameters, leaves that need grad
    def read_model(model_dir: str, has_optim: bool) -> None:
        state = dist_checkpointing.load(
            sharded_state(actor, optimizer, with_optim=has_optim, is_loading=True), model_dir
        )
        actor.module.load_state_dict(state["model"], strict=False)
        if has_optim:
            optimizer.load_state_dict(state["optimizer"])

    return ckpt.load_checkpoint(resolved, {}, read_model=read_model)
