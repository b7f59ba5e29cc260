"""The shipped Slurm templates (slurm/) on a two-host Slurm cluster of namespace hosts.

`sbatch -N 2 slurm/train.sbatch` runs the demo across both hosts (srun places one launcher per node,
node 0 of the node list is the controller, reached by its hostname); an array sweep of two points
runs one point per host; a job requeued by the template's pre-timeout path (USR1) while its host is
drained starts again on the other host and resumes from its checkpoint.
Without namespaces, Slurm or munge these tests skip with the reason; with CI=true and
MILES_REQUIRE_SLURM_NETNS=1 they fail instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import skip_or_fail
from harness import SMALL_RUN
from multihost_run import REPO, job_env, train_rows
from netns_hosts import HostGroup
from slurm_hosts import SlurmCluster, slurm_problem

pytestmark = pytest.mark.exec_workers  # the hosts are network namespaces: no fork server there

TINY = list(SMALL_RUN)
DEMO = "launch/configs/demo_cpu.yaml"


@pytest.fixture(scope="module")
def cluster(netns_ready, tmp_path_factory) -> Iterator[SlurmCluster]:
    problem = slurm_problem()
    if problem is not None:
        skip_or_fail("MILES_REQUIRE_SLURM_NETNS", problem)
    group = HostGroup.create(2, "slurm")
    try:
        slurm = SlurmCluster(group.hosts, tmp_path_factory.mktemp("slurm"))
        try:
            slurm.start()
        except RuntimeError as e:
            skip_or_fail("MILES_REQUIRE_SLURM_NETNS", str(e))
        yield slurm
    finally:
        group.destroy()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return job_env(**{"SBATCH_OUTPUT": str(tmp_path / "%x-%j.out"), **extra})


def _logs(cluster: SlurmCluster, tmp_path: Path) -> str:
    outs = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.rglob("*.out")))
    nodes = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.rglob("node-*.log")))
    return f"{outs}\n{nodes}\n{cluster.logs()}"


def test_sbatch_two_nodes_trains_across_both_hosts(cluster, tmp_path) -> None:
    run_dir = tmp_path / "train"
    flags = [*TINY, "--num-rollout", "2", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1"]
    job = cluster.submit(
        ["sbatch", "--parsable", "-N", "2", "slurm/train.sbatch", DEMO, *flags],
        _env(tmp_path, MILES_RUN_DIR=str(run_dir)),
        REPO,
    )
    (record,) = cluster.wait_done([job], timeout_s=400)[job]
    logs = _logs(cluster, tmp_path)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), f"{record}\n{logs}"
    assert record["NodeList"] == "h[0-1]", record
    node0 = (run_dir / "slurm" / "node-0-0.log").read_text()  # srun's %n: the node's index in the job
    node1 = (run_dir / "slurm" / "node-1-1.log").read_text()
    # node 1 found the controller by the first host of the node list, over the bridge
    assert "launch on h0: node 0 of 2, controller h0:" in node0, logs
    assert "launch on h1: node 1 of 2, controller h0:" in node1, logs
    assert "node 1: spawned ['trainer:1']" in node1, logs
    assert "listening on tcp://h0:" in node0, logs
    assert "trainer:1 registered from host h1 (node 1)" in node0, logs
    assert "dp=2" in (run_dir / "logs" / "trainer_1.log").read_text()
    assert [r["step"] for r in train_rows(run_dir)] == [0, 1], logs


def test_array_sweep_runs_on_both_hosts(cluster, tmp_path) -> None:
    sweep_file = tmp_path / "lr.yaml"
    lrs = [0.002, 0.005]
    grid = {"name": "lr", "base": str(REPO / DEMO), "sweep_dir": str(tmp_path / "sweep"), "grid": {"lr": lrs}}
    sweep_file.write_text(yaml.safe_dump(grid))
    job = cluster.submit(
        [sys.executable, "-m", "miles.cli", "sweep", str(sweep_file), "--submit", "--num-rollout", "2", *TINY],
        _env(tmp_path, SBATCH_OUTPUT=str(tmp_path / "%x-%A_%a.out")),
        REPO,
    )
    records = cluster.wait_done([job], timeout_s=400)[job]
    logs = _logs(cluster, tmp_path)
    assert [(r["JobState"], r["ExitCode"]) for r in records] == [("COMPLETED", "0:0")] * 2, f"{records}\n{logs}"
    assert sorted(r["BatchHost"] for r in records) == ["h0", "h1"], records  # one CPU a host: one point each
    for i, lr in enumerate(lrs):
        run_dir = tmp_path / "sweep" / f"lr-{i}"
        assert [r["step"] for r in train_rows(run_dir)] == [0, 1], f"point {i}\n{logs}"
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["lr"] == lr


def test_requeued_job_resumes_on_the_other_host(cluster, tmp_path) -> None:
    """USR1 (the template's pre-timeout path) while the job's host is drained: the job checkpoints,
    requeues itself, starts again on the other host and resumes from the checkpoint."""
    run_dir = tmp_path / "train"
    num_rollout = 6
    # each engine step waits 0.1 s, so the USR1 sent after the first step lands well before the last one
    # (on a fast machine the six tiny steps could all end before the signal made its way to the controller)
    env = _env(tmp_path, MILES_RUN_DIR=str(run_dir), MILES_ENGINE_STEP_DELAY_S="0.1")
    job = cluster.submit(
        ["sbatch", "--parsable", "-N", "1", "slurm/train.sbatch", DEMO, *TINY, "--num-rollout", str(num_rollout)],
        env,
        REPO,
    )
    deadline = time.monotonic() + 300
    while not train_rows(run_dir):
        assert time.monotonic() < deadline, f"no step logged in 300 s\n{_logs(cluster, tmp_path)}"
        time.sleep(0.2)
    first_host = cluster.records(job)[0]["BatchHost"]
    cluster.client(["scontrol", "update", f"NodeName={first_host}", "State=DRAIN", "Reason=requeue-test"], check=True)
    cluster.client(["scancel", "--batch", "--signal=USR1", job], check=True)
    pending_since: list[float] = []

    def release_requeued(records) -> None:
        # a requeued job waits (about 2 min) before it may start again: let it start after a few seconds
        if records[job] and records[job][0]["JobState"] == "PENDING":
            pending_since.append(time.monotonic())
            if pending_since[-1] - pending_since[0] >= 3.0:
                cluster.client(["scontrol", "update", f"JobId={job}", "StartTime=now"])

    try:
        (record,) = cluster.wait_done([job], timeout_s=400, on_poll=release_requeued)[job]
    finally:
        cluster.client(["scontrol", "update", f"NodeName={first_host}", "State=RESUME"])
    logs = _logs(cluster, tmp_path)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        f"{record}\n{logs}"
    )
    other = {"h0": "h1", "h1": "h0"}[first_host]
    assert record["BatchHost"] == other, record
    node_log = (run_dir / "slurm" / "node-0-0.log").read_text()  # both starts append to it
    starts = [line.split("launch on ", 1)[1].split(":")[0] for line in node_log.splitlines() if "launch on " in line]
    assert starts == [first_host, other], logs
    assert "received SIGUSR1" in node_log, logs
    resumed = [line for line in node_log.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and node_log.index(resumed[0]) > node_log.index(f"launch on {other}"), logs
    # every step trained exactly once across the two starts, the second from the first's checkpoint
    assert [r["step"] for r in train_rows(run_dir)] == list(range(num_rollout)), logs
    stopped_at = int(resumed[0].rsplit("at rollout ", 1)[1]) - 1
    assert 0 <= stopped_at < num_rollout - 1, resumed[0]
    assert (run_dir / "ckpt" / f"iter_{stopped_at:07d}").is_dir()
