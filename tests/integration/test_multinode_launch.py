"""Two torchrun "nodes" on one machine: node 0 runs the controller, node 1 a node agent."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from miles.controller.runtime import Runtime
from miles.wire.launch_env import first_slurm_host, launch_env
from miles.wire.specs import WorkerDied, WorkerSpec

from harness import free_port_run  # isort: skip

NOOP = "miles.testing.noop:NoopWorker"

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_two_torchrun_nodes_selftest(tmp_path) -> None:
    port = free_port_run(2)  # torchrun's store on P, the controller on P + 1
    env = {
        **os.environ,
        "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "MILES_HEARTBEAT_TIMEOUT_S": "15",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("MILES_RUN_SECRET", None)  # exercise the secret hand-off through torchrun's store
    procs = []
    for node in (0, 1):
        cmd = [
            shutil.which("torchrun"),
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "miles.launch",
            "--selftest",
            "--workers-per-node",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=150)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(outputs)
    summary = json.loads([line for line in outputs[0].splitlines() if line.startswith("{")][-1])
    assert summary == {
        **summary,
        "selftest": "ok",
        "num_nodes": 2,
        "workers": 4,
        "workers_per_node": {"0": 2, "1": 2},
        "transport": "tcp",
    }
    assert "agent:1" in outputs[1] and "spawned ['noop:2', 'noop:3']" in outputs[1]
    assert sorted(os.listdir(tmp_path / "run" / "logs")) == [f"noop_{i}.log" for i in range(4)]
    leftover = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert leftover == []


def test_single_node_selftest_without_torchrun(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GROUP_", "LOCAL_", "MASTER_"))}
    out = subprocess.run(
        [sys.executable, "-m", "miles.launch", "--selftest", "--workers-per-node", "3", "--run-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["selftest"], summary["transport"], summary["workers_per_node"]) == ("ok", "ipc", {"0": 3})


AGENT_SCRIPT = (
    "import sys; from miles.workers.node_agent import run_agent; "
    "sys.exit(run_agent(1, sys.argv[1], bytes.fromhex(sys.argv[2]), heartbeat_interval_s=0.2, heartbeat_timeout_s=10))"
)


def test_remote_worker_death_is_reported_by_its_node_agent(tmp_path) -> None:
    port = free_port_run(2)  # torchrun's store on P, the controller on P + 1
    key = os.urandom(32)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT_SCRIPT, f"tcp://127.0.0.1:{port}", key.hex()],
        env={**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    async def main() -> list[int]:
        specs = [WorkerSpec("noop", 0, NOOP, node=0), WorkerSpec("noop", 1, NOOP, node=1)]
        rt = await Runtime.start(
            specs, run_dir=str(tmp_path), transport="tcp", num_nodes=2, port=port, secret=key, heartbeat_interval_s=0.2
        )
        try:
            infos = await rt.call_all("noop", "whoami")
            assert [i["node"] for i in infos] == [0, 1]
            remote = rt.worker("noop", 1)
            # the agent spawned it (exec'd as its child, or forked by a fork server at its request), not the controller
            assert psutil.Process(remote.pid).environ()["MILES_PARENT_PID"] == str(agent.pid)
            pending = asyncio.ensure_future(remote.call("sleep", 60))
            await asyncio.sleep(0.2)
            os.kill(remote.pid, signal.SIGKILL)
            with pytest.raises(WorkerDied) as err:
                await asyncio.wait_for(pending, 5.0)
            assert (err.value.role, err.value.rank, err.value.node, err.value.signal) == ("noop", 1, 1, "SIGKILL")
            assert "ready: noop:1" in err.value.log_tail
            return [rt.worker("noop", 0).pid, remote.pid]
        finally:
            await rt.shutdown()

    try:
        pids = asyncio.run(asyncio.wait_for(main(), 60))
        out, _ = agent.communicate(timeout=30)
        assert agent.returncode == 0, out  # told to shut down, not orphaned
        assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)
    finally:
        if agent.poll() is None:
            agent.kill()


def test_launch_env_reads_torchrun_and_slurm() -> None:
    torchrun = {
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29400",
        "RANK": "1",
        "WORLD_SIZE": "3",
    }
    le = launch_env(torchrun)
    assert (le.node_rank, le.num_nodes, le.master_addr, le.controller_port, le.source) == (
        1,
        3,
        "10.0.0.5",
        29401,
        "torchrun",
    )
    assert launch_env({**torchrun, "MILES_CONTROLLER_PORT": "7000"}).controller_port == 7000
    slurm = {"SLURM_PROCID": "2", "SLURM_NODEID": "2", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu[007-010]"}
    le = launch_env(slurm)
    assert (le.node_rank, le.num_nodes, le.master_addr, le.controller_port, le.source) == (
        2,
        4,
        "gpu007",
        29501,
        "slurm",
    )
    assert first_slurm_host("a1,b2") == "a1"
    assert first_slurm_host("node[3,5-6],x") == "node3"
    assert launch_env({}).num_nodes == 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
