"""Trainer checkpoints with torch Distributed Checkpoint (DCP).

Layout of one checkpoint directory (`<save>/iter_{step:07d}`):
    model/          DCP shards of the policy (and critic) parameters and optimizer states
    rng/rank_{r}.pt RNG states of rank r (torch, CUDA, numpy, python)
    meta.json       step, LR-schedule states and the caller's extra state (e.g. data-source state)
    COMPLETE        written last, by rank 0, after every rank finished: only then is it a checkpoint

A directory without COMPLETE (a crash mid-save) is ignored by `latest_complete_checkpoint`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def checkpoint_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"iter_{step:07d}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def latest_complete_checkpoint(save_dir: str) -> str | None:
    """The `iter_*` directory under `save_dir` with the highest step and a COMPLETE marker."""
    if not save_dir or not os.path.isdir(save_dir):
        return None
    steps = []
    for name in os.listdir(save_dir):
        m = _ITER_RE.match(name)
        if m and is_complete(os.path.join(save_dir, name)):
            steps.append(int(m.group(1)))
        elif m:
            logger.warning(
                "ignoring incomplete checkpoint %s (no %s marker)", os.path.join(save_dir, name), COMPLETE_MARKER
            )
    return checkpoint_dir(save_dir, max(steps)) if steps else None


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
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]], save_optim: bool
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key, (model, optim) in models.items():
        if optim is not None and save_optim:
            msd, osd = get_state_dict(model, optim)
            state[key] = {"model": msd, "optim": osd}
        else:
            state[key] = {"model": get_state_dict(model, [])[0]}
    return state


def save_checkpoint(
    path: str,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
    meta: dict[str, Any],
    *,
    save_optim: bool = True,
) -> None:
    """Collective: every rank writes its shards; rank 0 writes meta.json and then COMPLETE."""
    rank = dist.get_rank()
    if rank == 0:
        if os.path.exists(path):  # a stale or partial save of the same step: start clean
            shutil.rmtree(path)
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    dist.barrier()
    dcp.save(_model_optim_state(models, save_optim), checkpoint_id=os.path.join(path, "model"))
    torch.save(_rng_state(), os.path.join(path, "rng", f"rank_{rank}.pt"))
    if rank == 0:
        _write_json(os.path.join(path, "meta.json"), {**meta, "has_optim": save_optim})
    dist.barrier()  # every rank's shards and RNG file exist before the marker
    if rank == 0:
        with open(os.path.join(path, COMPLETE_MARKER), "w") as f:
            f.write("ok\n")
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()
    logger.info("saved checkpoint %s", path)


def load_checkpoint(
    path: str, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]
) -> dict[str, Any]:
    """Collective: restore model/optimizer shards and this rank's RNG; returns meta.json."""
    if not is_complete(path):
        raise FileNotFoundError(
            f"checkpoint {path!r} has no {COMPLETE_MARKER} marker (missing or interrupted save); "
            "point --load at a complete iter_* directory or at the save root for the latest complete one"
        )
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    state = _model_optim_state(models, meta.get("has_optim", True))
    dcp.load(state, checkpoint_id=os.path.join(path, "model"))
    for key, (model, optim) in models.items():
        if "optim" in state[key]:
            set_state_dict(model, optim, model_state_dict=state[key]["model"], optim_state_dict=state[key]["optim"])
        else:
            set_state_dict(
                model,
                [],
                model_state_dict=state[key]["model"],
                optim_state_dict={},
                options=StateDictOptions(strict=True),
            )
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


def resolve_load_path(path: str) -> str | None:
    """An `iter_*` directory as given, or the latest complete one under a save root."""
    if _ITER_RE.match(os.path.basename(os.path.normpath(path))):
        return path
    return latest_complete_checkpoint(path)


def _write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
