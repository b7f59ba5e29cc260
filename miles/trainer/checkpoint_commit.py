"""How a collective checkpoint save ends: every rank commits it, or every rank raises the same error.

A save that fails on any rank (a full disk, say) raises `CheckpointWriteError` on every rank, naming the
directory (`raise_first`, after each rank's failure became one line: `write_error`); the partial
directory is removed and never gets its marker. A save that succeeds everywhere gets its COMPLETE
marker from rank 0, written atomically (`write_marker`). The synchronous save (`checkpoint.py`) and the
background writer (`checkpoint_async.py`) both end this way.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from miles.trainer.checkpoint_layout import COMPLETE_MARKER, CheckpointWriteError

# torch.save reports a short write without its errno ("unexpected pos 704 vs 598"): with less free
# space than this left on the device, a failed write is taken to be a full disk.
_DISK_FULL_FREE_BYTES = 64 * 1024**2
# DCP raises CheckpointException, a BaseException: caught beside Exception, so every save failure is shared
SAVE_ERRORS = (Exception, CheckpointException)


def write_marker(path: str) -> None:
    """COMPLETE appears whole or not at all: written beside, synced, renamed into place."""
    marker = os.path.join(path, COMPLETE_MARKER)
    with open(marker + ".tmp", "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".tmp", marker)
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def raise_first(path: str, local_error: str | None) -> None:
    """Collective: every rank learns every rank's error; with any, the partial save is removed and all raise."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local_error)
    errors = [e for e in gathered if e]
    if not errors:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # frees what was written; without COMPLETE it was never usable
    raise CheckpointWriteError(errors[0])


def write_error(path: str, exc: BaseException) -> str:
    """One line naming the checkpoint and the cause; a full disk is said so, whatever layer noticed it."""
    if _is_disk_full(exc, path):
        return (
            f"disk full (ENOSPC) while saving checkpoint {path}; free space or point --save elsewhere "
            f"(the partial checkpoint was removed)"
        )
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: name the first rank's cause
    if isinstance(failures, dict) and failures:
        exc = unwrapped_failure(next(iter(failures.values())))
    reason = " ".join(str(exc).split())  # one line, whatever the layer below printed
    return f"writing checkpoint {path} failed: {type(exc).__name__}: {reason} (the partial checkpoint was removed)"


def _is_disk_full(exc: BaseException, path: str) -> bool:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict) and any(
            isinstance(f, BaseException) and _is_disk_full(f, path) for f in map(unwrapped_failure, failures.values())
        ):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return _free_bytes(path) < _DISK_FULL_FREE_BYTES


def unwrapped_failure(failure: Any) -> Any:
    """DCP wraps each rank's exception with its traceback summary: the exception itself."""
    return failure[0] if isinstance(failure, tuple) and failure else failure


def _free_bytes(path: str) -> int:
    """Free bytes on the device of `path` (or of its nearest existing parent); unknown is plenty."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return _DISK_FULL_FREE_BYTES
