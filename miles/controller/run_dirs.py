"""A run's own directories: one run at a time per `--output-dir`, one run's checkpoints per `--save`.

- `lock_output_dir`: `miles train` holds `<output-dir>/.miles.lock` (an exclusive `flock`, the file
  naming the holder's pid and host) from before it writes anything there until it exits. A second run
  on the same directory is refused in one line naming the holder; the kernel drops the lock of a process
  that died, so a lock file left by a dead run is taken over. A directory that cannot be created or
  written (read-only, full) is refused in one line.
- `check_save_reuse`: a `--save` that already holds complete checkpoints belongs to another run unless
  this one continues them (`--auto-resume`, or a `--load` inside `--save`) or says `--overwrite-save`;
  otherwise refused, so a run never mixes its checkpoints with another's and `--auto-resume` never
  picks another run's weights.
- `clear_save_dir`: `--overwrite-save` removes the old `iter_*` entries at start-up (links unlinked,
  never followed).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket

from miles.config import TrainConfig
from miles.trainer.checkpoint_layout import COMPLETE_MARKER, complete_checkpoint_steps, remove_checkpoint_dir

logger = logging.getLogger(__name__)

LOCK_NAME = ".miles.lock"
_ITER_RE = re.compile(r"^iter_\d{7,}$")
_FULL = (errno.ENOSPC, errno.EDQUOT)


class RunDirError(ValueError):
    """An output or checkpoint directory the run cannot use; one line naming the flag and the fix."""


def output_dir_error(output_dir: str, error: OSError) -> RunDirError:
    """One line for a `--output-dir` the run cannot write: full, read-only or otherwise refused."""
    if error.errno in _FULL:
        return RunDirError(
            f"--output-dir {output_dir!r} is full ({error.strerror}); free space or point --output-dir elsewhere"
        )
    return RunDirError(
        f"--output-dir {output_dir!r} is not writable ({error.strerror or error}); "
        "point --output-dir at a directory you can write"
    )


class OutputDirLock:
    """Held while the run lives; `release` (or leaving the `with` block) removes the lock file."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):  # still ours: a later run never finds a lock it must judge
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_output_dir(output_dir: str) -> OutputDirLock:
    """Create `output_dir` and hold its run lock; RunDirError when another live run holds it or the
    directory cannot be written."""
    path = os.path.join(output_dir, LOCK_NAME)
    for _ in range(5):  # the holder may unlink the file between our open and our flock: open again
        try:
            os.makedirs(output_dir, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise output_dir_error(output_dir, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirError(
                f"--output-dir {output_dir!r} is in use by another run ({holder or 'holder unknown'}, "
                f"lock {path}); wait for it to end, stop it, or pick another --output-dir"
            ) from None
        if _same_file(fd, path):
            return _claim(output_dir, path, fd)
        os.close(fd)
    raise RunDirError(f"--output-dir {output_dir!r}: its lock {path} keeps changing hands; pick another --output-dir")


def _claim(output_dir: str, path: str, fd: int) -> OutputDirLock:
    stale = _holder(fd)
    if stale:
        logger.info("taking over the lock of %s (%s has ended)", output_dir, stale)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        raise output_dir_error(output_dir, e) from None
    return OutputDirLock(path, fd)


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def check_save_reuse(train: TrainConfig) -> None:
    """Refuse a fresh run into a `--save` holding complete checkpoints, and `--overwrite-save` beside a resume."""
    if not train.save:
        return
    save = os.path.realpath(train.save)
    if train.overwrite_save:
        resumes = train.auto_resume or (train.load and _inside(os.path.realpath(train.load), save))
        if resumes:
            given = "--auto-resume" if train.auto_resume else f"--load {train.load!r}"
            raise RunDirError(
                f"--overwrite-save deletes the checkpoints under --save {train.save!r} that {given} resumes from; "
                "drop one of the two"
            )
        return
    if train.auto_resume or (train.load and _inside(os.path.realpath(train.load), save)):
        return  # this run continues the checkpoints under --save
    steps = complete_checkpoint_steps(train.save)
    if steps:
        held = f"iter_{steps[0]:07d}" + (f" .. iter_{steps[-1]:07d}" if len(steps) > 1 else "")
        loads = f" (--load {train.load!r} is outside it)" if train.load else ""
        raise RunDirError(
            f"--save {train.save!r} already holds {len(steps)} checkpoint(s) of another run ({held}){loads}; resume "
            "them with --auto-resume, start fresh and delete them with --overwrite-save, or point --save at a new "
            "directory"
        )


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def clear_save_dir(train: TrainConfig) -> list[str]:
    """`--overwrite-save`: remove every `iter_*` entry under `--save` (markers first); the removed paths."""
    if not (train.overwrite_save and train.save and os.path.isdir(train.save)):
        return []
    removed = []
    for name in sorted(os.listdir(train.save)):
        if not _ITER_RE.match(name):
            continue
        path = os.path.join(train.save, name)
        marker = os.path.join(path, COMPLETE_MARKER)
        if not os.path.islink(path) and os.path.lexists(marker):
            os.unlink(marker)  # no longer a checkpoint, even if the removal stops halfway
        remove_checkpoint_dir(path)
        removed.append(path)
    if removed:
        logger.info("--overwrite-save: removed %d old checkpoint(s) under %s", len(removed), train.save)
    return removed
