"""Runtime lifecycle with real processes: deaths, hangs, signals, and nothing left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from miles.controller.runtime import Runtime
from miles.wire.fork_client import ForkedWorker
from miles.wire.procs import run_processes
from miles.wire.rpc import RpcClosed
from miles.wire.specs import WorkerDied, WorkerSpec

NOOP = "miles.testing.noop:NoopWorker"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(coro, timeout_s: float = 60.0):
    async def guarded():
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(guarded())


def is_gone(pid: int) -> bool:
    try:  # reap it if it is our own child (a zombie would still "exist")
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_all_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if not is_gone(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if not is_gone(p)]


def assert_nothing_left(rt: Runtime, pids: list[int]) -> None:
    assert wait_all_gone(pids, timeout_s=2.0) == []
    tagged = [p.pid for p in run_processes(rt.run_id) if not is_gone(p.pid)]
    assert tagged == [], f"processes of run {rt.run_id} still alive: {tagged}"


def specs(n: int, **init_kwargs) -> list[WorkerSpec]:
    return [WorkerSpec("noop", i, NOOP, init_kwargs=dict(init_kwargs)) for i in range(n)]


def assert_started_by(rt: Runtime, worker_start: str) -> None:
    """Every local worker of `rt` was forked (worker_start "fork") or exec'd ("exec")."""
    forked = [isinstance(p.child.popen, ForkedWorker) for p in rt._peers.values() if p.child is not None]
    assert forked and all(f == (worker_start == "fork") for f in forked), forked


def test_worker_sigkilled_mid_call_is_named_and_everything_ends(tmp_path, worker_start) -> None:
    async def main():
        rt = await Runtime.start(specs(2), run_dir=str(tmp_path))
        try:
            assert_started_by(rt, worker_start)
            victim = rt.worker("noop", 1)
            grandchild = await victim.call("spawn_grandchild")
            pids = rt.local_pids() + [grandchild]
            busy = asyncio.ensure_future(rt.worker("noop", 0).call("sleep_sync", 60))
            doomed = asyncio.ensure_future(victim.call("sleep", 60))
            await asyncio.sleep(0.2)
            os.kill(victim.pid, signal.SIGKILL)
            with pytest.raises(WorkerDied) as err:
                await asyncio.wait_for(doomed, timeout=5.0)  # the bound: named within 5 s
            died = err.value
            assert (died.role, died.rank, died.pid, died.signal, died.exitcode) == (
                "noop",
                1,
                victim.pid,
                "SIGKILL",
                None,
            )
            assert "noop:1" in str(died) and "SIGKILL" in str(died) and str(victim.pid) in str(died)
            assert "ready: noop:1" in died.log_tail  # the log tail is the worker's own log
            with pytest.raises(WorkerDied):
                await busy  # pending calls on healthy siblings fail with the same error
            with pytest.raises(WorkerDied):
                await rt.worker("noop", 0).call("echo", 1)  # and so do later ones
            assert await rt.wait_failure() is died
        finally:
            await rt.shutdown()
        assert_nothing_left(rt, pids)

    run(main())


def test_orderly_shutdown_ends_workers_and_grandchildren(tmp_path, worker_start) -> None:
    async def main():
        async with await Runtime.start(specs(2, tag="x"), run_dir=str(tmp_path)) as rt:
            assert_started_by(rt, worker_start)
            assert await rt.call_all("noop", "get_tag") == ["x", "x"]
            grandchildren = await rt.call_all("noop", "spawn_grandchild")
            pids = rt.local_pids() + grandchildren
            # the run's processes are found by its id, forked ones too (what teardown relies on after a crash)
            assert set(pids) <= {p.pid for p in run_processes(rt.run_id)}
            children = [p.child for p in rt._peers.values()]
        assert [c.popen.returncode for c in children] == [0, 0]  # they left on request, not by force
        assert rt.failure is None
        assert_nothing_left(rt, pids)
        await rt.shutdown()  # idempotent

    run(main())


def test_hung_worker_is_detected_by_heartbeat(tmp_path) -> None:
    async def main():
        rt = await Runtime.start(
            specs(1), run_dir=str(tmp_path), heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5, shutdown_grace_s=1.0
        )
        pids = rt.local_pids()
        with pytest.raises(WorkerDied, match=r"noop:0 .* hung: no heartbeat"):
            await rt.worker("noop").call("block_loop", 60)
        await rt.shutdown()
        assert_nothing_left(rt, pids)

    run(main())


