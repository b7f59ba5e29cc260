"""A warm process that forks miles workers: ``python -m miles.wire.forkserver SOCKET_PATH``.

A worker exec'd fresh spends seconds of CPU importing torch, transformers and the worker modules. This
server imports them once (`PRELOAD`, or the comma-separated `MILES_FORKSERVER_PRELOAD`; a name that does not
import is skipped), then binds an AF_UNIX socket at SOCKET_PATH: the path exists once it serves. Spawners
that find it in `MILES_FORKSERVER` ask it for workers (`fork_client.fork_worker`); it forks one per request
when the worker would be the same as an exec'd one and refuses otherwise, with the reason, and the spawner
execs. It compares the interpreter, miles, the network namespace, the cgroup and the import-time
environment (`fork_client.spawn_key`), and refuses a worker whose `sys.path` would import a module it has
already imported from another file ("shadowed") or adds installed distributions it never saw.

One thread, serial: between accepts (every `ACCEPT_POLL_S`) it reaps ended workers and sends each exit code
on that worker's connection. Nothing preloaded may start a thread or initialise CUDA (a fork copies only the
calling thread, and CUDA does not survive a fork): the server refuses to serve otherwise. Its workers get
SIGTERM when it exits (PR_SET_PDEATHSIG); with ``--parent-pid`` so does the server when that process exits.
SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import gc
import glob
import importlib
import importlib.machinery
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading

from miles.wire.fork_child import (
    ARGV_ROOM,
    ENV_ROOM_BYTES,
    ENV_ROOM_VAR,
    ProcAreas,
    become_worker,
    encode_environ,
)
from miles.wire.fork_client import key_mismatch, recv_message, send_message, spawn_key
from miles.wire.procs import set_parent_death_signal

logger = logging.getLogger(__name__)

# the seconds of import every process of a run pays: also what the test suite's multiprocessing fork server
# preloads (tests/conftest.py)
TORCH_PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "safetensors.torch",
]
PRELOAD = [
    *TORCH_PRELOAD,
    "zmq",
    "msgpack",
    "aiohttp",
    "uvloop",
    "miles.workers.main",
    "miles.workers.trainer_worker",
    "miles.workers.rollout_worker",
    "miles.trainer.fsdp",
    "miles.engines.embedded.engine",
    "miles.engines.http_front",
    "miles.weights.receiver",
]
PRELOAD_ENV = "MILES_FORKSERVER_PRELOAD"
ACCEPT_POLL_S = 0.05
REQUEST_TIMEOUT_S = 10.0
CHILD_READY_TIMEOUT_S = 10.0


def preload(names: list[str]) -> list[str]:
    """Import `names`; returns those that imported (the others are logged and skipped)."""
    loaded = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optional module; the worker imports what it needs itself
            logger.info("preload: skipped %s (%s: %s)", name, type(e).__name__, e)
        else:
            loaded.append(name)
    return loaded


def fork_hazard() -> str | None:
    """Why forking from this process is unsafe now (None: it is safe)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised while preloading; a forked child cannot use it"
    threads = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if threads:
        return f"preloading started threads {threads}; a fork copies only the calling thread"
    return None


def base_sys_path() -> list[str]:
    """This interpreter's `sys.path` without what the working directory and PYTHONPATH put there: the part
    a worker's path shares with it."""
    own = set(_pythonpath_entries(os.environ, os.getcwd()))
    path = sys.path if sys.flags.safe_path else sys.path[1:]
    return [p for p in path if p not in own]


def worker_sys_path(env: dict[str, str], cwd: str, base: list[str]) -> list[str]:
    """The `sys.path` of ``python -m`` run in `cwd` with `env`, on an interpreter whose remaining path is `base`."""
    first = [] if env.get("PYTHONSAFEPATH") else [cwd]
    return list(dict.fromkeys([*first, *_pythonpath_entries(env, cwd), *base]))


