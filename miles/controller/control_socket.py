"""The controller's IPC control socket file: where it lives, and the ones killed runs left behind.

``ipc_socket_path(run_dir, run_id)`` names this run's socket, ``<run_dir>/.ctl-<run_id>.sock``, or
``ctl.sock`` in a fresh 0700 temp dir when that path is too long for a Unix socket; it creates
``run_dir`` and first removes the sockets of earlier runs there that no one listens on
(``remove_stale_sockets``). ``remove_ipc_socket`` deletes the file and the temp dir at shutdown.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def remove_stale_sockets(run_dir: str) -> list[str]:
    """Remove the control sockets a killed controller left in `run_dir` (no one listens on them).

    A socket someone still listens on belongs to a live run in the same directory: it is kept.
    """
    removed = []
    for path in Path(run_dir).glob(".ctl-*.sock"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            removed.append(str(path))
        except OSError as e:  # not a socket, or not ours to judge: leave it
            logger.debug("leaving %s: %s", path, e)
        else:
            logger.warning("another run is listening on %s in this run directory; its files may mix with these", path)
        finally:
            probe.close()
    if removed:
        logger.info("removed %d stale control socket(s) of an earlier run: %s", len(removed), ", ".join(removed))
    return removed


def ipc_socket_path(run_dir: str, run_id: str) -> tuple[str, str | None]:
    """This run's socket path, and the temp dir holding it (None when it lives in `run_dir`)."""
    # IPC frames are unsigned: the endpoint makes the socket file 0600, so only this user can connect.
    # Unix socket paths are limited to ~107 bytes: fall back to a 0700 temp dir.
    ipc_dir = None
    ipc_path = os.path.join(run_dir, f".ctl-{run_id}.sock")
    if len(ipc_path) > 100:
        ipc_dir = tempfile.mkdtemp(prefix=f"miles-{run_id}-")
        ipc_path = os.path.join(ipc_dir, "ctl.sock")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    remove_stale_sockets(run_dir)
    return ipc_path, ipc_dir


def remove_ipc_socket(ipc_path: str | None, ipc_dir: str | None) -> None:
    """Delete the socket file and its temp dir, where there are any."""
    if ipc_path is not None and os.path.exists(ipc_path):
        os.unlink(ipc_path)
    if ipc_dir is not None:
        shutil.rmtree(ipc_dir, ignore_errors=True)
