"""What a process forked by the fork server (`miles.wire.forkserver`) does to become the worker an exec
would have started: its own session, its log on stdout and stderr, the request's working directory,
environment and `sys.path`, fresh random seeds, default signal handlers, then ``python -m <module>``.

The kernel still shows the server's command line and environment for it (/proc/PID/cmdline and environ
read the memory the server was exec'd with); tools that find a run's processes read those
(`procs.run_processes` looks for MILES_RUN_ID there), so the child writes its own over them. The server
was exec'd with room to spare in both (`ARGV_ROOM`, `ENV_ROOM_BYTES`), and the kernel reads the areas in
place, as it does for setproctitle.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import random
import runpy
import signal
import sys
from dataclasses import dataclass

from miles.wire.procs import set_parent_death_signal

ENV_ROOM_VAR = "MILES_FORKSERVER_ROOM"
ENV_ROOM_BYTES = 96 * 1024
ARGV_ROOM = 512


@dataclass(slots=True)
class ProcAreas:
    """Where this process's argv and environment strings lie ([start, end) addresses, from /proc/self/stat)."""

    arg_start: int
    arg_end: int
    env_start: int
    env_end: int

    @classmethod
    def of_this_process(cls) -> ProcAreas:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 is fields[0]
        return cls(*(int(fields[n - 3]) for n in (48, 49, 50, 51)))

    @property
    def env_bytes(self) -> int:
        return self.env_end - self.env_start


def encode_environ(env: dict[str, str]) -> bytes:
    """`env` as the kernel lays out an environment: NUL-terminated `NAME=value` strings."""
    return b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())


def become_worker(
    request: dict, sys_path: list[str], areas: ProcAreas, server_pid: int, ready_fd: int, close: list
) -> None:
    """Turn this freshly forked process into the worker `request` describes and run it; never returns.

    `close` holds what the server had open (its listening socket, other workers' connections, descriptors):
    a worker must not keep them. `ready_fd` gets one byte once the process is in its own session and shows
    its own command line and environment, so that whoever has its pid can signal its group and find it by
    run id. A server that dies before the child asked for its death signal leaves it to exit at once."""
    code = 1
    try:
        os.setsid()
        _reset_signals()
        set_parent_death_signal()
        if os.getppid() != server_pid:  # the server died before the signal was asked for
            return
        for obj in close:
            if isinstance(obj, int):
                os.close(obj)
            else:
                obj.close()
        _redirect_stdio(request["log_path"])
        env = request["env"]
        _replace_environ(env)
        _show_as(areas, f"{sys.executable} -m {request['module']}", encode_environ(env))
        os.chdir(request["cwd"])
        sys.path[:] = sys_path
        importlib.invalidate_caches()
        _reseed()
        os.write(ready_fd, b"r")
        os.close(ready_fd)
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the traceback goes to the worker's log, where an exec'd one's would
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _redirect_stdio(log_path: str) -> None:
    """stdin from /dev/null, stdout and stderr appended to the worker's log, as `spawn_worker_process` does."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)


def _reset_signals() -> None:
    """The handlers a fresh interpreter starts with (the server installed its own for SIGTERM)."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _replace_environ(env: dict[str, str]) -> None:
    """The request's environment, wholesale, for Python and for C (getenv, and what exec'd children inherit).

    After this no C environment string points into the area `_show_as` overwrites: clearenv drops the
    original pointers and setenv (through os.environ) copies each value."""
    os.environ.clear()
    try:
        ctypes.CDLL("libc.so.6").clearenv()
    except (OSError, AttributeError):
        pass
    os.environ.update(env)


def _show_as(areas: ProcAreas, title: str, environ: bytes) -> None:
    """Write `title` over the argv area and `environ` over the environment area, zero-filling the rest.

    The argv area's last byte is left non-zero: the kernel then reads the command line as one string up to
    its first NUL (the setproctitle convention), which `ps` and psutil split at spaces."""
    arg_size = areas.arg_end - areas.arg_start
    title_bytes = os.fsencode(title)[: arg_size - 2] + b"\0"
    argv = title_bytes + b"\0" * (arg_size - len(title_bytes) - 1) + b" "
    ctypes.memmove(areas.arg_start, argv, arg_size)
    if len(environ) >= areas.env_bytes:  # the server checked; never truncate mid-string
        return
    ctypes.memmove(areas.env_start, environ + b"\0" * (areas.env_bytes - len(environ)), areas.env_bytes)


def _reseed() -> None:
    """Seeds a fresh process would draw (the server's state is shared by all its children otherwise)."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