def _pythonpath_entries(env: dict[str, str], cwd: str) -> list[str]:
    return [os.path.abspath(os.path.join(cwd, p)) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def shadowed(path: list[str]) -> str | None:
    """Why a worker importing through `path` would not get the modules this process has imported (None: it
    would): one resolves to another file, or an entry new to this process holds installed distributions,
    which the preloaded libraries' optional-package checks never saw."""
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if "." in name or spec is None or spec.name != name or not spec.has_location:
            continue  # a submodule, an alias (__main__, __mp_main__), or not from a file: no path shadows it
        spec = _find_spec(name, path)
        found = spec.origin if spec is not None else None
        if found != origin:
            return f"{name} would import from {found or 'nowhere'} in the worker, but the server has it from {origin}"
    for entry in (p for p in path[1:] if p not in sys.path):
        installed = glob.glob(os.path.join(glob.escape(entry), "*.dist-info"))
        if installed:
            return f"PYTHONPATH entry {entry} holds installed packages ({os.path.basename(installed[0])}, ...)"
    return None


def _find_spec(name: str, path: list[str]) -> importlib.machinery.ModuleSpec | None:
    """The spec a fresh interpreter whose `sys.path` is `path` would find for top-level module `name`."""
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
        else:
            continue
        if spec is not None:
            return spec
    return None


class ForkServer:
    """The accept loop: one request, one fork (or one refusal), one exit code per worker."""

    def __init__(self, path: str, environ: dict[str, str]) -> None:
        self.path = path
        self.key = spawn_key(environ)
        self.base_path = base_sys_path()
        self.areas = ProcAreas.of_this_process()
        self.workers: dict[int, socket.socket] = {}  # pid -> the connection its exit code goes to
        self.listener: socket.socket | None = None
        self.stopping = False
        self.forked = self.refused = 0

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        gc.freeze()  # the preloaded objects stay out of the children's collections, and so do their pages
        self.listener = _listen(self.path)
        logger.info("serving on %s (pid %d)", self.path, os.getpid())
        try:
            while not self.stopping:
                self._reap()
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError:
                    continue
                self._handle(conn)
        finally:
            self.listener.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            logger.info("stopped: %d workers forked, %d requests refused", self.forked, self.refused)

    def _stop(self, _signum: int, _frame: object) -> None:
        self.stopping = True

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        pid = None
        try:
            request = recv_message(conn)
            if request is None:
                conn.close()
                return
            reason, path = self._refusal(conn, request)
            if reason is None:
                pid = self._fork(request, path, conn)
                reason = None if pid is not None else "the forked worker ended before it was set up (see its log)"
            env = request.get("env", {})
            who = f"{env.get('MILES_ROLE', '?')}:{env.get('MILES_RANK', '?')}"
            if reason is not None:
                self.refused += 1
                logger.info("refused %s: %s (log=%s)", who, reason, request.get("log_path"))
                send_message(conn, {"refused": reason})
                conn.close()
                return
            send_message(conn, {"pid": pid})
            self.workers[pid] = conn
            self.forked += 1
            logger.info("forked %s pid=%d log=%s", who, pid, request["log_path"])
        except Exception as e:  # noqa: BLE001 - a bad request or a gone client must not end the server
            logger.warning("request failed (%s: %s)", type(e).__name__, e)
            conn.close()
            if pid is not None and pid not in self.workers:  # its spawner never learnt of it: end it
                os.kill(pid, signal.SIGKILL)

    def _refusal(self, conn: socket.socket, request: dict) -> tuple[str | None, list[str]]:
        """(why this request cannot be forked or None, the worker's sys.path)."""
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            return f"the request came from uid {uid}; this server forks for uid {os.getuid()} only", []
        why = key_mismatch(request["key"], self.key)
        if why is not None:
            return why, []
        env_bytes = len(encode_environ(request["env"]))
        if env_bytes >= self.areas.env_bytes:
            return (
                f"the worker's environment ({env_bytes} bytes) exceeds the {self.areas.env_bytes} bytes kept for it",
                [],
            )
        path = worker_sys_path(request["env"], request["cwd"], self.base_path)
        return shadowed(path), path

    def _fork(self, request: dict, path: list[str], conn: socket.socket) -> int | None:
        """Fork the worker; its pid once it is set up (own session, own command line), None if it failed."""
        ready_r, ready_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            owned = [self.listener, conn, ready_r, *self.workers.values()]
            become_worker(request, path, self.areas, server_pid, ready_w, owned)
        os.close(ready_w)
        try:
            readable, _, _ = select.select([ready_r], [], [], CHILD_READY_TIMEOUT_S)
            ready = bool(readable) and os.read(ready_r, 1) == b"r"
        finally:
            os.close(ready_r)
        if not ready:
            os.kill(pid, signal.SIGKILL)  # reaped by _reap, like any other
            return None
        return pid

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is None:
                continue
            try:
                conn.settimeout(1.0)
                send_message(conn, {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass  # its spawner has gone
            conn.close()


def _listen(path: str) -> socket.socket:
    """A listening socket at `path`, which appears only once it accepts (bound elsewhere, then renamed)."""
    staging = f"{path}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(staging)
    os.chmod(staging, 0o600)
    listener.listen(64)
    os.replace(staging, path)
    listener.settimeout(ACCEPT_POLL_S)
    return listener


def _reexec_with_room(argv: list[str]) -> None:
    """Exec this server again with room in its argv and environment areas for what its workers write there
    (`fork_child`), and unbuffered output, as the workers it stands in for have."""
    env = {**os.environ, ENV_ROOM_VAR: " " * ENV_ROOM_BYTES, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "miles.wire.forkserver", *argv, "--argv-room=" + " " * ARGV_ROOM]
    os.execve(sys.executable, args, env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles.wire.forkserver", description=__doc__.split("\n")[0])
    parser.add_argument("socket_path", help="where to bind the AF_UNIX socket (at most 107 bytes)")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process (the parent) exits")
    parser.add_argument("--argv-room", default="", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.parent_pid:
        set_parent_death_signal()  # kept across the exec below
        if os.getppid() != args.parent_pid:
            sys.exit(f"parent process {args.parent_pid} is already gone")
    if ENV_ROOM_VAR not in os.environ:
        _reexec_with_room(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s forkserver pid=%(process)d: %(message)s")
    environ = dict(os.environ)  # what it was started with: preloaded libraries may write their defaults in
    names = [n for n in environ.get(PRELOAD_ENV, "").split(",") if n] or PRELOAD
    loaded = preload(names)
    hazard = fork_hazard()
    if hazard is not None:
        sys.exit(f"miles fork server: not serving: {hazard}")
    logger.info("preloaded %d of %d modules", len(loaded), len(names))
    ForkServer(args.socket_path, environ).serve()


if __name__ == "__main__":
    main()
