"""Workers forked from a warm server (miles.wire.forkserver): what it refuses, what a forked worker looks like
from outside, and what happens to a run when the server dies."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile

import psutil
import pytest

from miles.controller.runtime import Runtime
from miles.wire import fork_client
from miles.wire.fork_client import ForkedWorker, key_mismatch, spawn_key
from miles.wire.specs import WorkerDied, WorkerSpec

NOOP = "miles.testing.noop:NoopWorker"


def run(coro, timeout_s: float = 60.0):
    async def guarded():
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(guarded())


def test_key_names_what_differs_and_ignores_what_a_worker_sets_after_the_fork() -> None:
    base = {"HOME": "/root", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/a"}
    same = {**base, "HOME": "/elsewhere", "CUDA_VISIBLE_DEVICES": "3", "PYTHONPATH": "/b", "MILES_RUN_ID": "x"}
    assert key_mismatch(spawn_key(same), spawn_key(base)) is None
    why = key_mismatch(spawn_key({**base, "OMP_NUM_THREADS": "4"}), spawn_key(base))
    assert why is not None and "OMP_NUM_THREADS" in why and "'4'" in why and "'1'" in why
    why = key_mismatch(spawn_key({**base, "MILES_FP8_CUDA_KERNELS": "1"}), spawn_key(base))
    assert why is not None and "MILES_FP8_CUDA_KERNELS" in why
    torchrun_sets = {"TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # read by process groups
    assert key_mismatch(spawn_key({**base, **torchrun_sets}), spawn_key(base)) is None
    other_ns = {**spawn_key(base), "netns": "net:[1]"}
    assert "netns" in key_mismatch(other_ns, spawn_key(base))


@pytest.fixture
def own_server(tmp_path_factory, monkeypatch):
    """A fork server of this test's own (it gets killed), preloading only the worker entry: ready in a second."""
    socket_dir = tempfile.mkdtemp(prefix="mfs-")
    path = os.path.join(socket_dir, "s")
    log_path = tmp_path_factory.mktemp("own_server") / "server.log"
    server = fork_client.start(path, log_path=log_path, preload=["miles.workers.main"])
    try:
        assert fork_client.wait_ready(path, timeout=60, server=server), "the fork server did not come up"
        monkeypatch.setenv("MILES_FORKSERVER", path)
        yield server
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_an_environment_no_server_matches_falls_back_to_exec_with_the_reason(
    tmp_path, ready_fork_servers, caplog
) -> None:
    spec = WorkerSpec("noop", 0, NOOP, env={"OMP_NUM_THREADS": "7"})

    async def main():
        async with await Runtime.start([spec], run_dir=str(tmp_path)) as rt:
            child = rt._peers[b"noop:0"].child
            assert not isinstance(child.popen, ForkedWorker)  # exec'd: a Popen, and it serves all the same
            assert await rt.worker("noop").call("echo", 5) == 5

    with caplog.at_level(logging.INFO, logger="miles.wire.fork_client"):
        run(main())
    fallbacks = [r.getMessage() for r in caplog.records if "instead of forked" in r.getMessage()]
    assert fallbacks and all("OMP_NUM_THREADS (worker '7'" in m for m in fallbacks), fallbacks


def test_a_worker_whose_path_shadows_a_preloaded_package_is_refused(tmp_path, ready_fork_servers, caplog) -> None:
    shadow = tmp_path / "shadow"
    (shadow / "msgpack").mkdir(parents=True)
    (shadow / "msgpack" / "__init__.py").write_text("raise ImportError('a stand-in that must never be imported')\n")
    env = {**os.environ, "PYTHONPATH": f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with caplog.at_level(logging.INFO, logger="miles.wire.fork_client"):
        assert fork_client.fork_worker(env, tmp_path / "worker.log") is None
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any(f"msgpack would import from {shadow}" in m for m in refusals), refusals
    assert not (tmp_path / "worker.log").exists()  # nothing was forked


def test_a_forked_worker_shows_its_own_command_line_and_environment_and_exit_code(tmp_path, own_server) -> None:
    failing = WorkerSpec("noop", 1, NOOP, init_kwargs={"fail_in_init": True, "init_sleep_s": 2.0})

    async def main():
        with pytest.raises(WorkerDied) as err:
            rt = await Runtime.start([WorkerSpec("noop", 0, NOOP), failing], run_dir=str(tmp_path), wait_ready=False)
            try:
                worker = psutil.Process(rt._peers[b"noop:0"].pid)
                assert worker.ppid() == own_server.pid and isinstance(rt._peers[b"noop:0"].child.popen, ForkedWorker)
                assert worker.cmdline()[1:] == ["-m", "miles.workers.main"]
                assert worker.environ()["MILES_RUN_ID"] == rt.run_id
                assert "MILES_FORKSERVER_ROOM" not in worker.environ()
                await rt.wait_ready()
            finally:
                await rt.shutdown()
        # the exit code travels back from the server, as a Popen's would
        assert (err.value.rank, err.value.exitcode) == (1, 1)
        assert "asked to fail in __init__" in err.value.log_tail

    run(main())


def test_killing_the_server_ends_its_workers_and_the_run_names_one(tmp_path, own_server) -> None:
    async def main():
        rt = await Runtime.start([WorkerSpec("noop", i, NOOP) for i in range(2)], run_dir=str(tmp_path))
        try:
            pids = rt.local_pids()
            assert all(psutil.Process(p).ppid() == own_server.pid for p in pids)
            os.kill(own_server.pid, signal.SIGKILL)
            died = await asyncio.wait_for(rt.wait_failure(), timeout=10)
            assert isinstance(died, WorkerDied) and died.role == "noop" and died.signal == "SIGTERM"
        finally:
            await rt.shutdown()
        _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    run(main())


def test_the_server_refuses_to_serve_after_cuda_or_threads_start(tmp_path) -> None:
    from miles.wire.forkserver import fork_hazard

    assert fork_hazard() is None or "thread" in fork_hazard()  # this test process may run threads of its own
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    (tmp_path / "starts_a_thread.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = tmp_path / "server.log"
    server = fork_client.start(str(tmp_path / "s"), env=env, log_path=log, preload=["starts_a_thread"])
    assert server.wait(timeout=60) != 0 and not (tmp_path / "s").exists()
    assert "not serving: preloading started threads" in log.read_text()
