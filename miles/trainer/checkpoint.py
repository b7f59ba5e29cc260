"""Trainer checkpoints with torch Distributed Checkpoint (DCP).

Layout of one checkpoint directory (`<save>/iter_{step:07d}`):
    model/          DCP shards of the policy (and critic) parameters and optimizer states
    rng/rank_{r}.pt RNG states of rank r (torch, CUDA, numpy, python)
    meta.json       step, LR-schedule states and the caller's extra state (e.g. data-source state)
    COMPLETE        written last (atomically), by rank 0, once every rank wrote its part: only then is
                    it a checkpoint

A directory without COMPLETE (a crash mid-save) is ignored by `latest_complete_checkpoint`.
`--max-checkpoints N` keeps the newest N complete checkpoints (`prune_checkpoints`): older complete ones
lose their marker first, then their files, so a deletion cut short never leaves a directory that looks
loadable; incomplete directories are left for inspection. A save
that fails on any rank (a full disk, say) raises `CheckpointWriteError` on every rank, naming the
directory; the partial directory is removed and never gets its marker (`checkpoint_commit.py`).
`miles train` prints that one line and exits 1.

Asynchronous saves (`--async-save`, the FSDP default) pass a `BackgroundWriter` (`checkpoint_async.py`):
this module writes meta.json and the RNG files and returns; the writer's thread writes the DCP shards
and then COMPLETE.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from miles.trainer.checkpoint_async import BackgroundWriter
from miles.trainer.checkpoint_commit import SAVE_ERRORS, raise_first, unwrapped_failure, write_error, write_marker
from miles.trainer.checkpoint_layout import (  # noqa: F401 - the layout's names, re-exported
    COMPLETE_MARKER,
    CheckpointWriteError,
    checkpoint_dir,
    complete_checkpoint_steps,
    is_complete,
    latest_complete_checkpoint,
    prune_checkpoints,
    remove_checkpoint_dir,
    resolve_load_path,
)
from miles.trainer.safe_load import SafeLoadPlanner, SafeReader

logger = logging.getLogger(__name__)


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def _model_optim_state(
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]], save_optim: bool, trainable_only: bool
) -> dict[str, Any]:
    """`trainable_only` (LoRA): frozen parameters are left out; they are the run's --hf-checkpoint."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    state: dict[str, Any] = {}
    for key, (model, optim) in models.items():
        if optim is not None and save_optim:
            msd, osd = get_state_dict(model, optim, options=options)
            state[key] = {"model": msd, "optim": osd}
        else:
            state[key] = {"model": get_state_dict(model, [], options=options)[0]}
        if trainable_only:  # a tied weight's second name (lm_head.weight) escapes ignore_frozen_params
            trains = {name for name, p in model.named_parameters() if p.requires_grad}
            state[key]["model"] = {k: v for k, v in state[key]["model"].items() if k in trains}
    return state


def save_checkpoint(
    path: str,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
    meta: dict[str, Any],
    *,
    save_optim: bool = True,
    write_model: Callable[[str], None] | None = None,
    trainable_only: bool = False,
    background: BackgroundWriter | None = None,
) -> None:
    """Collective: every rank writes its shards; rank 0 writes meta.json and then COMPLETE.

    `write_model(model_dir)` replaces the DCP save of `models` for a backend with its own sharded
    format (megatron-core's dist_checkpointing); the rest of the layout is the same.
    `trainable_only`: only parameters that train (a LoRA adapter) and their optimizer state are written.
    Any rank's write failure is shared with every rank (none is left waiting in a barrier), and all
    raise the same CheckpointWriteError. `background`: the shards and COMPLETE are written by that writer's
    thread, after this returns (see the module doc).
    """
    if background is not None:
        background.wait()  # at most one save in flight; the previous one's failure is raised here
        background.ensure_group()
    rank = dist.get_rank()
    error = None
    try:
        if rank == 0:
            remove_checkpoint_dir(path)  # a stale or partial save of the same step (a link: only the link)
            os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    except SAVE_ERRORS as e:  # shared with every rank below
        error = write_error(path, e)
    raise_first(path, error)  # nothing to write into: every rank stops here
    try:
        if write_model is not None:
            write_model(os.path.join(path, "model"))
        else:
            state = _model_optim_state(models, save_optim, trainable_only)
            if background is None:
                dcp.save(state, checkpoint_id=os.path.join(path, "model"))
        torch.save(_rng_state(), os.path.join(path, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            _write_json(
                os.path.join(path, "meta.json"), {**meta, "has_optim": save_optim, "trainable_only": trainable_only}
            )
        if background is not None:
            background.stage(path, state)
    except SAVE_ERRORS as e:  # shared with every rank below
        error = write_error(path, e)
    raise_first(path, error)  # every rank's shards and RNG file exist before the marker
    if background is not None:  # every rank staged its snapshot: the threads' collectives all take place
        background.launch()
        logger.info("writing checkpoint %s in the background", path)
        return
    try:
        if rank == 0:
            write_marker(path)
    except SAVE_ERRORS as e:  # shared with every rank below
        error = write_error(path, e)
    raise_first(path, error)
    logger.info("saved checkpoint %s", path)


def load_checkpoint(
    path: str,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
    *,
    read_model: Callable[[str, bool], None] | None = None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Collective: restore model/optimizer shards and this rank's RNG; returns meta.json.

    `read_model(model_dir, has_optim)` replaces the DCP load of `models` (see `save_checkpoint`).
    `trainable_only` (LoRA): only the parameters that train are read; the frozen ones keep the
    values the model was built with (its --hf-checkpoint)."""
    if not is_complete(path):
        raise FileNotFoundError(
            f"checkpoint {path!r} has no {COMPLETE_MARKER} marker (missing or interrupted save); "
            "point --load at a complete iter_* directory or at the save root for the latest complete one"
        )
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if bool(meta.get("trainable_only", False)) != trainable_only:
        saved = "only trainable parameters (a LoRA adapter)" if meta.get("trainable_only") else "every parameter"
        raise ValueError(f"checkpoint {path!r} holds {saved}; resume it with the --lora-rank it was saved with")
    model_dir = os.path.join(path, "model")
    if read_model is not None:
        read_model(model_dir, meta.get("has_optim", True))
    else:
        try:
            _load_dcp(model_dir, models, meta.get("has_optim", True), trainable_only)
        except CheckpointException as e:  # a BaseException: made an error the worker reports, not one it dies of
            cause = unwrapped_failure(next(iter(e.failures.values()))) if e.failures else e
            reason = " ".join(str(cause).split())
            raise RuntimeError(f"reading checkpoint {path} failed: {type(cause).__name__}: {reason}") from None
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        logger.warning(
            "no RNG state for rank %d in %s (different world size?); RNG not restored", dist.get_rank(), path
        )
    dist.barrier()
    logger.info("loaded checkpoint %s", path)
    return meta


def _load_dcp(
    model_dir: str,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
    has_optim: bool,
    trainable_only: bool,
) -> None:
    state = _model_optim_state(models, has_optim, trainable_only)
    # read without unpickling arbitrary objects (safe_load.py)
    dcp.load(state, storage_reader=SafeReader(model_dir), planner=SafeLoadPlanner())
    options = StateDictOptions(strict=not trainable_only)  # LoRA: the frozen base is absent by design
    for key, (model, optim) in models.items():
        if "optim" in state[key]:
            set_state_dict(
                model,
                optim,
                model_state_dict=state[key]["model"],
                optim_state_dict=state[key]["optim"],
                options=options,
            )
        else:
            set_state_dict(model, [], model_state_dict=state[key]["model"], optim_state_dict={}, options=options)


def _write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
