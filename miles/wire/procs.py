"""Process plumbing shared by the controller and the node agents: spawn, reap, kill, log tails.

Every worker starts in its own session (``start_new_session``) so that a kill of its process
group also ends whatever it spawned (engine servers, compile workers). Descendants that moved to
yet another session are found through psutil before the kill.

Where ``MILES_FORKSERVER`` names warm fork servers (`miles.wire.forkserver`), a worker is forked from
one of them instead of exec'd, when the server accepts it; its parent is then the server, not the
spawner, which is why a worker checks on its spawner with `parent_alive` rather than its parent pid.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from miles.wire import fork_client

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 20


@dataclasses.dataclass(slots=True)
class ChildProcess:
    """A spawned worker process and where its output goes (`popen` is a ForkedWorker when it was forked)."""

    role: str
    rank: int
    popen: subprocess.Popen | fork_client.ForkedWorker
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def name(self) -> str:
        return f"{self.role}:{self.rank}"


def log_path_for(run_dir: str | os.PathLike, role: str, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"{role}_{rank}.log"


def visible_devices(worker_gpus: str | None, parent_visible: str | None) -> str | None:
    """The worker's CUDA_VISIBLE_DEVICES in the node's own numbering.

    The placement numbers GPUs 0..G-1 as this process sees them; when this process was itself started
    with CUDA_VISIBLE_DEVICES (say `2,3`), its GPU 1 is the node's GPU 3, and that is what the worker
    must be given. Entries may be indices or UUIDs; they are passed through as written."""
    if worker_gpus is None or not parent_visible or not parent_visible.strip():
        return worker_gpus
    parent = [d.strip() for d in parent_visible.split(",") if d.strip()]
    if not worker_gpus.strip():
        return worker_gpus
    chosen = []
    for index in worker_gpus.split(","):
        i = int(index)
        if not 0 <= i < len(parent):
            raise ValueError(
                f"the placement gives a worker GPU {i}, but this process sees only {len(parent)} "
                f"(CUDA_VISIBLE_DEVICES={parent_visible!r}); widen CUDA_VISIBLE_DEVICES or pass --num-gpus-per-node"
            )
        chosen.append(parent[i])
    return ",".join(chosen)


def spawn_worker_process(role: str, rank: int, env: dict[str, str], run_dir: str | os.PathLike) -> ChildProcess:
    """Start ``python -m miles.workers.main`` with stdout/stderr appended to its per-worker log: forked from a
    warm server of ``MILES_FORKSERVER`` when one accepts it, exec'd otherwise."""
    log_path = log_path_for(run_dir, role, rank)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    if "CUDA_VISIBLE_DEVICES" in env:
        full_env["CUDA_VISIBLE_DEVICES"] = visible_devices(
            env["CUDA_VISIBLE_DEVICES"], os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    full_env = fork_client.with_miles_on_path(full_env)
    if os.environ.get(fork_client.SERVERS_ENV):
        forked = fork_client.fork_worker(full_env, log_path)
        if forked is not None:
            logger.info("forked %s:%d pid=%d from %s log=%s", role, rank, forked.pid, forked.server_path, log_path)
            return ChildProcess(role, rank, forked, log_path)
    with open(log_path, "ab") as log_file:  # the child keeps its own copy of the descriptor
        popen = subprocess.Popen(
            [sys.executable, "-m", "miles.workers.main"],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    logger.info("spawned %s:%d pid=%d log=%s", role, rank, popen.pid, log_path)
    return ChildProcess(role, rank, popen, log_path)


def read_log_tail(path: str | os.PathLike, lines: int = LOG_TAIL_LINES, max_bytes: int = 64 * 1024) -> str:
    """Last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    all_lines = data.decode(errors="replace").splitlines()
    start = len(all_lines) - lines
    # a crash usually ends in a traceback longer than the tail: show it whole (bounded)
    for i in range(len(all_lines) - 1, max(-1, len(all_lines) - 4 * lines), -1):
        if all_lines[i].startswith("Traceback (most recent call last)"):
            start = min(start, max(i - 1, len(all_lines) - 4 * lines))
            break
    return "\n".join(all_lines[max(0, start) :])


def describe_exit(returncode: int | None) -> tuple[int | None, str | None]:
    """(exit code, signal name) from a Popen returncode; negative codes mean 'killed by signal'."""
    if returncode is None:
        return None, None
    if returncode < 0:
        try:
            return None, signal.Signals(-returncode).name
        except ValueError:
            return None, f"signal {-returncode}"
    return returncode, None


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def run_processes(run_id: str) -> list[psutil.Process]:
    """Live processes of this user tagged MILES_RUN_ID=run_id (workers and whatever they spawned, even
    orphans whose worker died first and that re-parented to init)."""
    me, uid = os.getpid(), os.getuid()
    candidates = []
    for p in psutil.process_iter(["uids"]):
        if p.pid != me and p.info["uids"] is not None and p.info["uids"].real == uid:
            candidates.append(p)
    found, unread = _tagged(candidates, run_id)
    if unread:  # in the middle of an exec: the new image's environment is not laid out yet
        time.sleep(0.05)  # long enough for an exec to finish; a process with no environment at all stays out
        found += _tagged(unread, run_id)[0]
    return found


def _tagged(processes: list[psutil.Process], run_id: str) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(the live ones tagged MILES_RUN_ID=run_id, those whose environment read empty)."""
    found, unread = [], []
    for p in processes:
        try:
            env = p.environ()
            if not env:
                unread.append(p)
            elif env.get("MILES_RUN_ID") == run_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found, unread


def kill_tree(children: list[ChildProcess], *, grace_s: float = 3.0, run_id: str | None = None) -> None:
    """SIGTERM every child's process group and descendants, wait ``grace_s``, then SIGKILL what is left.

    Blocking (used from atexit and signal paths as well as from the async shutdown, via a thread).
    """
    child_pids = {c.pid for c in children}
    extra = [p for c in children if c.popen.poll() is None for p in descendants(c.pid)]
    if run_id is not None:
        known = {p.pid for p in extra} | child_pids
        extra += [p for p in run_processes(run_id) if p.pid not in known]
    if not children and not extra:
        return
    _signal_all(children, extra, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _any_alive(children, extra):
        time.sleep(0.05)
    if _any_alive(children, extra):
        _signal_all(children, extra, signal.SIGKILL)
    for c in children:
        try:
            c.popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            logger.error("%s pid=%d survived SIGKILL for 5 s (uninterruptible sleep?)", c.name, c.pid)
    psutil.wait_procs(extra, timeout=2.0)


def _signal_all(children: list[ChildProcess], extra: list[psutil.Process], sig: signal.Signals) -> None:
    for c in children:
        try:
            os.killpg(c.pid, sig)  # pgid == pid thanks to start_new_session
        except (ProcessLookupError, PermissionError):
            pass
    for p in extra:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def _any_alive(children: list[ChildProcess], extra: list[psutil.Process]) -> bool:
    if any(c.popen.poll() is None for c in children):
        return True
    return any(_alive(p) for p in extra)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_own_descendants(grace_s: float = 2.0) -> None:
    """Used by a worker on its way out: end everything it spawned itself."""
    release_resource_tracker()
    procs = descendants(os.getpid())
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def release_resource_tracker() -> None:
    """Close this process's end of the pipe to multiprocessing's resource tracker, if it started one.

    The tracker (a child, started by shared memory or torch's tensor sharing) ignores SIGTERM: it exits,
    unlinking whatever is still registered, once every process holding the pipe has closed it. Closed here,
    it ends within the caller's grace period instead of waiting out all of it for the SIGKILL, which would
    also skip that clean-up."""
    module = sys.modules.get("multiprocessing.resource_tracker")  # never imported: no tracker was started
    tracker = getattr(module, "_resource_tracker", None)
    fd = getattr(tracker, "_fd", None)
    if fd is None:
        return
    tracker._fd = None  # a later use starts a new tracker rather than writing to a closed descriptor
    try:
        os.close(fd)
    except OSError:
        pass


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` to this process when its parent exits (PR_SET_PDEATHSIG); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    pr_set_pdeathsig = 1
    return libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) == 0


def parent_alive(pid: int) -> bool:
    """Whether process `pid`, which started this one, still runs.

    An exec'd worker's parent is its spawner; a forked one's is the fork server, so there the spawner counts
    as alive while a process with its pid runs that is older than this one (a reused pid would be younger)."""
    if os.getppid() == pid:
        return True
    try:
        spawner = psutil.Process(pid)
        return spawner.status() != psutil.STATUS_ZOMBIE and spawner.create_time() <= psutil.Process().create_time()
    except psutil.Error:
        return False


def die_with_parent(expected_ppid: int) -> None:
    """Ask Linux to SIGTERM this process when its parent dies; exit now if `expected_ppid` is already gone."""
    if not set_parent_death_signal():
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent-pid poll")
    if expected_ppid and not parent_alive(expected_ppid):
        logger.error("parent pid %d is already gone; exiting", expected_ppid)
        os._exit(3)
