"""Where checkpoints live and which are complete: the layout of `miles/trainer/checkpoint.py`, without torch.

The controller finds, resumes from and prunes checkpoints with these; importing the trainer's
checkpoint module for them would import torch into it (seconds at start-up).
"""

from __future__ import annotations

import logging
import os
import re
import shutil

from miles.errors import RunFailed

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


class CheckpointWriteError(RunFailed):
    """A checkpoint could not be written; its directory holds no COMPLETE marker."""


def checkpoint_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"iter_{step:07d}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def is_link(save_dir: str, name: str) -> bool:
    """`save_dir/name` or its marker is a symbolic link: a save never writes or deletes through one."""
    path = os.path.join(save_dir, name)
    return os.path.islink(path) or os.path.islink(os.path.join(path, COMPLETE_MARKER))


def remove_checkpoint_dir(path: str) -> None:
    """Remove `path` (a stale or partial `iter_*` directory) without following links: a link is unlinked,
    never the directory it points at."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)  # rmtree unlinks the links inside a directory; it never descends into them


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


def complete_checkpoint_steps(save_dir: str) -> list[int]:
    """Steps of the complete `iter_*` checkpoints under `save_dir`, oldest first."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    names = (_ITER_RE.match(name) for name in os.listdir(save_dir))
    return sorted(int(m.group(1)) for m in names if m and is_complete(os.path.join(save_dir, m.group(0))))


def prune_checkpoints(save_dir: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` (>= 1) complete checkpoints under `save_dir`; the deleted paths.
    A checkpoint that is (or whose marker is) a symbolic link is never deleted: it may point outside `save_dir`."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least the newest complete checkpoint is kept; pass keep >= 1")
    removed = []
    for step in complete_checkpoint_steps(save_dir)[:-keep]:
        path = checkpoint_dir(save_dir, step)
        if is_link(save_dir, os.path.basename(path)):  # what a link points at lies outside --save: left alone
            logger.warning("not pruning %s: it is a symbolic link (--max-checkpoints never deletes through one)", path)
            continue
        os.remove(os.path.join(path, COMPLETE_MARKER))  # no longer a checkpoint, even if rmtree stops halfway
        shutil.rmtree(path)
        removed.append(path)
        logger.info("removed checkpoint %s (--max-checkpoints %d)", path, keep)
    return removed


def resolve_load_path(path: str) -> str | None:
    """An `iter_*` directory as given, or the latest complete one under a save root."""
    if _ITER_RE.match(os.path.basename(os.path.normpath(path))):
        return path
    return latest_complete_checkpoint(path)