@pytest.mark.exec_workers  # its leftover check looks among this process's children; forked: test_forkserver.py
def test_failing_constructor_fails_start_with_traceback(tmp_path) -> None:
    async def main():
        with pytest.raises(WorkerDied) as err:
            await Runtime.start(specs(2, fail_in_init=True), run_dir=str(tmp_path))
        assert err.value.exitcode == 1 and err.value.role == "noop"
        assert "asked to fail in __init__" in err.value.log_tail and "Traceback" in err.value.log_tail
        pids = [c.pid for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
        leftover = [p for p in pids if "miles.workers.main" in " ".join(psutil.Process(p).cmdline())]
        assert wait_all_gone(leftover, 5.0) == []

    run(main())


def test_warm_up_runs_after_ready_and_sync_calls_wait_for_it(tmp_path) -> None:
    async def main():
        rt = await Runtime.start(specs(1, warm_up_s=3.0), run_dir=str(tmp_path))
        try:
            worker = rt.worker("noop", 0)
            assert await worker.call("is_warm") is False  # ready was reported without waiting for warm_up
            assert await worker.call("is_warm_sync") is True  # a sync call runs after it, on the same thread
        finally:
            await rt.shutdown()

    run(main())


def test_worker_not_ready_in_time_fails_start(tmp_path) -> None:
    async def main():
        with pytest.raises(WorkerDied, match=r"noop:0 .* was not ready within register_timeout_s=1.5") as err:
            await Runtime.start(
                specs(1, init_sleep_s=60), run_dir=str(tmp_path), register_timeout_s=1.5, shutdown_grace_s=0.5
            )
        assert err.value.exitcode is None  # still running when declared late; then torn down
        assert wait_all_gone([err.value.pid], 5.0) == []

    run(main())


CONTROLLER_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from miles.controller.runtime import Runtime
    from miles.wire.specs import WorkerSpec

    async def main():
        rt = await Runtime.start([WorkerSpec("noop", i, "miles.testing.noop:NoopWorker") for i in range(2)],
                                 run_dir=sys.argv[1], heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0)
        grandchild = await rt.worker("noop", 0).call("spawn_grandchild")
        print(json.dumps({"workers": rt.local_pids(), "grandchild": grandchild}), flush=True)
        async with rt:
            await asyncio.sleep(600)

    asyncio.run(main())
""")


def start_controller(tmp_path, worker_start: str = "exec") -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail("controller subprocess did not start its workers")
    info = json.loads(line)
    parents = {psutil.Process(pid).ppid() for pid in info["workers"]}
    assert (parents == {proc.pid}) == (worker_start == "exec"), f"workers' parents {parents}, controller {proc.pid}"
    return proc, info["workers"] + [info["grandchild"]]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_controller_signalled_leaves_no_process(tmp_path, sig: signal.Signals, worker_start) -> None:
    proc, pids = start_controller(tmp_path, worker_start)
    try:
        assert all(psutil.pid_exists(p) for p in pids)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        # SIGKILL: the workers notice by themselves (parent-death signal, or a forked one's poll of the controller's
        # pid, or heartbeat silence);
        # SIGTERM / Ctrl-C: the controller tears down before exiting
        assert wait_all_gone(pids, timeout_s=20.0) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in pids:
            if not is_gone(p):
                os.kill(p, signal.SIGKILL)


def test_a_call_whose_connection_is_gone_raises_the_loss_that_names_the_worker(tmp_path) -> None:
    """The socket can report a peer gone before the loss is declared (a lost node's workers: their heartbeats
    have yet to time out). The call then waits for the verdict and raises it, naming the worker, instead of
    the socket's error (which reached `miles train` as a traceback)."""

    async def main():
        rt = await Runtime.start(specs(1), run_dir=str(tmp_path), heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5)
        try:
            victim = rt.worker("noop", 0)
            pids = rt.local_pids()

            async def connection_gone(*args, **kwargs):
                raise RpcClosed("controller: peer b'noop:0' is not connected (never registered or gone)")

            rt.rpc.call = connection_gone
            os.kill(victim.pid, signal.SIGKILL)  # noticed by the monitor's next poll, after the call has failed
            with pytest.raises(WorkerDied, match=r"noop:0"):
                await asyncio.wait_for(victim.call("echo", 1), timeout=5.0)
        finally:
            await rt.shutdown()
        assert_nothing_left(rt, pids)

    run(main())
