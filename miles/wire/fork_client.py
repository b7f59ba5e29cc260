"""The spawner's side of a warm fork server (`miles.wire.forkserver`): ask it for a worker, watch the worker.

A worker exec'd fresh spends seconds of CPU importing torch and transformers before its first line of
work; a run with many short steps, or a test suite that starts hundreds of runs, pays that again and again.
A fork server has imported them once; `fork_worker` asks it to fork a worker instead. The server forks only
when the worker would be the same as an exec'd one: same interpreter, same `miles`, same network namespace
and cgroup, and the same values of every environment variable read at import time (`spawn_key`). Anything
else, and anything that goes wrong on the way, returns None and the caller execs the worker as before.

Wire: one AF_UNIX stream connection per worker, each message a 4-byte big-endian length and a msgpack map.
The client sends the request; the server answers ``{"pid": N}`` or ``{"refused": reason}``, and later, on
the same connection, ``{"exit": returncode}`` when the worker has ended (Popen's convention: -N for signal N).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import psutil

logger = logging.getLogger(__name__)

SERVERS_ENV = "MILES_FORKSERVER"  # the sockets to try, os.pathsep-separated
WORKER_MODULE = "miles.workers.main"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
REPLY_TIMEOUT_S = 60.0
_HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 16 << 20

# Environment variables a preloaded module may read while it is imported (thread pools, allocators, library
# paths, the HF caches, CUDA, and miles' FP8 switch): a worker forked from a server that was started with other
# values would differ from an exec'd one. Left out: CUDA_VISIBLE_DEVICES (read when CUDA starts, which never
# happens in the server), PYTHONPATH (compared by what it resolves to: the server's "shadowed" check),
# TORCHELASTIC_* and TORCH_NCCL_* (read when a process group starts, from the worker's own environment; torchrun
# sets some for the processes it starts) and
# TORCHINDUCTOR_CACHE_DIR (inductor writes its default back into the environment of whoever imports it).
KEY_ENV_PREFIXES = (
    "PYTHON",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NCCL",
    "NVIDIA",
    "TRITON",
    "OMP_",
    "KMP_",
    "MKL",
    "OPENBLAS",
    "GLIBC_",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "LD_",
    "MALLOC",
    "SLURM_",
)
KEY_ENV_NAMES = ("MILES_FP8_CUDA_KERNELS",)
KEY_ENV_EXCLUDED = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")
KEY_ENV_EXCLUDED_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")

# Each reason a worker was exec'd after all is logged once per process: a run starts a handful of workers,
# a test process hundreds, and the reason is the same for all of them.
_reported_fallbacks: set[str] = set()


def spawn_key(env: dict[str, str]) -> dict:
    """What must be equal between a fork server and a worker for a fork to stand in for an exec of `env`."""
    return {
        # the binary and the environment it runs in (a venv's python is a link to its base interpreter's)
        "python": f"{os.path.realpath(sys.executable)} prefix={sys.prefix}",
        "miles": PACKAGE_ROOT,
        "netns": _read_link("/proc/self/ns/net"),
        "cgroup": _read_text("/proc/self/cgroup"),
        "env": {
            k: v
            for k, v in env.items()
            if (k.startswith(KEY_ENV_PREFIXES) or k in KEY_ENV_NAMES)
            and not (k in KEY_ENV_EXCLUDED or k.startswith(KEY_ENV_EXCLUDED_PREFIXES))
        },
    }


def key_mismatch(worker: dict, server: dict) -> str | None:
    """Why a worker with key `worker` cannot be forked from a server with key `server` (None: it can)."""
    for part in ("python", "miles", "netns", "cgroup"):
        if worker.get(part) != server.get(part):
            return f"{part} differs (worker {worker.get(part)!r}, server {server.get(part)!r})"
    mine, theirs = worker.get("env", {}), server.get("env", {})
    names = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if not names:
        return None
    shown = ", ".join(f"{k} (worker {mine.get(k)!r}, server {theirs.get(k)!r})" for k in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"environment differs: {shown}{more}"


def _read_link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def send_message(sock: socket.socket, message: dict) -> None:
    payload = msgpack.packb(message)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_message(sock: socket.socket) -> dict | None:
    """The next message on a blocking socket; None when the peer closed it first."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"fork server message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
    payload = _recv_exact(sock, size)
    return None if payload is None else msgpack.unpackb(payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class ForkedWorker:
    """A worker forked by a fork server, with the part of `subprocess.Popen` the spawner uses.

    Its parent is the server, so only the server can reap it: the exit code comes over the request's
    connection. When the server dies first (the worker then gets SIGTERM, its parent-death signal), the
    connection closes without one and the worker counts as killed by SIGTERM once its pid is gone."""

    def __init__(self, pid: int, sock: socket.socket, server_path: str) -> None:
        self.pid = pid
        self.server_path = server_path
        self.returncode: int | None = None
        self._sock: socket.socket | None = sock
        self._buffer = b""
        self._lock = threading.Lock()
        sock.setblocking(False)

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._read_exit()
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(f"{WORKER_MODULE} (forked) pid={self.pid}", timeout)
            wait_s = 0.1 if remaining is None else min(remaining, 0.1)
            try:
                select.select([self._sock], [], [], wait_s)  # for the exit message
            except (TypeError, ValueError, OSError):
                time.sleep(wait_s)  # no connection any more (the server is gone): the pid is watched
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_exit(self) -> None:
        if self._sock is not None:
            try:
                while True:
                    chunk = self._sock.recv(4096)
                    if not chunk:
                        self._close()
                        break
                    self._buffer += chunk
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close()
            if len(self._buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack(self._buffer[: _HEADER.size])
                if len(self._buffer) >= _HEADER.size + size:
                    message = msgpack.unpackb(self._buffer[_HEADER.size : _HEADER.size + size])
                    self.returncode = int(message["exit"])
                    self._close()
                    return
        if self._sock is None and not _pid_running(self.pid):
            self.returncode = -signal.SIGTERM

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _pid_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def fork_worker(env: dict[str, str], log_path: str | os.PathLike) -> ForkedWorker | None:
    """A worker forked from the first server of `MILES_FORKSERVER` that accepts `env`; None: exec it instead.

    `env` is the worker's whole environment, as it would be given to the exec."""
    paths = [p for p in os.environ.get(SERVERS_ENV, "").split(os.pathsep) if p]
    request = {
        "key": spawn_key(env),
        "env": env,
        "log_path": str(log_path),
        "cwd": os.getcwd(),
        "module": WORKER_MODULE,
    }
    for path in paths:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(REPLY_TIMEOUT_S)
            try:
                sock.connect(path)
                send_message(sock, request)
                reply = recv_message(sock)
            except BaseException:
                sock.close()
                raise
        except (OSError, ValueError) as e:
            _report_fallback(f"fork server {path} did not answer ({type(e).__name__}: {e})")
            continue
        if reply is not None and "pid" in reply:
            return ForkedWorker(int(reply["pid"]), sock, path)
        sock.close()
        _report_fallback(f"fork server {path} refused: {(reply or {}).get('refused', 'it closed the connection')}")
    return None


def _report_fallback(reason: str) -> None:
    if reason not in _reported_fallbacks:
        _reported_fallbacks.add(reason)
        logger.info("worker exec'd instead of forked: %s", reason)


def with_miles_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with this checkout of miles first on PYTHONPATH: a worker (and a fork server standing in for one)
    imports the same miles as its spawner, whatever its working directory."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)}


def start(
    path: str,
    env: dict[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
    preload: list[str] | None = None,
) -> subprocess.Popen:
    """Start a fork server on socket `path` that ends with this process; `wait_ready` says when it serves.

    `env` (default: this process's) is the environment it compares workers against, with this checkout of
    miles first on PYTHONPATH as `spawn_worker_process` puts it for workers; `preload` replaces its list."""
    env = with_miles_on_path(dict(os.environ if env is None else env))
    if preload is not None:
        env["MILES_FORKSERVER_PRELOAD"] = ",".join(preload)
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # the child keeps its own copy
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "miles.wire.forkserver", path, "--parent-pid", str(os.getpid())],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        if log is not subprocess.DEVNULL:
            log.close()


def wait_ready(path: str, timeout: float, server: subprocess.Popen | None = None) -> bool:
    """Whether the server on `path` serves within `timeout` s (it binds the socket only once preloaded);
    False early when `server`, its process, has ended."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= deadline or (server is not None and server.poll() is not None):
            return False
        time.sleep(0.05)
    return True
